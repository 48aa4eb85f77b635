"""Argument checks of `sbd.block_attention_with_kvcache`, shared by the oracle and the Triton launcher.

Two kinds, both with messages that name the argument (same wording as the C++ CPU kernel):
- `check_block_attention_args`: shapes, dtypes, devices, softmax_scale and aliasing of the caches, from
  metadata on the host (works on fake tensors too; sharing memory with `sbd_kernels.ops._overlap`);
- `assert_block_attention_values`: values (lengths in range, no cache overflow, page ids in range) with
  `torch._assert_async`, so a CUDA launcher never waits on the device; on CPU tensors it raises at once.
  Skipped inside `sbd_kernels.ops.trusted_values()` (the kernels clamp L, c and page ids regardless).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from sbd_kernels.ops._float32 import as_float32, exact_g
from sbd_kernels.ops._overlap import check_disjoint, check_writable
from sbd_kernels.ops._trusted import values_trusted

OP = "sbd.block_attention_with_kvcache"
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
# The kernels use softmax_scale as a float32 (round to nearest even): exactly the doubles strictly between
# 2^-150 (the midpoint to the smallest subnormal, rounds to 0) and 2^128 - 2^103 (the midpoint between
# the largest float32 and 2^128, rounds to inf) become finite and > 0. 1e39 would become inf, 1e-50 0.
SCALE_LOWER_BOUND = 2.0**-150
SCALE_UPPER_BOUND = 2.0**128 - 2.0**103


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


def _fail(message: str) -> None:
    """Raise the op's RuntimeError. Callers test first and format the message only on failure: formatting
    the ~25 messages of a valid call would cost more than all its checks together."""
    raise RuntimeError(f"{OP}: {message}")


# Layout reminders appended to shape errors: the usual cause is a tensor in Hugging Face's head-major layout.
QKV_LAYOUT = ("q, k and v are [B, S, H, D] (Hugging Face attention passes [B, H, S, D]: call .transpose(1, 2) "
              "on q, k and v)")
CACHE_LAYOUT = ("caches are [B, S_max, Hkv, D] or paged [num_pages, page_size, Hkv, D] (a Hugging Face "
                "StaticCache layer is [B, Hkv, S_max, D]: call .transpose(1, 2))")


def _fail_dim(name: str, dim: int, label: str, got: int, other: str, expected: int, layout: str) -> None:
    _fail(f"{name} dimension {dim} ({label}) is {got}, {other}'s is {expected}; {layout}")


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor, hkv: int) -> None:
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4:
            _fail(f"{name} must be 4-D, got shape {list(cache.shape)}; {CACHE_LAYOUT}")
        if cache.dtype != q.dtype:
            _fail(f"{name} must have the dtype of q ({q.dtype}), got {cache.dtype}")
        if cache.device != q.device:
            _fail(f"{name} must be on the device of q ({q.device}), got {cache.device}")
        if cache.shape[2] != hkv:
            _fail_dim(name, 2, "Hkv", cache.shape[2], "k", hkv, CACHE_LAYOUT)
        if cache.shape[3] != q.shape[3]:
            _fail_dim(name, 3, "D", cache.shape[3], "q", q.shape[3], CACHE_LAYOUT)
        if cache.stride(3) != 1:
            _fail(f"{name} must have a contiguous last dimension (stride 1)")
    if k_cache.shape != v_cache.shape:
        _fail(f"v_cache shape {list(v_cache.shape)} must equal k_cache shape {list(k_cache.shape)}")


def _check_int32_vector(name: str, t: torch.Tensor, batch: int, device: torch.device) -> None:
    if t.dtype != torch.int32:
        _fail(f"{name} must be int32, got {t.dtype}")
    if not (t.dim() == 1 and t.shape[0] == batch):
        _fail(f"{name} must have shape [{batch}], got {list(t.shape)}")
    if t.device != device:
        _fail(f"{name} must be on the device of q ({device}), got {t.device}")


def _plain(t: torch.Tensor) -> bool:
    """A plain tensor with real memory (not fake, meta or a subclass): the fast paths below apply."""
    return type(t) is torch.Tensor and t.device.type != "meta"


def _storage_bytes(t: torch.Tensor) -> tuple[int, int]:
    """[first, end) byte addresses of the storage of `t`: a view never reaches outside them."""
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


# Layouts already decided free of aliasing. The exact decisions of `_overlap` cost 15-40 us each in Python
# (measured: 17 us for check_writable of kv[:, 0], 38 us for check_disjoint of kv[:, 0] and kv[:, 1]),
# and a decode loop passes the same cache layouts at every step and layer: a lookup costs about 2 us. The
# answer depends only on the key (sizes, strides, element sizes and the distance between data pointers).
_SAFE_LAYOUTS: set[tuple] = set()
_MAX_SAFE_LAYOUTS = 4096


def _remember(key: tuple) -> None:
    if len(_SAFE_LAYOUTS) >= _MAX_SAFE_LAYOUTS:
        _SAFE_LAYOUTS.clear()
    _SAFE_LAYOUTS.add(key)


def _check_writable_cache(name: str, cache: torch.Tensor) -> None:
    if not _plain(cache):
        check_writable(OP, name, cache)  # strides only: works on fake tensors
        return
    if cache.is_contiguous():
        return
    key = ("writable", tuple(cache.shape), cache.stride())
    if key not in _SAFE_LAYOUTS:
        check_writable(OP, name, cache)
        _remember(key)


def _check_disjoint_cache(cache_name: str, cache: torch.Tensor, name: str, t: torch.Tensor) -> None:
    """check_disjoint of two plain tensors whose storages meet, remembered by layout."""
    key = ("disjoint", tuple(cache.shape), cache.stride(), cache.element_size(), tuple(t.shape), t.stride(),
           t.element_size(), t.data_ptr() - cache.data_ptr())
    if key not in _SAFE_LAYOUTS:
        check_disjoint(OP, cache_name, cache, name, t)
        _remember(key)


def _check_no_aliasing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, cache_seqlens: torch.Tensor, num_causal: torch.Tensor,
                       block_table: torch.Tensor | None) -> None:
    """The caches are written in place: no two of their elements may share memory, nor may they share memory
    with each other or with any argument the kernels read (decided exactly for strided views by
    `sbd_kernels.ops._overlap`: the two halves of one combined kv allocation are disjoint). Metadata only.
    Tensors in separate allocations (storages with no byte in common) are disjoint without further work.
    Fake tensors have no data pointers: the checks between two arguments skip them, the real kernel
    checks when it runs."""
    _check_writable_cache("k_cache", k_cache)
    _check_writable_cache("v_cache", v_cache)
    caches = [("k_cache", k_cache), ("v_cache", v_cache)]
    read = [("q", q), ("k", k), ("v", v), ("cache_seqlens", cache_seqlens), ("num_causal", num_causal)]
    if block_table is not None:
        read.append(("block_table", block_table))
    pairs = [(caches[0], caches[1])] + [(cache, other) for cache in caches for other in read]
    if not all(_plain(t) for _, t in caches + read):
        for (cache_name, cache), (name, t) in pairs:
            check_disjoint(OP, cache_name, cache, name, t)
        return
    spans = {name: _storage_bytes(t) for name, t in caches + read}
    for (cache_name, cache), (name, t) in pairs:
        (first_a, end_a), (first_b, end_b) = spans[cache_name], spans[name]
        if first_a < end_b and first_b < end_a:
            _check_disjoint_cache(cache_name, cache, name, t)


def check_block_attention_args(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor, num_causal: torch.Tensor, block_size: int,
    block_table: torch.Tensor | None = None, softmax_scale: float | None = None, *, aliasing: bool = True,
    max_head_dim: int | None = MAX_HEAD_DIM,
) -> AttentionDims:
    """Check shapes, dtypes, devices, softmax_scale (finite, > 0 as a float32) and that the caches alias nothing; return
    the sizes of the call. Raises RuntimeError naming the argument(s), in the C++ kernel's words (dtypes
    as `torch.float32`, shapes as `[B, S, H, D]`). aliasing=False skips the aliasing check: a caller traced by
    torch.compile outside a custom op (whose data pointers dynamo cannot read) checks it in eager calls only.
    max_head_dim: the largest head size the kernels take (None: any, for an implementation of the op's contract
    without that limit)."""
    if q.dim() != 4:
        _fail(f"q must be 4-D [B, S, Hq, D], got shape {list(q.shape)}; {QKV_LAYOUT}")
    if q.dtype not in FLOAT_DTYPES:
        _fail(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    batch, seq, hq, dim = q.shape
    if max_head_dim is not None and not 0 < dim <= max_head_dim:
        _fail(f"q head dim must be in [1, {max_head_dim}], got {dim}")
    if dim < 1:
        _fail(f"q head dim must be >= 1, got {dim}")
    if k.dim() != 4:
        _fail(f"k must be 4-D [B, S, Hkv, D], got shape {list(k.shape)}; {QKV_LAYOUT}")
    for axis, label in ((0, "B"), (1, "S"), (3, "D")):
        if k.shape[axis] != q.shape[axis]:
            _fail_dim("k", axis, label, k.shape[axis], "q", q.shape[axis], QKV_LAYOUT)
    hkv = k.shape[2]
    if not (hkv > 0 and hq % hkv == 0):
        _fail(f"q heads ({hq}) must be a multiple of k heads ({hkv})")
    if v.shape != k.shape:
        _fail(f"v shape {list(v.shape)} must equal k shape {list(k.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            _fail(f"{name} must have the dtype of q ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            _fail(f"{name} must be on the device of q ({q.device}), got {t.device}")
    if not 0 <= block_size <= seq:
        _fail(f"block_size must be in [0, S={seq}], got {block_size}")
    if softmax_scale is not None and not SCALE_LOWER_BOUND < softmax_scale < SCALE_UPPER_BOUND:
        rounded = f" ({exact_g(as_float32(softmax_scale))} as a float32)" if 0 < softmax_scale < math.inf else ""
        _fail(f"softmax_scale must be finite and > 0 as a float32, got {exact_g(softmax_scale)}{rounded}")
    _check_cache_pair(k_cache, v_cache, q, hkv)
    _check_int32_vector("cache_seqlens", cache_seqlens, batch, q.device)
    _check_int32_vector("num_causal", num_causal, batch, q.device)
    if block_table is None:
        if k_cache.shape[0] != batch:
            _fail(f"k_cache must have batch size {batch} (contiguous cache), got {k_cache.shape[0]}")
        page_size = capacity = k_cache.shape[1]
    else:
        if block_table.dtype != torch.int32:
            _fail(f"block_table must be int32, got {block_table.dtype}")
        if not (block_table.dim() == 2 and block_table.shape[0] == batch):
            _fail(f"block_table must have shape [{batch}, max_pages], got {list(block_table.shape)}")
        if block_table.device != q.device:
            _fail(f"block_table must be on the device of q ({q.device}), got {block_table.device}")
        if k_cache.shape[1] <= 0:
            _fail("k_cache page size must be positive")
        page_size = k_cache.shape[1]
        capacity = block_table.shape[1] * page_size
    if aliasing:
        _check_no_aliasing(q, k, v, k_cache, v_cache, cache_seqlens, num_causal, block_table)
    return AttentionDims(batch, seq, seq - block_size, block_size, hq, hkv, dim,
                         block_table is not None, page_size, capacity, k_cache.shape[0])


def assert_block_attention_values(
    cache_seqlens: torch.Tensor, num_causal: torch.Tensor, dims: AttentionDims,
    block_table: torch.Tensor | None = None,
) -> None:
    """Check values without a host sync: cache_seqlens >= 0, 0 <= num_causal <= C, L + c <= capacity, the
    pages holding slots [0, L + c) are in [0, num_pages), and a page the call writes is used by no other table
    entry. Raises RuntimeError on CPU tensors. One
    condition at a time over the whole batch, in this order (so does the C++ kernel): with two bad values
    the first condition's error is raised, whichever sequences hold them.
    Returns at once inside `trusted_values()`: 4-6 small kernels per call saved (about twice as many with a
    block_table); the kernels clamp L to
    [0, capacity], c to [0, C] and mask page ids outside [0, num_pages), so nothing goes out of bounds."""
    if values_trusted():
        return
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
        # A page written by the call (holding slots [L_b, L_b + c_b)) must be used once in the whole table: shared
        # pages (a common prefix) are read-only, since the write of one sequence would race with the reads of
        # another (the kernels run the sequences in parallel) or with its own second mapping of the page.
        used_ids = torch.where(used & in_range, block_table.to(torch.int64), dims.num_pages)  # spare bucket
        uses = torch.zeros(dims.num_pages + 1, dtype=torch.int32, device=block_table.device)
        uses.scatter_add_(0, used_ids.flatten(), torch.ones_like(used_ids, dtype=torch.int32).flatten())
        written = used & (page_index[None, :] >= (lengths // dims.page_size)[:, None]) & (causal > 0)[:, None]
        torch._assert_async(((uses[used_ids] == 1) | ~written).all(),
                            f"{OP}: block_table maps a page the call writes (slots [L_b, L_b + c_b)) to more than "
                            "one used entry; pages shared between sequences must be read-only")
