"""The benchmark harness every `bench/bench_<family>.py` uses: grid selection, provider set-up, labelling and
timing.

Each bench file is a pytest-benchmark module. One test, parametrised over the family's records of the
benchmark grid (`sbd_kernels.benchmark_grid`) and over providers, times every provider of a comparison (our
op, the oracle, the torch baseline a user would otherwise write, torch.compile of it) on the same inputs:

    fn, device, x, correct = build_provider(provider, lambda: ..., optional=("compile",))
    measure(benchmark, lambda: fn(*x), family="sampling", shape=shape, provider=provider, baseline="eager",
            device=device, bytes_moved=logits.nbytes, correct=correct)

`measure` tags the timing with the record and what the report needs, then times single calls (synchronised
on CUDA) after warm-up calls. The report (`sbd bench`, `sbd_kernels.bench_report`) turns the JSON that
pytest-benchmark writes into one table per family, with ratios taken against the `baseline` provider of the
same case in the same run, and achieved GB/s or GFLOP/s against this machine's measured ceilings
(`sbd_kernels.machine`). A provider whose outputs failed the oracle check on the benchmark inputs
(`correct=False`) gets no ratio.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sbd_kernels.benchmark_grid import GRIDS, Shape, shape_to_dict

# Timed rounds per provider and case. 20 rounds of a 0.1-10 ms kernel keep a family under a minute on the
# 2-core reference machine while giving stable medians; a bench file passes fewer for its long cases, and
# SBD_BENCH_ROUNDS overrides both (e.g. 3 for a smoke run).
DEFAULT_ROUNDS = 20
WARMUP_ROUNDS = 3


def quick_grid() -> bool:
    """SBD_BENCH_QUICK=1: the quick subset of each family's grid instead of the full grid."""
    return os.environ.get("SBD_BENCH_QUICK") == "1"


def grid(family: str) -> list[Shape]:
    """The records this run times for `family` (full or quick grid)."""
    return GRIDS[family](quick_grid())


def parametrize_shapes(family: str):
    """pytest parametrisation of a bench test over `grid(family)`, ids as the records' `test_id`
    ("1-16" for batch 1, block 16) so that `-k` selects cases."""
    return pytest.mark.parametrize("shape", grid(family), ids=lambda shape: shape.test_id)


def bench_rounds(default: int | None = None) -> int:
    """SBD_BENCH_ROUNDS when set, else the bench file's `default` for this case, else DEFAULT_ROUNDS."""
    return int(os.environ.get("SBD_BENCH_ROUNDS", default or DEFAULT_ROUNDS))


def build_provider(provider: str, build: Callable[[], Any], *, optional: tuple[str, ...] = ()) -> Any:
    """`build()` (a provider's function, inputs and oracle check), or a skip: the `triton` provider without
    CUDA, or an exception of an `optional` provider (torch.compile or FlexAttention failing on this
    machine is a result, not a crash)."""
    if provider == "triton" and not torch.cuda.is_available():
        pytest.skip("triton provider: no CUDA device on this machine (the CPU set runs instead)")
    try:
        return build()
    except Exception as err:
        if provider not in optional:
            raise
        pytest.skip(f"{provider} provider failed on this machine: {type(err).__name__}: {err}"[:300])


_COMPILED: dict[Callable, Callable] = {}


def compiled(fn: Callable) -> Callable:
    """torch.compile of `fn` with dynamic shapes, compiled once for every case of the file."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]


def record(benchmark, *, family: str, shape: Shape, provider: str, baseline: str,
           bytes_moved: int | None = None, flops: int | None = None, correct: bool | None = None) -> None:
    """Tag one timing with what the report needs.

    family: op family ("sampling", "scatter", "attention", "decode"); shape: the grid record, whose label is
    the case (identical for every provider of one comparison); provider: who is timed ("sbd", "naive",
    "eager", "compile", "sdpa", "triton", ...); baseline: the provider ratios are taken against;
    bytes_moved / flops: the physical work of one call (formula in the bench file), for GB/s and GFLOP/s;
    correct: whether this provider's outputs matched the oracle on these exact inputs (None for providers
    that are not checked).
    """
    benchmark.group = f"{family} | {shape.label}"
    benchmark.extra_info.update(
        family=family, case=shape.label, shape=shape_to_dict(shape), provider=provider, baseline=baseline,
        bytes_moved=bytes_moved, flops=flops, correct=correct,
    )


def measure(benchmark, call: Callable[[], Any], *, family: str, shape: Shape, provider: str, baseline: str,
            device: str = "cpu", bytes_moved: int | None = None, flops: int | None = None,
            correct: bool | None = None, rounds: int | None = None) -> Any:
    """`record` the case, then time `call()` with pytest-benchmark: WARMUP_ROUNDS calls, then
    `bench_rounds(rounds)` timed single calls, each ending with a device synchronisation on CUDA. Returns the
    last result."""
    record(benchmark, family=family, shape=shape, provider=provider, baseline=baseline,
           bytes_moved=bytes_moved, flops=flops, correct=correct)
    sync = torch.cuda.synchronize if device == "cuda" else None

    def timed():
        out = call()
        if sync is not None:
            sync()
        return out

    return benchmark.pedantic(timed, rounds=bench_rounds(rounds), warmup_rounds=WARMUP_ROUNDS, iterations=1)


def random_weights_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Fills a model built on the meta device and moved with `to_empty`: norm weights 1, every other parameter
    uniform +-0.02 (the spread of the usual std-0.02 init), drawn in the parameter's dtype (no fp32 copy:
    10x faster than a normal init for 1.5B parameters). Returns the model in eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.rand(param.shape, generator=gen, dtype=param.dtype) * 0.04 - 0.02)
    return model.eval()
