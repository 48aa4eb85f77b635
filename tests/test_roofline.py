"""Roofline model (`sbd_kernels.roofline`): op costs by hand, GEMM shapes of real configs, the paper's
setting, the `--paper` JSON schema, the SBD speedup formula and its inputs (demo JSON, decode benchmark
JSON)."""
from __future__ import annotations

import argparse
import json

import pytest

from sbd_kernels import roofline as rl
from sbd_kernels.model import ModelConfig

UNIT = rl.Hardware("unit", {"fp32": 1.0, "bf16": 1.0, "fp8": 1.0}, 1.0, "1 FLOP/s, 1 byte/s")
FP32 = rl.PRECISIONS["fp32"]
BF16 = rl.PRECISIONS["bf16"]

# Paper Sec. 4 as quoted in SBD_SPEC.md section 4: "time(16) ~ 1.004 time(1) (H100 roofline, 8B model, FP8
# weights)" at small batch. The paper's Table 3 itself was not available to us, so this is the one published
# number the reproduction is checked against.
PAPER_SLOWDOWN_B1_K16 = 1.004

# Llama-3.1-8B: 8,030,261,248 parameters; the 128256 x 4096 input embedding and the 65 RMSNorm weight vectors
# are not matmuls of the forward.
LLAMA_MATMUL_PARAMS = 8_030_261_248 - 128256 * 4096 - (2 * 32 + 1) * 4096


def tiny_config(**overrides) -> ModelConfig:
    shapes = {"vocab_size": 6, "dim": 4, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 8,
              "max_seq_len": 64}
    return ModelConfig(**{**shapes, **overrides})


def test_linear_cost_by_hand():
    """Guards against a wrong GEMM byte count: W read once, x read and y written once, per row."""
    op = rl.linear_cost("w", rows=2, in_features=3, out_features=5, prec=BF16)
    assert op.flops == 2 * 2 * 3 * 5
    assert op.bytes == 3 * 5 * 2 + 2 * (3 + 5) * 2


def test_op_takes_the_slower_ceiling():
    """Guards against summing (or taking the min of) compute and memory time instead of the max."""
    hw = rl.Hardware("x", {"fp32": 10.0}, 100.0, "")
    assert rl.OpCost("a", flops=50, bytes=100, compute="fp32").seconds(hw) == 5.0     # compute-bound
    assert rl.OpCost("a", flops=5, bytes=1000, compute="fp32", count=3).seconds(hw) == 30.0  # memory-bound


def test_missing_compute_dtype_falls_back_to_bf16():
    """Guards against a KeyError (or an FP8 rate) for FP8 weights on a GPU without FP8 units (A100)."""
    assert rl.HARDWARE["a100"].peak("fp8") == rl.HARDWARE["a100"].peak("bf16")


@pytest.mark.parametrize("tokens,kv_len,num_causal,expected", [
    (1, 10, 1, 11),                        # NTP step: L + 1 keys
    (4, 10, 0, 4 * 14),                    # later block pass: every row sees L + k
    (8, 10, 4, 4 * 10 + 10 + 4 * 18),      # first block pass: causal rows L+1..L+4, block rows L + 2k
    (3, 0, 0, 9),                          # empty cache
])
def test_attention_keys_by_hand(tokens, kv_len, num_causal, expected):
    """Guards against the wrong attention pattern of SBD passes (SBD_SPEC 3.2-3.3) in the FLOP count."""
    assert rl.attention_keys(tokens, kv_len, num_causal) == expected


def test_attention_bytes_by_hand():
    """Guards against counting the KV cache once per query head instead of once per KV head (GQA)."""
    cfg = tiny_config()                       # head_dim 2, Hq 2, Hkv 1
    op = rl.attention_cost(cfg, batch=3, tokens=2, kv_len=5, num_causal=1, prec=FP32)
    per_seq = 5 * 1 * 2 * 2 * 4 + 2 * 1 * 2 * 2 * 4 + 2 * 2 * 2 * 2 * 4 + 1 * 1 * 2 * 2 * 4
    assert op.bytes == 3 * per_seq
    assert op.flops == 4 * 2 * 2 * 3 * rl.attention_keys(2, 5, 1)


def test_forward_time_by_hand():
    """Guards against a missing or duplicated matmul in the forward: a 1-layer model on a unit machine."""
    cfg = tiny_config()
    # rows = 1: (in, out) of wq, wk, wv, wo, w1, w3, w2, lm_head
    linears = [(4, 4), (4, 2), (4, 2), (4, 4), (4, 8), (4, 8), (8, 4), (4, 6)]
    expected = sum(max(2 * i * o, (i * o + i + o) * 4) for i, o in linears)
    attn = rl.attention_cost(cfg, 1, 1, 3, 1, FP32)
    expected += max(attn.flops, attn.bytes)
    assert rl.forward_time(cfg, UNIT, FP32, batch=1, tokens=1, kv_len=3) == pytest.approx(expected)


def test_llama_gemm_shapes_give_its_parameter_count():
    """Guards against wrong GEMM shapes (GQA k/v width, SwiGLU's three matrices, the LM head): at one token
    and an empty cache the weight bytes of a forward are the model's matmul parameters."""
    cfg = ModelConfig.preset("llama3.1-8b")
    costs = rl.forward_costs(cfg, batch=1, tokens=1, kv_len=0, prec=rl.PRECISIONS["fp8"])
    linears = [op for op in costs if op.name != "attention"]
    # one row: flops = 2 x in x out, i.e. twice the weight count
    assert sum(op.count * op.flops // 2 for op in linears) == LLAMA_MATMUL_PARAMS
    flops, _ = rl.forward_work(cfg, batch=1, tokens=1, kv_len=0, prec=rl.PRECISIONS["fp8"])
    attention_flops = 4 * cfg.head_dim * cfg.n_heads * cfg.n_layers              # 1 query, 1 key per head
    assert flops == 2 * LLAMA_MATMUL_PARAMS + attention_flops


def test_paper_setting_reproduces_the_published_slowdown():
    """Guards against a model that disagrees with the paper's own roofline number (SBD_SPEC 4: time(16) ~
    1.004 time(1), H100, 8B, FP8 weights), within 2%."""
    rows = rl.paper_table3()
    cell = {(r["batch"], r["k"]): r["slowdown"] for r in rows}
    assert cell[1, 16] == pytest.approx(PAPER_SLOWDOWN_B1_K16, rel=0.02)


def test_paper_table_grows_with_k_and_batch():
    """Guards against a table whose slowdowns do not grow with k and batch; the paper's claim that returns
    shrink at batch 8-16 with k >= 32 needs the compute-bound regime there (> 1.3x), not at batch 1
    (< 1.1x)."""
    cell = {(r["batch"], r["k"]): r["slowdown"] for r in rl.paper_table3()}
    for b in (1, 4, 8, 16):
        assert all(cell[b, k] < cell[b, 2 * k] for k in (2, 4, 8, 16, 32))
    for k in (2, 4, 8, 16, 32, 64):
        assert cell[1, k] <= cell[4, k] <= cell[8, k] <= cell[16, k]
    assert cell[1, 64] < 1.1
    assert cell[16, 32] > 1.3 and cell[16, 64] > 2.0


def parse(argv: list[str]) -> argparse.Namespace:
    return rl.add_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_paper_json_schema(tmp_path):
    """Guards against `--paper --json` output that downstream tools cannot read: {"table3": [{"batch": int,
    "k": int, "kv_len": int, "slowdown": float}, ...]} over batch {1,4,8,16} x k {2,...,64}."""
    path = tmp_path / "table3.json"
    rl.main(parse(["--paper", "--json", str(path)]))
    data = json.loads(path.read_text())
    assert list(data) == ["table3"]
    rows = data["table3"]
    expected = {(b, k) for b in (1, 4, 8, 16) for k in (2, 4, 8, 16, 32, 64)}
    assert {(r["batch"], r["k"]) for r in rows} == expected
    for r in rows:
        assert set(r) == {"batch", "k", "kv_len", "slowdown"}
        assert all(isinstance(r[key], int) for key in ("batch", "k", "kv_len"))
        assert isinstance(r["slowdown"], float) and r["slowdown"] >= 1.0


@pytest.mark.parametrize("t1,tk,t2k,k,passes,expected", [
    (1.0, 1.0, 1.0, 16, 4, 4.0),             # free block passes: speedup = k / l
    (1.0, 2.0, 3.0, 4, 2, 4 / 5),            # 4 x 1 / (3 + 1 x 2)
    (2.0, 2.5, 3.0, 16, 1, 32 / 3),          # one pass per block: only the 2k pass is paid
])
def test_sbd_speedup_by_hand(t1, tk, t2k, k, passes, expected):
    """Guards against the wrong wall-clock formula (SBD_SPEC 4): k time(1) / (time(2k) + (l-1) time(k))."""
    assert rl.sbd_speedup(rl.BlockTimes(k, t1, tk, t2k), passes) == pytest.approx(expected)


def test_bad_inputs_raise():
    """Guards against silently projecting impossible inputs."""
    with pytest.raises(ValueError, match="passes_per_block"):
        rl.sbd_speedup(rl.BlockTimes(16, 1, 1, 1), 0.5)
    with pytest.raises(ValueError, match="num_causal"):
        rl.forward_costs(tiny_config(), 1, 2, 0, FP32, num_causal=3)
    with pytest.raises(ValueError, match="mean_passes"):
        rl.mean_passes({0: 3})


def test_mean_passes_of_a_distribution():
    """Guards against weighting the histogram by passes instead of by blocks."""
    assert rl.mean_passes({1: 2, 3: 1, 4: 1}) == pytest.approx((2 + 3 + 4) / 4)


def demo_results() -> list[dict]:
    """`sbd demo --json` shape: the SBD model's NTP row, two SBD rows, the NTP-only baseline."""
    rows = [("sbd", "ntp", None, 1.0, 330), ("sbd", "sbd", 0.0, 1.0, 330), ("sbd", "sbd", 0.1, 1.0, 30),
            ("sbd", "sbd", 0.35, 0.9, 66), ("ntp_only", "ntp", None, 1.0, 330)]
    return [{"task": "add", "exact_kv_check": True, "rows": [
        {"model": model, "method": method, "gamma": gamma, "accuracy": acc, "nfe": nfe, "answer_tokens": 330,
         "nfe_speedup": 330 / nfe, "tokens_per_s": 100.0 * 330 / nfe, "wall_speedup": 330 / nfe}
        for model, method, gamma, acc, nfe in rows]}]


def test_nfe_stats_from_demo_json():
    """Guards against mixing models or counting gamma 0 (plain NTP order) as an SBD setting."""
    stats = rl.nfe_stats_from_demo(demo_results())
    assert [s.label for s in stats] == ["measured: add, gamma 0.1", "measured: add, gamma 0.35"]
    assert stats[0].nfe_speedup == pytest.approx(11.0)
    assert stats[0].passes_per_block == pytest.approx(16 / 11)
    assert stats[1].passes_per_block == pytest.approx(16 / 5)


def test_nfe_stats_merge_equal_gammas():
    """Guards against a projection table repeating one measurement once per gamma that gave the same NFE."""
    results = demo_results()
    results[0]["rows"][3].update(nfe=30, accuracy=1.0)              # gamma 0.35 now equals gamma 0.1
    (stat,) = rl.nfe_stats_from_demo(results)
    assert stat.label == "measured: add, gamma 0.1, 0.35" and stat.nfe_speedup == pytest.approx(11.0)


def test_projection_from_demo_json(tmp_path):
    """Guards against a projection that does not apply the formula to the roofline times of each batch, and
    a table that is not labelled as a projection."""
    stats = {"llama3.1-8b": rl.nfe_stats_from_demo(demo_results(), gammas=[0.1])}
    rows = rl.projection_rows(["llama3.1-8b"], "h100", "bf16", [1, 16], 4096, stats)
    cfg, hw = ModelConfig.preset("llama3.1-8b"), rl.HARDWARE["h100"]
    for r in rows:
        times = rl.block_times(cfg, hw, BF16, r["batch"], 16, 4096)
        assert r["wall_speedup"] == pytest.approx(16 * times.t1 / (times.t2k + (16 / 11 - 1) * times.tk))
    assert rows[0]["wall_speedup"] > rows[1]["wall_speedup"]  # larger batch, costlier block passes
    text = rl.projection_markdown(rows, "h100", "bf16", 4096)
    assert "Projection, not a measurement" in text and "| batch 1 | batch 16 |" in text

    demo = tmp_path / "demo.json"
    demo.write_text(json.dumps(demo_results()))
    out = tmp_path / "projection.json"
    rl.main(parse(["--project", "--demo-json", str(demo), "--json", str(out)]))
    projected = json.loads(out.read_text())["projection"]
    assert {r["model"] for r in projected} == {"llama3.1-8b", "qwen3-8b"}
    assert {r["batch"] for r in projected} == {1, 4, 8, 16}


def test_measured_comparison_from_benchmark_json():
    """Guards against pairing the wrong widths of a decode case, a case missing one width being shown, and a
    fixed cost per forward that is not the measured time(1) minus the roofline's."""
    ceilings = {"copy_gbs": 10.0, "matmul_gflops": {"fp32": 100.0, "bf16": 200.0}}
    cfg = tiny_config().__dict__

    def entry(case, tokens, seconds):
        shape = {"config": cfg, "dtype": "fp32", "batch": 2, "kv_len": 8, "k": 4, "tokens": tokens,
                 "ceilings": ceilings}
        info = {"family": "decode", "case": case, "decode": shape}
        return {"extra_info": info, "stats": {"median": seconds}}

    raw = {"benchmarks": [entry("full", 1, 0.010), entry("full", 4, 0.015), entry("full", 8, 0.030),
                          entry("partial", 1, 0.010), {"extra_info": {"family": "sampling"}, "stats": {}}]}
    cases = rl.measured_cases(raw)
    assert [c.label for c in cases] == ["full"]
    (row,) = rl.compare_rows(cases)
    assert row["slowdown_k"] == pytest.approx(1.5) and row["slowdown_2k"] == pytest.approx(3.0)
    times = rl.block_times(tiny_config(), rl.cpu_hardware(ceilings), FP32, 2, 4, 8)
    assert row["pred_slowdown_k"] == pytest.approx(times.slowdown_k)
    fixed = 0.010 - times.t1                                    # what the roofline misses of time(1)
    assert row["pred_fixed_slowdown_2k"] == pytest.approx((times.t2k + fixed) / 0.010)
    assert "| full |" in rl.compare_markdown([row])


# ----------------------------------------------------------------------------------------------------
# Plots of the benchmark report (bench/plots.py)
# ----------------------------------------------------------------------------------------------------
def test_parse_case_labels():
    """Guards against case labels of the bench files being misread (x axis or grouping of a plot)."""
    from bench.plots import parse_case

    assert parse_case("small fp32 B=4 L=512 k=16") == {"B": "4", "L": "512", "k": "16", "words": "small fp32"}
    assert parse_case("B=1 K=16 V=128256 bf16") == {"B": "1", "K": "16", "V": "128256", "words": "bf16"}


def test_tokens_per_s_from_forward_times():
    """Guards against a tokens/s that is not the SBD_SPEC 4 cost model: NTP B / time(1), SBD B k / (time(2k)
    + (l - 1) time(k))."""
    from bench.plots import tokens_per_s

    times = {1: 0.01, 16: 0.02, 32: 0.03}
    assert tokens_per_s(times, 4, 16, None) == pytest.approx(400.0)
    stat = rl.NfeStat("x", nfe_speedup=8.0)                     # l = 2
    assert tokens_per_s(times, 4, 16, stat) == pytest.approx(4 * 16 / (0.03 + 0.02))
    assert tokens_per_s({1: 0.01}, 4, 16, stat) is None


def test_write_plots(tmp_path, capsys):
    """Guards against a plot crashing on real report rows, and a missing input failing instead of being
    skipped with a message."""
    from bench.plots import write_plots

    sampling = [{"case": f"B=1 K=16 V={v} bf16", "provider": p, "median_ms": v / 1e4, "gflops": None}
                for v in (1000, 50257) for p in ("sbd", "eager")]
    decode = [{"case": f"small fp32 B={b} L=512 k=16", "provider": f"sbd t={t}", "median_ms": t * 0.5 + b,
               "gflops": 1.0} for b in (1, 4) for t in (1, 16, 32)]
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

    from bench.bench_decode import BLOCK, pass_inputs

    cfg = ModelConfig.preset("small")
    for tokens, causal, block_size in ((1, 1, 0), (BLOCK, 0, BLOCK), (2 * BLOCK, BLOCK, BLOCK)):
        ids, num_causal, size = pass_inputs(cfg, 3, tokens)
        assert ids.shape == (3, tokens) and int(ids.max()) < cfg.vocab_size
        assert num_causal.dtype == torch.int32 and num_causal.tolist() == [causal] * 3 and size == block_size


def test_decode_bench_cache_size():
    """Guards against the full grid allocating a KV cache beyond the machine's memory: the size the skip
    rule reads is the cache the benchmark allocates."""
    from bench.bench_decode import BLOCK, cache_gib

    # 1B config, bf16: 16 layers x K and V x 16 rows x (16384 + 2k) slots x 8 heads x 64 dims x 2 bytes
    assert cache_gib("1b", 16, 16384) == pytest.approx(16 * 2 * 16 * (16384 + 2 * BLOCK) * 8 * 64 * 2 / 2**30)
    assert cache_gib("1b", 16, 16384) > 4 > cache_gib("1b", 4, 4096)
