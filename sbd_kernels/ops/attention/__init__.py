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

    Non-finite scores (s q_i . k_j in fp32: a NaN or inf in q, k or a cache slot in use, or s q . k
    overflowing): a NaN or +inf score among row i's keys makes out_i and lse_i NaN; a -inf score weighs
    exp(-inf) = 0, and a row whose every score is -inf is read as having no keys: out = 0, lse = -inf.

    Precision of fp32 inputs: the C++ CPU kernel, and the Triton kernel at D > 128, multiply in fp32. The
    Triton kernel at D <= 128 multiplies on tensor cores as 3xTF32 (each operand split into a TF32 high part,
    rounded to nearest with ties away, and the fp32 remainder), which keeps fp32 accuracy for elements of q,
    k and v (new rows and the cache slots in use) below 2^128 - 2^116 = 3.4019929e+38 in magnitude. An
    element from there up to FLT_MAX = 3.4028235e+38 has an infinite high part: the scores it enters (its
    row's for q, its key's for k) turn +-inf or NaN, and a v element turns its dimension of out inf or NaN in
    every row of its sequence and KV head but padding rows, rows that give its key no weight included
    (0 x inf), where fp32 gives finite results.

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
        softmax_scale: finite and > 0 as a float32 (the kernels' type); default D ** -0.5.

    Returns:
        out [B, S, Hq, D] (dtype of q) and lse [B, Hq, S] fp32 (natural log).

    Strides and memory:
        - q, k, v may have any strides, and may share memory with each other (e.g. head slices of one
          fused qkv projection output); they are only read.
        - cache_seqlens, num_causal and block_table may have any strides, 0 included (a column of a
          [B, n] state tensor, `torch.tensor([L]).expand(B)`, `table[:, ::2]`); they are only read.
        - k_cache and v_cache may have any strides with a contiguous last dimension: one layer of a
          stacked cache, a head-major layout, or the two halves of one allocation (FlashInfer's paged
          `kv[num_pages, 2, page_size, Hkv, D]` with k_cache = kv[:, 0], v_cache = kv[:, 1]; or
          `kv[B, S_max, 2, Hkv, D]`).
        - Written: only cache slots [L_b, L_b + c_b) (and the fresh out, lse). Never read: padding rows
          [c_b, C) of q / k / v, cache slots at or past L_b, block_table entries past the pages holding
          slots [0, L_b + c_b) (they may hold any value).
        - Aliasing is rejected: a cache with two elements at one address (e.g. expanded), k_cache and
          v_cache sharing memory, or a cache sharing memory with q, k, v, cache_seqlens, num_causal or
          block_table. The decision is exact for strided views, from sizes, strides and data pointers only
          (no data read, no sync); a layout it cannot decide within its search budget is rejected as
          "may share memory". Not checked: two sequences whose block_table rows name the same page. A
          page may be shared (a common prefix) only where this call does not write it.

    Errors (RuntimeError, "sbd.block_attention_with_kvcache: <argument> ..."; the C++ CPU kernel and the
    Python backends raise the same words):
        - shapes: q not 4-D; D not in [1, 256]; k not [B, S, Hkv, D]; Hq not a multiple of Hkv; v shape
          != k shape; a cache not 4-D or not [*, *, Hkv, D]; v_cache shape != k_cache shape; a
          contiguous cache whose batch is not B; cache_seqlens / num_causal not [B]; block_table not
          [B, max_pages]; a paged cache with page size 0; block_size not in [0, S];
        - dtypes: q not fp32 / fp16 / bf16; k, v or a cache not of q's dtype; cache_seqlens, num_causal
          or block_table not int32;
        - devices: any tensor not on q's device;
        - layout: a cache whose last dimension has stride != 1; the aliasing above ("... is written in
          place and must not share memory with ...", "... must not have elements sharing memory", or
          "... may share memory ..." when undecidable);
        - softmax_scale NaN, infinite or <= 0, or a finite double that is infinite or 0 as a float32
          (>= 2^128 - 2^103 = 3.4028236e+38 or <= 2^-150 = 7.0e-46, e.g. 1e39 or 1e-50);
        - values: cache_seqlens < 0; num_causal outside [0, C]; L_b + c_b beyond the cache capacity
          (S_max, or max_pages * page_size); a page id outside [0, num_pages) for a page in use (checked in
          this order, each over the whole batch: the first condition that fails is reported). On CUDA
          these come from `torch._assert_async` (no host sync: reported as a device-side assert at the
          next synchronisation; the kernels clamp, so nothing is read or written out of bounds). Inside
          `sbd_kernels.ops.trusted_values()` these value checks are skipped (for a caller that built or
          validated the lengths, e.g. once per decode); the kernels still clamp every index (L_b to the
          capacity, c_b to [0, C], page ids to the pool), so nothing is written out of bounds: a bad value
          gives wrong results instead of an error. The C++ CPU kernel checks values on the host regardless;
        - on CUDA (Triton): a cache capacity + C above 2^31 - 2^16 slots per sequence, more than 2^31 - 2^16 query
          rows per KV head (S x Hq / Hkv), or more than 2^31 - 1 programs (B x Hkv x ceil(S x Hq / Hkv / 16)).
        The fake kernel (torch.compile) raises every error above except the values, memory shared between
        two arguments (fake tensors have no data pointers) and, with symbolic shapes, a cache's own
        overlap; the compiled call raises those when it runs.

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
