"""Benchmark of sbd.mask_scatter_ (EB rule): the C++ op against the oracle, eager torch and torch.compile.

    python -m pytest bench/bench_scatter.py -q          # or: python -m bench.report --only scatter

Providers on the same inputs: `sbd` (torch.ops.sbd.mask_scatter_ on CPU), `naive` (the oracle, a Python
loop per row), `eager` (what a user would write in torch: stable sort + cumsum + scatter), `compile`
(torch.compile of eager) and, where CUDA is present, `triton` (the Triton launcher on the GPU).
The op updates its inputs in place, so every timed call first restores block_tokens and is_masked from a
saved copy (two copies of B x K elements, the same cost for every provider); otherwise the second call
would find fewer masked positions and the last ones none at all.
"""
from __future__ import annotations

import pytest
import torch

from bench.common import record, run_timed
from sbd_kernels.ops.scatter import naive

FAMILY = "scatter"
BATCHES = [1, 16, 128]
BLOCKS = [16, 32]
PROVIDERS = ["sbd", "naive", "eager", "compile", "triton"]
# Paper's "high" chat setting (docs/algorithm.md §3.7): with entropies uniform in [0, 0.2) about 4-5 positions
# of a 16-block are accepted, a realistic mid-block pass.
GAMMA = 0.35


def eager_mask_scatter_(block_tokens, is_masked, sampled, entropy, gamma):
    """EB rule in vectorised torch: rank by a stable sort, exclusive cumsum, scatter back, update in place.

    Candidates are the masked positions; non-candidates sort last with key +inf and are cut by the
    candidate count. (cumsum accumulates in another order than the op, which can flip a decision exactly
    at the gamma boundary; the oracle check below says whether it did on these inputs.)
    """
    key = torch.where(is_masked, entropy, torch.inf)
    sorted_key, order = torch.sort(key, dim=1, stable=True)
    before = torch.cumsum(sorted_key, dim=1) - sorted_key  # [B, K]: sum of the entropies ranked before
    rank = torch.arange(key.shape[1], device=key.device)
    num_candidates = is_masked.sum(dim=1, keepdim=True)
    take = (rank < num_candidates) & ((rank == 0) | (before <= gamma[:, None]))
    accepted = torch.zeros_like(is_masked).scatter_(1, order, take)
    block_tokens.copy_(torch.where(accepted, sampled, block_tokens))
    is_masked.logical_and_(~accepted)
    return accepted, accepted.sum(dim=1, dtype=torch.int32), ~is_masked.any(dim=1)


_COMPILED = {}


def compiled_eager():
    """torch.compile of the eager version, compiled once with dynamic shapes for every case."""
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(eager_mask_scatter_, dynamic=True)
    return _COMPILED["fn"]


def make_inputs(batch: int, k: int, device: str = "cpu"):
    """A mid-block pass: 70% of positions still masked, entropies uniform in [0, 0.2), gamma per row."""
    gen = torch.Generator().manual_seed(batch * 1000 + k)
    tokens = torch.randint(0, 50000, (batch, k), generator=gen)
    is_masked = torch.rand(batch, k, generator=gen) < 0.7
    sampled = torch.randint(0, 50000, (batch, k), generator=gen)
    entropy = torch.rand(batch, k, generator=gen) * 0.2
    gamma = torch.full((batch,), GAMMA)
    return [t.to(device) for t in (tokens, is_masked, sampled, entropy, gamma)]


def provider_fn(provider: str):
    """(function with the op's first five arguments, device) of one provider."""
    if provider == "sbd":
        return torch.ops.sbd.mask_scatter_, "cpu"
    if provider == "naive":
        return naive.mask_scatter_, "cpu"
    if provider == "eager":
        return eager_mask_scatter_, "cpu"
    if provider == "compile":
        return compiled_eager(), "cpu"
    from sbd_kernels.ops.scatter import triton as triton_kernels
    return triton_kernels.mask_scatter_, "cuda"


def matches_oracle(fn, inputs) -> bool:
    """Whether `fn` gives the oracle's outputs and in-place updates on fresh copies of `inputs`."""
    tokens, is_masked, sampled, entropy, gamma = inputs
    got_tokens, got_masked = tokens.clone(), is_masked.clone()
    got = fn(got_tokens, got_masked, sampled, entropy, gamma)
    ref_tokens, ref_masked = tokens.cpu(), is_masked.cpu()
    ref = naive.mask_scatter_(ref_tokens, ref_masked, sampled.cpu(), entropy.cpu(), gamma.cpu())
    return all(torch.equal(a.cpu(), e) for a, e in zip((*got, got_tokens, got_masked), (*ref, ref_tokens, ref_masked)))


def bytes_moved(batch: int, k: int) -> int:
    """Bytes one call must touch: per position is_masked read + write (2), entropy (4), sampled read and
    block_tokens write (16, upper bound: every position accepted), accepted (1); per row gamma (4),
    num_accepted (4), block_done (1)."""
    return batch * k * (2 + 4 + 16 + 1) + batch * (4 + 4 + 1)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("k", BLOCKS)
@pytest.mark.parametrize("batch", BATCHES)
def test_mask_scatter(benchmark, batch, k, provider):
    if provider == "triton" and not torch.cuda.is_available():
        pytest.skip("triton provider: no CUDA device on this machine (the CPU set runs instead)")
    try:
        fn, device = provider_fn(provider)
        inputs = make_inputs(batch, k, device)
        correct = None if provider == "naive" else matches_oracle(fn, inputs)
    except Exception as err:  # torch.compile failing on this machine is a result, not a crash
        if provider != "compile":
            raise
        pytest.skip(f"compile provider: torch.compile of the eager version failed: {type(err).__name__}: {err}")
    tokens, is_masked, sampled, entropy, gamma = inputs
    saved_tokens, saved_masked = tokens.clone(), is_masked.clone()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def call():
        tokens.copy_(saved_tokens)
        is_masked.copy_(saved_masked)
        out = fn(tokens, is_masked, sampled, entropy, gamma)
        sync()
        return out

    record(benchmark, family=FAMILY, case=f"B={batch} K={k} eb", provider=provider, baseline="eager",
           bytes_moved=bytes_moved(batch, k), correct=correct)
    run_timed(benchmark, call)
