"""Property test of sbd.mask_scatter_: every backend (C++ CPU, Triton under the interpreter or compiled on
CUDA copies of the buffers with SBD_TEST_DEVICE=cuda, the oracle itself) on random inputs laid out as
views inside larger poisoned buffers, against the oracle on contiguous copies.

Each case draws B, K, entropies with ties, +inf, -inf, NaN and values whose sums overflow, masked and
valid patterns, a rule and a gamma (tensor or number, including 0, +inf and numbers beyond fp32), and a
layout per tensor argument (`sbd_kernels.testing.Embedded`: offset, strided, or stride 0 for read-only
arguments whose rows are all equal); sometimes `sampled` is `block_tokens` itself or `valid` is
`is_masked` itself (the aliases the op allows). Properties: the three outputs and the in-place arguments
equal the oracle's; nothing outside the in-place views changed; read-only arguments are unchanged.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import pytest
import torch

from sbd_kernels import testing
from sbd_kernels.ops.scatter import naive
from sbd_kernels.testing import Embedded

# The interpreter computes with numpy, which warns on the sums this test means to reach (-inf + inf, fp32
# overflow of 3e38 + 3e38).
pytestmark = pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")

INF = float("inf")
NAN = float("nan")
SENTINEL = -7777
BACKENDS = ("cpu", "triton", "naive")
CASES_PER_CHUNK = 25
CHUNKS = 12  # 300 cases in the default run (about 15 s of CPU time here)
SLOW_CHUNKS = 40  # 1000 more in the slow test


op_for = functools.partial(testing.backend_op, "mask_scatter_")


@dataclass
class Case:
    """One call: contiguous inputs plus how each tensor argument is laid out."""

    tensors: dict[str, torch.Tensor | None]  # block_tokens, is_masked, sampled, entropy, gamma, valid
    gamma_val: float
    rule: str
    layouts: dict[str, str]  # argument -> Embedded layout
    alias: str | None  # None, "sampled" (sampled is block_tokens) or "valid" (valid is is_masked)

    def describe(self, seed: int) -> str:
        shape = tuple(self.tensors["block_tokens"].shape)
        gamma = "tensor" if self.tensors["gamma"] is not None else self.gamma_val
        return f"seed {seed}: [B, K] = {shape}, rule {self.rule}, gamma {gamma}, layouts {self.layouts}, " \
               f"alias {self.alias}"


def random_entropy(rng: random.Random, gen: torch.Generator, batch: int, k: int) -> torch.Tensor:
    """Values on a 1/16 grid (exact in fp32, so many ties and exact boundary sums), with rare +inf, NaN,
    -inf, negative values and 3e38 (whose sums overflow to +inf)."""
    entropy = torch.randint(0, 13, (batch, k), generator=gen).to(torch.float32) / 16
    specials = [(INF, 0.06), (NAN, 0.04), (-INF, 0.01), (-1 / 16, 0.02), (3e38, 0.02)]
    for value, p in specials:
        entropy[torch.rand(batch, k, generator=gen) < p * rng.choice([0, 1, 3])] = value
    if rng.random() < 0.1 and entropy.numel():
        entropy[:] = entropy[0, 0]  # one value everywhere: ties broken by position only
    return entropy


def random_mask(rng: random.Random, gen: torch.Generator, batch: int, k: int, p_true: float) -> torch.Tensor:
    """Random pattern, sometimes all True, all False, or with one row all False."""
    pattern = rng.choice(["random", "random", "all", "none", "row off"])
    mask = torch.rand(batch, k, generator=gen) < p_true
    if pattern == "all":
        mask[:] = True
    elif pattern == "none":
        mask[:] = False
    elif pattern == "row off" and batch:
        mask[rng.randrange(batch)] = False
    return mask


def random_gamma(rng: random.Random, gen: torch.Generator, batch: int) -> tuple[torch.Tensor | None, float]:
    """(gamma tensor or None, gamma_val): grid values, 0, +inf, 3e38 and numbers beyond fp32."""
    if rng.random() < 0.5:
        values = torch.tensor([0.0, 1 / 16, 0.25, 0.5, 1.0, 2.0, INF, 3e38])
        gamma = values[torch.randint(0, len(values), (batch,), generator=gen)]
        if rng.random() < 0.2:
            gamma[:] = rng.choice([0.0, 0.25, INF])  # equal rows: may be laid out with stride 0
        return gamma, rng.choice([0.1, -1.0])  # gamma_val is ignored when gamma is given, even if < 0
    return None, rng.choice([0.0, 1 / 16, 0.1, 0.25, 0.5, 1.0, 3.0, INF, 3.5e38, 1e300])


def read_only_layout(rng: random.Random, t: torch.Tensor | None) -> str:
    """A layout for a read-only argument: stride 0 along the rows when they are all equal (sometimes)."""
    rows_equal = t is not None and t.numel() > 0 and bool((t == t[:1]).all())  # NaN rows never equal
    choices = ["contiguous", "offset", "strided"] + (["expanded"] * 2 if rows_equal else [])
    return rng.choice(choices)


def random_case(seed: int) -> Case:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batch = rng.choice([0, 1, 1, 2, 3, 5, 8]) if rng.random() < 0.05 else rng.choice([1, 2, 3, 5, 8])
    k = rng.choice([0, 1]) if rng.random() < 0.05 else rng.choice([1, 2, 3, 7, 16, 17, 32, 40])
    entropy = random_entropy(rng, gen, batch, k)
    is_masked = random_mask(rng, gen, batch, k, rng.choice([0.3, 0.7, 0.95]))
    valid = random_mask(rng, gen, batch, k, 0.85) if rng.random() < 0.6 else None
    sampled = torch.randint(1000, 2000, (batch, k), generator=gen)
    if batch and rng.random() < 0.1:  # equal rows: may be laid out with stride 0
        sampled[:] = sampled[:1].clone()
        if valid is not None:
            valid[:] = valid[:1].clone()
    block_tokens = torch.randint(0, 1000, (batch, k), generator=gen)
    block_tokens[is_masked] = SENTINEL  # a write to a masked position that is not accepted shows
    gamma, gamma_val = random_gamma(rng, gen, batch)
    tensors = {"block_tokens": block_tokens, "is_masked": is_masked, "sampled": sampled, "entropy": entropy,
               "gamma": gamma, "valid": valid}
    layouts = {name: rng.choice(["contiguous", "offset", "strided"]) for name in ("block_tokens", "is_masked")}
    layouts.update({name: read_only_layout(rng, tensors[name])
                    for name in ("sampled", "entropy", "gamma", "valid") if tensors[name] is not None})
    alias = None
    if rng.random() < 0.1:
        alias = "sampled"
    elif valid is not None and rng.random() < 0.1:
        alias = "valid"
    return Case(tensors, gamma_val, rng.choice(["eb", "threshold"]), layouts, alias)


def expected_result(case: Case):
    """The oracle on contiguous copies; an aliased argument is a copy of the in-place one's inputs."""
    args = {name: None if t is None else t.clone() for name, t in case.tensors.items()}
    if case.alias == "sampled":
        args["sampled"] = args["block_tokens"].clone()
    if case.alias == "valid":
        args["valid"] = args["is_masked"].clone()
    outputs = naive.mask_scatter_(args["block_tokens"], args["is_masked"], args["sampled"], args["entropy"],
                                  args["gamma"], case.gamma_val, case.rule, args["valid"])
    return outputs, args["block_tokens"], args["is_masked"]


def run_case(backend: str, case: Case, seed: int) -> None:
    embedded = {name: Embedded(t, case.layouts[name]) for name, t in case.tensors.items() if t is not None}
    views = {name: embedded[name].view if name in embedded else None for name in case.tensors}
    if case.alias == "sampled":
        views["sampled"] = views["block_tokens"]
    if case.alias == "valid":
        views["valid"] = views["is_masked"]
    outputs = op_for(backend)(views["block_tokens"], views["is_masked"], views["sampled"], views["entropy"],
                              views["gamma"], case.gamma_val, case.rule, views["valid"])

    (expected, expected_tokens, expected_masked) = expected_result(case)
    where = f"{backend}, {case.describe(seed)}"
    for name, got, want in zip(("accepted", "num_accepted", "block_done"), outputs, expected):
        assert got.dtype == want.dtype and got.shape == want.shape, f"{name} dtype/shape: {where}"
        assert torch.equal(got, want), f"{name}: {got} != {want}; {where}"
    assert torch.equal(views["block_tokens"], expected_tokens), f"block_tokens: {where}"
    assert torch.equal(views["is_masked"], expected_masked), f"is_masked: {where}"
    for name, arg in embedded.items():
        if name in ("block_tokens", "is_masked"):
            arg.check_outside(f"{name}: {where}")
        elif name != case.alias:
            arg.check_unchanged(f"{name}: {where}")


def run_chunk(chunk: int) -> None:
    for seed in range(chunk * CASES_PER_CHUNK, (chunk + 1) * CASES_PER_CHUNK):
        case = random_case(seed)
        for backend in BACKENDS:
            run_case(backend, case, seed)


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_every_backend_matches_the_oracle_on_embedded_random_inputs(chunk):
    """Guards against a backend disagreeing with the oracle on some input the contract allows (special
    entropies, gamma 0 / +inf / beyond fp32, empty rows, allowed aliases), reading or writing through a
    wrong stride or offset, writing outside an in-place view, or writing a read-only argument."""
    run_chunk(chunk)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(CHUNKS, CHUNKS + SLOW_CHUNKS))
def test_every_backend_matches_the_oracle_on_more_random_inputs(chunk):
    """The same property on 1000 more cases."""
    run_chunk(chunk)


def test_cases_cover_the_contract():
    """The default run's cases reach every feature they are meant to (so the property test can fail)."""
    seen = set()
    for seed in range(CHUNKS * CASES_PER_CHUNK):
        case = random_case(seed)
        t = case.tensors
        seen.add(("rule", case.rule))
        seen.add(("gamma", "tensor" if t["gamma"] is not None else "number"))
        seen.add(("alias", case.alias))
        seen.update(("layout", name, layout) for name, layout in case.layouts.items())
        if t["gamma"] is None:
            seen.add(("gamma_val", case.gamma_val))
        else:
            seen.update(("gamma entry", float(g)) for g in t["gamma"])
        entropy = t["entropy"]
        seen.update(("entropy", name) for name, hit in (("+inf", entropy.isposinf()), ("-inf", entropy.isneginf()),
                                                          ("nan", entropy.isnan()), ("negative", entropy < 0),
                                                          ("huge", entropy == 3e38)) if hit.any())
        seen.add(("empty", t["block_tokens"].numel() == 0))
    for name in ("sampled", "entropy", "gamma", "valid"):
        assert ("layout", name, "expanded") in seen, name
    for name in ("block_tokens", "is_masked"):
        assert ("layout", name, "strided") in seen and ("layout", name, "offset") in seen
    for value in (0.0, INF, 1e300, 3.5e38):
        assert ("gamma_val", value) in seen
    for value in (0.0, INF):
        assert ("gamma entry", value) in seen
    for name in ("+inf", "-inf", "nan", "negative", "huge"):
        assert ("entropy", name) in seen
    assert {("alias", "sampled"), ("alias", "valid"), ("empty", True), ("rule", "threshold")} <= seen
