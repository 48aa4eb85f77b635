"""The benchmark pipeline: `sbd bench` runs the repository's bench files with pytest-benchmark, checks the
op against its oracle, and writes the report (ratios against the baseline of the same run, ceilings of this
machine, plots); the bench files' own inputs."""
import json
import math
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from test_roofline import demo_results
from torch.utils._python_dispatch import TorchDispatchMode

from sbd_kernels import bench_report, machine
from sbd_kernels import benchmark_grid as grid
from sbd_kernels.bench_plots import tokens_per_s, write_plots
from sbd_kernels.bench_report import markdown, rows_from_raw
from sbd_kernels.roofline import NfeStat

REPO = Path(__file__).resolve().parent.parent
CEILINGS = {"copy_gbs": 10.0, "matmul_gflops": {"fp32": 100.0, "bf16": 400.0}}


@pytest.mark.slow
def test_sbd_bench_writes_a_report_with_ratios(tmp_path):
    """Guards against a broken link between the bench files, the harness and the report (an empty table,
    a missing baseline ratio, an oracle flag that is never set), and against `sbd bench` working only from
    the repository root: it runs from another folder, told where the bench files are."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "sbd_kernels.cli", "bench", "--bench-dir", str(REPO / "bench"), "--only", "scatter",
           "-k", "1-16 and (sbd or eager)", "--rounds", "2", "--no-gpu-static", "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "report.json").read_text())["results"]["scatter"]
    by_provider = {r["provider"]: r for r in rows}
    assert set(by_provider) == {"sbd", "eager"}
    assert by_provider["sbd"]["oracle"] == "pass"
    assert by_provider["eager"]["speedup"] == pytest.approx(1.0)
    assert by_provider["sbd"]["speedup"] > 0
    assert grid.shape_from_dict("scatter", by_provider["sbd"]["shape"]) == grid.ScatterShape(1, 16)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "measured ceilings: copy bandwidth" in report and "| B=1 K=16 eb | sbd |" in report


def test_sbd_bench_without_bench_files_says_where_they_are(tmp_path):
    """Guards against `sbd bench` from an installed package, outside a checkout, failing with a traceback or
    an import error instead of one line naming the folder it looked in and --bench-dir."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "sbd_kernels.cli", "bench"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 1
    expected = (f"sbd bench: no benchmark files (bench_*.py) in {tmp_path.resolve() / 'bench'}; they are in the "
                "source repository, not the installed package: run `sbd bench` at the root of a checkout or pass "
                "--bench-dir CHECKOUT/bench")
    assert proc.stderr.strip().splitlines() == [expected]


def raw_entry(family: str, shape, provider: str, baseline: str, median: float, **work) -> dict:
    """One pytest-benchmark entry as the harness tags it."""
    info = {"family": family, "case": shape.label, "shape": grid.shape_to_dict(shape), "provider": provider,
            "baseline": baseline, "bytes_moved": None, "flops": None, "correct": True, **work}
    return {"stats": {"median": median, "data": [median]}, "extra_info": info}


def test_report_rows_take_the_peak_of_the_records_dtype():
    """Guards against a matmul-peak fraction taken against the wrong ceiling: fp16 against fp32 (CPU torch
    has no fast fp16 GEMM), bf16 against bf16; the dtype comes from the record, not from the label text."""
    fp16, bf16 = grid.AttentionShape(1, 512, "fp16"), grid.AttentionShape(1, 512, "bf16")
    raw = {"benchmarks": [raw_entry("attention", fp16, "sbd", "sdpa", 0.01, flops=int(1e9)),
                          raw_entry("attention", fp16, "sdpa", "sdpa", 0.02, flops=int(1e9)),
                          raw_entry("attention", bf16, "sbd", "sdpa", 0.01, flops=int(1e9), correct=False)]}
    rows = rows_from_raw(raw, CEILINGS)["attention"]
    by_case = {(r["case"], r["provider"]): r for r in rows}
    fp16_sbd = by_case[fp16.label, "sbd"]
    assert fp16_sbd["gflops"] == pytest.approx(100.0) and fp16_sbd["pct_peak"] == pytest.approx(100.0)
    assert fp16_sbd["speedup"] == pytest.approx(2.0)
    bf16_sbd = by_case[bf16.label, "sbd"]
    assert bf16_sbd["pct_peak"] == pytest.approx(25.0)
    assert bf16_sbd["speedup"] is None and bf16_sbd["oracle"] == "FAIL"


def test_no_speedup_against_a_baseline_that_failed_its_oracle_check():
    """Guards against a speedup taken against a baseline whose outputs were wrong on these inputs (a ratio
    against a computation that did something else): no ratio for any row of that case, and the cell says why."""
    shape = grid.ScatterShape(16, 16)
    raw = {"benchmarks": [raw_entry("scatter", shape, "sbd", "eager", 0.001),
                          raw_entry("scatter", shape, "eager", "eager", 0.004, correct=False)]}
    rows = {r["provider"]: r for r in rows_from_raw(raw, CEILINGS)["scatter"]}
    assert rows["sbd"]["speedup"] is None and rows["eager"]["speedup"] is None
    assert rows["sbd"]["withheld"] == "baseline eager failed its oracle check"
    assert rows["eager"]["withheld"] == "oracle check FAILED"
    report = markdown(HEADER, {"scatter": list(rows.values())})
    assert "| baseline eager failed its oracle check | pass |" in report


# ----------------------------------------------------------------------------------------------------
# The header and ceilings of the run (bench/conftest.py stores them; --from-json reads them back)
# ----------------------------------------------------------------------------------------------------
HEADER = {"cpu": "Run CPU", "cores": 2, "torch_threads": 2, "cpu_isa": "avx512", "gpu": None, "torch": "2.x",
          "triton": "3.x", "python": "3.11", "commit": "run1234", "date": "2026-01-02 03:04 UTC",
          "copy_gbs": 20.0, "matmul_gflops": {"fp32": 100.0, "bf16": 400.0},
          "ceilings_by_threads": {"1": {"copy_gbs": 10.0, "matmul_gflops": {"fp32": 50.0, "bf16": 200.0}},
                                  "2": {"copy_gbs": 20.0, "matmul_gflops": {"fp32": 100.0, "bf16": 400.0}}}}
H100 = {"name": "NVIDIA H100 80GB HBM3", "driver": "550.54.15", "cuda": "12.4"}


def test_cpu_rows_take_the_ceilings_of_their_own_thread_count():
    """Guards against a result divided by ceilings measured at another thread count: the 1-thread decode
    forwards (1b bf16 B=16 L=512 t=32) read 49% of the 2-thread bf16 peak while they ran at 97% of the
    1-thread one, which the report's roofline section used. A row takes the ceilings stored with it (decode),
    else those of its recorded thread count, else none rather than another count's."""
    shape = grid.SamplingShape(1, 16, 32000, "bf16")
    decode = grid.DecodeShape("1b", 16, 512, 32)
    stored = {**HEADER["ceilings_by_threads"]["1"], "threads": 1}
    raw = {"machine_info": {bench_report.HEADER_KEY: HEADER}, "benchmarks": [
        raw_entry("decode", decode, decode.provider, "sbd t=1", 0.01, flops=int(1.9e9), device="cpu", threads=1,
                  decode={"ceilings": stored}),
        raw_entry("sampling", shape, "sbd", "eager", 0.01, bytes_moved=int(1e8), device="cpu", threads=1),
        raw_entry("sampling", shape, "eager", "eager", 0.01, bytes_moved=int(1e8), device="cpu", threads=2),
        raw_entry("sampling", shape, "compile", "eager", 0.01, bytes_moved=int(1e8), device="cpu", threads=4)]}
    header = bench_report.stored_header(raw)
    families = rows_from_raw(raw, bench_report.report_ceilings(header, raw))
    assert families["decode"][0]["pct_peak"] == pytest.approx(95.0)        # 190 GFLOP/s of the 1-thread 200
    pct_copy = {r["provider"]: r["pct_copy"] for r in families["sampling"]}
    assert pct_copy == {"sbd": pytest.approx(100.0), "eager": pytest.approx(50.0), "compile": None}
    report = markdown(header, families, bench_report.report_ceilings(header, raw))
    assert "- measured ceilings at 1 torch thread: copy bandwidth 10.0 GB/s" in report
    assert "| B=1 K=16 V=32000 bf16 | sbd | 1 |" in report


def test_bench_run_stores_its_header_and_the_ceilings_of_its_thread_counts(monkeypatch):
    """Guards against a bench JSON that does not say which machine took it, or what it reached at the thread
    counts its CPU timings ran with: the run stores `machine_header` and the ceilings at each of those counts
    (GPU timings need none), measured with torch at that count and the count restored after."""
    import importlib

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    conftest = importlib.import_module("bench.conftest")
    monkeypatch.setattr(conftest, "machine_header", lambda checkout, **kwargs: {"cpu": "Run CPU"})
    monkeypatch.setattr(machine, "_ceilings_at", lambda threads: {"copy_gbs": 10.0 * threads})
    before = torch.get_num_threads()
    output = {"machine_info": {"node": "vm"}, "benchmarks": [
        {"extra_info": {"device": "cpu", "threads": 1}}, {"extra_info": {"device": "cpu", "threads": 2}},
        {"extra_info": {"device": "cpu", "threads": 1}}, {"extra_info": {"device": "cuda", "threads": 3}}, {}]}
    conftest.pytest_benchmark_update_json(types.SimpleNamespace(stash=pytest.Stash()), [], output)
    assert output["machine_info"][bench_report.HEADER_KEY] == {
        "cpu": "Run CPU", "ceilings_by_threads": {"1": {"copy_gbs": 10.0}, "2": {"copy_gbs": 20.0}}}
    assert torch.get_num_threads() == before


def test_a_gpu_bench_run_stores_the_clocks_it_ran_at(monkeypatch):
    """Guards against a GPU bench report whose only clocks are those NVML gave once, at rest (an H200 at 345
    MHz): a run on the GPU samples it while the benchmarks run, stores the summary in its header and the
    report prints it; a CPU run starts no sampling."""
    import importlib

    from test_gpucheck import BUSY, CAPPED, FakeNvml

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    conftest = importlib.import_module("bench.conftest")
    monkeypatch.setattr(conftest, "machine_header", lambda checkout, **kwargs: {"cpu": "Run CPU"})
    fake = FakeNvml([BUSY, CAPPED])
    monkeypatch.setattr(conftest, "GpuMonitor", lambda: machine.GpuMonitor(interval_s=0.01, nvml=fake))
    session = types.SimpleNamespace(config=types.SimpleNamespace(stash=pytest.Stash()))
    monkeypatch.setattr(conftest, "bench_device", lambda: "cpu")
    conftest.pytest_sessionstart(session)
    assert conftest.MONITOR not in session.config.stash
    monkeypatch.setattr(conftest, "bench_device", lambda: "cuda")
    conftest.pytest_sessionstart(session)
    while fake.calls < 3:
        time.sleep(0.01)
    output = {"machine_info": {}, "benchmarks": []}
    conftest.pytest_benchmark_update_json(session.config, [], output)
    conftest.pytest_sessionfinish(session)
    assert fake.shut
    header = output["machine_info"][bench_report.HEADER_KEY]
    assert header["gpu_load"]["min_sm_clock_mhz"] == 1755 and header["gpu_load"]["reasons"]["software power cap"] >= 1
    report = markdown({**HEADER, **header, "gpu": H100}, {})
    assert "- GPU while the benchmarks ran (NVML; clocks: medians of the busy samples): SM " in report


def write_raw(path: Path, raw: dict) -> Path:
    path.write_text(json.dumps(raw))
    return path


def test_from_json_labels_the_report_with_the_machine_that_ran_it(tmp_path, monkeypatch):
    """Guards against `sbd bench --from-json` labelling old timings with the machine that rebuilds the report
    (its CPU, "GPU: none", its commit and date, and no datasheet fractions for GPU rows): the header and
    ceilings come from the JSON; a JSON that did not store them says "not stored", nothing from here."""
    def measure_here(*args, **kwargs):
        raise AssertionError("the report measured the machine rebuilding it")

    monkeypatch.setattr(bench_report, "machine_header", measure_here, raising=False)
    shape = grid.SamplingShape(1, 16, 128256, "bf16")
    logits = 16 * 128256 * 2
    benchmarks = [raw_entry("sampling", shape, "sbd", "eager", 4e-5, bytes_moved=logits, device="cuda", graph_ms=0.0025),
                  raw_entry("sampling", shape, "eager", "eager", 4e-4, bytes_moved=logits, device="cuda", graph_ms=0.1)]
    stored = write_raw(tmp_path / "stored.json", {"machine_info": {bench_report.HEADER_KEY: {**HEADER, "gpu": H100}},
                                                  "benchmarks": benchmarks})
    bench_report.main(["--from-json", str(stored), "--no-gpu-static", "--out", str(tmp_path / "a")])
    report = (tmp_path / "a" / "report.md").read_text()
    for expected in ("- machine: Run CPU, 2 cores", "name NVIDIA H100 80GB HBM3", "commit run1234, 2026-01-02 03:04 UTC",
                     "| 0.0025 | 1.642 | 49 |"):
        assert expected in report, expected
    assert "not stored" not in report

    old = {"machine_info": {"python_version": "3.12.3", "cpu": {"brand_raw": "Old CPU", "count": 16}},
           "commit_info": {"id": "35a7bd8ab3d2", "dirty": True}, "datetime": "2026-11-27T04:15:23+00:00",
           "benchmarks": benchmarks}
    bench_report.main(["--from-json", str(write_raw(tmp_path / "old.json", old)), "--no-gpu-static",
                       "--out", str(tmp_path / "b")])
    report = (tmp_path / "b" / "report.md").read_text()
    for expected in ("- machine: Old CPU, 16 cores, torch threads not stored", "- GPU: not stored",
                     "- measured ceilings: not stored", "commit 35a7bd8+dirty, 2026-11-27 04:15 UTC",
                     "| 0.0025 | 1.642 | - |", "nothing is taken from the machine that rebuilt this report"):
        assert expected in report, expected


def test_header_names_the_cpu_features_that_pick_the_gemms(tmp_path, monkeypatch):
    """Guards against reports of two CPUs that print the same model line and kernel build ("avx512") but run
    bf16 GEMMs on different hardware (AVX512-BF16 dot products on an AMD EPYC Zen 4, AMX tiles on a Xeon):
    the header lists the CPU's CPU_FEATURES from /proc/cpuinfo, and a run that stored none says nothing."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\n"
                       "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8 avx512_fp16\n")
    real_path = machine.Path
    monkeypatch.setattr(machine, "Path", lambda name: real_path(cpuinfo if name == "/proc/cpuinfo" else name))
    assert machine.cpu_features() == ["avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"]
    assert "CPU kernels avx512, CPU features avx2 avx512f avx512_bf16 avx512_fp16 amx_tile amx_bf16\n" in markdown(
        {**HEADER, "cpu_features": machine.cpu_features()}, {})
    assert "- machine: Run CPU, 2 cores, torch threads 2, CPU kernels avx512\n" in markdown(HEADER, {})


def test_gpu_run_header_measures_no_cpu_ceilings(tmp_path, monkeypatch):
    """Guards against a GPU bench run measuring the CPU's ceilings when it writes its JSON (seconds a stage of
    `sbd gpu-check` stopped at its budget may not have before SIGKILL), and against its report then reading as
    if they had been lost: the GPU rows keep their datasheet fractions, the CPU line says why it has none."""
    def measure(*args, **kwargs):
        raise AssertionError("a GPU run measured the CPU ceilings")

    monkeypatch.setattr(machine, "machine_ceilings", measure)
    header = machine.machine_header(tmp_path, gpu=False, ceilings=False)
    assert header["copy_gbs"] is None and header["matmul_gflops"] == {}
    shape = grid.SamplingShape(1, 16, 128256, "bf16")
    logits = 16 * 128256 * 2
    benchmarks = [raw_entry("sampling", shape, "sbd", "eager", 4e-5, bytes_moved=logits, device="cuda", graph_ms=0.0025),
                  raw_entry("sampling", shape, "eager", "eager", 4e-4, bytes_moved=logits, device="cuda", graph_ms=0.1)]
    run = {**HEADER, "gpu": H100, "copy_gbs": None, "matmul_gflops": {}}
    raw = write_raw(tmp_path / "gpu.json", {"machine_info": {bench_report.HEADER_KEY: run}, "benchmarks": benchmarks})
    bench_report.main(["--from-json", str(raw), "--no-gpu-static", "--out", str(tmp_path / "out")])
    report = (tmp_path / "out" / "report.md").read_text()
    assert "- measured ceilings: not measured by a run on the GPU" in report and "| 0.0025 | 1.642 | 49 |" in report


# ----------------------------------------------------------------------------------------------------
# Plots of the report (sbd_kernels.bench_plots)
# ----------------------------------------------------------------------------------------------------
def test_tokens_per_s_from_forward_times():
    """Guards against tokens/s off the docs/algorithm.md §4 cost model: NTP B / time(1), SBD B k / (time(2k)
    + (l - 1) time(k))."""
    times = {1: 0.01, 16: 0.02, 32: 0.03}
    assert tokens_per_s(times, 4, 16, None) == pytest.approx(400.0)
    stat = NfeStat("x", nfe_speedup=8.0)                     # l = 2
    assert tokens_per_s(times, 4, 16, stat) == pytest.approx(4 * 16 / (0.03 + 0.02))
    assert tokens_per_s({1: 0.01}, 4, 16, stat) is None


def report_row(shape, provider: str, median_ms: float) -> dict:
    return {"case": shape.label, "shape": grid.shape_to_dict(shape), "provider": provider, "median_ms": median_ms,
            "gflops": 1.0}


def test_write_plots(tmp_path, capsys):
    """Guards against a plot crashing on report rows, or reading its axes from anything but the records,
    and a missing input failing instead of being skipped with a message."""
    sampling = [report_row(grid.SamplingShape(1, 16, vocab, "bf16"), provider, vocab / 1e4)
                for vocab in (1000, 50257) for provider in ("sbd", "eager")]
    decode = [report_row(shape, shape.provider, shape.tokens * 0.5 + shape.batch)
              for shape in (grid.DecodeShape("small", b, 512, t) for b in (1, 4) for t in (1, 16, 32))]
    (tmp_path / "demo.json").write_text(json.dumps(demo_results()))
    written = write_plots(tmp_path, {"sampling": sampling, "decode": decode})
    assert sorted(p.name for p in written) == ["accuracy_vs_nfe.png", "decode_tokens_per_s.png",
                                               "sampling_latency.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in written)
    assert "attention_gflops.png skipped: no attention results" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------
# End-to-end decode benchmark inputs (bench/bench_decode.py)
# ----------------------------------------------------------------------------------------------------
def test_decode_bench_pass_kinds():
    """Guards against the benchmark timing other passes than the three SBD pass kinds the roofline predicts:
    t = 1 NTP step (1 causal row), t = k later block pass (no causal row), t = 2k first block pass."""
    import torch

    from bench.bench_decode import model_config, pass_inputs

    cfg = model_config("small")
    k = grid.DECODE_BLOCK
    for tokens, causal, block_size in ((1, 1, 0), (k, 0, k), (2 * k, k, k)):
        ids, num_causal, size = pass_inputs(cfg, grid.DecodeShape("small", 3, 512, tokens))
        assert ids.shape == (3, tokens) and int(ids.max()) < cfg.vocab_size
        assert num_causal.dtype == torch.int32 and num_causal.tolist() == [causal] * 3 and size == block_size


def test_decode_bench_cache_size():
    """Guards against the full grid allocating a KV cache beyond the machine's memory: the size the skip
    rule reads is the cache the benchmark allocates."""
    from bench.bench_decode import cache_gib

    def gib(batch, kv_len):
        return cache_gib(grid.DecodeShape("1b", batch, kv_len, 1))

    k = grid.DECODE_BLOCK
    # 1B config, bf16: 16 layers x K and V x 16 rows x (16384 + 2k) slots x 8 heads x 64 dims x 2 bytes
    assert gib(16, 16384) == pytest.approx(16 * 2 * 16 * (16384 + 2 * k) * 8 * 64 * 2 / 2**30)
    assert gib(16, 16384) > 4 > gib(4, 4096)


class FakeBenchmark:
    """The pytest-benchmark fixture as the harness uses it on the CPU: pedantic runs the warm-up and timed
    rounds of one call each, `timed` wraps every call (a hook for what a test checks inside it)."""

    def __init__(self, timed=None):
        self.extra_info, self.group, self.timed = {}, None, timed or (lambda target: target())

    def pedantic(self, target, rounds, warmup_rounds, iterations):
        assert iterations == 1
        return [self.timed(target) for _ in range(warmup_rounds + rounds)][-1]


class OpLog(TorchDispatchMode):
    """The aten ops run inside it, but for those run while `paused`."""

    def __init__(self):
        super().__init__()
        self.ops, self.paused = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_scatter_bench_times_the_op_alone_on_fresh_inputs(monkeypatch):
    """Guards against timing the input restore with the op: two copy_ calls per timed call (2.5 us beside
    the op's 4.7 us at B = 16, K = 16 here) that bytes_moved does not count. Each timed call runs the
    provider and no other tensor op, and finds fresh inputs (as masked as the originals) although every
    call updates them."""
    from bench import bench_scatter
    from bench.harness import WARMUP_ROUNDS, bench_rounds

    shape = grid.ScatterShape(16, 16)
    fresh = bench_scatter.make_inputs(shape)[1]
    seen = []

    def provider(tokens, is_masked, sampled, entropy, gamma):
        log.paused = True
        seen.append(torch.equal(is_masked, fresh))
        is_masked.zero_()                                       # what the op does to the masks it accepts
        log.paused = False
        log.ops.append("provider")

    def timed(target):
        log.ops.clear()
        with log:
            target()
        assert log.ops == ["provider"]

    log = OpLog()
    monkeypatch.setattr(bench_scatter, "set_up", lambda p, s: (provider, bench_scatter.make_inputs(s), True))
    benchmark = FakeBenchmark(timed)
    bench_scatter.test_mask_scatter(benchmark, shape, "sbd")
    assert seen == [True] * (WARMUP_ROUNDS + bench_rounds())
    assert benchmark.extra_info["threads"] == torch.get_num_threads()


class FakeCudaBenchmark(FakeBenchmark):
    """The pytest-benchmark fixture as the harness uses it on CUDA: rounds of `iterations` calls each, then the
    one call pytest-benchmark adds for the result."""

    def pedantic(self, target, rounds, warmup_rounds, iterations):
        return [self.timed(target) for _ in range((warmup_rounds + rounds) * iterations + 1)][-1]


def test_an_oracle_on_cuda_is_timed_in_a_few_synchronised_calls(monkeypatch):
    """Guards against timing the oracles on CUDA as the kernels are, 30 rounds of 10 calls (331 calls with the
    warm-up): the scatter oracle, a Python loop at 35-53 ms per call at B = 128, then took longer per case than
    the scatter stage's whole budget. An oracle gets a few rounds of one call, each call synchronised, no
    CUDA graph, and its input pool holds as many fresh copies as it calls."""
    from bench import bench_scatter, harness

    monkeypatch.delenv("SBD_BENCH_ROUNDS", raising=False)
    calls, syncs = [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: syncs.append(len(calls)))
    monkeypatch.setattr(bench_scatter, "DEVICE", "cuda")
    monkeypatch.setattr(bench_scatter, "set_up", lambda p, s: (lambda *args: calls.append(args),
                                                               bench_scatter.make_inputs(s), None))
    benchmark = FakeCudaBenchmark()
    bench_scatter.test_mask_scatter(benchmark, grid.ScatterShape(128, 16), "naive")
    count = 3 + 3 + 1  # WARMUP_ROUNDS and ORACLE_CUDA_ROUNDS calls, and pytest-benchmark's one
    assert len(calls) == count
    assert harness.measured_calls("cuda", provider="naive") == count
    assert syncs == list(range(count + 1))  # after the refill, then after every call
    assert benchmark.extra_info["graph_ms"] is None and benchmark.extra_info["provider"] == "naive"
    assert harness.measured_calls("cuda", provider="sbd", graph=False) == (3 + 30) * 10 + 1  # the kernels: unchanged


def test_the_plain_sampling_call_is_timed_against_the_filtered_one(monkeypatch):
    """Guards against the sampling bench's `sbd plain` row (the filtered case's call without the filter) taking
    its ratios against `eager`, which runs the filter: other work. Its baseline is `sbd`, the same call with
    the filter (what the filter costs); the other rows keep `eager`."""
    from bench import bench_sampling

    monkeypatch.setattr(bench_sampling, "DEVICE", "cpu")
    monkeypatch.setenv("SBD_BENCH_ROUNDS", "1")
    shape = grid.SamplingShape(1, 4, 1000, "fp32", top_k=1)
    for provider, baseline in (("sbd plain", "sbd"), ("sbd", "eager"), ("eager", "eager")):
        benchmark = FakeBenchmark()
        bench_sampling.test_entropy_sample(benchmark, shape, provider)
        assert benchmark.extra_info["baseline"] == baseline, provider


def test_gpu_rates_without_a_graph_time_say_they_come_from_the_median():
    """Guards against a GPU table whose TB/s and TFLOP/s are said to come from CUDA-graph times while those of
    a row without one (the oracle, a call that cannot be captured) silently come from its eager median: such
    a row's rates and fractions are marked (median), and the row says where its rates come from."""
    shape = grid.ScatterShape(16, 16)
    raw = {"benchmarks": [
        raw_entry("scatter", shape, "naive", "eager", 1e-3, bytes_moved=10**9, device="cuda", graph_ms=None),
        raw_entry("scatter", shape, "sbd", "eager", 1e-3, bytes_moved=10**9, device="cuda", graph_ms=0.5),
        raw_entry("scatter", shape, "eager", "eager", 2e-3, bytes_moved=10**9, device="cuda", graph_ms=1.0)]}
    ceilings = bench_report.datasheet_ceilings(H100["name"])
    rows = {r["provider"]: r for r in rows_from_raw(raw, ceilings)["scatter"]}
    report = markdown(dict(HEADER, gpu=H100), {"scatter": list(rows.values())}, ceilings)
    assert "| naive | 1.000 | 1.000-1.000 | - | 1.000 (median) | 30 (median) | - | - |" in report
    assert "| sbd | 1.000 | 1.000-1.000 | 0.5000 | 2.000 | 60 | - | - |" in report
    assert "marked (median)" in report
    assert rows["naive"]["rate_from"] == "median ms" and rows["sbd"]["rate_from"] == "graph ms"


def test_input_pool_hands_out_each_copy_once():
    """Guards against a timing that runs out of fresh copies and silently reuses updated inputs: past its
    size the pool raises; a refill restores every copy and starts over."""
    from bench.harness import InputPool

    original = torch.tensor([[True, False, True]])
    pool = InputPool((original,), 2)
    first, second = pool.take()[0], pool.take()[0]
    assert first.data_ptr() != second.data_ptr() and first.is_contiguous()
    first.zero_()
    with pytest.raises(IndexError):
        pool.take()
    pool.refill()
    assert torch.equal(pool.take()[0], original) and original.tolist() == [[True, False, True]]


def test_decode_bench_computes_the_logits_the_decoder_reads(monkeypatch):
    """Guards against timing LM-head work the decoder skips: `generate` keeps the logits of the k block rows
    of a first block pass (keep_last), so the bench's t = 2k pass returns [B, k, V] and its flops are the
    roofline's with the LM head on those rows."""
    from bench import bench_decode
    from sbd_kernels import roofline

    monkeypatch.setattr(bench_decode, "ceilings", lambda: None)
    monkeypatch.setenv("SBD_BENCH_ROUNDS", "1")
    k = grid.DECODE_BLOCK
    shape = grid.DecodeShape("small", 2, 512, 2 * k)
    logits = []
    benchmark = FakeBenchmark(lambda target: logits.append(target()))
    bench_decode.test_decode_pass(benchmark, shape)
    cfg = bench_decode.model_config("small")
    assert logits[-1].shape == (2, k, cfg.vocab_size)
    flops, _ = roofline.forward_work(cfg, 2, 2 * k, 512, roofline.PRECISIONS["fp32"], num_causal=k)
    assert benchmark.extra_info["flops"] == int(flops) and benchmark.extra_info["correct"] is True


def test_gpu_static_section_without_triton_is_one_line(monkeypatch):
    """Guards against `sbd bench` without triton writing a ModuleNotFoundError traceback into the report and
    exiting 1 though the report was written: the section says triton is not installed, status 0."""
    find_spec = bench_report.importlib.util.find_spec
    monkeypatch.setattr(bench_report.importlib.util, "find_spec",
                        lambda name, *args: None if name == "triton" else find_spec(name, *args))
    monkeypatch.setattr(bench_report.subprocess, "run", lambda *a, **k: pytest.fail("ran the compile check"))
    section, status = bench_report.gpu_static_section()
    assert status == 0 and "triton is not installed" in section and "Traceback" not in section


@pytest.mark.parametrize("written", ["nothing", "no timings"])
def test_sbd_bench_never_reports_the_timings_of_an_earlier_run(tmp_path, monkeypatch, written):
    """Guards against `sbd bench` reading the raw.json an earlier run left in the results folder when this run's
    pytest wrote none (a collection error, a crash) and reporting those old timings as new: the old file is
    removed before the run, and a run that wrote no file, or one without timings, is an error saying so."""
    bench_dir = tmp_path / "bench"
    bench_dir.mkdir()
    (bench_dir / "bench_scatter.py").write_text("")
    out = tmp_path / "results"
    out.mkdir()
    shape = grid.ScatterShape(1, 16)
    stale = {"benchmarks": [raw_entry("scatter", shape, "sbd", "eager", 1e-5),
                            raw_entry("scatter", shape, "eager", "eager", 1e-4)]}
    write_raw(out / "raw.json", stale)

    def run_benchmarks(bench, raw_json, *args):
        if written == "no timings":
            write_raw(raw_json, {"benchmarks": []})
        return 2

    monkeypatch.setattr(bench_report, "run_benchmarks", run_benchmarks)
    with pytest.raises(SystemExit) as info:
        bench_report.main(["--bench-dir", str(bench_dir), "--out", str(out), "--no-gpu-static"])
    what = "wrote no results" if written == "nothing" else "recorded no timings"
    assert str(info.value) == (f"sbd bench: the benchmark run (pytest exit status 2) {what} in "
                               f"{out / 'raw.json'}; no report written")
    assert not (out / "report.md").exists()


def _entry(family: str = "sampling", **changes) -> dict:
    """A tagged entry of `family` with `changes` applied to its extra_info (a value None removes the key)."""
    shape = grid.DecodeShape("small", 1, 512, 1) if family == "decode" else grid.SamplingShape(1, 16, 32000, "fp32")
    entry = raw_entry(family, shape, shape.provider if family == "decode" else "sbd", "sbd t=1", 1e-5)
    for key, value in changes.items():
        entry["extra_info"].pop(key) if value is None else entry["extra_info"].update({key: value})
    return entry


# A JSON of the wrong shape, and what the error must say is missing or wrong.
WRONG_SHAPES = {
    "a list": ([], 'expected an object with a "benchmarks" list, got a list'),
    "no benchmarks": ({"machine_info": {}},
                      'expected an object with a "benchmarks" list, got an object with keys machine_info'),
    "entry not an object": ({"benchmarks": [3]}, "benchmarks[0] is an int, expected an object"),
    "no median": ({"benchmarks": [{**_entry(), "stats": {"mean": 1.0}}]},
                  "benchmarks[0].stats has no number 'median'"),
    "no provider": ({"benchmarks": [_entry(provider=None)]}, "benchmarks[0].extra_info has no 'provider'"),
    "unknown family": ({"benchmarks": [_entry(family="matmul")]},
                       "benchmarks[0].extra_info.family 'matmul' is none of attention, decode, hf, sampling, scatter"),
    "bad shape": ({"benchmarks": [_entry(shape={"batch": 1})]},
                  "benchmarks[0].extra_info.shape is not a sampling record (SamplingShape.__init__() missing 3"),
    "bad decode": ({"benchmarks": [_entry("decode", decode={"batch": 1})]},
                   "benchmarks[0].extra_info.decode has no 'config'"),
    "partial header": ({"machine_info": {bench_report.HEADER_KEY: {"cpu": "x"}}, "benchmarks": [_entry()]},
                       "machine_info.sbd has no 'cores'"),
}


@pytest.mark.parametrize("name", list(WRONG_SHAPES))
def test_from_json_names_what_a_wrong_json_lacks(tmp_path, name):
    """Guards against `sbd bench --from-json` on a JSON of another shape (not pytest-benchmark's, an entry the
    harness did not tag, a header cut short) failing with a bare KeyError / AttributeError / TypeError: the
    error names the file and what is missing, before any report is written."""
    raw, words = WRONG_SHAPES[name]
    path = write_raw(tmp_path / "wrong.json", raw)
    with pytest.raises(ValueError) as info:
        bench_report.main(["--from-json", str(path), "--no-gpu-static", "--out", str(tmp_path / "out")])
    assert str(info.value).startswith(f"{path}: not a pytest-benchmark JSON of `sbd bench`: {words}")
    assert not (tmp_path / "out").exists()


def test_hf_bench_checks_the_sbd_decode_it_times(monkeypatch):
    """Guards against the HF bench's SBD correctness gate checking another decode than the one it times: the
    exact-KV check ran at gamma 0.1, one position per pass on the random weights (32 passes for 32 tokens),
    while the timed decode runs at GAMMA_IN_ENTROPIES x log V (3 per pass). The check runs at the timed gamma,
    and its verdict is the row's oracle flag."""
    pytest.importorskip("transformers")
    from bench import bench_hf

    calls = []

    def check(model, prompts, **kwargs):
        calls.append(kwargs)
        return types.SimpleNamespace(passed=False)

    def measure(benchmark, call, **kwargs):
        benchmark.extra_info["correct"] = kwargs["correct"]
        return types.SimpleNamespace(nfe=torch.tensor([12]), generated=torch.tensor([64]))

    monkeypatch.setattr(bench_hf.hf, "check", check)
    monkeypatch.setattr(bench_hf, "measure", measure)
    monkeypatch.setattr(bench_hf, "_CHECKED", {})
    benchmark = FakeBenchmark()
    bench_hf.test_hf_decode(benchmark, grid.HfDecodeShape("small", 1), "sbd ops")
    vocab = grid.HF_MODELS["small"]["vocab_size"]
    assert calls == [{"max_new_tokens": 32, "block_size": 16, "gamma": bench_hf.GAMMA_IN_ENTROPIES * math.log(vocab)}]
    assert benchmark.extra_info["correct"] is False


@pytest.mark.parametrize("graph_differs", [False, True])
def test_hf_bench_checks_graphed_decodes_against_the_eager_ones(monkeypatch, graph_differs):
    """Guards against a graphed HF decode row (steps replayed from CUDA graphs) getting a speedup with no check of
    its tokens: the row's oracle flag is whether its tokens and passes equal the eager decode's, and a replay that
    read a stale buffer (other tokens) fails it. Off CUDA the row is a skip that says why."""
    pytest.importorskip("transformers")
    from bench import bench_hf

    benchmark = FakeBenchmark()
    with pytest.raises(pytest.skip.Exception, match="sbd ops graphed: CUDA graphs replay on a GPU only"):
        bench_hf.test_hf_decode(benchmark, grid.HfDecodeShape("small", 1), "sbd ops graphed")
    decodes = []

    def generate(model, ids, **kwargs):
        decodes.append(kwargs)
        sequences = torch.tensor([[5, 6, 7, 8]])
        if kwargs["cuda_graph"] and graph_differs:
            sequences = torch.tensor([[5, 6, 7, 9]])
        return types.SimpleNamespace(sequences=sequences, nfe=torch.tensor([2]), generated=torch.tensor([2]))

    def measure(benchmark, call, **kwargs):
        benchmark.extra_info["correct"] = kwargs["correct"]
        return call()

    monkeypatch.setattr(bench_hf, "DEVICE", "cuda")
    model = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=64))
    monkeypatch.setattr(bench_hf, "random_model", lambda name: model)
    monkeypatch.setattr(bench_hf, "prompts", lambda shape, vocab: torch.tensor([[5, 6]]))
    monkeypatch.setattr(bench_hf.hf, "generate", generate)
    monkeypatch.setattr(bench_hf, "measure", measure)
    bench_hf.test_hf_decode(benchmark, grid.HfDecodeShape("small", 1), "sbd ops graphed")
    assert benchmark.extra_info["correct"] is not graph_differs
    assert [(d["method"], d["cuda_graph"]) for d in decodes] == [("sbd", True), ("sbd", False), ("sbd", True)]
    assert benchmark.extra_info["nfe_speedup"] == grid.HfDecodeShape("small", 1).new_tokens / 2


def test_sampling_bench_checks_the_plain_call_it_sets_a_speedup_on(monkeypatch):
    """Guards against the sampling bench's `sbd plain` row (the filtered case's call without its filter) getting a
    speedup against eager with no oracle check of its outputs (correct None): it is checked against the oracle
    without filters, and a plain call that still filtered fails that check."""
    from bench import bench_sampling

    monkeypatch.setattr(bench_sampling, "DEVICE", "cpu")
    shape = grid.SamplingShape(1, 4, 1000, "fp32", top_k=1)
    _, inputs, correct = bench_sampling.set_up("sbd plain", shape)
    assert correct is True
    filtered = bench_sampling.provider_fn("sbd", shape)
    assert not bench_sampling.matches_oracle(filtered, *inputs, shape, bench_sampling.provider_filters("sbd plain",
                                                                                                       shape))
