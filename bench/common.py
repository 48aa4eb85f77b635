"""Shared pieces of the benchmark suite: provider metadata, timing, and this machine's measured ceilings.

Every `bench/bench_<family>.py` is a pytest-benchmark module. One parametrised test times every provider of a
comparison (our op, the oracle, the torch baseline a user would otherwise write, torch.compile of it) on the
same inputs, and tags each timing with `record(...)`:

    record(benchmark, family="sampling", case="B=1 K=16 V=128256 bf16", provider="sbd", baseline="eager",
           bytes_moved=logits.nbytes, correct=matches_oracle)
    run_timed(benchmark, lambda: torch.ops.sbd.entropy_sample(logits, seed, offset))

`bench/report.py` turns the JSON that pytest-benchmark writes into one table per family, with ratios taken
against the `baseline` provider of the same case in the same run, and achieved GB/s or GFLOP/s against the
ceilings measured here (`machine_ceilings`). A provider whose outputs failed the oracle check on the
benchmark inputs (`correct=False`) gets no ratio.
"""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from functools import cache
from pathlib import Path

import torch

DTYPES_BY_NAME = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
REPO_ROOT = Path(__file__).resolve().parent.parent

# Timed rounds per provider and case. 20 rounds of a 0.1-10 ms kernel keep a family under a minute here
# while giving stable medians on this shared machine; SBD_BENCH_ROUNDS overrides it (e.g. 3 for a smoke run).
DEFAULT_ROUNDS = 20
WARMUP_ROUNDS = 3


def quick_grid() -> bool:
    """SBD_BENCH_QUICK=1: a small subset of each family's cases instead of the full grid of the design
    (the full grid of the four families took 28 minutes on this 2-core machine)."""
    return os.environ.get("SBD_BENCH_QUICK") == "1"


def bench_rounds() -> int:
    return int(os.environ.get("SBD_BENCH_ROUNDS", DEFAULT_ROUNDS))


def record(benchmark, *, family: str, case: str, provider: str, baseline: str,
           bytes_moved: int | None = None, flops: int | None = None, correct: bool | None = None) -> None:
    """Tag one timing with what the report needs.

    family: op family ("sampling", "scatter", "attention", "decode"); case: readable shape label, identical
    for every provider of one comparison; provider: who is timed ("sbd", "naive", "eager", "compile",
    "sdpa", "triton", ...); baseline: the provider ratios are taken against; bytes_moved / flops: the
    physical work of one call (formula in the bench file), for GB/s and GFLOP/s; correct: whether this
    provider's outputs matched the oracle on these exact inputs (None for providers that are not checked).
    """
    benchmark.group = f"{family} | {case}"
    benchmark.extra_info.update(
        family=family, case=case, provider=provider, baseline=baseline,
        bytes_moved=bytes_moved, flops=flops, correct=correct,
    )


def run_timed(benchmark, fn, rounds: int | None = None):
    """Time `fn()` with pytest-benchmark: warm-up rounds first, then `rounds` single calls. Returns the
    last result."""
    return benchmark.pedantic(fn, rounds=rounds or bench_rounds(), warmup_rounds=WARMUP_ROUNDS, iterations=1)


def median_seconds(fn, repeats: int = 7) -> float:
    """Median wall time of `fn()` over `repeats` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_copy_bandwidth_gbs(nbytes: int = 256 << 20) -> float:
    """Copy bandwidth in GB/s, STREAM convention: (bytes read + bytes written) / time of `dst.copy_(src)`
    over a 256 MiB fp32 buffer, far beyond the last-level cache, with torch's default thread count."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src)) / 1e9


def measure_matmul_peak_gflops(dtype: torch.dtype, n: int = 2048) -> float:
    """Achieved GFLOP/s of `torch.mm` on square n x n operands (2 n^3 flops) in `dtype`: the practical
    matmul ceiling of this machine (bf16 runs on AMX where the CPU has it)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    return 2 * n**3 / median_seconds(lambda: torch.mm(a, b, out=out), repeats=5) / 1e9


# Matmul ceilings are measured for fp32 and bf16 only: CPU torch has no fast fp16 GEMM (0.2 GFLOP/s
# measured here at n = 2048), so fp16 results are compared against the fp32 ceiling.
PEAK_DTYPE_FOR = {"fp32": "fp32", "fp16": "fp32", "bf16": "bf16"}


@cache
def machine_ceilings() -> dict:
    """Measured copy bandwidth and matmul peaks of this machine (cached for the process)."""
    return {
        "copy_gbs": measure_copy_bandwidth_gbs(),
        "matmul_gflops": {name: measure_matmul_peak_gflops(DTYPES_BY_NAME[name]) for name in ("fp32", "bf16")},
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, check=False).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gpu_info() -> dict | None:
    """Name, driver and clocks of GPU 0 from nvidia-ml-py, or None without CUDA or NVML."""
    if not torch.cuda.is_available():
        return None
    try:
        import pynvml
    except ImportError:
        return {"name": torch.cuda.get_device_name(0), "nvml": "nvidia-ml-py not installed"}
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        return {
            "name": name.decode() if isinstance(name, bytes) else name,
            "driver": pynvml.nvmlSystemGetDriverVersion(),
            "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
            "mem_clock_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM),
            "max_sm_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM),
        }
    finally:
        pynvml.nvmlShutdown()


def machine_header() -> dict:
    """Everything a results table is labelled with: machine, software versions, commit, ceilings."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_isa": torch.ops.sbd._cpu_isa() if hasattr(torch.ops.sbd, "_cpu_isa") else "n/a",
        "gpu": gpu_info(),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        **machine_ceilings(),
    }
