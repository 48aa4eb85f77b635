"""Benchmark of sbd.block_attention_with_kvcache: the C++ op against SDPA, FlexAttention and the oracle.

    python -m pytest bench/bench_attention.py -q         # or: python -m bench.report --only attention
    SBD_BENCH_QUICK=1 python -m pytest bench/bench_attention.py -q  # fp32 and bf16 at B = 1 only

One SBD decode pass of a Llama-3-8B-like layer (Hq = 32, Hkv = 8, D = 128) with C = 16 causal rows (the
previous block, appended to the cache) and a K = 16 block, over a cache of L tokens. Providers on the same
inputs: `sbd` (torch.ops.sbd.block_attention_with_kvcache on CPU), `sdpa` (what a user writes today: copy
the causal K/V into the cache, concatenate cache and block K/V, scaled_dot_product_attention with
enable_gqa and a boolean SBD mask built once outside the timing), `flex` (FlexAttention compiled, same
concatenation, the mask as a mask_mod with a block mask built outside the timing), `naive` (the oracle)
and, where CUDA is present, `triton`. Ratios are against `sdpa`.

GFLOP/s = flops / time, flops = 4 Hq D x (number of (row, key) pairs the mask allows): 2 for q.k and 2 for
p.v per pair, useful work only. The report sets it against this machine's measured matmul peak (fp32;
bf16; fp16 against fp32). bytes_moved = cache K/V read once + q, k, v read + out written + the appended
rows written.
"""
from __future__ import annotations

import os
from functools import cache

import pytest
import torch
import torch.nn.functional as F

from bench.common import DTYPES_BY_NAME, bench_rounds, quick_grid, record, run_timed
from sbd_kernels.ops.attention import naive
from sbd_kernels.testing import TOLERANCES

FAMILY = "attention"
PROVIDERS = ["sbd", "sdpa", "flex", "naive", "triton"]
Q_HEADS, KV_HEADS, HEAD_DIM, CAUSAL, BLOCK = 32, 8, 128, 16, 16
LENGTHS = [512, 4096, 16384]
if quick_grid():
    DTYPES, BATCHES = ["fp32", "bf16"], [1]
else:
    DTYPES, BATCHES = ["fp32", "bf16", "fp16"], [1, 4]
# Timed rounds by cache length (after 3 warm-up calls), so that the whole file stays near 2 minutes on
# this loaded 2-core machine: one SDPA call takes ~70 ms at L = 512 and ~1.2 s at L = 16384 here.
# SBD_BENCH_ROUNDS, when set, overrides them.
ROUNDS_BY_LENGTH = {512: 10, 4096: 5, 16384: 3}
# The oracle expands K/V to every query head and builds the dense mask (0.6 s per call at L = 512, 4 s at
# L = 16384 here): timed at the shortest length only, and run once per case for the correctness gate.
NAIVE_LENGTHS = (512,)
CACHE_SLACK = 64  # free slots after L + C, as a serving engine would have


def make_inputs(batch: int, length: int, dtype: torch.dtype, device: str = "cpu") -> dict:
    """Random q, k, v and a contiguous cache holding `length` tokens per sequence (all sequences full)."""
    gen = torch.Generator().manual_seed(length + batch)
    seq = CAUSAL + BLOCK

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)
    capacity = length + CAUSAL + CACHE_SLACK
    return {
        "q": randn(batch, seq, Q_HEADS, HEAD_DIM),
        "k": randn(batch, seq, KV_HEADS, HEAD_DIM),
        "v": randn(batch, seq, KV_HEADS, HEAD_DIM),
        "k_cache": randn(batch, capacity, KV_HEADS, HEAD_DIM),
        "v_cache": randn(batch, capacity, KV_HEADS, HEAD_DIM),
        "cache_seqlens": torch.full((batch,), length, dtype=torch.int32, device=device),
        "num_causal": torch.full((batch,), CAUSAL, dtype=torch.int32, device=device),
    }


def sbd_mask(length: int, device: str = "cpu") -> torch.Tensor:
    """[S, L + S] bool over [cache ; causal rows ; block]: causal row i sees the cache and causal rows
    0..i, block rows see everything."""
    seq = CAUSAL + BLOCK
    row = torch.arange(seq, device=device)[:, None]
    col = torch.arange(length + seq, device=device)[None, :]
    return (col < length) | (row >= CAUSAL) | (col - length <= row)


def append_and_concat(x: dict, length: int):
    """The cache append and the [B, Hkv, L + S, D] keys / values a user builds for SDPA or FlexAttention."""
    x["k_cache"][:, length:length + CAUSAL] = x["k"][:, :CAUSAL]
    x["v_cache"][:, length:length + CAUSAL] = x["v"][:, :CAUSAL]
    keys = torch.cat([x["k_cache"][:, :length + CAUSAL], x["k"][:, CAUSAL:]], dim=1).transpose(1, 2)
    values = torch.cat([x["v_cache"][:, :length + CAUSAL], x["v"][:, CAUSAL:]], dim=1).transpose(1, 2)
    return keys, values


def sdpa_provider(length: int, device: str):
    mask = sbd_mask(length, device)

    def run(x):
        keys, values = append_and_concat(x, length)
        out = F.scaled_dot_product_attention(x["q"].transpose(1, 2), keys, values, attn_mask=mask,
                                             enable_gqa=True)
        return out.transpose(1, 2)
    return run


_FLEX = {}


def flex_provider(length: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=True)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < length) | (q_idx >= CAUSAL) | (kv_idx - length <= q_idx)
    seq = CAUSAL + BLOCK
    block_mask = create_block_mask(mask_mod, None, None, seq, length + seq, device=device)

    def run(x):
        keys, values = append_and_concat(x, length)
        out = _FLEX["fn"](x["q"].transpose(1, 2), keys, values, block_mask=block_mask, enable_gqa=True)
        return out.transpose(1, 2)
    return run


def op_args(x: dict) -> tuple:
    return (x["q"], x["k"], x["v"], x["k_cache"], x["v_cache"], x["cache_seqlens"], x["num_causal"], BLOCK)


def provider_fn(provider: str, length: int):
    """(function of the input dict returning out [B, S, Hq, D], device) of one provider."""
    if provider == "sbd":
        return lambda x: torch.ops.sbd.block_attention_with_kvcache(*op_args(x))[0], "cpu"
    if provider == "naive":
        return lambda x: naive.block_attention_with_kvcache(*op_args(x))[0], "cpu"
    if provider == "sdpa":
        return sdpa_provider(length, "cpu"), "cpu"
    if provider == "flex":
        return flex_provider(length, "cpu"), "cpu"
    from sbd_kernels.ops.attention import triton as attention_triton
    return lambda x: attention_triton.block_attention_with_kvcache(*op_args(x))[0], "cuda"


@cache
def oracle_output(batch: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """The oracle's out on the inputs of this case (make_inputs is deterministic), computed once."""
    expected, _ = naive.block_attention_with_kvcache(*op_args(make_inputs(batch, length, dtype)))
    return expected


def matches_oracle(out: torch.Tensor, batch: int, length: int) -> bool:
    """Whether `out` equals the oracle's output on the same inputs under the tolerance table (no padding
    rows here: every row is compared)."""
    expected = oracle_output(batch, length, out.dtype)
    atol, rtol = TOLERANCES[out.dtype]
    return bool(torch.allclose(out.float().cpu(), expected.float(), atol=atol, rtol=rtol))


def visible_pairs(batch: int, length: int) -> int:
    """(row, key) pairs the SBD mask allows: causal row i sees L + i + 1 keys, block rows L + C + K."""
    causal = sum(length + i + 1 for i in range(CAUSAL))
    return batch * (causal + BLOCK * (length + CAUSAL + BLOCK))


def bytes_moved(batch: int, length: int, dtype: torch.dtype) -> int:
    size = torch.tensor([], dtype=dtype).element_size()
    seq = CAUSAL + BLOCK
    cache_read = 2 * batch * length * KV_HEADS * HEAD_DIM
    qkv_read = batch * seq * (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    out_written = batch * seq * Q_HEADS * HEAD_DIM
    appended = 2 * batch * CAUSAL * KV_HEADS * HEAD_DIM
    return size * (cache_read + qkv_read + out_written + appended)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("batch", BATCHES)
def test_block_attention(benchmark, batch, length, dtype_name, provider):
    if provider == "triton" and not torch.cuda.is_available():
        pytest.skip("triton provider: no CUDA device on this machine (the CPU set runs instead)")
    if provider == "naive" and length not in NAIVE_LENGTHS:
        pytest.skip(f"naive provider: timed only at L in {NAIVE_LENGTHS} (seconds per call)")
    dtype = DTYPES_BY_NAME[dtype_name]
    try:
        fn, device = provider_fn(provider, length)
        x = make_inputs(batch, length, dtype, device)
        correct = matches_oracle(fn(x), batch, length) if provider != "naive" else None
    except Exception as err:  # FlexAttention not compiling on this machine is a result, not a crash
        if provider != "flex":
            raise
        pytest.skip(f"flex provider: compiled FlexAttention failed: {type(err).__name__}: {err}"[:300])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def call():
        out = fn(x)
        sync()
        return out

    record(benchmark, family=FAMILY,
           case=f"B={batch} Hq={Q_HEADS} Hkv={KV_HEADS} D={HEAD_DIM} C={CAUSAL} K={BLOCK} L={length} {dtype_name}",
           provider=provider, baseline="sdpa", bytes_moved=bytes_moved(batch, length, dtype),
           flops=4 * Q_HEADS * HEAD_DIM * visible_pairs(batch, length), correct=correct)
    rounds = bench_rounds() if "SBD_BENCH_ROUNDS" in os.environ else ROUNDS_BY_LENGTH[length]
    run_timed(benchmark, call, rounds=rounds)
