"""Passes that the Triton threshold search of `sbd.entropy_sample` makes (top-k, top-p), and the tiles they read.

    python tools/threshold_passes.py            # replay in numpy: passes and tiles per filter and design
    python tools/threshold_passes.py --check    # also the interpreted kernel, on 4 of the rows (~20 s)

A pass reads its whole source, the row (V / 1024 tiles) or the row's 8192 candidates (8 tiles: the 8
largest logits of each of the 1024 lanes, kept by the pass that finds the row's max), and compares every
entry with 16 pivots: on a GPU the tiles read are the search's cost (the pass that finds the max, before any
search, is not counted). The replay follows `_sampling_key_search` step for step in fp32 / int64, on rows of
128256 logits (fp32 and bf16; N(0, s^2) with s = 1, 2.5, 5, plus 20 entries raised by 5 to 15), top-k 1,
20, 50, 1000 and top-p 0.5, 0.9, 0.95, 0.99 at T = 1, for four designs of the search (`DESIGNS`): the
kernel's, and the three before it. The candidates are searched when the answer is among them: every entry
above the floor (the largest of the lanes' smallest candidates) is one, so when those entries reach the goal
(k of them, or top_p of the row's mass), else the row.
A pass that only takes its range's extremes (top-k, when they are the answer) reads its source like the
others but does about a third of a pivot pass's SASS instructions per tile (sm_90).
--check runs the threshold kernel alone under the Triton interpreter with MAX_ROUNDS = 0, 1, 2, ... and prints
the first that gives the oracle's cut-off: the replay's count, unless the range's low end is the answer
before the search has closed it.
"""
from __future__ import annotations

import argparse
import os
from typing import NamedTuple

import numpy as np
import torch

VOCAB = 128256
PIVOTS = 16
MAX_ROUNDS = 9
LANES = 1024  # the threshold kernel's tile: entry v is in lane v % LANES
CANDIDATES = 8  # largest logits kept per lane
LOWEST_KEY = -2139095040  # key(-3.4028235e38)
EXP_FLOOR = np.float32(-128.0)


def key(x) -> np.ndarray:
    """`_sampling_key`: int64 key of fp32 x in the floats' order, -0.0 and 0.0 sharing 0."""
    bits = (np.asarray(x, dtype=np.float32) + np.float32(0)).view(np.int32).astype(np.int64)
    return np.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def value(k) -> np.ndarray:
    """`_sampling_key_value`: the fp32 value of a key."""
    k = np.asarray(k).astype(np.int64).astype(np.int32)
    return np.where(k < 0, k ^ 0x7FFFFFFF, k).view(np.float32)


class Design(NamedTuple):
    """One design of the search: where its first pass puts the pivots, who sums top-p's total mass, whether
    top-k 1 is searched, whether a count search ends on its range's extremes, and whether it searches the
    row's candidates first."""
    first_in_value: bool  # the first pass's pivots evenly in value over the logits with weight, else in key
    mass_in_first_pass: bool  # the first pass's lowest pivot measures the total mass, else a pass of its own
    top_k_1_searched: bool  # top-k 1 searched like any k, else the row's max at once
    count_extremes: bool  # top-k: when the answer is its range's largest or smallest entry, a pass takes those
    candidates: bool = False  # search the lanes' largest logits first, the row only when they miss the answer


DESIGNS = {
    "kernel": Design(first_in_value=True, mass_in_first_pass=True, top_k_1_searched=False, count_extremes=True,
                     candidates=True),
    "row only": Design(first_in_value=True, mass_in_first_pass=True, top_k_1_searched=False, count_extremes=True),
    "first pass in value": Design(first_in_value=True, mass_in_first_pass=False, top_k_1_searched=True,
                                  count_extremes=False),
    "every pass in key": Design(first_in_value=False, mass_in_first_pass=False, top_k_1_searched=True,
                                count_extremes=False),
}


class Search(NamedTuple):
    """What one filter's search did: its answer key, its passes (of them, over the row's candidates, and that
    took only their range's extremes) and the 1024-entry tiles they read."""
    answer: int
    passes: int
    candidate_passes: int
    extremes_passes: int
    tiles: int


def search_passes(x: np.ndarray, w: np.ndarray, goal: float, x_low, x_high, design: Design,
                  mass_fraction: float | None = None, total: float | None = None) -> tuple[int, int, int]:
    """(answer key, passes, passes that only took the range's extremes) of the search for the largest key K
    with sum of w over key >= K at least the goal; with `mass_fraction` the goal is that fraction of `total`
    or, when None, of the total weight, which the design's first pass measures at its lowest pivot."""
    keys = key(x)
    lo, hi = LOWEST_KEY, int(key(x.max())) + 1
    count_lo, count_hi = w.sum(), 0.0  # W(lo), W(hi)
    steps = np.arange(1, PIVOTS + 1)
    fractions = (steps.astype(np.float32) / np.float32(PIVOTS + 1)).astype(np.float32)
    first_fractions = fractions
    if mass_fraction is not None and design.mass_in_first_pass:
        first_fractions = ((steps - 1).astype(np.float32) / np.float32(PIVOTS)).astype(np.float32)
    passes = extremes_passes = 0
    while hi - lo > 1 and passes < MAX_ROUNDS:
        inside = (keys >= lo) & (keys < hi) & (w > 0)
        key_min, key_max = (keys[inside].min(), keys[inside].max()) if inside.any() else (hi, lo - 1)
        passes += 1
        rank = goal - count_hi
        if design.count_extremes and mass_fraction is None and rank in (1, count_lo - count_hi):
            lo = int(key_max if rank == 1 else key_min)
            hi = lo + 1
            extremes_passes += 1
            continue
        if design.first_in_value and passes == 1:
            a = np.float32(max(value(lo), x_low))
            b = np.float32(min(value(hi - 1), x_high))
            pivots = np.clip(key(a * (np.float32(1) - first_fractions) + b * first_fractions), lo, hi - 1)
        else:
            pivots = lo + ((hi - lo) * steps) // (PIVOTS + 1)
        reach = np.array([w[keys >= p].sum() for p in pivots])
        if mass_fraction is not None and passes == 1:
            goal = mass_fraction * (total if total is not None else reach[0] if design.mass_in_first_pass
                                    else w.sum())
        enough = reach >= goal
        if key_min == key_max:
            lo, hi = int(key_min), int(key_min) + 1
        else:
            lo, hi = max([lo, *pivots[enough]]), min([hi, *pivots[~enough]])
            count_lo, count_hi = min([count_lo, *reach[enough]]), max([count_hi, *reach[~enough]])
    return lo, passes, extremes_passes


def rows(seed: int = 0):
    """(label, fp32 row) of every row the replay runs on."""
    rng = np.random.default_rng(seed)
    for dtype in ("fp32", "bf16"):
        for scale in (1.0, 2.5, 5.0):
            x = (rng.standard_normal(VOCAB) * scale).astype(np.float32)
            x[rng.integers(0, VOCAB, 20)] += rng.uniform(5, 15, 20).astype(np.float32)
            if dtype == "bf16":
                x = torch.from_numpy(x).bfloat16().float().numpy()
            yield f"{dtype} s={scale}", x


def lane_candidates(x: np.ndarray) -> tuple[np.ndarray, float]:
    """(the row's candidates above -inf, floor): each lane's CANDIDATES largest logits, and the largest of the
    lanes' smallest candidates, which no entry that is not a candidate exceeds (-inf when no lane holds
    CANDIDATES entries)."""
    tiles = max(-(-x.size // LANES), CANDIDATES)
    lanes = np.full(tiles * LANES, -np.inf, dtype=np.float32)
    lanes[:x.size] = x
    by_lane = -np.sort(-lanes.reshape(-1, LANES), axis=0)[:CANDIDATES]  # [CANDIDATES, LANES], each lane descending
    kept = by_lane.ravel()
    return kept[kept > -np.inf], float(by_lane[-1].max())


def weights(x: np.ndarray, name: str, m) -> np.ndarray:
    """The search's weight of each logit: 1 for top-k, exp(x - m) (clamped as the kernel does) for top-p."""
    if name == "top_k":
        return np.ones_like(x, dtype=np.float64)
    return np.exp(np.maximum(x - m, EXP_FLOOR)).astype(np.float64)


def replay(x: np.ndarray, setting: tuple[str, float], design: Design = DESIGNS["kernel"]) -> Search:
    """One filter's search on one row, with the bounds the kernel passes to the search: over the candidates
    when the design has them and they hold the answer, else over the row; top-p's passes count the one that
    sums the mass when the design's search does not."""
    name, amount = setting
    m = x.max()
    row_tiles = -(-x.size // LANES)
    if name == "top_k" and amount == 1 and not design.top_k_1_searched:
        return Search(int(key(m)), 0, 0, 0, 0)
    w = weights(x, name, m)
    if name == "top_k":
        args, kwargs = (amount, x.min(), m, design), {}
    else:
        args, kwargs = (0.0, max(x.min(), m + EXP_FLOOR), m, design), {"mass_fraction": amount}
    if design.candidates:
        kept, floor = lane_candidates(x)
        wc = weights(kept, name, m)
        # The entries above floor are all candidates: the answer is among them when they reach the goal.
        if wc[kept > floor].sum() >= (amount if name == "top_k" else amount * w.sum()):
            total = {"total": float(w.sum())} if name == "top_p" else {}  # the first pass's online mass
            answer, passes, extremes = search_passes(kept, wc, args[0], max(args[1], np.float32(floor)), *args[2:],
                                                     **kwargs, **total)
            return Search(answer, passes, passes, extremes, passes * CANDIDATES)
    answer, passes, extremes = search_passes(x, w, *args, **kwargs)
    passes += name == "top_p" and not design.mass_in_first_pass
    return Search(answer, passes, 0, extremes, passes * row_tiles)


SETTINGS = [("top_k", 1), ("top_k", 20), ("top_k", 50), ("top_k", 1000),
            ("top_p", 0.5), ("top_p", 0.9), ("top_p", 0.95), ("top_p", 0.99)]


def kernel_passes(x: np.ndarray, setting: tuple[str, float]) -> int | None:
    """The smallest MAX_ROUNDS (0 included) at which the interpreted threshold kernel returns the oracle's
    cut-off."""
    from sbd_kernels.ops._aot import launch
    from sbd_kernels.ops.sampling import naive
    from sbd_kernels.ops.sampling import triton as sampling_triton

    name, amount = setting
    logits = torch.from_numpy(x).view(1, 1, -1)
    filters = {"top_k_val": amount} if name == "top_k" else {"top_p_val": amount}
    kept = naive.kept_by_filters(logits, torch.ones(1), torch.tensor([filters.get("top_k_val", 0)]),
                                 torch.tensor([filters.get("top_p_val", 1.0)]), torch.zeros(1))
    want = float(torch.where(kept, logits, float("inf")).min())
    zero = torch.zeros(1, dtype=torch.int64)
    for rounds in range(MAX_ROUNDS + 1):
        threshold_launch = sampling_triton._sampling_launches(logits, zero, zero, temperature_val=1.0, **filters)[1][0]
        threshold_launch = threshold_launch._replace(constexprs={**threshold_launch.constexprs, "MAX_ROUNDS": rounds})
        launch([threshold_launch])
        if float(threshold_launch.args["threshold_ptr"][0]) == want:
            return rounds
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="also run the interpreted kernel on 4 rows")
    args = parser.parse_args()
    searches = {name: {setting: [] for setting in SETTINGS} for name in DESIGNS}
    for _, x in rows():
        for setting in SETTINGS:
            for name, design in DESIGNS.items():
                searches[name][setting].append(replay(x, setting, design))
            assert len({s.answer for per_design in searches.values() for s in per_design[setting][-1:]}) == 1, setting
    print("per filter, over 6 rows: passes (mean / most), tiles read (mean);",
          "the kernel's passes over the candidates and that took extremes only (mean)")
    for setting in SETTINGS:
        kernel = searches["kernel"][setting]
        print(f"  {setting[0]} {setting[1]}:", " | ".join(
            f"{name} {np.mean([s.passes for s in per_design[setting]]):.2f} / "
            f"{max(s.passes for s in per_design[setting])}, {np.mean([s.tiles for s in per_design[setting]]):.0f}"
            for name, per_design in searches.items()),
              f"| {np.mean([s.candidate_passes for s in kernel]):.2f}, {np.mean([s.extremes_passes for s in kernel]):.2f}")
    for name, per_design in searches.items():
        every = [s for per_setting in per_design.values() for s in per_setting]
        print(f"{name}: {np.mean([s.passes for s in every]):.2f} passes and {np.mean([s.tiles for s in every]):.0f} "
              f"tiles on average, {max(s.passes for s in every)} passes at most, over {len(every)} searches")
    if args.check:
        os.environ["TRITON_INTERPRET"] = "1"
        for (label, x), _ in zip(rows(seed=1), range(2)):
            for setting in (("top_k", 50), ("top_p", 0.9)):
                print(f"{label} {setting[0]} {setting[1]}: replay {replay(x, setting).passes} passes, "
                      f"kernel right from MAX_ROUNDS = {kernel_passes(x, setting)}")


if __name__ == "__main__":
    main()
