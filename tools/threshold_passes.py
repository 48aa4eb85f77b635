"""Passes over a row that the Triton threshold search of `sbd.entropy_sample` makes (top-k, top-p).

    python tools/threshold_passes.py            # replay in numpy: mean and largest pass count per filter
    python tools/threshold_passes.py --check    # also the interpreted kernel, on 4 of the rows (~20 s)

A pass reads the whole row and compares every entry with 16 pivots: on a GPU the pass count is the search's
cost (the pass that finds the row's max, before any search, is not counted). The replay follows
`_sampling_key_search` step for step in fp32 / int64, on rows of 128256 logits (fp32 and bf16; N(0, s^2)
with s = 1, 2.5, 5, plus 20 entries raised by 5 to 15), top-k 1, 20, 50, 1000 and top-p 0.5, 0.9, 0.95,
0.99 at T = 1, for three designs of the search (`DESIGNS`): the kernel's, and the two before it. A pass
that only takes its range's extremes (top-k, when they are the answer) reads the row like the others but
does about a third of a pivot pass's SASS instructions per tile (sm_90).
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
    top-k 1 is searched, and whether a count search ends on its range's extremes."""
    first_in_value: bool  # the first pass's pivots evenly in value over the logits with weight, else in key
    mass_in_first_pass: bool  # the first pass's lowest pivot measures the total mass, else a pass of its own
    top_k_1_searched: bool  # top-k 1 searched like any k, else the row's max at once
    count_extremes: bool  # top-k: when the answer is its range's largest or smallest entry, a pass takes those


DESIGNS = {
    "kernel": Design(first_in_value=True, mass_in_first_pass=True, top_k_1_searched=False, count_extremes=True),
    "first pass in value": Design(first_in_value=True, mass_in_first_pass=False, top_k_1_searched=True,
                                  count_extremes=False),
    "every pass in key": Design(first_in_value=False, mass_in_first_pass=False, top_k_1_searched=True,
                                count_extremes=False),
}


def search_passes(x: np.ndarray, w: np.ndarray, goal: float, x_low, x_high, design: Design,
                  mass_fraction: float | None = None) -> tuple[int, int, int]:
    """(answer key, passes, passes that only took the range's extremes) of the search for the largest key K
    with sum of w over key >= K at least the goal; with `mass_fraction` the goal is that fraction of the total
    weight, which the design's first pass measures at its lowest pivot."""
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
            goal = mass_fraction * (reach[0] if design.mass_in_first_pass else w.sum())
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


def replay(x: np.ndarray, setting: tuple[str, float], design: Design = DESIGNS["kernel"]) -> tuple[int, int, int]:
    """(answer key, passes, of them extremes only) of one filter on one row, with the bounds the kernel passes
    to the search; top-p's passes count the one that sums the mass when the design's search does not."""
    name, amount = setting
    m = x.max()
    if name == "top_k":
        if amount == 1 and not design.top_k_1_searched:
            return int(key(m)), 0, 0
        return search_passes(x, np.ones_like(x, dtype=np.float64), amount, x.min(), m, design)
    w = np.exp(np.maximum(x - m, EXP_FLOOR)).astype(np.float64)
    answer, passes, extremes = search_passes(x, w, 0.0, max(x.min(), m + EXP_FLOOR), m, design, mass_fraction=amount)
    return answer, passes + (not design.mass_in_first_pass), extremes


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
    counts = {name: {setting: [] for setting in SETTINGS} for name in DESIGNS}
    extremes = {setting: [] for setting in SETTINGS}
    for _, x in rows():
        for setting in SETTINGS:
            answers = {name: replay(x, setting, design) for name, design in DESIGNS.items()}
            assert len({answer for answer, _, _ in answers.values()}) == 1, setting
            for name, (_, passes, _) in answers.items():
                counts[name][setting].append(passes)
            extremes[setting].append(answers["kernel"][2])
    print("passes over a row (mean / most over 6 rows):", " | ".join(DESIGNS),
          "| the kernel's passes that took extremes only (mean)")
    for setting in SETTINGS:
        print(f"  {setting[0]} {setting[1]}:",
              " | ".join(f"{np.mean(counts[name][setting]):.2f} / {max(counts[name][setting])}" for name in DESIGNS),
              f"| {np.mean(extremes[setting]):.2f}")
    for name in DESIGNS:
        every = [passes for per_setting in counts[name].values() for passes in per_setting]
        print(f"{name}: {np.mean(every):.2f} passes on average, {max(every)} at most, over {len(every)} searches")
    if args.check:
        os.environ["TRITON_INTERPRET"] = "1"
        for (label, x), _ in zip(rows(seed=1), range(2)):
            for setting in (("top_k", 50), ("top_p", 0.9)):
                print(f"{label} {setting[0]} {setting[1]}: replay {replay(x, setting)[1]} passes, "
                      f"kernel right from MAX_ROUNDS = {kernel_passes(x, setting)}")


if __name__ == "__main__":
    main()
