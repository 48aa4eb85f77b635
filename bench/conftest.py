"""Benchmarks time the compiled kernels: the Triton interpreter must be off, and the ops registered. Every
case's own kernel and its plain baseline run before the providers that compile per case or run the oracle,
and a run stopped in the middle of a timing still writes the timings it finished: a run stopped at a time
budget (`sbd gpu-check`) keeps complete comparisons. On a GPU, NVML is sampled while the benchmarks run and
the header records the clocks, temperature, power and clock event reasons they ran at."""
import os
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    raise RuntimeError("bench: unset TRITON_INTERPRET; the interpreter would time Python, not kernels")

import pytest
from pytest_benchmark.utils import safe_dumps

import sbd_kernels  # noqa: F401
from bench.harness import bench_device
from sbd_kernels.bench_report import HEADER_KEY, PARTIAL_VARIABLE
from sbd_kernels.machine import GpuMonitor, ceilings_by_threads, machine_header

MONITOR = pytest.StashKey[GpuMonitor]()


def pytest_sessionstart(session):
    """On the GPU: starts sampling it (`machine.GpuMonitor`, every 0.5 s in a thread of this process). A
    device that SBD_BENCH_DEVICE asks for and this machine lacks stops the run in one line."""
    try:
        device = bench_device()
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None
    if device == "cuda":
        session.config.stash[MONITOR] = GpuMonitor().__enter__()


def pytest_sessionfinish(session):
    monitor = session.config.stash.get(MONITOR, None)
    if monitor is not None:
        monitor.__exit__(None, None, None)


@pytest.hookimpl(hookwrapper=True)
def pytest_benchmark_generate_json(config, benchmarks, include_data, machine_info, commit_info):
    """Drops the timings without one finished round before pytest-benchmark writes its JSON. A run stopped
    by SIGINT in the middle of a timing (`sbd gpu-check` stops a stage at its budget) leaves one such entry,
    and the writer would fail on it (min() of no data) and lose every timing taken before it."""
    benchmarks[:] = [bench for bench in benchmarks if bench]
    yield


def pytest_benchmark_update_json(config, benchmarks, output_json):
    """Stores what the report is labelled with in the JSON, taken on this machine at the end of this run:
    machine_info[HEADER_KEY] = `machine_header` (CPU, GPU, versions, commit, date, ceilings at torch's
    default thread count) and "ceilings_by_threads", the CPU ceilings at every thread count a CPU timing ran
    with (the extra_info "threads" the harness records), so that `sbd bench --from-json` labels the timings
    with the machine that took them, and sets each against the ceilings of its own thread count. A run on
    the GPU measures no CPU ceilings (its results are set against the GPU's datasheet): the hook then takes
    well under a second, inside the grace period of a `sbd gpu-check` stage stopped at its budget."""
    threads = [b["extra_info"]["threads"] for b in output_json["benchmarks"]
               if b.get("extra_info", {}).get("device") == "cpu" and "threads" in b["extra_info"]]
    header = machine_header(Path(__file__).resolve().parent, ceilings=bench_device() == "cpu")
    monitor = config.stash.get(MONITOR, None)
    if monitor is not None:
        header["gpu_load"] = monitor.summary()
    output_json["machine_info"][HEADER_KEY] = {**header, "ceilings_by_threads": ceilings_by_threads(threads)}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    """With SBD_BENCH_PARTIAL set, appends the test's finished timing (its pytest-benchmark JSON entry, with the
    extra_info the test added after timing) to that file at once: a run killed later (a compile that ignores
    SIGINT past gpu-check's grace period) keeps it."""
    path = os.environ.get(PARTIAL_VARIABLE)
    fixture = getattr(item, "funcargs", {}).get("benchmark") if path else None
    stats = getattr(fixture, "stats", None)
    if stats and not fixture.has_error:
        with open(path, "a") as handle:
            handle.write(safe_dumps(stats.as_dict(include_data=True)) + "\n")


# Providers timed after every other row of their file, in this order: FlexAttention and torch.compile compile
# per case (on an H200, 2 attention cases in 48 s when FlexAttention came right after each case's sbd and
# SDPA rows), the oracle takes up to seconds per call.
LATE_PROVIDERS = ("flex", "compile", "naive")


def late_rank(item) -> int:
    """0 for a test whose `provider` is not late (or that has none), else 1 + its place in LATE_PROVIDERS."""
    provider = getattr(item, "callspec", None) and item.callspec.params.get("provider")
    return LATE_PROVIDERS.index(provider) + 1 if provider in LATE_PROVIDERS else 0


def pytest_collection_modifyitems(config, items):
    first = {}
    for index, item in enumerate(items):
        first.setdefault(item.path, index)
    items.sort(key=lambda item: (first[item.path], late_rank(item)))  # stable: cases keep their order
