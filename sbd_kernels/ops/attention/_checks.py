"""Argument checks of `sbd.block_attention_with_kvcache`, shared by the oracle and the Triton launcher.

Two kinds, both with messages that name the argument (same wording as the C++ CPU kernel):
- `check_block_attention_args`: shapes, dtypes and devices, on the host (works on fake tensors too);
- `assert_block_attention_values`: values (lengths in range, no cache overflow, page ids in range) with
  `torch._assert_async`, so a CUDA launcher never waits on the device; on CPU tensors it raises at once.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

OP = "sbd.block_attention_with_kvcache"
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


class AttentionDims(NamedTuple):
    """Sizes of one call. `capacity` is the number of cache slots of each sequence."""

    batch: int  # B
    seq: int  # S = C + K query rows per sequence
    num_causal_slots: int  # C
    block_size: int  # K
    q_heads: int  # Hq
    kv_heads: int  # Hkv
    head_dim: int  # D
    paged: bool
    page_size: int  # contiguous cache: S_max (one "page" per sequence)
    capacity: int  # contiguous: S_max; paged: max_pages * page_size
    num_pages: int  # paged: k_cache.shape[0]; contiguous: B


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise RuntimeError(f"{OP}: {message}")


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor, hkv: int) -> None:
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _require(cache.dim() == 4, f"{name} must be 4-D, got shape {list(cache.shape)}")
        _require(cache.dtype == q.dtype, f"{name} must have the dtype of q ({q.dtype}), got {cache.dtype}")
        _require(cache.device == q.device, f"{name} must be on the device of q ({q.device}), got {cache.device}")
        _require(cache.shape[2] == hkv and cache.shape[3] == q.shape[3],
                 f"{name} must have {hkv} heads of dim {q.shape[3]}, got shape {list(cache.shape)}")
        _require(cache.stride(3) == 1, f"{name} must have a contiguous last dimension (stride 1)")
    _require(k_cache.shape == v_cache.shape,
             f"v_cache shape {list(v_cache.shape)} must equal k_cache shape {list(k_cache.shape)}")


def _check_int32_vector(name: str, t: torch.Tensor, batch: int, device: torch.device) -> None:
    _require(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
    _require(t.dim() == 1 and t.shape[0] == batch, f"{name} must have shape [{batch}], got {list(t.shape)}")
    _require(t.device == device, f"{name} must be on the device of q ({device}), got {t.device}")


def check_block_attention_args(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor, num_causal: torch.Tensor, block_size: int,
    block_table: torch.Tensor | None = None, softmax_scale: float | None = None,
) -> AttentionDims:
    """Check shapes, dtypes, devices and softmax_scale (finite, > 0); return the sizes of the call. Raises
    RuntimeError naming the argument. Dtypes print as `torch.float32`, shapes as `[B, S, H, D]` (the C++
    kernel's wording)."""
    _require(q.dim() == 4, f"q must be 4-D [B, S, Hq, D], got shape {list(q.shape)}")
    _require(q.dtype in FLOAT_DTYPES, f"q must be float32, float16 or bfloat16, got {q.dtype}")
    batch, seq, hq, dim = q.shape
    _require(0 < dim <= MAX_HEAD_DIM, f"q head dim must be in [1, {MAX_HEAD_DIM}], got {dim}")
    _require(k.dim() == 4 and k.shape[:2] == q.shape[:2] and k.shape[3] == dim,
             f"k must have shape [{batch}, {seq}, Hkv, {dim}], got {list(k.shape)}")
    hkv = k.shape[2]
    _require(hkv > 0 and hq % hkv == 0, f"q heads ({hq}) must be a multiple of k heads ({hkv})")
    _require(v.shape == k.shape, f"v shape {list(v.shape)} must equal k shape {list(k.shape)}")
    for name, t in (("k", k), ("v", v)):
        _require(t.dtype == q.dtype, f"{name} must have the dtype of q ({q.dtype}), got {t.dtype}")
        _require(t.device == q.device, f"{name} must be on the device of q ({q.device}), got {t.device}")
    _require(0 <= block_size <= seq, f"block_size must be in [0, S={seq}], got {block_size}")
    if softmax_scale is not None:
        _require(math.isfinite(softmax_scale) and softmax_scale > 0,
                 f"softmax_scale must be finite and > 0, got {softmax_scale:g}")
    _check_cache_pair(k_cache, v_cache, q, hkv)
    _check_int32_vector("cache_seqlens", cache_seqlens, batch, q.device)
    _check_int32_vector("num_causal", num_causal, batch, q.device)
    if block_table is None:
        _require(k_cache.shape[0] == batch,
                 f"k_cache must have batch size {batch} (contiguous cache), got {k_cache.shape[0]}")
        page_size = capacity = k_cache.shape[1]
    else:
        _require(block_table.dtype == torch.int32, f"block_table must be int32, got {block_table.dtype}")
        _require(block_table.dim() == 2 and block_table.shape[0] == batch,
                 f"block_table must have shape [{batch}, max_pages], got {list(block_table.shape)}")
        _require(block_table.device == q.device,
                 f"block_table must be on the device of q ({q.device}), got {block_table.device}")
        _require(k_cache.shape[1] > 0, "k_cache page size must be positive")
        page_size = k_cache.shape[1]
        capacity = block_table.shape[1] * page_size
    return AttentionDims(batch, seq, seq - block_size, block_size, hq, hkv, dim,
                         block_table is not None, page_size, capacity, k_cache.shape[0])


def assert_block_attention_values(
    cache_seqlens: torch.Tensor, num_causal: torch.Tensor, dims: AttentionDims,
    block_table: torch.Tensor | None = None,
) -> None:
    """Check values without a host sync: 0 <= num_causal <= C, cache_seqlens >= 0, L + c <= capacity,
    and the pages holding slots [0, L + c) are in [0, num_pages). Raises RuntimeError on CPU tensors."""
    lengths = cache_seqlens.to(torch.int64)
    causal = num_causal.to(torch.int64)
    torch._assert_async((lengths >= 0).all(), f"{OP}: cache_seqlens must be >= 0")
    torch._assert_async(((causal >= 0) & (causal <= dims.num_causal_slots)).all(),
                        f"{OP}: num_causal must be in [0, C={dims.num_causal_slots}]")
    end = lengths + causal
    torch._assert_async((end <= dims.capacity).all(),
                        f"{OP}: cache_seqlens + num_causal exceeds the cache capacity ({dims.capacity} slots)")
    if block_table is not None:
        pages_used = (end + dims.page_size - 1) // dims.page_size  # [B]
        page_index = torch.arange(block_table.shape[1], device=block_table.device)
        used = page_index[None, :] < pages_used[:, None]  # [B, max_pages]
        in_range = (block_table >= 0) & (block_table < dims.num_pages)
        torch._assert_async((in_range | ~used).all(),
                            f"{OP}: block_table holds a page id outside [0, {dims.num_pages}) for a used page")
