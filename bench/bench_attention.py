"""Benchmark of sbd.block_attention_with_kvcache: the op against SDPA, FlexAttention and the oracle.

    python -m pytest bench/bench_attention.py -q         # or: sbd bench --only attention
    SBD_BENCH_QUICK=1 python -m pytest bench/bench_attention.py -q  # fp32 and bf16 at B = 1 only

One SBD decode pass of a Llama-3-8B-like layer (Hq = 32, Hkv = 8, D = 128) with C = 16 causal rows (the
previous block, appended to the cache) and a K = 16 block, over a cache of L tokens. Providers on the same
inputs, all on `bench_device()` (the CPU, or the GPU where there is one): `sbd`
(torch.ops.sbd.block_attention_with_kvcache: the C++ kernel on CPU tensors, the Triton kernel on CUDA ones),
`sdpa` (what a user writes today: copy the causal K/V into the cache, concatenate cache and block K/V,
scaled_dot_product_attention with enable_gqa and a boolean SBD mask built once outside the timing), `flex`
(FlexAttention compiled, same concatenation, the mask as a mask_mod with a block mask built outside the
timing) and `naive` (the oracle). Ratios are against `sdpa`.

GFLOP/s = flops / time, flops = 4 Hq D x (number of (row, key) pairs the mask allows): 2 for q.k and 2 for
p.v per pair, useful work only. The report sets it against this machine's measured matmul peak (fp32;
bf16; fp16 against fp32), on CUDA against the GPU's datasheet. bytes_moved = cache K/V read once + q, k, v
read + out written + the appended rows written.
"""
from __future__ import annotations

from functools import cache

import pytest
import torch
import torch.nn.functional as F

from bench.harness import bench_device, build_provider, compiled, measure, parametrize_shapes
from sbd_kernels.benchmark_grid import TORCH_DTYPES, AttentionShape
from sbd_kernels.ops.attention import naive
from sbd_kernels.testing import TOLERANCES

FAMILY = "attention"
PROVIDERS = ["sbd", "sdpa", "flex", "naive"]
DEVICE = bench_device()
# Timed rounds on the CPU by cache length (after 3 warm-up calls), so that the whole file stays near 2
# minutes on this loaded 2-core machine: one SDPA call takes ~70 ms at L = 512 and ~1.2 s at L = 16384
# here. SBD_BENCH_ROUNDS, when set, overrides them (on CUDA the harness's CUDA_ROUNDS apply).
ROUNDS_BY_LENGTH = {512: 10, 4096: 5, 16384: 3}
# The oracle expands K/V to every query head and builds the dense mask (0.6 s per call at L = 512, 4 s at
# L = 16384 here): timed at the shortest length only, and run once per case for the correctness gate.
NAIVE_LENGTHS = (512,)
CACHE_SLACK = 64  # free slots after L + C, as a serving engine would have


def make_inputs(shape: AttentionShape, device: str = "cpu") -> dict:
    """Random q, k, v and a contiguous cache holding `length` tokens per sequence (all sequences full)."""
    batch, length, dtype = shape.batch, shape.length, TORCH_DTYPES[shape.dtype]
    gen = torch.Generator().manual_seed(length + batch)

    def randn(*dims):
        return torch.randn(*dims, generator=gen).to(dtype).to(device)
    capacity = length + shape.causal + CACHE_SLACK
    return {
        "q": randn(batch, shape.seq, shape.q_heads, shape.head_dim),
        "k": randn(batch, shape.seq, shape.kv_heads, shape.head_dim),
        "v": randn(batch, shape.seq, shape.kv_heads, shape.head_dim),
        "k_cache": randn(batch, capacity, shape.kv_heads, shape.head_dim),
        "v_cache": randn(batch, capacity, shape.kv_heads, shape.head_dim),
        "cache_seqlens": torch.full((batch,), length, dtype=torch.int32, device=device),
        "num_causal": torch.full((batch,), shape.causal, dtype=torch.int32, device=device),
    }


def sbd_mask(shape: AttentionShape, device: str = "cpu") -> torch.Tensor:
    """[S, L + S] bool over [cache ; causal rows ; block]: causal row i sees the cache and causal rows
    0..i, block rows see everything."""
    row = torch.arange(shape.seq, device=device)[:, None]
    col = torch.arange(shape.length + shape.seq, device=device)[None, :]
    return (col < shape.length) | (row >= shape.causal) | (col - shape.length <= row)


def append_and_concat(x: dict, shape: AttentionShape):
    """The cache append and the [B, Hkv, L + S, D] keys / values a user builds for SDPA or FlexAttention."""
    length, causal = shape.length, shape.causal
    x["k_cache"][:, length:length + causal] = x["k"][:, :causal]
    x["v_cache"][:, length:length + causal] = x["v"][:, :causal]
    keys = torch.cat([x["k_cache"][:, :length + causal], x["k"][:, causal:]], dim=1).transpose(1, 2)
    values = torch.cat([x["v_cache"][:, :length + causal], x["v"][:, causal:]], dim=1).transpose(1, 2)
    return keys, values


def sdpa_provider(shape: AttentionShape, device: str):
    mask = sbd_mask(shape, device)

    def run(x):
        keys, values = append_and_concat(x, shape)
        out = F.scaled_dot_product_attention(x["q"].transpose(1, 2), keys, values, attn_mask=mask,
                                             enable_gqa=True)
        return out.transpose(1, 2)
    return run


def flex_provider(shape: AttentionShape, device: str):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = compiled(flex_attention)
    length, causal = shape.length, shape.causal

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < length) | (q_idx >= causal) | (kv_idx - length <= q_idx)
    block_mask = create_block_mask(mask_mod, None, None, shape.seq, length + shape.seq, device=device)

    def run(x):
        keys, values = append_and_concat(x, shape)
        out = flex(x["q"].transpose(1, 2), keys, values, block_mask=block_mask, enable_gqa=True)
        return out.transpose(1, 2)
    return run


def op_args(x: dict, shape: AttentionShape) -> tuple:
    return (x["q"], x["k"], x["v"], x["k_cache"], x["v_cache"], x["cache_seqlens"], x["num_causal"], shape.block)


def provider_fn(provider: str, shape: AttentionShape, device: str):
    """The function of the input dict returning out [B, S, Hq, D] of one provider, on `device`."""
    if provider == "sbd":
        return lambda x: torch.ops.sbd.block_attention_with_kvcache(*op_args(x, shape))[0]
    if provider == "naive":
        return lambda x: naive.block_attention_with_kvcache(*op_args(x, shape))[0]
    if provider == "sdpa":
        return sdpa_provider(shape, device)
    return flex_provider(shape, device)


@cache
def oracle_output(shape: AttentionShape, device: str) -> torch.Tensor:
    """The oracle's out on the inputs of this case (make_inputs is deterministic), computed once on `device`
    (seconds per case on the CPU, milliseconds on a GPU) and kept on the CPU."""
    expected, _ = naive.block_attention_with_kvcache(*op_args(make_inputs(shape, device), shape))
    return expected.cpu()


def matches_oracle(out: torch.Tensor, shape: AttentionShape, device: str) -> bool:
    """Whether `out` equals the oracle's output on the same inputs under the tolerance table (no padding
    rows here: every row is compared)."""
    expected = oracle_output(shape, device)
    atol, rtol = TOLERANCES[out.dtype]
    return bool(torch.allclose(out.float().cpu(), expected.float(), atol=atol, rtol=rtol))


def visible_pairs(shape: AttentionShape) -> int:
    """(row, key) pairs the SBD mask allows: causal row i sees L + i + 1 keys, block rows L + C + K."""
    causal = sum(shape.length + i + 1 for i in range(shape.causal))
    return shape.batch * (causal + shape.block * (shape.length + shape.seq))


def bytes_moved(shape: AttentionShape) -> int:
    size = TORCH_DTYPES[shape.dtype].itemsize
    heads_dim = shape.kv_heads * shape.head_dim
    cache_read = 2 * shape.batch * shape.length * heads_dim
    qkv_read = shape.batch * shape.seq * (shape.q_heads + 2 * shape.kv_heads) * shape.head_dim
    out_written = shape.batch * shape.seq * shape.q_heads * shape.head_dim
    appended = 2 * shape.batch * shape.causal * heads_dim
    return size * (cache_read + qkv_read + out_written + appended)


def set_up(provider: str, shape: AttentionShape):
    """(function, inputs, oracle check) of one provider on DEVICE."""
    fn = provider_fn(provider, shape, DEVICE)
    x = make_inputs(shape, DEVICE)
    return fn, x, matches_oracle(fn(x), shape, DEVICE) if provider != "naive" else None


# Providers whose failure on a machine (FlexAttention's) is a skip with the reason, not a failed run.
OPTIONAL = ("flex",)


@pytest.mark.parametrize("provider", PROVIDERS)
@parametrize_shapes(FAMILY)
def test_block_attention(benchmark, shape, provider):
    if provider == "naive" and shape.length not in NAIVE_LENGTHS:
        pytest.skip(f"naive provider: timed only at L in {NAIVE_LENGTHS} (seconds per call)")
    fn, x, correct = build_provider(provider, lambda: set_up(provider, shape), optional=OPTIONAL)
    measure(benchmark, lambda: fn(x), family=FAMILY, shape=shape, provider=provider, baseline="sdpa",
            device=DEVICE, bytes_moved=bytes_moved(shape),
            flops=4 * shape.q_heads * shape.head_dim * visible_pairs(shape), correct=correct,
            rounds=ROUNDS_BY_LENGTH[shape.length], graph=provider != "naive", optional=OPTIONAL)
