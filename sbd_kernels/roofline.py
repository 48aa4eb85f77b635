"""Roofline model of one decoder forward, and the wall-clock speedup of SBD it implies (paper Sec. 4).

Time of a forward of `t` query tokens per sequence, batch `b`, `L` tokens already cached: every matmul and
every attention runs at the slower of its two ceilings, summed over the layers and the LM head,

    time(t) = sum_ops max(flops_op / peak_flops, bytes_op / bandwidth)

    linear x[M, K] @ W[K, N], M = b t:   flops = 2 M K N,   bytes = K N w + M (K + N) a
    attention, per layer:                flops = 4 D Hq b sum_rows keys(row)
                                         bytes = b (L Hkv D 2 kv + t Hkv D 2 a + 2 t Hq D a + c Hkv D 2 kv)

with w, a, kv the bytes per weight, activation and cached element, c the causal rows appended to the cache
(1 for an NTP step, 0 for a later pass of a block, k for the first pass of a block), keys(row) = L + i + 1
for causal row i and L + t for a block row (SBD_SPEC 3.2-3.3). The seven linears of a layer are wq, wk,
wv (dim -> Hq D, Hkv D, Hkv D), wo (Hq D -> dim), w1, w3 (dim -> ffn), w2 (ffn -> dim); the LM head is
dim -> vocab over all b t rows (every block row needs its logits). As in the paper, only matmuls and
attention are counted: norms, RoPE, residual adds, SwiGLU's product and the embedding gather move about
b t (10 dim + 2 (Hq + Hkv) D + 3 ffn) activations per layer, for Llama-3.1-8B in bf16 0.7% of a layer's
weight bytes at b t = 16 but 22% at b t = 512, where unfused they add ~13% to the compute-bound time.

A block of k tokens decoded in l passes costs time(2k) + (l - 1) time(k), k NTP steps cost k time(1):

    wall-clock speedup = k time(1) / (time(2k) + (l - 1) time(k))                      (SBD_SPEC 4)

Time is linear in l, so the mean passes per block of a measured distribution gives the exact expected
speedup over many blocks. The first block after the prefill has no 2k pass; it is ignored (one block of an
answer).

Checks (tests/test_roofline.py): op costs by hand, Llama-3.1-8B's parameter count from the GEMM shapes, and
the paper's setting against the one number of its roofline analysis we have (SBD_SPEC 4: time(16) ~ 1.004
time(1) at small batch; this model gives 1.011 at batch 1, KV cache 4096). The cells of the paper's Table 3
were not available to us, so the rest of `--paper` is our model's prediction, not a reproduction.

    python -m sbd_kernels.roofline --model llama3.1-8b --hardware h100 --batch 1,4,8,16
    python -m sbd_kernels.roofline --paper --json table3.json
    python -m sbd_kernels.roofline --project --demo-json demo.json
    python -m sbd_kernels.roofline --measured bench/results/raw.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sbd_kernels.model import ModelConfig


# ----------------------------------------------------------------------------------------------------
# Hardware and precision
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    """Ceilings of one machine: dense matmul FLOP/s by compute dtype, and memory bandwidth in bytes/s."""

    name: str
    matmul_flops: dict[str, float]
    bandwidth: float
    source: str

    def peak(self, compute: str) -> float:
        """FLOP/s for matmuls in `compute`; a dtype the machine has no units for runs at the bf16 rate
        (A100 has no FP8 tensor cores: FP8 weights are upcast and multiplied in bf16)."""
        return self.matmul_flops[compute] if compute in self.matmul_flops else self.matmul_flops["bf16"]


# Datasheet numbers, dense (the datasheets print "with sparsity" figures, twice these). fp32 is the
# non-tensor-core rate: torch multiplies fp32 without TF32 by default.
HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        "NVIDIA H100 SXM5 80GB", {"fp8": 1978.9e12, "bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12},
        3.35e12, "NVIDIA H100 Tensor Core GPU datasheet, SXM5 column (FP8 3,958 / BF16 1,979 TFLOPS with "
        "sparsity, HBM3 3.35 TB/s)"),
    "h200": Hardware(
        "NVIDIA H200 SXM 141GB", {"fp8": 1978.9e12, "bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12},
        4.8e12, "NVIDIA H200 Tensor Core GPU datasheet, SXM column (same tensor cores as H100 SXM, HBM3e "
        "4.8 TB/s)"),
    "a100": Hardware(
        "NVIDIA A100 SXM4 80GB", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
        2.039e12, "NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column (BF16 312 TFLOPS dense, HBM2e "
        "2,039 GB/s; no FP8)"),
}


def cpu_hardware(ceilings: dict | None = None) -> Hardware:
    """This CPU from measured ceilings (`bench.common.machine_ceilings()`, measured now if not given):
    STREAM-convention copy bandwidth and torch.mm GFLOP/s in fp32 and bf16 (fp16 at the fp32 rate: CPU torch
    has no fast fp16 GEMM)."""
    if ceilings is None:
        from bench.common import machine_ceilings

        ceilings = machine_ceilings()
    gflops = ceilings["matmul_gflops"]
    flops = {"fp32": gflops["fp32"] * 1e9, "fp16": gflops["fp32"] * 1e9, "bf16": gflops["bf16"] * 1e9}
    return Hardware("this CPU (measured)", flops, ceilings["copy_gbs"] * 1e9,
                    f"measured: copy {ceilings['copy_gbs']:.1f} GB/s, torch.mm fp32 {gflops['fp32']:.0f} / "
                    f"bf16 {gflops['bf16']:.0f} GFLOP/s")


@dataclass(frozen=True)
class Precision:
    """Bytes per weight, activation and cached K/V element, and the dtypes the matmuls and the attention
    run in."""

    weight_bytes: float
    act_bytes: float
    kv_bytes: float
    compute: str
    attention_compute: str


PRECISIONS: dict[str, Precision] = {
    # The paper's setting (SBD_SPEC 4): FP8 weights multiplied on FP8 tensor cores; activations and the KV
    # cache stay bf16, so attention runs at the bf16 rate (our reading: the paper names only the weights).
    "fp8": Precision(1, 2, 2, "fp8", "bf16"),
    "bf16": Precision(2, 2, 2, "bf16", "bf16"),
    "fp16": Precision(2, 2, 2, "fp16", "fp16"),
    "fp32": Precision(4, 4, 4, "fp32", "fp32"),
}


# ----------------------------------------------------------------------------------------------------
# Cost of one forward
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpCost:
    """One matmul or attention of the forward; `count` identical copies (one per layer)."""

    name: str
    flops: float
    bytes: float
    compute: str
    count: int = 1

    def seconds(self, hw: Hardware) -> float:
        return self.count * max(self.flops / hw.peak(self.compute), self.bytes / hw.bandwidth)


def linear_cost(name: str, rows: int, in_features: int, out_features: int, prec: Precision,
                count: int = 1) -> OpCost:
    """x [rows, in] @ W [in, out]: W read once, x read and y written once."""
    flops = 2 * rows * in_features * out_features
    nbytes = (in_features * out_features * prec.weight_bytes
              + rows * (in_features + out_features) * prec.act_bytes)
    return OpCost(name, flops, nbytes, prec.compute, count)


def attention_keys(tokens: int, kv_len: int, num_causal: int) -> int:
    """Sum over the query rows of one sequence of the keys each row attends to: causal row i sees
    L + i + 1 keys, each of the t - c block rows sees L + t (SBD_SPEC 3.2-3.3)."""
    block_rows = tokens - num_causal
    return num_causal * kv_len + num_causal * (num_causal + 1) // 2 + block_rows * (kv_len + tokens)


def attention_cost(cfg: ModelConfig, batch: int, tokens: int, kv_len: int, num_causal: int, prec: Precision,
                   count: int = 1) -> OpCost:
    """Block attention of one layer: S = Q K^T and P V per query head over the cached and new keys; the
    cache is read once per KV head (GQA groups share it), the causal rows' K/V written once."""
    d, hq, hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    flops = 4 * d * hq * batch * attention_keys(tokens, kv_len, num_causal)
    nbytes = batch * (kv_len * hkv * d * 2 * prec.kv_bytes        # cached K and V read
                      + tokens * hkv * d * 2 * prec.act_bytes     # new K and V read
                      + 2 * tokens * hq * d * prec.act_bytes      # q read, out written
                      + num_causal * hkv * d * 2 * prec.kv_bytes)  # causal K/V appended to the cache
    return OpCost(name="attention", flops=flops, bytes=nbytes, compute=prec.attention_compute, count=count)


def forward_costs(cfg: ModelConfig, batch: int, tokens: int, kv_len: int, prec: Precision,
                  num_causal: int | None = None) -> list[OpCost]:
    """Every matmul and attention of one forward of `tokens` rows per sequence (layers folded into
    `count`). num_causal defaults to the pass kind SBD uses for that width: 1 token -> an NTP step (1 causal
    row); otherwise a later pass of a block (0 causal rows)."""
    if num_causal is None:
        num_causal = 1 if tokens == 1 else 0
    if not 0 <= num_causal <= tokens:
        raise ValueError(f"forward_costs: num_causal ({num_causal}) must be in [0, tokens={tokens}]")
    rows, n = batch * tokens, cfg.n_layers
    dim, q_dim, kv_dim = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return [
        linear_cost("wq", rows, dim, q_dim, prec, n),
        linear_cost("wk", rows, dim, kv_dim, prec, n),
        linear_cost("wv", rows, dim, kv_dim, prec, n),
        attention_cost(cfg, batch, tokens, kv_len, num_causal, prec, n),
        linear_cost("wo", rows, q_dim, dim, prec, n),
        linear_cost("w1", rows, dim, cfg.ffn_dim, prec, n),
        linear_cost("w3", rows, dim, cfg.ffn_dim, prec, n),
        linear_cost("w2", rows, cfg.ffn_dim, dim, prec, n),
        linear_cost("lm_head", rows, dim, cfg.vocab_size, prec),
    ]


def forward_time(cfg: ModelConfig, hw: Hardware, prec: Precision, batch: int, tokens: int, kv_len: int,
                 num_causal: int | None = None) -> float:
    """Predicted seconds of one forward (see `forward_costs` for num_causal)."""
    return sum(op.seconds(hw) for op in forward_costs(cfg, batch, tokens, kv_len, prec, num_causal))


def forward_work(cfg: ModelConfig, batch: int, tokens: int, kv_len: int, prec: Precision,
                 num_causal: int | None = None) -> tuple[float, float]:
    """(flops, bytes) of one forward: the physical work the benchmarks divide by time."""
    ops = forward_costs(cfg, batch, tokens, kv_len, prec, num_causal)
    return sum(op.count * op.flops for op in ops), sum(op.count * op.bytes for op in ops)


@dataclass(frozen=True)
class BlockTimes:
    """Predicted seconds of the three pass kinds at one batch and cache length, block size k."""

    k: int
    t1: float    # NTP step: 1 token, appended to the cache
    tk: float    # later pass of a block: k block rows
    t2k: float   # first pass of a block: k causal rows (appended) + k block rows

    @property
    def slowdown_k(self) -> float:
        return self.tk / self.t1

    @property
    def slowdown_2k(self) -> float:
        return self.t2k / self.t1


def block_times(cfg: ModelConfig, hw: Hardware, prec: Precision, batch: int, k: int,
                kv_len: int) -> BlockTimes:
    return BlockTimes(
        k=k,
        t1=forward_time(cfg, hw, prec, batch, 1, kv_len, num_causal=1),
        tk=forward_time(cfg, hw, prec, batch, k, kv_len, num_causal=0),
        t2k=forward_time(cfg, hw, prec, batch, 2 * k, kv_len, num_causal=k),
    )


# ----------------------------------------------------------------------------------------------------
# SBD wall-clock speedup
# ----------------------------------------------------------------------------------------------------
def sbd_speedup(times: BlockTimes, passes_per_block: float) -> float:
    """k time(1) / (time(2k) + (l - 1) time(k)) for a mean of l passes per block (l >= 1)."""
    if passes_per_block < 1:
        raise ValueError(f"sbd_speedup: passes_per_block must be >= 1, got {passes_per_block}")
    return times.k * times.t1 / (times.t2k + (passes_per_block - 1) * times.tk)


def mean_passes(distribution: dict[int, int]) -> float:
    """Mean passes per block of a histogram {passes: number of blocks}."""
    blocks = sum(distribution.values())
    if blocks <= 0 or min(distribution) < 1:
        raise ValueError(f"mean_passes: need blocks with >= 1 pass, got {distribution}")
    return sum(p * n for p, n in distribution.items()) / blocks


@dataclass(frozen=True)
class NfeStat:
    """Measured NFE statistics of one decode setting: passes per block l = k x (SBD NFE per token) /
    (NTP NFE per token of the same model), i.e. l = k / NFE speedup."""

    label: str
    nfe_speedup: float
    block_size: int = 16
    accuracy: float | None = None

    @property
    def passes_per_block(self) -> float:
        return self.block_size / self.nfe_speedup


# Paper Table 1 (SBD_SPEC 5), average NFE speedup over the six benchmarks at k = 16.
PAPER_NFE = {
    "llama3.1-8b": [NfeStat("paper Table 1, gamma low", 3.0), NfeStat("paper Table 1, gamma high", 3.4)],
    "qwen3-8b": [NfeStat("paper Table 1, gamma low", 3.2), NfeStat("paper Table 1, gamma high", 3.8)],
}


def nfe_stats_from_demo(results: list[dict], block_size: int = 16,
                        gammas: Iterable[float] | None = None) -> list[NfeStat]:
    """NFE statistics of the SBD model's SBD rows of `sbd demo --json` output (a list of
    {"task", "rows": [{"model", "method", "gamma", "accuracy", "nfe", "answer_tokens", ...}]}), relative to
    the same model's NTP row of the same task. gammas: keep only these (None = every gamma > 0). Gammas of
    one task with the same NFE and accuracy become one statistic ("gamma 0.1, 0.35")."""
    stats = []
    for task in results:
        rows = task["rows"]
        ntp = next(r for r in rows if r["model"] == "sbd" and r["method"] == "ntp")
        ntp_per_token = ntp["nfe"] / ntp["answer_tokens"]
        merged: dict[tuple, list[float]] = {}
        for r in rows:
            if r["model"] != "sbd" or r["method"] != "sbd" or not r["gamma"]:
                continue
            if gammas is not None and r["gamma"] not in gammas:
                continue
            speedup = ntp_per_token / (r["nfe"] / r["answer_tokens"])
            merged.setdefault((speedup, r.get("accuracy")), []).append(r["gamma"])
        for (speedup, accuracy), task_gammas in merged.items():
            label = f"measured: {task['task']}, gamma " + ", ".join(f"{g:g}" for g in task_gammas)
            stats.append(NfeStat(label, speedup, task.get("block_size", block_size), accuracy))
    return stats


# ----------------------------------------------------------------------------------------------------
# The paper's Table 3 setting, and the GPU projection
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PaperSetting:
    """Assumptions of the paper's roofline table (SBD_SPEC 4): Llama-3.1 8B, FP8 weights, H100 SXM.
    kv_len is not stated in the material we have; 4096 is our choice. It matters little at batch 1 (1k to
    16k moves the k = 16 slowdown between 1.012 and 1.010) and much at batch 16 (k = 64: 2.96 to 1.46: a
    longer cache makes the 1-token forward costlier and the block's extra compute relatively cheaper)."""

    model: str = "llama3.1-8b"
    hardware: str = "h100"
    precision: str = "fp8"
    kv_len: int = 4096
    batches: tuple[int, ...] = (1, 4, 8, 16)
    ks: tuple[int, ...] = (2, 4, 8, 16, 32, 64)


def paper_table3(setting: PaperSetting = PaperSetting()) -> list[dict[str, Any]]:
    """Block-forward slowdown time(k) / time(1) for every (batch, k) of the paper's table."""
    cfg = ModelConfig.preset(setting.model)
    hw, prec = HARDWARE[setting.hardware], PRECISIONS[setting.precision]
    rows = []
    for batch in setting.batches:
        for k in setting.ks:
            times = block_times(cfg, hw, prec, batch, k, setting.kv_len)
            rows.append({"batch": batch, "k": k, "kv_len": setting.kv_len, "slowdown": times.slowdown_k})
    return rows


def table3_markdown(rows: list[dict[str, Any]]) -> str:
    ks = sorted({r["k"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    cell = {(r["batch"], r["k"]): r["slowdown"] for r in rows}
    lines = ["| batch | " + " | ".join(f"k={k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]
    lines += [f"| {b} | " + " | ".join(f"{cell[b, k]:.3f}" for k in ks) + " |" for b in batches]
    return "\n".join(lines)


def projection_rows(models: Iterable[str], hardware: str, precision: str, batches: Iterable[int], kv_len: int,
                    stats_by_model: dict[str, list[NfeStat]]) -> list[dict[str, Any]]:
    """Projected SBD wall-clock speedup for each model, NFE statistic and batch."""
    hw, prec = HARDWARE[hardware], PRECISIONS[precision]
    rows = []
    for model in models:
        cfg = ModelConfig.preset(model)
        for stat in stats_by_model[model]:
            for batch in batches:
                times = block_times(cfg, hw, prec, batch, stat.block_size, kv_len)
                rows.append({"model": model, "nfe_source": stat.label, "nfe_speedup": stat.nfe_speedup,
                             "passes_per_block": stat.passes_per_block, "batch": batch,
                             "slowdown_k": times.slowdown_k, "slowdown_2k": times.slowdown_2k,
                             "wall_speedup": sbd_speedup(times, stat.passes_per_block)})
    return rows


def projection_markdown(rows: list[dict[str, Any]], hardware: str, precision: str, kv_len: int) -> str:
    """One table: model x NFE statistic in rows, batch in columns, projected wall-clock speedup in cells."""
    batches = sorted({r["batch"] for r in rows})
    keyed: dict[tuple[str, str], dict[int, dict]] = {}
    for r in rows:
        keyed.setdefault((r["model"], r["nfe_source"]), {})[r["batch"]] = r
    hw = HARDWARE[hardware]
    lines = [
        (f"**Projection, not a measurement**: roofline model (`sbd roofline --project`) of {hw.name} "
        f"({hw.source}), {precision} weights, KV cache {kv_len} tokens, block k = 16; wall-clock speedup "
        "= k time(1) / (time(2k) + (l - 1) time(k)) with l = passes per block from the NFE speedup. "
        "NFE sources: \"measured\" rows come from `sbd demo` on the bundled small models and synthetic "
        "tasks, where whole blocks are revealed in 1-2 passes (a best case, not a forecast for 8B models "
        "on natural text); \"paper Table 1\" rows use the NFE speedups the paper measured on the 8B models."),
        "",
        "| model | NFE source | NFE speedup | passes per block | "
        + " | ".join(f"batch {b}" for b in batches) + " |",
        "|---|---|---|---|" + "---|" * len(batches),
    ]
    for (model, source), by_batch in keyed.items():
        first = next(iter(by_batch.values()))
        cells = " | ".join(f"{by_batch[b]['wall_speedup']:.2f}x" for b in batches)
        lines.append(f"| {model} | {source} | {first['nfe_speedup']:.1f}x "
                     f"| {first['passes_per_block']:.2f} | "
                     f"{cells} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Prediction against the end-to-end decode benchmark
# ----------------------------------------------------------------------------------------------------
@dataclass
class MeasuredCase:
    """Median seconds of the three pass widths of one (config, dtype, batch, cache length, k)."""

    label: str
    config: dict
    dtype: str
    batch: int
    kv_len: int
    k: int
    ceilings: dict | None
    seconds: dict[int, float] = field(default_factory=dict)


def measured_cases(raw: dict) -> list[MeasuredCase]:
    """Group the "decode" entries of a pytest-benchmark JSON (written by `bench/bench_decode.py`, which puts
    the shape in extra_info["decode"]) by case; keeps the cases with all three widths."""
    cases: dict[str, MeasuredCase] = {}
    for bench in raw.get("benchmarks", []):
        info = bench.get("extra_info", {})
        shape = info.get("decode")
        if info.get("family") != "decode" or shape is None:
            continue
        case = cases.setdefault(info["case"], MeasuredCase(
            info["case"], shape["config"], shape["dtype"], shape["batch"], shape["kv_len"], shape["k"],
            shape.get("ceilings")))
        case.seconds[shape["tokens"]] = bench["stats"]["median"]
    return [c for c in cases.values() if {1, c.k, 2 * c.k} <= set(c.seconds)]


def compare_rows(cases: list[MeasuredCase], ceilings: dict | None = None) -> list[dict[str, Any]]:
    """Measured vs predicted time(k)/time(1) and time(2k)/time(1) on this CPU. The ceilings stored with
    each case (measured during the benchmark run) are used; `ceilings` is the fallback.

    Two predictions: the roofline alone, and the roofline plus a fixed cost per forward that it cannot see
    (Python, op dispatch, norms and RoPE, thread start-up), taken as the measured time(1) minus the
    roofline's: fixed = max(time(1) - roofline(1), 0), prediction (roofline(t) + fixed) / time(1).
    """
    rows = []
    for c in cases:
        hw = cpu_hardware(c.ceilings or ceilings)
        cfg, prec = ModelConfig(**c.config), PRECISIONS[c.dtype]
        times = block_times(cfg, hw, prec, c.batch, c.k, c.kv_len)
        t1, tk, t2k = c.seconds[1], c.seconds[c.k], c.seconds[2 * c.k]
        fixed = max(t1 - times.t1, 0.0)
        rows.append({"case": c.label, "t1_ms": t1 * 1e3, "pred_t1_ms": times.t1 * 1e3,
                     "fixed_ms": fixed * 1e3,
                     "slowdown_k": tk / t1, "pred_slowdown_k": times.slowdown_k,
                     "pred_fixed_slowdown_k": (times.tk + fixed) / t1,
                     "slowdown_2k": t2k / t1, "pred_slowdown_2k": times.slowdown_2k,
                     "pred_fixed_slowdown_2k": (times.t2k + fixed) / t1})
    return rows


def _median_error(rows: list[dict[str, Any]], measured: str, predicted: str) -> float:
    return statistics.median(abs(r[measured] / r[predicted] - 1) for r in rows)


def compare_markdown(rows: list[dict[str, Any]]) -> str:
    """Table of `compare_rows`: measured / roofline / roofline + fixed cost, and the median errors."""
    lines = [("Roofline prediction vs measurement on this CPU (ceilings measured in the same run). time(t) = "
              "one forward with t query tokens per sequence; ratios as measured / roofline / roofline + the "
              "fixed cost per forward (measured time(1) - roofline time(1))."), "",
             ("| case | time(1) ms measured / roofline | time(k)/time(1) | time(2k)/time(1) |"),
             "|---|---|---|---|"]
    for r in rows:
        ratios = [" / ".join(f"{r[key]:.2f}" for key in (f"slowdown_{w}", f"pred_slowdown_{w}",
                                                          f"pred_fixed_slowdown_{w}")) for w in ("k", "2k")]
        t1 = f"{r['t1_ms']:.2f} / {r['pred_t1_ms']:.2f}"
        lines.append(f"| {r['case']} | {t1} | {ratios[0]} | {ratios[1]} |")
    if rows:
        errors = []
        for kind, name in (("", "roofline"), ("fixed_", "roofline + fixed cost")):
            per_width = [_median_error(rows, f"slowdown_{w}", f"pred_{kind}slowdown_{w}")
                         for w in ("k", "2k")]
            errors.append(name + " " + " / ".join(f"{100 * e:.0f}%" for e in per_width))
        lines += ["", "Median relative error of the predicted ratios (time(k)/time(1) / time(2k)/time(1)): "
                  + ", ".join(errors) + "."]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Command line (`sbd roofline`)
# ----------------------------------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default="llama3.1-8b", help="ModelConfig preset (default llama3.1-8b)")
    parser.add_argument("--hardware", default="h100", choices=[*HARDWARE, "cpu"],
                        help="datasheet GPU, or this CPU from measured ceilings")
    parser.add_argument("--precision", default="bf16", choices=list(PRECISIONS))
    parser.add_argument("--batch", default="1,4,8,16", type=_int_list, help="comma-separated batch sizes")
    parser.add_argument("--k", default=16, type=int, help="block size")
    parser.add_argument("--kv-len", default=4096, type=int, help="tokens already in the KV cache")
    parser.add_argument("--passes", type=float, default=None,
                        help="mean passes per block l: also print the wall-clock speedup")
    parser.add_argument("--paper", action="store_true",
                        help="the paper's table setting (Llama-3.1 8B, FP8 weights, H100): "
                        "slowdown time(k)/time(1)")
    parser.add_argument("--project", action="store_true",
                        help="GPU projection table (Llama-3.1-8B, Qwen3-8B on --hardware, batch 1/4/8/16)")
    parser.add_argument("--demo-json", type=Path, help="`sbd demo --json` output: measured NFE statistics")
    parser.add_argument("--measured", type=Path,
                        help="pytest-benchmark JSON with bench_decode results: prediction vs measurement")
    parser.add_argument("--json", type=Path, help="write the result as JSON to this path")
    return parser


def _model_table(args: argparse.Namespace) -> dict[str, Any]:
    cfg = ModelConfig.preset(args.model)
    hw = cpu_hardware() if args.hardware == "cpu" else HARDWARE[args.hardware]
    prec = PRECISIONS[args.precision]
    print(f"{args.model} on {hw.name} ({hw.source}), {args.precision}, KV cache {args.kv_len}, k = {args.k}")
    print(f"{'batch':>5} {'time(1) ms':>10} {'time(k)/time(1)':>15} {'time(2k)/time(1)':>16}"
          + (f" {'speedup at l=' + format(args.passes, 'g'):>18}" if args.passes else ""))
    rows = []
    for batch in args.batch:
        times = block_times(cfg, hw, prec, batch, args.k, args.kv_len)
        row = {"batch": batch, "k": args.k, "kv_len": args.kv_len, "t1_s": times.t1,
               "slowdown_k": times.slowdown_k, "slowdown_2k": times.slowdown_2k}
        line = f"{batch:>5} {1e3 * times.t1:>10.3f} {times.slowdown_k:>15.3f} {times.slowdown_2k:>16.3f}"
        if args.passes:
            row["wall_speedup"] = sbd_speedup(times, args.passes)
            line += f" {row['wall_speedup']:>17.2f}x"
        print(line)
        rows.append(row)
    return {"model": args.model, "hardware": hw.name, "precision": args.precision, "rows": rows}


def _project(args: argparse.Namespace) -> dict[str, Any]:
    models = ("llama3.1-8b", "qwen3-8b")
    measured = nfe_stats_from_demo(json.loads(args.demo_json.read_text()), args.k) if args.demo_json else []
    stats = {m: [*measured, *PAPER_NFE[m]] for m in models}
    rows = projection_rows(models, args.hardware, args.precision, args.batch, args.kv_len, stats)
    print(projection_markdown(rows, args.hardware, args.precision, args.kv_len))
    return {"projection": rows}


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Runs one mode and returns what it printed as data (also written to --json)."""
    if args.paper:
        setting = PaperSetting(kv_len=args.kv_len)
        rows = paper_table3(setting)
        print(f"Block-forward slowdown time(k)/time(1): {setting.model}, {setting.precision} weights, "
              f"{HARDWARE[setting.hardware].name}, KV cache {setting.kv_len}\n")
        print(table3_markdown(rows))
        result: dict[str, Any] = {"table3": rows}
    elif args.project:
        result = _project(args)
    elif args.measured:
        rows = compare_rows(measured_cases(json.loads(args.measured.read_text())))
        if not rows:
            raise SystemExit(f"sbd roofline: no complete decode cases (t = 1, k, 2k) in {args.measured}")
        print(compare_markdown(rows))
        result = {"comparison": rows}
    else:
        result = _model_table(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main(add_arguments(argparse.ArgumentParser(prog="sbd roofline", description=__doc__,
                                               formatter_class=argparse.RawDescriptionHelpFormatter)).parse_args())
