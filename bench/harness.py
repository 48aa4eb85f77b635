"""The benchmark harness every `bench/bench_<family>.py` uses: grid selection, provider set-up, labelling and
timing.

Each bench file is a pytest-benchmark module. One test, parametrised over the family's records of the
benchmark grid (`sbd_kernels.benchmark_grid`) and over providers, times every provider of a comparison (our
op, the oracle, the torch baseline a user would otherwise write, torch.compile of it) on the same inputs:

    fn, x, correct = build_provider(provider, lambda: ..., optional=("compile",))
    measure(benchmark, lambda: fn(*x), family="sampling", shape=shape, provider=provider, baseline="eager",
            bytes_moved=logits.nbytes, correct=correct)

Every provider runs on `bench_device()`: the CPU, or with an NVIDIA GPU the GPU, where `sbd` is the op
through `torch.ops.sbd` (its Triton kernel) and the baselines (SDPA, FlexAttention, eager torch,
torch.compile) run on CUDA tensors. `measure` tags the timing with the record and what the report needs,
then times calls after warm-up calls: single calls on the CPU; on CUDA, rounds of CUDA_CALLS_PER_ROUND calls
ended by one synchronisation (the eager cost per call, launch overhead included), and in addition the call
replayed from a CUDA graph (`graph_ms`: GPU time alone, the basis of achieved TB/s and TFLOP/s); the oracles
(ORACLE_PROVIDERS, reference points rather than the product) a few rounds of one synchronised call. The report
(`sbd bench`, `sbd_kernels.bench_report`) turns the JSON that pytest-benchmark writes into one table per
family, with ratios taken against the `baseline` provider of the same case in the same run, and achieved
bandwidth and FLOP/s against this machine's ceilings (`sbd_kernels.machine`: measured on the CPU; on CUDA
the GPU's datasheet). A provider whose outputs failed the oracle check on the benchmark inputs
(`correct=False`) gets no ratio.
"""
from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from sbd_kernels.benchmark_grid import GRIDS, Shape, shape_to_dict

# Timed rounds per provider and case. 20 rounds of a 0.1-10 ms kernel keep a family under a minute on the
# 2-core reference machine while giving stable medians; a bench file passes fewer for its long cases, and
# SBD_BENCH_ROUNDS overrides both (e.g. 3 for a smoke run).
DEFAULT_ROUNDS = 20
WARMUP_ROUNDS = 3
# On CUDA the per-file round counts (tuned for the CPU's milliseconds) give way to CUDA_ROUNDS rounds of
# CUDA_CALLS_PER_ROUND back-to-back calls and one synchronisation: a 20 us kernel timed alone would measure
# the ~10 us synchronisation with it. The CUDA-graph time is the median of CUDA_GRAPH_ROUNDS rounds of
# CUDA_CALLS_PER_ROUND replays between two events.
CUDA_ROUNDS = 30
CUDA_CALLS_PER_ROUND = 10
CUDA_GRAPH_ROUNDS = 20
# The oracles are reference points, not the product: on CUDA each gets ORACLE_CUDA_ROUNDS rounds of one call,
# synchronised after it, and no CUDA graph. At CUDA_ROUNDS rounds of CUDA_CALLS_PER_ROUND calls (331 calls with
# the warm-up) the scatter oracle, a Python loop over host copies at 35-53 ms per call at B = 128, took longer
# per case than the 25 s `sbd gpu-check` gives the whole scatter file.
ORACLE_PROVIDERS = ("naive",)
ORACLE_CUDA_ROUNDS = 3
DEVICE_VARIABLE = "SBD_BENCH_DEVICE"


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


def bench_device() -> str:
    """Where every provider runs: "cuda" when torch sees a GPU, else "cpu"; SBD_BENCH_DEVICE=cpu (or cuda)
    chooses, e.g. the CPU set on a GPU machine. Raises ValueError for another value, or cuda without a GPU."""
    wanted = os.environ.get(DEVICE_VARIABLE, "")
    if wanted not in ("", "cpu", "cuda"):
        raise ValueError(f"{DEVICE_VARIABLE} must be cpu or cuda, got {wanted!r}")
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{DEVICE_VARIABLE}=cuda, but torch {torch.__version__} sees no CUDA device")
    return wanted or ("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to `count` inside, the previous one restored after (for the other
    bench files of the same pytest run)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def bench_rounds(default: int | None = None) -> int:
    """SBD_BENCH_ROUNDS when set, else the bench file's `default` for this case, else DEFAULT_ROUNDS."""
    return int(os.environ.get("SBD_BENCH_ROUNDS", default or DEFAULT_ROUNDS))


def build_provider(provider: str, build: Callable[[], Any], *, optional: tuple[str, ...] = ()) -> Any:
    """`build()` (a provider's function, inputs and oracle check), or a skip for an exception of an `optional`
    provider (torch.compile or FlexAttention failing on this machine is a result, not a crash)."""
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


def record(benchmark, *, family: str, shape: Shape, provider: str, baseline: str, device: str = "cpu",
           bytes_moved: int | None = None, flops: int | None = None, correct: bool | None = None) -> None:
    """Tag one timing with what the report needs.

    family: op family ("sampling", "scatter", "attention", "decode"); shape: the grid record, whose label is
    the case (identical for every provider of one comparison); provider: who is timed ("sbd", "naive",
    "eager", "compile", "sdpa", ...); baseline: the provider ratios are taken against; device: where it ran;
    bytes_moved / flops: the physical work of one call (formula in the bench file), for GB/s and GFLOP/s;
    correct: whether this provider's outputs matched the oracle on these exact inputs (None for providers
    that are not checked). Also stores torch's current thread count ("threads"): CPU results are set against
    the ceilings measured at that count (bench/conftest.py stores them in the JSON).
    """
    benchmark.group = f"{family} | {shape.label}"
    benchmark.extra_info.update(
        family=family, case=shape.label, shape=shape_to_dict(shape), provider=provider, baseline=baseline,
        device=device, threads=torch.get_num_threads(), bytes_moved=bytes_moved, flops=flops, correct=correct,
    )


def measure(benchmark, call: Callable[[], Any], *, family: str, shape: Shape, provider: str, baseline: str,
            device: str = "cpu", bytes_moved: int | None = None, flops: int | None = None,
            correct: bool | None = None, rounds: int | None = None, cuda_rounds: int = CUDA_ROUNDS,
            calls_per_round: int = CUDA_CALLS_PER_ROUND, graph: bool = True, optional: tuple[str, ...] = (),
            refill: Callable[[], None] | None = None) -> Any:
    """`record` the case, then time `call()` with pytest-benchmark after WARMUP_ROUNDS warm-up rounds:
    `bench_rounds(rounds)` rounds of single calls on the CPU; on CUDA `bench_rounds(cuda_rounds)` rounds of
    `calls_per_round` calls ended by one synchronisation, pytest-benchmark dividing each round by its calls
    (an oracle: `cuda_timing`). On CUDA with `graph` (a call that never syncs with the host), also the call
    replayed from a CUDA graph: extra_info["graph_ms"], None when the capture is refused. Returns the last
    result. An exception of an `optional` provider is a skip, as in build_provider: torch.compile may compile
    again while timed (seen on an H200: Inductor failed on a recompile for the top-p baseline).

    refill: for an op that updates its inputs in place, `InputPool.refill` of the pool `call` takes its
    inputs from (sized with `measured_calls`): run before the timing and before every CUDA-graph round, never
    inside a timed region, so that every timed call finds fresh inputs and no restore is timed with it."""
    try:
        return _measure(benchmark, call, family=family, shape=shape, provider=provider, baseline=baseline,
                        device=device, bytes_moved=bytes_moved, flops=flops, correct=correct, rounds=rounds,
                        cuda_rounds=cuda_rounds, calls_per_round=calls_per_round, graph=graph, refill=refill)
    except Exception as err:
        if provider not in optional:
            raise
        pytest.skip(f"{provider} provider failed on this machine while timed: {type(err).__name__}: {err}"[:300])


def cuda_timing(provider: str, cuda_rounds: int, calls_per_round: int, graph: bool) -> tuple[int, int, bool]:
    """(rounds, calls per round, CUDA graph) of `provider`'s timing on CUDA: those asked for, or for an oracle
    (ORACLE_PROVIDERS) ORACLE_CUDA_ROUNDS rounds of one call each, so each call is synchronised, and no graph."""
    if provider in ORACLE_PROVIDERS:
        return ORACLE_CUDA_ROUNDS, 1, False
    return cuda_rounds, calls_per_round, graph


def measured_calls(device: str, *, provider: str = "", rounds: int | None = None, cuda_rounds: int = CUDA_ROUNDS,
                   calls_per_round: int = CUDA_CALLS_PER_ROUND, graph: bool = True) -> int:
    """How many times `measure` with the same arguments calls `call()` between two refills, at most: on the
    CPU WARMUP_ROUNDS + bench_rounds(rounds) single calls; on CUDA those rounds of `calls_per_round` calls
    (`cuda_timing` for `provider`) and the one call pytest-benchmark adds for the result, or the CUDA graph's
    1 warm-up call and CUDA_CALLS_PER_ROUND captured calls when that is more."""
    if device != "cuda":
        return WARMUP_ROUNDS + bench_rounds(rounds)
    cuda_rounds, calls_per_round, graph = cuda_timing(provider, cuda_rounds, calls_per_round, graph)
    eager = (WARMUP_ROUNDS + bench_rounds(cuda_rounds)) * calls_per_round + 1
    return max(eager, 1 + CUDA_CALLS_PER_ROUND) if graph else eager


class InputPool:
    """`size` copies of the tensors an op updates in place, for timing it without restoring them inside the
    timed call: `take()` hands out the next fresh copy (IndexError past the last one, rather than a timing on
    inputs an earlier call updated), `refill()` restores every copy from the originals and starts over.

    The copies are stacked, [size, *shape] per tensor, so that a refill is one copy_ per tensor; `take()`
    returns views made in advance (contiguous slices), costing the timed call no tensor op."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], size: int):
        self.originals = tuple(t.clone() for t in tensors)
        self.stacks = tuple(t.unsqueeze(0).repeat(size, *(1,) * t.dim()) for t in tensors)  # [size, *t.shape]
        self.copies = [tuple(stack[i] for stack in self.stacks) for i in range(size)]
        self.next = 0

    def take(self) -> tuple[torch.Tensor, ...]:
        copy = self.copies[self.next]
        self.next += 1
        return copy

    def refill(self) -> None:
        for stack, original in zip(self.stacks, self.originals):
            stack.copy_(original.expand_as(stack))
        self.next = 0


def _measure(benchmark, call: Callable[[], Any], *, family: str, shape: Shape, provider: str, baseline: str,
             device: str, bytes_moved: int | None, flops: int | None, correct: bool | None, rounds: int | None,
             cuda_rounds: int, calls_per_round: int, graph: bool, refill: Callable[[], None] | None) -> Any:
    record(benchmark, family=family, shape=shape, provider=provider, baseline=baseline, device=device,
           bytes_moved=bytes_moved, flops=flops, correct=correct)
    if refill is not None:
        refill()
    if device != "cuda":
        return benchmark.pedantic(call, rounds=bench_rounds(rounds), warmup_rounds=WARMUP_ROUNDS, iterations=1)
    if refill is not None:
        torch.cuda.synchronize()  # the refill's copies end before the first timed round starts
    cuda_rounds, calls_per_round, graph = cuda_timing(provider, cuda_rounds, calls_per_round, graph)
    calls = 0

    def timed():
        nonlocal calls
        calls += 1
        out = call()
        if calls % calls_per_round == 0:
            torch.cuda.synchronize()
        return out

    out = benchmark.pedantic(timed, rounds=bench_rounds(cuda_rounds), warmup_rounds=WARMUP_ROUNDS,
                             iterations=calls_per_round)
    benchmark.extra_info["graph_ms"] = cuda_graph_ms(call, refill) if graph else None
    return out


def cuda_graph_ms(call: Callable[[], Any], refill: Callable[[], None] | None = None) -> float | None:
    """Milliseconds of one `call()` replayed from a CUDA graph (GPU time without Python, dispatch and launch
    costs): the median over CUDA_GRAPH_ROUNDS rounds of CUDA_CALLS_PER_ROUND calls, timed with CUDA events.
    Without `refill` the graph holds one call, replayed CUDA_CALLS_PER_ROUND times per round; with it (an op
    updating its inputs in place) the graph holds CUDA_CALLS_PER_ROUND calls, each on its own copy of the
    inputs, replayed once per round after `refill()` restored them, outside the events. None when the capture
    fails (a call that syncs with the host, or an op that cannot be captured)."""
    if refill is not None:
        refill()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    calls_in_graph = 1 if refill is None else CUDA_CALLS_PER_ROUND
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls_in_graph):
                call()
    except RuntimeError:  # capture refused (a host sync, an op CUDA graphs cannot hold): no graph time
        torch.cuda.synchronize()
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    times = []
    for _ in range(CUDA_GRAPH_ROUNDS):
        if refill is not None:
            refill()  # queued before `start`: the stream runs it before the timed replay
        start.record()
        for _ in range(CUDA_CALLS_PER_ROUND // calls_in_graph):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / CUDA_CALLS_PER_ROUND)
    return statistics.median(times)


def random_weights_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Fills a model built on the meta device and moved with `to_empty`: norm weights 1, every other parameter
    uniform +-0.02 (the spread of the usual std-0.02 init), drawn in the parameter's dtype (no fp32 copy:
    10x faster than a normal init for 1.5B parameters), by a generator on the model's device (a GPU fills 3 GB
    in milliseconds). Returns the model in eval mode."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.rand(param.shape, generator=gen, dtype=param.dtype, device=device) * 0.04 - 0.02)
    return model.eval()
