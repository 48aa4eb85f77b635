"""`sbd.block_attention_with_kvcache`: one attention launch per SBD decode pass.

Public wrapper, fake (meta) kernel for `torch.compile`, and the CUDA registration of the Triton kernel.
The CPU kernel is C++ (csrc/cpu/attention.cpp); the oracle is `naive.py`.
"""
from __future__ import annotations

import torch

from sbd_kernels.ops._cuda import register_triton_kernel
from sbd_kernels.ops.attention._checks import check_block_attention_args


def block_attention_with_kvcache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor, num_causal: torch.Tensor, block_size: int,
    block_table: torch.Tensor | None = None, softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one SBD pass over a KV cache: causal rows (appended to the cache) + a bidirectional block.

    Each sequence b has S = C + K query rows: rows [0, c_b) are causal tokens, rows [c_b, C) padding,
    rows [C, S) the block (K = block_size). With L_b = cache_seqlens[b], c_b = num_causal[b]:

        causal row i : keys = cache[0, L_b) + causal rows 0..i
        block row    : keys = cache[0, L_b) + causal rows 0..c_b-1 + all K block rows
        padding row  : no keys: out = 0, lse = -inf
        lse_i = log sum_j exp(s q_i . k_j),  out_i = sum_j exp(s q_i . k_j - lse_i) v_j,  s = softmax_scale

    Query head h reads KV head h // (Hq / Hkv). Side effect: K/V of the causal rows are written to cache
    slots [L_b, L_b + c_b); block and padding K/V are never written. RoPE is the caller's: causal token i
    sits at position L_b + i, block token j at L_b + c_b + j.

    Args:
        q: [B, S, Hq, D] fp32 / fp16 / bf16, D <= 256.
        k, v: [B, S, Hkv, D], dtype of q; Hq % Hkv == 0.
        k_cache, v_cache: contiguous [B, S_max, Hkv, D] or paged [num_pages, page_size, Hkv, D], dtype of
            q, last dimension contiguous; updated in place.
        cache_seqlens: [B] int32, L_b >= 0 (not mutated).
        num_causal: [B] int32, 0 <= c_b <= C.
        block_size: K >= 0 (0: a prefill-only call, S = C).
        block_table: optional [B, max_pages] int32 page ids (paged cache; any page size).
        softmax_scale: finite and > 0; default D ** -0.5.

    Returns:
        out [B, S, Hq, D] (dtype of q) and lse [B, Hq, S] fp32 (natural log).

    Errors: RuntimeError naming the argument for bad shapes / dtypes / devices, a softmax_scale that is
    NaN, infinite or <= 0, L_b + c_b beyond the cache capacity, num_causal outside [0, C] or page ids out
    of range.

    Example:
        >>> import torch, sbd_kernels
        >>> B, C, K, Hq, Hkv, D = 1, 2, 4, 4, 2, 64
        >>> q = torch.randn(B, C + K, Hq, D); k = torch.randn(B, C + K, Hkv, D); v = torch.randn_like(k)
        >>> k_cache = torch.zeros(B, 32, Hkv, D); v_cache = torch.zeros_like(k_cache)
        >>> lens = torch.tensor([10], dtype=torch.int32); nc = torch.tensor([2], dtype=torch.int32)
        >>> out, lse = sbd_kernels.block_attention_with_kvcache(q, k, v, k_cache, v_cache, lens, nc, K)
        >>> out.shape, lse.shape, bool(torch.equal(k_cache[0, 10:12], k[0, :2]))
        (torch.Size([1, 6, 4, 64]), torch.Size([1, 4, 6]), True)
    """
    return torch.ops.sbd.block_attention_with_kvcache(
        q, k, v, k_cache, v_cache, cache_seqlens, num_causal, block_size, block_table, softmax_scale)


@torch.library.register_fake("sbd::block_attention_with_kvcache")
def _block_attention_with_kvcache_fake(q, k, v, k_cache, v_cache, cache_seqlens, num_causal, block_size,
                                       block_table=None, softmax_scale=None):
    dims = check_block_attention_args(q, k, v, k_cache, v_cache, cache_seqlens, num_causal, block_size,
                                      block_table, softmax_scale)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((dims.batch, dims.q_heads, dims.seq), dtype=torch.float32)
    return out, lse


register_triton_kernel("block_attention_with_kvcache", "attention")
