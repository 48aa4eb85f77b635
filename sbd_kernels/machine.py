"""This machine: its measured ceilings (copy bandwidth, matmul peaks) and what a benchmark result is
labelled with (CPU, GPU, software versions, commit).

The ceilings are what achieved GB/s and GFLOP/s of CPU results are set against, in the benchmark report and
in the roofline model of this CPU (`sbd roofline --hardware cpu`). They are measured, not looked up: a
2-core cloud slice reaches a fraction of its socket's datasheet bandwidth. GPU results are set against the
GPU's datasheet instead (`sbd_kernels.bench_report.datasheet_ceilings`).
"""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import threading
import time
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import final

import torch

# Matmul ceilings are measured for fp32 and bf16 only: CPU torch has no fast fp16 GEMM (0.2 GFLOP/s
# measured on the 2-core reference machine at n = 2048), so fp16 results are compared against the fp32
# ceiling.
PEAK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PEAK_DTYPE_FOR = {"fp32": "fp32", "fp16": "fp32", "bf16": "bf16"}


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
    over a 256 MiB fp32 buffer, far beyond the last-level cache, with torch's current thread count."""
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


@cache
def _ceilings_at(threads: int) -> dict:
    return {
        "copy_gbs": measure_copy_bandwidth_gbs(),
        "matmul_gflops": {name: measure_matmul_peak_gflops(dtype) for name, dtype in PEAK_DTYPES.items()},
    }


def machine_ceilings() -> dict:
    """{"copy_gbs": GB/s, "matmul_gflops": {"fp32": ..., "bf16": ...}} measured at torch's current thread
    count (a few seconds; cached per thread count for the process)."""
    return _ceilings_at(torch.get_num_threads())


def ceilings_by_threads(counts: Iterable[int]) -> dict[str, dict]:
    """{str(threads): `machine_ceilings()` measured with torch at that many threads} for each of `counts`
    (JSON keys, hence strings); torch's thread count is restored after. A result is set against the ceilings
    of the thread count it ran with: on the 2-core reference machine torch.mm bf16 reached 391 GFLOP/s at 2
    threads and about 200 at 1."""
    before = torch.get_num_threads()
    try:
        by_threads = {}
        for threads in sorted(set(counts)):
            torch.set_num_threads(threads)
            by_threads[str(threads)] = machine_ceilings()
        return by_threads
    finally:
        torch.set_num_threads(before)


def cpuinfo_field(name: str) -> str | None:
    """The value of the first `name : value` line of /proc/cpuinfo, or None (no such line, or no such file)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


# The CPU features that decide which GEMM and kernel code runs: our kernels' builds (AVX2, AVX-512), oneDNN's
# bf16 GEMMs in torch.mm and in ATen's brgemm (AVX512-BF16 dot products, or AMX tiles), fp16 arithmetic.
# A 2-core AMD EPYC Zen 4 and a 2-core Xeon with AMX both print "avx512" as their kernel build; their bf16
# matmul ceilings differ by the AMX tiles.
CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")


def cpu_features() -> list[str]:
    """The CPU_FEATURES this CPU has, from the flags of /proc/cpuinfo (empty where there is none)."""
    flags = set((cpuinfo_field("flags") or "").split())
    return [name for name in CPU_FEATURES if name in flags]


def git_commit(folder: Path) -> str:
    """Short commit of the git checkout holding `folder` ("+dirty" with uncommitted changes to tracked
    files), or "unknown" outside a checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=folder, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=folder,
                               capture_output=True, text=True, check=False).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gpu_info() -> dict | None:
    """GPU 0 from nvidia-ml-py: name, driver, CUDA version of torch, current and maximum SM and memory clocks,
    memory; None without CUDA. Without NVML (not installed, or failing) the name comes from torch and the
    "nvml" entry says why the rest is missing."""
    if not torch.cuda.is_available():
        return None
    try:
        import pynvml
    except ImportError:
        return {"name": torch.cuda.get_device_name(0), "cuda": torch.version.cuda,
                "nvml": "nvidia-ml-py not installed"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return {"name": torch.cuda.get_device_name(0), "cuda": torch.version.cuda, "nvml": f"NVML failed: {err}"}
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        return {
            "name": name.decode() if isinstance(name, bytes) else name,
            "driver": pynvml.nvmlSystemGetDriverVersion(),
            "cuda": torch.version.cuda,
            "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
            "max_sm_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM),
            "mem_clock_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM),
            "max_mem_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM),
            "memory_gib": round(pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30, 1),
        }
    finally:
        pynvml.nvmlShutdown()


# NVML's clock event reasons (the bits of nvmlDeviceGetCurrentClocksEventReasons, nvmlClocksEventReason* in
# nvml.h): why the SM clock was below its maximum when a sample was taken.
CLOCK_EVENT_REASONS = {0x1: "idle", 0x2: "application clocks setting", 0x4: "software power cap",
                       0x8: "hardware slowdown", 0x10: "sync boost", 0x20: "software thermal slowdown",
                       0x40: "hardware thermal slowdown", 0x80: "hardware power brake",
                       0x100: "display clock setting"}
SAMPLE_INTERVAL_S = 0.5  # 20 samples in the shortest stage budget (scatter's 25 s at 600 s), ~1 ms of NVML each
# How GpuMonitor.summary reduces each reading over the busy samples.
SUMMARY_OF = {"sm_clock_mhz": statistics.median, "mem_clock_mhz": statistics.median, "temperature_c": max,
              "power_w": max, "utilization_pct": lambda values: round(statistics.mean(values))}


@final
class GpuMonitor:
    """GPU 0 as NVML sees it while a `with` block runs: SM and memory clocks, temperature, power,
    utilisation and clock event reasons, read every `interval_s` seconds by a daemon thread.

    `summary()` sets the clocks of the busy samples (utilisation > 0) against the idle ones a report's header
    reads before the stages start: a benchmark's TB/s means little without the clock it ran at. A field the
    GPU does not report is left out; NVML missing or failing gives {"error": why} and no samples; nothing here
    raises into the stage it watches.
    """

    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S, nvml=None):
        self.interval_s = interval_s
        self.samples: list[dict] = []
        self.error: str | None = None
        self._nvml = nvml
        self._handle = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GpuMonitor:
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            self._nvml.nvmlInit()
            self._handle = self._nvml.nvmlDeviceGetHandleByIndex(0)
        except ImportError:
            self.error = "nvidia-ml-py not installed"
            return self
        except self._nvml.NVMLError as err:  # no driver, no GPU, no permission
            self.error = f"NVML failed: {err}"
            return self
        self._thread = threading.Thread(target=self._run, name="sbd-gpu-monitor", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._nvml.nvmlShutdown()

    def _run(self) -> None:
        while True:
            self.samples.append(self.sample())
            if self._stop.wait(self.interval_s):
                return

    def _read(self, name: str, *args):
        """nvml.<name>(handle, *args), or None when this GPU or driver does not report it."""
        try:
            return getattr(self._nvml, name)(self._handle, *args)
        except (self._nvml.NVMLError, AttributeError):  # not supported here; a function this nvidia-ml-py lacks
            return None

    def sample(self) -> dict:
        """One reading: the fields NVML gave, in MHz, degrees C, W and percent; reasons as a bit mask."""
        nvml = self._nvml
        utilisation = self._read("nvmlDeviceGetUtilizationRates")
        power_mw = self._read("nvmlDeviceGetPowerUsage")
        reasons = self._read("nvmlDeviceGetCurrentClocksEventReasons")
        if reasons is None:
            reasons = self._read("nvmlDeviceGetCurrentClocksThrottleReasons")  # its name before driver 535
        fields = {"sm_clock_mhz": self._read("nvmlDeviceGetClockInfo", nvml.NVML_CLOCK_SM),
                  "mem_clock_mhz": self._read("nvmlDeviceGetClockInfo", nvml.NVML_CLOCK_MEM),
                  "temperature_c": self._read("nvmlDeviceGetTemperature", nvml.NVML_TEMPERATURE_GPU),
                  "power_w": None if power_mw is None else power_mw / 1000,
                  "utilization_pct": None if utilisation is None else utilisation.gpu,
                  "reasons": reasons}
        return {k: v for k, v in fields.items() if v is not None}

    def summary(self) -> dict:
        """{"samples", "busy", "interval_s"} and, over the busy samples (utilisation > 0; all of them where the
        GPU reports no utilisation), each reading reduced by SUMMARY_OF (median clocks, hottest temperature,
        highest power, mean utilisation), the lowest SM clock, and each clock event reason but idleness with
        the number of busy samples it was set in; {"error": why} when NVML could not be read."""
        if self.error is not None:
            return {"error": self.error}
        samples = list(self.samples)  # the thread may append meanwhile
        busy = [s for s in samples if s.get("utilization_pct", 1) > 0]
        result = {"samples": len(samples), "busy": len(busy), "interval_s": self.interval_s}
        for key, reduce in SUMMARY_OF.items():
            values = [s[key] for s in busy if key in s]
            if values:
                result[key] = reduce(values)
        if "sm_clock_mhz" in result:
            result["min_sm_clock_mhz"] = min(s["sm_clock_mhz"] for s in busy if "sm_clock_mhz" in s)
        counts = {name: sum(1 for s in busy if s.get("reasons", 0) & bit)
                  for bit, name in CLOCK_EVENT_REASONS.items() if bit != 0x1}
        result["reasons"] = {name: count for name, count in counts.items() if count}
        return result


def gpu_load_text(load: dict) -> str:
    """One line of a GpuMonitor summary: "SM 1980 MHz (lowest 1755), memory 3201 MHz, 61 C, 412 W, 38%
    busy in 40 of 41 samples 0.5 s apart; clock events: software power cap in 3"."""
    if not load:
        return "-"
    if "error" in load:
        return f"not sampled ({load['error']})"
    if not load["busy"]:
        return f"idle in all {load['samples']} samples"
    parts = []
    if "sm_clock_mhz" in load:
        parts.append(f"SM {load['sm_clock_mhz']:.0f} MHz (lowest {load['min_sm_clock_mhz']:.0f})")
    if "mem_clock_mhz" in load:
        parts.append(f"memory {load['mem_clock_mhz']:.0f} MHz")
    if "temperature_c" in load:
        parts.append(f"{load['temperature_c']} C")
    if "power_w" in load:
        parts.append(f"{load['power_w']:.0f} W")
    if "utilization_pct" in load:
        parts.append(f"{load['utilization_pct']}% busy in {load['busy']} of {load['samples']} samples "
                     f"{load['interval_s']} s apart")
    else:
        parts.append(f"{load['samples']} samples {load['interval_s']} s apart (no utilisation reported)")
    text = ", ".join(parts)
    if load["reasons"]:
        text += "; clock events: " + ", ".join(f"{name} in {count}" for name, count in load["reasons"].items())
    return text


def machine_header(checkout: Path, gpu: bool = True, ceilings: bool = True) -> dict:
    """Everything a results table is labelled with: machine, software versions, the commit of `checkout`
    (the folder the benchmark files came from), ceilings. gpu=False leaves the GPU out (None) without
    asking the driver; ceilings=False leaves the CPU ceilings unmeasured (copy_gbs None, no matmul peaks),
    for results set against a GPU's datasheet."""
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
        "cpu_features": cpu_features(),
        "gpu": gpu_info() if gpu else None,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "commit": git_commit(checkout),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        **(machine_ceilings() if ceilings else {"copy_gbs": None, "matmul_gflops": {}}),
    }
