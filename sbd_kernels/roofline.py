"""Roofline model of one decoder forward, and the wall-clock speedup of SBD it implies (paper Sec. 4).

Time of a forward of `t` query tokens per sequence, batch `b`, `L` tokens already cached: every matmul and
every attention runs at the slower of its two ceilings, summed over the layers and the LM head,

    time(t) = sum_ops max(flops_op / peak_flops, bytes_op / bandwidth)

    linear x[M, K] @ W[K, N], M = b t:   flops = 2 M K N,   bytes = K N w + M (K + N) a
    attention, per layer:                flops = 4 D Hq b sum_rows keys(row)
                                         bytes = b (L Hkv D 2 kv + t Hkv D 2 a + 2 t Hq D a + c Hkv D 2 kv)

with w, a, kv the bytes per weight, activation and cached element, c the causal rows appended to the cache
(1 for an NTP step, 0 for a later pass of a block, k for the first pass of a block), keys(row) = L + i + 1
for causal row i, L + t for a block row (docs/algorithm.md §3.2-3.3). A layer's seven linears are wq, wk,
wv (dim -> Hq D, Hkv D, Hkv D), wo (Hq D -> dim), w1, w3 (dim -> ffn), w2 (ffn -> dim); the LM head is
dim -> vocab over the b r rows whose logits the decoder reads (`logit_rows`, `sbd_kernels.generate`'s
keep_last): r = 1 for an NTP step, r = k for both block passes. A first pass's k causal rows only fill the
cache; logits for them would be 10.3% of that pass's FLOPs at Llama-3.2-1B shapes, batch 1, L = 512, k = 16.
As in the paper, only matmuls and attention are counted: norms, RoPE, residual adds, SwiGLU's product and
the embedding gather move about
b t (10 dim + 2 (Hq + Hkv) D + 3 ffn) activations per layer, for Llama-3.1-8B in bf16 0.7% of a layer's
weight bytes at b t = 16 but 22% at b t = 512, where unfused they add ~13% to the compute-bound time.

A block of k tokens decoded in l passes costs time(2k) + (l - 1) time(k), k NTP steps cost k time(1):

    wall-clock speedup = k time(1) / (time(2k) + (l - 1) time(k))             (docs/algorithm.md §4)

Time is linear in l, so the mean passes per block of a measured distribution gives the exact expected
speedup over many blocks. The first block after the prefill has no 2k pass; it is ignored (one block of an
answer).

The paper's own roofline (its appendix code, Fig. 11) is `PaperRoofline`: its three quirks (an FFN GEMM
4096 times too large, K/V projections 256 wide, the bandwidth read as 3.35 x 1024^4 B/s) and its modelling
choices (no LM head, two FFN matrices, 1-byte activations and cache, attention over the cache alone) are
named fields. As published it reproduces the paper's Table 3 within 0.2%: 321 of its 336 cells to the
table's 3 decimals, the largest difference 0.0075 at batch 16, k = 64, KV 65,536, where the paper prints
one value for every KV length from 16 to 65,536 and its code's value has moved from 3.799 to 3.792.
`--paper` prints it beside our model and what each difference changes.

Checks (tests/test_roofline.py): op costs by hand, Llama-3.1-8B's parameter count from the GEMM shapes, the
336 cells of Table 3, each quirk's effect as its note states it, and the paper's configuration turned into
ours one field at a time landing on `forward_costs`.

    python -m sbd_kernels.roofline --model llama3.1-8b --hardware h100 --batch 1,4,8,16
    python -m sbd_kernels.roofline --paper --json table3.json
    python -m sbd_kernels.roofline --project --demo-json demo.json
    python -m sbd_kernels.roofline --measured bench/results/raw.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from sbd_kernels import argtypes
from sbd_kernels.argtypes import UsageError, add_option
from sbd_kernels.model import PRESETS, ModelConfig


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
        """FLOP/s for matmuls in `compute`. FP8 on a machine without FP8 units runs at the bf16 rate (A100 has
        no FP8 tensor cores: FP8 weights are upcast and multiplied in bf16); any other dtype without a rate is
        a ValueError rather than another dtype's rate (a CPU's fp16 GEMM is neither its fp32 nor its bf16 one)."""
        if compute in self.matmul_flops:
            return self.matmul_flops[compute]
        if compute == "fp8" and "bf16" in self.matmul_flops:
            return self.matmul_flops["bf16"]
        raise ValueError(f"{self.name}: no {compute} matmul rate ({self.source})")


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


# n of the fp16 torch.mm that measures a CPU's fp16 rate, below the n = 2048 of machine_ceilings' fp32 and bf16:
# where CPU torch has no fast fp16 GEMM (0.2 GFLOP/s on the 2-core reference machine, sbd_kernels.machine) one
# 2048^3 product takes 86 s and the measurement (6 products) 9 minutes, at n = 512 8 s. On a Xeon with
# AVX512-FP16 at one thread, fp16 reached 190 GFLOP/s at n = 512 and 165 at n = 1024 (fp32: 197 and 194).
CPU_FP16_GEMM_N = 512


def cpu_hardware(ceilings: dict | None = None) -> Hardware:
    """This CPU from its measured ceilings: `ceilings` as `sbd_kernels.machine.machine_ceilings()` returns them
    (STREAM-convention copy bandwidth, torch.mm GFLOP/s in fp32 and bf16), or when not given those measured now
    plus torch.mm's fp16 rate (n = CPU_FP16_GEMM_N). Given ceilings without an fp16 rate leave fp16 without one
    (`Hardware.peak` raises): it is neither the fp32 nor the bf16 rate."""
    if ceilings is None:
        from sbd_kernels.machine import machine_ceilings, measure_matmul_peak_gflops

        measured = machine_ceilings()
        fp16 = measure_matmul_peak_gflops(torch.float16, n=CPU_FP16_GEMM_N)
        ceilings = {**measured, "matmul_gflops": {**measured["matmul_gflops"], "fp16": fp16}}
    return ceilings_hardware(ceilings, "this CPU (measured)")


def ceilings_hardware(ceilings: dict, name: str | None = None) -> Hardware:
    """The Hardware of ceilings in `machine_ceilings()` units: {"copy_gbs": GB/s, "matmul_gflops": {dtype:
    GFLOP/s}, "source" (absent: "measured")}, a CPU's measured ones or a GPU's datasheet
    (`bench_report.datasheet_ceilings`: fp16 and bf16 at the tensor-core rate); a rate for each dtype they
    hold and none for the others. name: default the source."""
    source = ceilings.get("source", "measured")
    gflops = ceilings["matmul_gflops"]
    rates = " / ".join(f"{dtype} {rate:.3g}" for dtype, rate in gflops.items())
    return Hardware(name or source, {dtype: rate * 1e9 for dtype, rate in gflops.items()}, ceilings["copy_gbs"] * 1e9,
                    f"{source}: copy {ceilings['copy_gbs']:.1f} GB/s, matmul {rates} GFLOP/s")


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
    # FP8 weights multiplied on FP8 tensor cores; activations and the KV cache stay bf16, attention runs at
    # the bf16 rate. The paper's roofline counts activations and cache in 1 byte (`PAPER_PRECISION`).
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
    L + i + 1 keys, each of the t - c block rows sees L + t (docs/algorithm.md §3.2-3.3)."""
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


def logit_rows(tokens: int, num_causal: int) -> int:
    """Rows per sequence whose logits a pass computes: its block rows, tokens - num_causal (a first block
    pass's causal rows only fill the cache), or 1 for a pass of causal rows alone (an NTP step: its last row
    predicts the next token)."""
    return tokens - num_causal or 1


def forward_costs(cfg: ModelConfig, batch: int, tokens: int, kv_len: int, prec: Precision,
                  num_causal: int | None = None) -> list[OpCost]:
    """Every matmul and attention of one forward of `tokens` rows per sequence (layers folded into
    `count`), the LM head on the batch x `logit_rows` rows whose logits are read. num_causal defaults to the
    pass kind SBD uses for that width: 1 token -> an NTP step (1 causal row); otherwise a later pass of a
    block (0 causal rows)."""
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
        linear_cost("lm_head", batch * logit_rows(tokens, num_causal), dim, cfg.vocab_size, prec),
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


# Paper Table 1 (docs/algorithm.md §5), average NFE speedup over the six benchmarks at k = 16.
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
# The paper's roofline (arXiv 2509.04185: Fig. 6 constants, Fig. 11 code) and its Table 3
# ----------------------------------------------------------------------------------------------------
# Fig. 6's "standard 8B transformer" (FFN_DIM = 4 * HIDDEN_DIM). The appendix code times one layer and no
# LM head; a layer count scales time(k) and time(1) alike, so Table 3 holds for any. 32 layers, as in
# Llama-3.1-8B, give the LM head that the comparison adds its share in a real 8B model.
PAPER_8B = ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=4 * 4096,
                       max_seq_len=131072)
# Fig. 6: PEAK_FLOPS = 1978e12 (FP8), PEAK_FLOPS_ATTENTION = 989e12 ("attention is done in BF16"), and a
# bandwidth of 3.35 TB/s, which the code writes 3.35 * (1024**4) (`PaperRoofline.tib_bandwidth_quirk`).
PAPER_H100 = Hardware("NVIDIA H100 (paper Fig. 6)", {"fp8": 1978e12, "bf16": 989e12}, 3.35e12,
                      "paper Fig. 6: 1978 TFLOP/s FP8 GEMMs, 989 TFLOP/s BF16 attention, 3.35 TB/s")
# BYTES = 1 counts the weights and every activation a GEMM or the attention reads or writes;
# BYTES_PER_KV_ELEMENT = 1 the KV cache.
PAPER_PRECISION = Precision(weight_bytes=1, act_bytes=1, kv_bytes=1, compute="fp8", attention_compute="bf16")

# Table 3 of the paper, time(k) / time(1), as published: per batch, for k = 2, 4, 8, 16, 32, 64, (the one
# value printed for every KV-cache length of the sweep from 16 to 65,536, the value at 4,194,304); where
# the paper prints one value for both, the pair repeats it. The sweep runs over powers of 2; the paper
# gives no value for 2^17 .. 2^21.
PAPER_TABLE3_RANGE_KV_LENS = tuple(2**e for e in range(4, 17))   # 16 .. 65,536
PAPER_TABLE3_LONG_KV_LEN = 4194304
PAPER_TABLE3_KV_LENS = (*PAPER_TABLE3_RANGE_KV_LENS, PAPER_TABLE3_LONG_KV_LEN)
PAPER_TABLE3_KS = (2, 4, 8, 16, 32, 64)
PAPER_TABLE3: dict[int, tuple[tuple[float, float], ...]] = {
    1: ((1.000, 1.000), (1.001, 1.001), (1.002, 1.002), (1.004, 1.004), (1.008, 1.007), (1.015, 1.029)),
    4: ((1.001, 1.001), (1.003, 1.003), (1.007, 1.006), (1.015, 1.014), (1.030, 1.028), (1.061, 1.111)),
    8: ((1.002, 1.002), (1.006, 1.005), (1.014, 1.012), (1.029, 1.026), (1.060, 1.054), (1.903, 1.903)),
    16: ((1.004, 1.003), (1.012, 1.009), (1.027, 1.022), (1.058, 1.047), (1.899, 1.720), (3.799, 3.422)),
}


@dataclass(frozen=True)
class PaperRoofline:
    """The paper's roofline model: the defaults are its configuration as published, quirks included; each
    field is one way it differs from ours (`forward_costs`: Llama-3.1-8B, FP8 weights, H100 datasheet).

    Quirks of the appendix code (the published Table 3 includes them):
      ffn_gemm_quirk: the FFN GEMMs are `gemm_roofline(tokens, HIDDEN_DIM, HIDDEN_DIM * FFN_DIM)` and
        `gemm_roofline(tokens, HIDDEN_DIM * FFN_DIM, HIDDEN_DIM)`; gemm_roofline(m, n, k) costs A [m, k] @
        B [k, n], symmetric in n and k, so each is an FFN matrix 4096 x 2^26 instead of 4096 x 16384:
        4096 times the FLOPs and ~4096 times the bytes of the real one. The FFN then takes 99.9% of a
        layer's time, and attention (the KV cache) hardly counts.
      kv_width_quirk: the K and V projections are NUM_HEADS * NUM_KV_HEADS = 256 wide, not
        NUM_KV_HEADS * HEAD_DIM = 1024.
      tib_bandwidth_quirk: MEMORY_BANDWIDTH = 3.35 * 1024**4 = 3.683e12 B/s, 9.95% above the 3.35e12 of the
        datasheet (`hardware.bandwidth` here is read as TB/s and multiplied by 1024**4 instead of 1e12).

    Modelling choices of the paper that ours does not share:
      gated_ffn False: two FFN matrices (up, down); Llama-3.1-8B's SwiGLU has three (w1, w3, w2).
      lm_head False: no LM head; ours has Llama's 4096 x 128256 on the rows whose logits are read
        (`logit_rows`): every row of the passes Table 3 compares, the k block rows of a first block pass.
      precision: activations and the KV cache in 1 byte; ours keeps both in bf16.
      sbd_attention False: every query row sees the kv_len cached keys and nothing else, and nothing is
        written to the cache; ours (`attention_cost`): an NTP step appends its K/V and sees L + 1 keys, a
        row of a later block pass sees L + k, the block's K/V is read with the cache.
    """

    model: ModelConfig = field(default_factory=lambda: PAPER_8B)
    hardware: Hardware = PAPER_H100
    precision: Precision = PAPER_PRECISION
    ffn_gemm_quirk: bool = True
    kv_width_quirk: bool = True
    tib_bandwidth_quirk: bool = True
    gated_ffn: bool = False
    lm_head: bool = False
    sbd_attention: bool = False

    @property
    def effective_hardware(self) -> Hardware:
        """`hardware`, with the bandwidth as the appendix code computes it under tib_bandwidth_quirk."""
        if not self.tib_bandwidth_quirk:
            return self.hardware
        return replace(self.hardware, bandwidth=self.hardware.bandwidth / 1e12 * 1024**4)


PAPER_QUIRKS = ("ffn_gemm_quirk", "kv_width_quirk", "tib_bandwidth_quirk")


def cache_attention_cost(cfg: ModelConfig, batch: int, tokens: int, kv_len: int, prec: Precision,
                         count: int = 1) -> OpCost:
    """The appendix's fused attention: each of the b t query rows sees the kv_len cached keys (not the
    block's own), Q is read and the output written once, the cache read once per KV head, nothing written:

        flops = 4 D Hq b t L,   bytes = 2 b t Hq D a + 2 b L Hkv D kv
    """
    d, hq, hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    flops = 4 * d * hq * batch * tokens * kv_len
    nbytes = 2 * batch * tokens * hq * d * prec.act_bytes + 2 * batch * kv_len * hkv * d * prec.kv_bytes
    return OpCost(name="attention", flops=flops, bytes=nbytes, compute=prec.attention_compute, count=count)


def paper_forward_costs(setup: PaperRoofline, batch: int, tokens: int, kv_len: int) -> list[OpCost]:
    """The appendix's `calculate_linear_layers_roofline` + `calculate_fused_attention_roofline` for one
    forward of `tokens` rows per sequence, the layers folded into `count`, with `setup`'s differences
    applied. Every field at our value gives `forward_costs` (an NTP step for 1 token, else a later block
    pass)."""
    cfg, prec, n, rows = setup.model, setup.precision, setup.model.n_layers, batch * tokens
    dim, q_dim = cfg.dim, cfg.n_heads * cfg.head_dim
    kv_dim = cfg.n_heads * cfg.n_kv_heads if setup.kv_width_quirk else cfg.n_kv_heads * cfg.head_dim
    ffn = cfg.dim * cfg.ffn_dim if setup.ffn_gemm_quirk else cfg.ffn_dim
    if setup.sbd_attention:
        attention = attention_cost(cfg, batch, tokens, kv_len, 1 if tokens == 1 else 0, prec, n)
    else:
        attention = cache_attention_cost(cfg, batch, tokens, kv_len, prec, n)
    ops = [linear_cost("wq", rows, dim, q_dim, prec, n),
           linear_cost("wk", rows, dim, kv_dim, prec, n),
           linear_cost("wv", rows, dim, kv_dim, prec, n),
           attention,
           linear_cost("wo", rows, q_dim, dim, prec, n),
           linear_cost("w1", rows, dim, ffn, prec, n)]
    if setup.gated_ffn:
        ops.append(linear_cost("w3", rows, dim, ffn, prec, n))
    ops.append(linear_cost("w2", rows, ffn, dim, prec, n))
    if setup.lm_head:
        ops.append(linear_cost("lm_head", batch * logit_rows(tokens, 1 if tokens == 1 else 0), dim,
                               cfg.vocab_size, prec))
    return ops


def paper_forward_time(setup: PaperRoofline, batch: int, tokens: int, kv_len: int) -> float:
    """Predicted seconds of one forward under `setup`."""
    hw = setup.effective_hardware
    return sum(op.seconds(hw) for op in paper_forward_costs(setup, batch, tokens, kv_len))


def paper_slowdown(setup: PaperRoofline, batch: int, k: int, kv_len: int) -> float:
    """Table 3's cell: time(k) / time(1) at one batch and KV-cache length."""
    return paper_forward_time(setup, batch, k, kv_len) / paper_forward_time(setup, batch, 1, kv_len)


# Our model of the same table, and the paper's configuration turned into it one difference at a time.
OURS = ("llama3.1-8b", "h100", "fp8")
PAPER_TO_OURS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("FFN GEMMs 4096 x 16384 (ffn_gemm_quirk off)", {"ffn_gemm_quirk": False}),
    ("K/V projections 1024 wide (kv_width_quirk off)", {"kv_width_quirk": False}),
    ("bandwidth 3.35e12 B/s (tib_bandwidth_quirk off), datasheet peaks 1978.9 / 989.4 TFLOP/s",
     {"tib_bandwidth_quirk": False, "hardware": HARDWARE["h100"]}),
    ("Llama-3.1-8B's SwiGLU FFN: w1, w3 4096 -> 14336, w2 back",
     {"gated_ffn": True, "model": ModelConfig.preset("llama3.1-8b")}),
    ("LM head 4096 -> 128256 on the rows whose logits are read", {"lm_head": True}),
    ("bf16 activations", {"precision": Precision(1, 2, 1, "fp8", "bf16")}),
    ("bf16 KV cache", {"precision": PRECISIONS["fp8"]}),
    ("SBD attention pattern: block rows see the block, the NTP row appends its K/V", {"sbd_attention": True}),
)


def ours_slowdown(batch: int, k: int, kv_len: int) -> float:
    """Our model's time(k) / time(1) (a later block pass over an NTP step) in the paper's setting."""
    model, hardware, precision = OURS
    times = block_times(ModelConfig.preset(model), HARDWARE[hardware], PRECISIONS[precision], batch, k, kv_len)
    return times.slowdown_k


# Cells that show what each difference does: the paper's headline (batch 1, k = 16), the largest memory-bound
# block forwards (b4 k64, b16 k16), the jump to compute-bound at 512 tokens (b8 k64, b16 k32), long caches.
DIFFERENCE_CELLS = ((1, 16, 16), (4, 64, 16), (16, 16, 16), (8, 64, 16), (16, 32, 16), (16, 32, 65536),
                    (16, 64, 4194304))

QUIRK_NOTES = {
    "ffn_gemm_quirk": (
        "the FFN GEMMs are written `gemm_roofline(num_tokens, HIDDEN_DIM, HIDDEN_DIM * FFN_DIM)` and "
        "`gemm_roofline(num_tokens, HIDDEN_DIM * FFN_DIM, HIDDEN_DIM)`: each costs as a 4096 x 67,108,864 "
        "matrix instead of 4096 x 16384, 4096x the FLOPs and about 4096x the bytes, so the FFN takes 99.9% of "
        "a layer's time and the attention hardly counts: the published table is flat in the KV length up to "
        "65,536. With the real FFN a long cache makes time(1) costlier and the block's extra GEMM work "
        "relatively cheaper (batch 16, k = 32, KV 65,536: 1.896 -> 1.069), until the attention itself turns "
        "compute-bound: k = 64 query rows over a 1-byte cache do 512 FLOPs per byte, above the BF16 ridge of "
        "269 (batch 1, k = 64, KV 4,194,304: 1.029 -> 1.890)."),
    "kv_width_quirk": (
        "the K and V projections are `NUM_HEADS * NUM_KV_HEADS` = 256 wide instead of NUM_KV_HEADS * HEAD_DIM "
        "= 1024, 3.6% of a layer's real weights left out; no cell moves by 0.01% beside the inflated FFN, "
        "and none by more than 1% once the FFN is corrected."),
    "tib_bandwidth_quirk": (
        "`MEMORY_BANDWIDTH = 3.35 * (1024**4)` = 3.683e12 B/s, 9.95% above the datasheet's 3.35e12: "
        "memory-bound forwards run 9.95% faster, so the cells whose block forward is compute-bound "
        "(batch x k = 512 or 1024 tokens; the FFN GEMM's ridge lies between 256 and 512) are up to 9.95% too "
        "high (batch 8, k = 64: 1.731 -> 1.903); the memory-bound ones (batch x k <= 256) move by < 1%."),
}

# Where our counting differs from the paper's outside the cells of Table 3.
LM_HEAD_NOTE = (
    "LM head: the paper counts none. Ours counts it on the rows whose logits the decoder reads: every row of an "
    "NTP step and of a later block pass (the two passes Table 3 compares), but only the k block rows of a first "
    "block pass over 2k rows, whose k causal rows only fill the cache; the paper's time(2k) (its Table 4) is a "
    "forward of 2k rows with no LM head.")

Cell = tuple[int, int, int]


def _table(slowdown: Callable[[int, int, int], float]) -> dict[Cell, float]:
    """{(batch, k, kv_len): slowdown(batch, k, kv_len)} over every cell of the paper's Table 3."""
    return {(b, k, kv): slowdown(b, k, kv)
            for b in PAPER_TABLE3 for kv in PAPER_TABLE3_KV_LENS for k in PAPER_TABLE3_KS}


def _setup_table(setup: PaperRoofline) -> dict[Cell, float]:
    return _table(lambda b, k, kv: paper_slowdown(setup, b, k, kv))


def published_table3() -> dict[Cell, float]:
    """The paper's Table 3 as {(batch, k, kv_len): slowdown} at every KV length it gives a value for: its
    one value for the range at each of PAPER_TABLE3_RANGE_KV_LENS, and the value at 4,194,304."""
    return {(b, k, kv): PAPER_TABLE3[b][j][0 if kv in PAPER_TABLE3_RANGE_KV_LENS else 1]
            for b in PAPER_TABLE3 for kv in PAPER_TABLE3_KV_LENS for j, k in enumerate(PAPER_TABLE3_KS)}


def paper_table3() -> list[dict[str, Any]]:
    """Table 3's cells from the paper's configuration as published ("paper") and from our model ("ours"),
    at every batch, block size and KV-cache length of the paper."""
    tables = {"paper": _setup_table(PaperRoofline()), "ours": _table(ours_slowdown)}
    return [{"batch": b, "k": k, "kv_len": kv, "slowdown": slowdown, "config": config}
            for config, table in tables.items() for (b, k, kv), slowdown in table.items()]


def _cell_rows(table: dict[Cell, float]) -> list[dict[str, Any]]:
    return [{"batch": b, "k": k, "kv_len": kv, "slowdown": table[b, k, kv]} for b, k, kv in DIFFERENCE_CELLS]


def paper_differences() -> dict[str, list[dict[str, Any]]]:
    """What each difference between the paper's configuration and ours does to Table 3.

    quirks_alone: each quirk corrected with the rest as published, its relative change over every cell
    (min_change, max_change) and the DIFFERENCE_CELLS; paper_to_ours: the published configuration turned
    into ours one difference at a time (PAPER_TO_OURS, cumulative), the DIFFERENCE_CELLS after each step.
    """
    published = PaperRoofline()
    base = _setup_table(published)
    alone = []
    for quirk in PAPER_QUIRKS:
        table = _setup_table(replace(published, **{quirk: False}))
        change = [table[cell] / base[cell] - 1 for cell in base]
        alone.append({"quirk": quirk, "note": QUIRK_NOTES[quirk], "min_change": min(change),
                      "max_change": max(change), "cells": _cell_rows(table)})
    steps, setup = [{"change": "paper, as published", "cells": _cell_rows(base)}], published
    for label, fields in PAPER_TO_OURS:
        setup = replace(setup, **fields)
        steps.append({"change": label, "cells": _cell_rows(_setup_table(setup))})
    return {"quirks_alone": alone, "paper_to_ours": steps}


def _span(table: dict[Cell, float], batch: int, k: int) -> str:
    """The cell over KV 16..65,536 as the paper prints it: one value, or "at 16..at 65,536" where the
    two differ at 3 decimals."""
    first, last = f"{table[batch, k, 16]:.3f}", f"{table[batch, k, 65536]:.3f}"
    return first if first == last else f"{first}..{last}"


def table3_markdown(rows: list[dict[str, Any]]) -> str:
    """Published vs paper configuration vs ours, KV 16..65,536 and KV 4,194,304, and how close the paper
    configuration comes to every published cell (`published_table3`): the largest difference, and how many
    cells agree to the published 3 decimals (|paper - published| <= 0.0005)."""
    tables: dict[str, dict[Cell, float]] = {"published": published_table3()}
    for r in rows:
        tables.setdefault(r["config"], {})[r["batch"], r["k"], r["kv_len"]] = r["slowdown"]
    names = ("published", "paper", "ours")
    lines = ["| batch | k | " + " | ".join(f"{n} KV 16..65,536" for n in names) + " | "
             + " | ".join(f"{n} KV 4,194,304" for n in names) + " |", "|---|---|" + "---|" * 6]
    for b in PAPER_TABLE3:
        for k in PAPER_TABLE3_KS:
            cells = [_span(tables[n], b, k) for n in names] + [f"{tables[n][b, k, 4194304]:.3f}" for n in names]
            lines.append(f"| {b} | {k} | " + " | ".join(cells) + " |")
    published, paper = tables["published"], tables["paper"]
    worst = max(published, key=lambda c: abs(paper[c] - published[c]))
    difference = abs(paper[worst] - published[worst])
    rounded = sum(abs(paper[c] - published[c]) <= 0.0005 + 1e-9 for c in published)
    b, k, kv = worst
    lines += ["", (f"paper vs published, all {len(published)} cells the paper gives (KV 16 to 65,536 by powers "
                   "of 2, where it prints one value per batch and k, and KV 4,194,304): largest difference "
                   f"{difference:.4f} ({100 * difference / published[worst]:.2f}%) at batch {b}, k = {k}, KV "
                   f"{kv:,}; {rounded} of {len(published)} cells agree to the published 3 decimals.")]
    return "\n".join(lines)


def _percent(change: float) -> str:
    """A relative change in percent: 2 decimals, 2 significant digits below 0.01%, 0 below rounding noise."""
    if abs(change) >= 1e-4:
        return f"{100 * change:+.2f}%"
    return f"{100 * change:+.1e}%" if abs(change) >= 1e-9 else "0%"


def differences_markdown(differences: dict[str, list[dict[str, Any]]]) -> str:
    """The two tables of `paper_differences` and the notes on the quirks."""
    head = " | ".join(f"b{b} k{k} KV {kv:,}" for b, k, kv in DIFFERENCE_CELLS)

    def values(entry: dict) -> str:
        return " | ".join(f"{c['slowdown']:.3f}" for c in entry["cells"])

    published = differences["paper_to_ours"][0]
    lines = ["Quirks of the published configuration, each corrected alone (the rest as published):", "",
             f"| quirk corrected | change over all cells | {head} |", "|---|---|" + "---|" * len(DIFFERENCE_CELLS),
             f"| none (as published) | | {values(published)} |"]
    for q in differences["quirks_alone"]:
        lines.append(f"| {q['quirk']} | {_percent(q['min_change'])} .. {_percent(q['max_change'])} "
                     f"| {values(q)} |")
    lines += [""] + [f"- {q['quirk']}: {q['note']}" for q in differences["quirks_alone"]]
    lines += ["", ("From the paper's configuration to ours, one difference at a time (each row keeps the "
                   "changes above it; the last row is ours):"), "", f"| change | {head} |",
              "|---|" + "---|" * len(DIFFERENCE_CELLS)]
    lines += [f"| {step['change']} | {values(step)} |" for step in differences["paper_to_ours"]]
    return "\n".join(lines + ["", LM_HEAD_NOTE])


def print_paper_comparison() -> dict[str, Any]:
    """`sbd roofline --paper`: Table 3 published / paper configuration / ours, and the differences."""
    model, hardware, precision = OURS
    hw = HARDWARE[hardware]
    print("Table 3 of the paper (arXiv 2509.04185): time(k)/time(1), one forward of a block of k tokens over one "
          "NTP forward\n"
          "  published: the paper's table (one value per batch and k for KV 16..65,536, one at KV 4,194,304)\n"
          "  paper: its roofline as published (Fig. 6 constants, Fig. 11 code), quirks included: "
          + ", ".join(PAPER_QUIRKS) + "\n"
          f"  ours: {model}, {precision} weights (FP8 GEMMs), bf16 activations and KV cache, LM head on the rows "
          f"whose logits are read, SBD attention pattern, {hw.name} ({hw.bandwidth:.3g} B/s)\n"
          "  a..b: the value at KV 16..at KV 65,536\n")
    rows = paper_table3()
    print(table3_markdown(rows))
    differences = paper_differences()
    print("\n" + differences_markdown(differences))
    return {"table3": rows, **differences}


# ----------------------------------------------------------------------------------------------------
# The GPU projection
# ----------------------------------------------------------------------------------------------------
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
    """Seconds of the three pass widths of one (config, dtype, batch, cache length, k): the medians of the
    timed calls, and on a GPU the CUDA-graph times (`graph_seconds`, GPU time alone) where they were taken."""

    label: str
    config: dict
    dtype: str
    batch: int
    kv_len: int
    k: int
    ceilings: dict | None
    device: str = "cpu"
    medians: dict[int, float] = field(default_factory=dict)
    graph_seconds: dict[int, float] = field(default_factory=dict)

    @property
    def timing(self) -> str:
        """"graph" when all three widths have a CUDA-graph time (a roofline predicts GPU time, not the launch
        overhead of an eager forward), else "median"."""
        return "graph" if {1, self.k, 2 * self.k} <= set(self.graph_seconds) else "median"

    @property
    def seconds(self) -> dict[int, float]:
        return self.graph_seconds if self.timing == "graph" else self.medians


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
            shape.get("ceilings"), info.get("device", "cpu")))
        case.medians[shape["tokens"]] = bench["stats"]["median"]
        if info.get("graph_ms"):
            case.graph_seconds[shape["tokens"]] = info["graph_ms"] / 1e3
    return [c for c in cases.values() if {1, c.k, 2 * c.k} <= set(c.medians)]


def case_ceilings(case: MeasuredCase, fallback: dict | None = None) -> dict:
    """The ceilings a measured case is set against: those stored with it, else `fallback`; ValueError naming
    the case when there are neither (a GPU without a datasheet entry, `bench_report.datasheet_key`): never the
    ceilings of the CPU this runs on."""
    found = case.ceilings or fallback
    if found is None:
        why = ("its GPU has no datasheet ceilings (no sbd_kernels.roofline.HARDWARE entry)" if case.device != "cpu"
               else "the run stored no ceilings with it")
        raise ValueError(f"case {case.label} ran on {case.device}, and {why}: there is nothing to set its timings "
                         "against")
    return found


def compare_rows(cases: list[MeasuredCase], ceilings: dict | None = None) -> list[dict[str, Any]]:
    """Measured vs predicted time(k)/time(1) and time(2k)/time(1), from each case's `seconds` (CUDA-graph
    times on a GPU where all three were taken, else medians). The ceilings stored with each case (on the CPU
    measured during the benchmark run at its thread count, on a GPU its datasheet) are used; `ceilings` is
    the fallback; a case with neither is a ValueError (`case_ceilings`).

    Two predictions: the roofline alone, and the roofline plus a fixed cost per forward that it cannot see
    (Python, op dispatch, norms and RoPE, thread start-up), taken as the measured time(1) minus the
    roofline's: fixed = max(time(1) - roofline(1), 0), prediction (roofline(t) + fixed) / time(1).
    """
    rows = []
    for c in cases:
        hw = ceilings_hardware(case_ceilings(c, ceilings))
        cfg, prec = ModelConfig(**c.config), PRECISIONS[c.dtype]
        times = block_times(cfg, hw, prec, c.batch, c.k, c.kv_len)
        t1, tk, t2k = c.seconds[1], c.seconds[c.k], c.seconds[2 * c.k]
        fixed = max(t1 - times.t1, 0.0)
        rows.append({"case": c.label, "device": c.device, "timing": c.timing, "t1_ms": t1 * 1e3,
                     "pred_t1_ms": times.t1 * 1e3,
                     "fixed_ms": fixed * 1e3,
                     "slowdown_k": tk / t1, "pred_slowdown_k": times.slowdown_k,
                     "pred_fixed_slowdown_k": (times.tk + fixed) / t1,
                     "slowdown_2k": t2k / t1, "pred_slowdown_2k": times.slowdown_2k,
                     "pred_fixed_slowdown_2k": (times.t2k + fixed) / t1})
    return rows


def _median_error(rows: list[dict[str, Any]], measured: str, predicted: str) -> float:
    return statistics.median(abs(r[measured] / r[predicted] - 1) for r in rows)


# What the measured times of `compare_rows` are, by (device, timing).
MEASUREMENT_LABELS = {
    ("cpu", "median"): ("on the CPU of the run: medians of the timed forwards, against the CPU's ceilings "
                        "measured in the same run at the thread count of the timings"),
    ("cuda", "graph"): ("on the GPU of the run: the forwards replayed from CUDA graphs (GPU time alone, without "
                        "launch overhead), against the GPU's datasheet ceilings"),
    ("cuda", "median"): ("on the GPU of the run: medians of eager forwards (launch overhead included; no CUDA-"
                         "graph time for every width), against the GPU's datasheet ceilings"),
}


def compare_markdown(rows: list[dict[str, Any]]) -> str:
    """Table of `compare_rows`: measured / roofline / roofline + fixed cost, and the median errors; what
    was measured is said per device and timing (MEASUREMENT_LABELS), rows marked where a table mixes them."""
    kinds = sorted({(r["device"], r["timing"]) for r in rows})
    marks = {kind: "" if len(kinds) == 1 else f" ({index + 1})" for index, kind in enumerate(kinds)}
    measured = "; ".join(f"{marks[kind].strip()} {MEASUREMENT_LABELS[kind]}".strip() for kind in kinds)
    lines = [(f"Roofline prediction vs measurement {measured}. time(t) = one forward with t query tokens per "
              "sequence; ratios as measured / roofline / roofline + the fixed cost per forward (measured "
              "time(1) - roofline time(1))."), "",
             ("| case | time(1) ms measured / roofline | time(k)/time(1) | time(2k)/time(1) |"),
             "|---|---|---|---|"]
    for r in rows:
        ratios = [" / ".join(f"{r[key]:.2f}" for key in (f"slowdown_{w}", f"pred_slowdown_{w}",
                                                          f"pred_fixed_slowdown_{w}")) for w in ("k", "2k")]
        t1 = f"{r['t1_ms']:.2f} / {r['pred_t1_ms']:.2f}"
        lines.append(f"| {r['case']}{marks[r['device'], r['timing']]} | {t1} | {ratios[0]} | {ratios[1]} |")
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
# --project's fixed setting: both 8B presets at the paper's block size, the demo's too (demo.BLOCK_SIZE).
PROJECT_MODELS = ("llama3.1-8b", "qwen3-8b")
PROJECT_K = 16


# The model-table flags (dest -> flag) and their defaults. They default to None in the parser, and `main` fills
# these in, so that a mode that does not read a flag can refuse it when given.
MODEL_FLAGS = {"model": "--model", "hardware": "--hardware", "precision": "--precision", "batch": "--batch",
               "k": "--k", "kv_len": "--kv-len", "passes": "--passes"}
FLAG_DEFAULTS = {"model": PROJECT_MODELS[0], "hardware": "h100", "precision": "bf16", "batch": [1, 4, 8, 16],
                 "k": PROJECT_K, "kv_len": 4096}
# The model-table flags --project reads; --paper and --measured read none of them.
PROJECT_FLAGS = ("hardware", "precision", "batch", "kv_len")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None, choices=list(PRESETS),
                        help=f"ModelConfig preset (default {FLAG_DEFAULTS['model']})")
    parser.add_argument("--hardware", default=None, choices=[*HARDWARE, "cpu"],
                        help=f"datasheet GPU, or this CPU from measured ceilings (default {FLAG_DEFAULTS['hardware']})")
    parser.add_argument("--precision", default=None, choices=list(PRECISIONS),
                        help=f"weights, activations and KV cache (default {FLAG_DEFAULTS['precision']})")
    parser.add_argument("--batch", default=None, type=argtypes.positive_int_list,
                        help="comma-separated batch sizes (default 1,4,8,16)")
    parser.add_argument("--k", default=None, type=argtypes.positive_int, help=f"block size (default {PROJECT_K})")
    add_option(parser, "--kv-len", default=None, type=argtypes.non_negative_int,
               help=f"tokens already in the KV cache (default {FLAG_DEFAULTS['kv_len']})")
    parser.add_argument("--passes", type=_passes, default=None,
                        help="mean passes per block l (1 <= l <= k): also print the wall-clock speedup")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--paper", action="store_true",
                      help="the paper's Table 3, time(k)/time(1): published, its roofline as published "
                      "(quirks named), ours, and what each difference changes, at the paper's batch, block and KV sizes")
    mode.add_argument("--project", action="store_true",
                      help="GPU projection table (Llama-3.1-8B, Qwen3-8B at k = 16 on a datasheet --hardware, "
                      "batch 1/4/8/16)")
    mode.add_argument("--measured", type=argtypes.existing_file,
                      help="pytest-benchmark JSON with bench_decode results: prediction vs measurement")
    add_option(parser, "--demo-json", type=argtypes.existing_file,
               help="`sbd demo --json` output: measured NFE statistics (with --project)")
    parser.add_argument("--json", type=argtypes.output_file, help="write the result as JSON to this path")
    return parser


def _passes(text: str) -> float:
    return argtypes.checked_number(text, float, lambda x: 1 <= x < float("inf"), "a finite number >= 1")


def read_json(path: str | Path) -> Any:
    """The JSON in the file at `path`; ValueError naming the file when it is not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not JSON ({err})") from None


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


def _check_mode_flags(args: argparse.Namespace) -> None:
    """UsageError for a model-table flag the chosen mode would ignore: --paper and --measured read none of them
    (the paper's setting is fixed; each measured case carries its own), --project reads PROJECT_FLAGS and
    projects for a datasheet GPU only."""
    paper = (f"it compares the paper's Table 3 in the paper's own setting (its batches, block sizes and KV "
             f"lengths; ours as {OURS[0]}, {OURS[2]} weights on the {OURS[1]} datasheet)")
    measured = "each decode case of the JSON carries its model, dtype, batch, cache length, block size and ceilings"
    project = (f"it projects {' and '.join(PROJECT_MODELS)} at k = {PROJECT_K}, passes per block from each NFE "
               "statistic")
    readers = {"--paper": (args.paper, (), paper), "--measured": (args.measured, (), measured),
               "--project": (args.project, PROJECT_FLAGS, project)}
    for mode, (chosen, reads, why) in readers.items():
        if not chosen:
            continue
        ignored = [flag for dest, flag in MODEL_FLAGS.items() if dest not in reads and getattr(args, dest) is not None]
        if ignored:
            raise UsageError(f"{mode} does not take {', '.join(ignored)}: {why} (drop {' '.join(ignored)})")
    if args.project and args.hardware is not None and args.hardware not in HARDWARE:
        raise UsageError(f"--project projects for a datasheet GPU (--hardware {', '.join(HARDWARE)}), "
                         f"not --hardware {args.hardware}")


def _project(args: argparse.Namespace) -> dict[str, Any]:
    models = PROJECT_MODELS
    measured = []
    if args.demo_json:
        try:
            measured = nfe_stats_from_demo(read_json(args.demo_json), PROJECT_K)
        except (KeyError, TypeError, AttributeError, StopIteration, ZeroDivisionError) as err:
            raise ValueError(f"{args.demo_json}: not the output of `sbd demo --json` ({type(err).__name__}: "
                             f"{err})") from None
    stats = {m: [*measured, *PAPER_NFE[m]] for m in models}
    rows = projection_rows(models, args.hardware, args.precision, args.batch, args.kv_len, stats)
    print(projection_markdown(rows, args.hardware, args.precision, args.kv_len))
    return {"projection": rows}


def _compare(path: str) -> dict[str, Any]:
    try:
        cases = measured_cases(read_json(path))
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path}: not a pytest-benchmark JSON ({type(err).__name__}: {err})") from None
    try:
        rows = compare_rows(cases)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    if not rows:
        raise ValueError(f"{path}: no complete decode cases (t = 1, k, 2k)")
    print(compare_markdown(rows))
    return {"comparison": rows}


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Runs one mode and returns what it printed as data (also written to --json)."""
    _check_mode_flags(args)
    for dest, default in FLAG_DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    if args.passes is not None and args.passes > args.k:
        raise UsageError(f"--passes ({args.passes}) must be <= --k ({args.k}): a pass reveals at least one token")
    if args.demo_json and not args.project:
        raise UsageError("--demo-json feeds --project; pass --project too")
    if args.paper:
        result: dict[str, Any] = print_paper_comparison()
    elif args.project:
        result = _project(args)
    elif args.measured:
        result = _compare(args.measured)
    else:
        result = _model_table(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    from sbd_kernels import cli

    cli.main(["roofline", *sys.argv[1:]])
