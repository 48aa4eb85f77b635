"""The benchmark pipeline: `sbd bench` runs the repository's bench files with pytest-benchmark, checks the
op against its oracle, and writes the report (ratios against the baseline of the same run, ceilings of this
machine, plots); the bench files' own inputs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_roofline import demo_results

from sbd_kernels import benchmark_grid as grid
from sbd_kernels.bench_plots import tokens_per_s, write_plots
from sbd_kernels.bench_report import rows_from_raw
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
