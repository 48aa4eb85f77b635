"""Triton kernels of `sbd.block_attention_with_kvcache`: split-KV ("flash decoding") SBD block attention.

For sequence b, KV head h, query row i and head g of the group (query head h * G + g, G = Hq / Hkv), with
L = cache_seqlens[b], c = num_causal[b], C = S - K, scale s = softmax_scale:

    keys(i) = cache slots [0, L)  +  new rows j of k/v with
              causal row i < c      : j < c and j <= i
              block row  i >= C     : j < c or j >= C
              padding row c <= i < C: none                    (out = 0, lse = -inf)
    lse[b, hG+g, i] = log sum_{j in keys(i)} exp(s q_i . k_j)
    out[b, i, hG+g] = sum_{j in keys(i)} exp(s q_i . k_j - lse) v_j

Stage 1, `_attention_split_kernel`, grid (B * Hkv * M tiles, 1 + cache splits): axis 0 enumerates the
(sequence, KV head, M tile) triples, (sequence, KV head) fastest (`_launch_grids`). The M tile packs the
query rows AND the G heads of one KV group (row m = i * G + g), so each K/V tile is loaded once for the
whole group. Split 0 attends to the S new rows and, in M tile 0, appends the causal rows' K/V to cache slots
[L, L + c) (the only cache writes). Split n >= 1 attends to the cache slots [(n-1) * SPLIT_LEN, n * SPLIT_LEN)
below L; splits starting at or past L exit at once (the number of splits comes from the cache capacity,
a shape, so the host never reads L). Each split writes a partial online-softmax state: m = max_j t_j,
l = sum_j e^(t_j - m), acc = sum_j e^(t_j - m) v_j with t = s q . k, the exponentials taken as
2^((t_j - m) log2(e)). The scores stay in natural units, log2(e) applied only after the max is subtracted: a
scale folded into s log2(e) overflows fp32 from s = 2.36e38, which the op accepts (up to 3.4e38).

Stage 2, `_attention_combine_kernel`, grid (B * Hkv * combine tiles): merges the 1 + ceil(L / SPLIT_LEN)
live splits with log-sum-exp, writes out = acc / l (dtype of q) and lse = m + ln l, or 0 / -inf for rows
without keys (l = 0: padding rows, rows whose every score is -inf).

Non-finite scores (the contract of naive.py: a NaN or +inf score makes the row's out and lse NaN) travel in
l, not m: tl.maximum and tl.max compile to maxnum, which drops a NaN operand on a GPU (the interpreter does
the same, np.fmax and np.nanmax), so a row whose only key scores NaN keeps m = -inf. Its exponential is
taken against 0 (the base of a row without a finite max), 2^(NaN) = NaN, so l and acc are NaN in its split,
and NaN * 0 = NaN keeps them NaN through every rescale of later tiles and of the combine. A +inf score makes
m = +inf and its own term 2^(inf - inf) = NaN.

Offsets into the tensors are int64: an index times a stride typed i32 (any stride below 2^31) passes 2^31
elements in large tensors, e.g. KV head 31 of a head-major cache [B, 32, 600000, 128] (a Hugging Face
StaticCache layer, transposed) starts 31 * 600000 * 128 = 2.4e9 elements in, which int32 wraps to -1.9e9.

Safety: cache loads are masked to slots < L (other = 0) and scores of masked keys are set to -inf before
the exponential, so a NaN-filled cache tail never reaches a result; L and c are clamped to the capacity
and to [0, C] and page ids to [0, num_pages) inside the kernel, so a bad value (reported on the host by
`torch._assert_async`) can never make the kernel read or write out of bounds.

Under TRITON_INTERPRET=1 every operand is upcast to fp32 right after its load (the interpreter gets bf16
arithmetic and bf16 tl.dot wrong). On a GPU, fp16/bf16 operands stay in their dtype for tl.dot (tensor
cores, fp32 accumulation; the probabilities are rounded to that dtype for P @ V) and fp32 operands use
3xTF32, which keeps fp32 accuracy on tensor cores (plain fp32 dots at D > 128, where 3xTF32 spills) for
elements below 2^128 - 2^116 = 3.4019929e38 in magnitude: from there up to FLT_MAX the TF32 high part
(cvt.rna.tf32.f32: 10 mantissa bits, ties away from zero) is inf, and the dots give inf or NaN (inf x 0)
where fp32 dots are finite. Clamping each K/V element, or plain fp32 dots, would cost every call for inputs
within 2^-12 (0.024%) of FLT_MAX; the op's docstring states the range instead.

Measured on an H100 (bf16, B = 1, Hq = 32, Hkv = 8, D = 128, C = K = 16, contiguous cache, CUDA graph
replay, value checks included): 57 us at L = 4096 (2.2x SDPA + cache copy), 125 us at L = 16384 (3.4x,
536 GB/s of K/V); the oracle tests pass there with the same tolerances as under the interpreter.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sbd_kernels.ops._aot import (
    MAX_GRID_X,
    KernelLaunch,
    KernelSpec,
    cdiv,
    compiles_for_gpu,
    launch,
    next_power_of_2,
    rows_aligned,
    sm_count,
    spec_of_launch,
    unique_specs,
    unspecialised_jit,
)
from sbd_kernels.ops.attention._checks import (
    AttentionDims,
    assert_block_attention_values,
    check_block_attention_args,
)


class _Tiles(NamedTuple):
    max_block_m: int  # rows of the M tile (query rows x heads of a KV group), at most
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


# Tiles by (fp16/bf16?, ALIGNED?, BLOCK_D class): the largest that compile with no register spill on
# sm_80 and sm_90 (ptxas -v --regAllocOptLevel=2, as `python -m sbd_kernels.aot` checks). A decode pass has
# M = (C + K) * G rows, e.g. 32 * 4 = 128; BLOCK_M is the smallest power of two >= M (tl.dot needs >= 16)
# up to max_block_m. Measured at D = 128: fp16 64 x 64 tiles spill 28-372 bytes with 4 warps and use
# 214-230 registers with 8; fp32 (3xTF32 dots hold hi/lo halves of each operand) spills from 32 x 32, and
# 16 x 32 with 8 warps uses 177-216 registers. Unaligned rows keep one 64-bit address per element, hence
# 16 x 16 tiles.
# fp32 at D = 256 spills with 3xTF32 and uses plain fp32 dots instead; unaligned it also needs one pipeline
# stage and 16 warps (8 warps spilled 20-112 bytes, 16 use 92-120 registers).
# At D <= 64 ptxas aims at the register count of the next occupancy step (64, 96 or 128: Triton declares the
# block size, .reqntid) and spills 8-20 bytes to reach it in some of the 18 shapes of a class (BLOCK_D 16-64
# x BLOCK_M x paged), which small changes of the code move from shape to shape. With int64 offsets and the
# softmax in natural units (one more multiply per score), 64-key fp16/bf16 tiles spilled 8 bytes in 1-6 of
# the 72 compiles of the class (sm_80 and sm_90) with any of 4 or 8 warps and 2 or 3 stages, 32-key tiles
# with 8 warps and 3 stages in 4, and with 4 warps and 3 stages in none (62-155 registers); aligned fp32
# spills in none with 8 warps and 1 stage (8 x 2 spilled in 6, 4 x 1 in 1, before int64), unaligned fp32 in
# none with 4 warps and 1 stage (2 x 1 spilled 8 bytes in 1 of 12, 2 x 2 in 1, 1 x 1 in 4). The speed of
# these small-head-dim tiles on a GPU is not measured.
# Unaligned fp16/bf16 tiles are also chosen to compile without spills with triton 3.6, where a paged cache's
# 64-bit element addresses run out of registers (255) with fewer threads: at D <= 64, 2 warps spilled 140-224
# bytes and 8 warps with 1 stage none (4 warps with 2 or 3 stages spilled 8 bytes with triton 3.8, to reach
# an occupancy step); at D = 128, 4 warps spilled 180-192 bytes and 8 warps none with 3.6 but 32 with 3.8,
# 16 warps none with either (120-128 registers). At D = 256 no tile avoids spills with 3.6 (8 warps: paged,
# 220-456 bytes; 16 warps also contiguous), nor does unaligned fp32 (16 warps, 72-140 bytes).
# Since the grid numbers (sequence, KV head, M tile) along one axis (one integer division more per program),
# unaligned fp16/bf16 16 x 16 tiles at D <= 64 spill with one version or the other in every warp and stage
# count (fp16 D = 16-64, contiguous and paged, sm_80 and sm_90: worst of 12 compiles, triton 3.8 / 3.6):
# 8 warps x 1 stage 16 / 0 bytes, 8 x 2 24 / 0, 16 x 1 8 / 12, 4 x 1 0 / 8 (D = 32 contiguous, sm_90), and
# 16 x 32 tiles with 8 warps 24 / 0. 16 x 32 with 16 warps and 1 stage spills with neither (nor in bf16).
_TILES = {
    (True, True, "small"): _Tiles(64, 32, 4, 3),
    (True, True, "mid"): _Tiles(64, 64, 8, 2),
    (True, True, "large"): _Tiles(64, 16, 8, 2),
    (False, True, "small"): _Tiles(16, 32, 8, 1),
    (False, True, "mid"): _Tiles(16, 32, 8, 2),
    (False, True, "large"): _Tiles(16, 16, 8, 2),
    (True, False, "small"): _Tiles(16, 32, 16, 1),
    (True, False, "mid"): _Tiles(16, 16, 16, 2),
    (True, False, "large"): _Tiles(16, 16, 8, 2),
    (False, False, "small"): _Tiles(16, 16, 4, 1),
    (False, False, "mid"): _Tiles(16, 16, 8, 2),
    (False, False, "large"): _Tiles(16, 16, 16, 1),
}


def _tiles(half: bool, aligned: bool, block_d: int) -> _Tiles:
    """The _TILES row of a launch: BLOCK_D <= 64 is "small", 128 "mid", 256 "large"."""
    size = "small" if block_d <= 64 else "mid" if block_d <= 128 else "large"
    return _TILES[(half, aligned, size)]


# Cache slots per split, at least: each split writes a partial (m, l, acc[M tile, D]) fp32 state; with
# 512 slots a bf16 split reads 512 * D * 2 * 2 bytes of K/V against 64 * D * 4 bytes of partial output
# (one eighth), so the split overhead stays small while L = 4096 still gives 8 splits per (b, head, tile).
MIN_SPLIT_LEN = 512
# Programs to aim for per SM of the input's GPU: two waves (264 programs on a 132-SM H100). The split count
# is a function of shapes and the SM count only (no sync).
PROGRAMS_PER_SM = 2
# Query rows per combine program: a [16, 256] fp32 tile plus the running state stays in registers.
COMBINE_BLOCK_M = 16
# Warps of the combine by ALIGNED: unaligned at D = 64, 4 warps spill 4 bytes on sm_90, 8 warps none.
COMBINE_WARPS = {True: 4, False: 8}
# Most cache slots per sequence plus causal slots C (capacity + C: the append's slot L + j, L clamped to the
# capacity, stays below it whatever L), and query rows per KV head (S x G), the kernels take: slot, key and row
# indices are int32, and a tile's indices or a loop's counter go one tile (at most 64) past them; 2^16 of
# headroom.
MAX_INDEX = 2**31 - 2**16
_LN2 = tl.constexpr(math.log(2.0))
_LOG2E = tl.constexpr(1.0 / math.log(2.0))


@triton.jit
def _tile_ptrs(base, row_offsets, d_idx, stride_d, ALIGNED: tl.constexpr):
    """Pointers [rows, BLOCK_D] = base + row_offsets[:, None] + d_idx[None, :] * stride_d (row_offsets int64).

    ALIGNED (checked by the launcher: 16-byte aligned data, strides of 16 bytes, stride_d == 1, so d is the
    offset) tells the compiler that every row starts on a 16-byte boundary, so rows load and store as 16-byte
    vectors; without it each element keeps its own 64-bit address (hence the smaller unaligned tiles of
    _TILES), and d * stride_d is taken in int64 (a strided head dim passes 2^31 from stride_d = 2^23).
    """
    if ALIGNED:
        ptrs = base + row_offsets[:, None] + d_idx[None, :]
        ptrs = tl.max_contiguous(tl.multiple_of(ptrs, [16, 16]), [1, d_idx.shape[0]])
    else:
        ptrs = base + row_offsets[:, None] + (d_idx.to(tl.int64) * stride_d)[None, :]
    return ptrs


@triton.jit
def _head_dim_mask(d_idx, D, io_ptr, ALIGNED: tl.constexpr):
    """d_idx < D, the head-dim mask of a tile. ALIGNED (rows of 16 bytes: D * element size of `io_ptr`'s
    dtype is a multiple of 16, and D of 4) tells the compiler that the mask is constant over each run of
    16 bytes, so that masked rows still load and store as 16-byte vectors: the kernels are compiled without
    Triton's specialisation on D % 16 (`unspecialised_jit`), which was what gave the masks that constancy."""
    d_ok = d_idx < D
    if ALIGNED:
        d_ok = tl.max_constancy(d_ok, [128 // io_ptr.dtype.element_ty.primitive_bitwidth])
    return d_ok


@triton.jit
def _online_softmax_update(q, k, v, valid, m_i, l_i, acc, softmax_scale,
                           HALF_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """One key tile of online softmax. q [BM, BD], k/v [BN, BD], valid [BM, BN] -> (m, l, acc).

    Scores t = s q . k and m stay in natural units; e^(t - m) is taken as 2^((t - m) log2(e)), the factor
    applied to the difference: s log2(e) overflows fp32 from s = 2.36e38, while t - m <= 0 (where it
    overflows to -inf, e^(t - m) = 0 is what it stands for)."""
    t = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * softmax_scale
    t = tl.where(valid, t, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(t, 1))
    # A row with no key so far (or only -inf or NaN scores: maxnum drops NaN) keeps m = -inf; subtract 0
    # instead so that e^(-inf - base) = 0, not NaN, while a NaN score still gives a NaN term of l.
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2((t - m_base[:, None]) * _LOG2E)
    alpha = tl.exp2((m_i - m_base) * _LOG2E)
    l_i = l_i * alpha + tl.sum(p, 1)
    if HALF_DOT:
        p = p.to(v.dtype)
    acc = tl.dot(p, v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _pair_and_tile(pairs):
    """((sequence, KV head) pair, M tile) of this program: grid axis 0 enumerates tile * pairs + pair
    (`_launch_grids`)."""
    pid = tl.program_id(0)
    return pid % pairs, pid // pairs


@triton.jit
def _cache_rows(slots, live, b, block_table_ptr, stride_btb, stride_btp, page_size, num_pages,
                PAGED: tl.constexpr):
    """(page, offset in page, in range) of cache slots [BN], page and offset int64 (offset * stride passes 2^31
    elements beyond about 2M slots of 8 heads x 128). Contiguous caches are one page per sequence."""
    if PAGED:
        entry = b.to(tl.int64) * stride_btb + (slots // page_size).to(tl.int64) * stride_btp
        page = tl.load(block_table_ptr + entry, mask=live, other=0)
        ok = live & (page >= 0) & (page < num_pages)
        return page.to(tl.int64), (slots % page_size).to(tl.int64), ok
    else:
        return tl.zeros_like(slots).to(tl.int64) + b, slots.to(tl.int64), live


@unspecialised_jit
def _attention_split_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, cache_seqlens_ptr, num_causal_ptr, block_table_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_kcp, stride_kcs, stride_kch,
    stride_vcp, stride_vcs, stride_vch,
    stride_len, stride_nc, stride_btb, stride_btp,
    S, C, Hkv, G, D, M, pairs, capacity, page_size, num_pages, split_len, num_splits,
    softmax_scale,
    PAGED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HALF_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr, ALIGNED: tl.constexpr,
):
    """Partial softmax state of one (sequence, KV head, M tile, split); split 0 = new rows + cache append.
    M = 0 (no query head) runs split 0 of one M tile: the cache append alone."""
    pid_bh, pid_m = _pair_and_tile(pairs)
    split = tl.program_id(1)
    b = pid_bh // Hkv
    h = pid_bh % Hkv
    # Compiled, a float argument is fp32 (the launcher rounds it); interpreted, it stays a Python float that
    # each op types by value, fp64 when subnormal or above FLT_MAX (3.4028235e38, which rounds to FLT_MAX).
    scale = tl.cast(softmax_scale, tl.float32)
    # Index tensors may be any views (a column of a [B, n] state tensor, an expanded scalar): use their strides.
    length = tl.minimum(tl.maximum(tl.load(cache_seqlens_ptr + b.to(tl.int64) * stride_len), 0), capacity)
    causal = tl.minimum(tl.maximum(tl.load(num_causal_ptr + b.to(tl.int64) * stride_nc), 0), C)
    start = (split - 1) * split_len
    if (split > 0) & (start >= length):
        return

    # M tile: row m = query row i * G + head g of the group; its class decides which keys it sees.
    m_idx = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row = m_idx // G
    q_head = h.to(tl.int64) * G + m_idx % G
    row_causal = row < causal
    row_block = (row >= C) & (row < S)
    row_live = (row_causal | row_block) & (m_idx < M)
    d_idx = tl.arange(0, BLOCK_D)
    d_ok = _head_dim_mask(d_idx, D, q_ptr, ALIGNED)
    # The KV head's part of each K/V address, once per program.
    k_base = k_ptr + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    k_cache_base = k_cache_ptr + h.to(tl.int64) * stride_kch
    v_cache_base = v_cache_ptr + h.to(tl.int64) * stride_vch
    q_ptrs = _tile_ptrs(q_ptr + b.to(tl.int64) * stride_qb, row.to(tl.int64) * stride_qs + q_head * stride_qh,
                        d_idx, stride_qd, ALIGNED)
    q = tl.load(q_ptrs, mask=row_live[:, None] & d_ok[None, :], other=0.0)
    if not HALF_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_idx = tl.arange(0, BLOCK_N)
    if split == 0:
        # The S new rows: causal rows [0, c) and block rows [C, S); padding rows are never loaded.
        for j0 in range(0, S, BLOCK_N):
            j = j0 + n_idx
            key_causal = j < causal
            key_live = key_causal | ((j >= C) & (j < S))
            kv_mask = key_live[:, None] & d_ok[None, :]
            k_tile = tl.load(_tile_ptrs(k_base, j.to(tl.int64) * stride_ks, d_idx, stride_kd, ALIGNED),
                             mask=kv_mask, other=0.0)
            v_tile = tl.load(_tile_ptrs(v_base, j.to(tl.int64) * stride_vs, d_idx, stride_vd, ALIGNED),
                             mask=kv_mask, other=0.0)
            if pid_m == 0:
                # Cache append of the causal rows: slots [L, L + c), bit-exact copies of the loaded rows.
                page, offset, ok = _cache_rows(length + j, key_causal & (length + j < capacity), b,
                                               block_table_ptr, stride_btb, stride_btp, page_size, num_pages,
                                               PAGED)
                store_mask = ok[:, None] & d_ok[None, :]
                tl.store(_tile_ptrs(k_cache_base, page * stride_kcp + offset * stride_kcs,
                                    d_idx, 1, ALIGNED), k_tile, mask=store_mask)
                tl.store(_tile_ptrs(v_cache_base, page * stride_vcp + offset * stride_vcs,
                                    d_idx, 1, ALIGNED), v_tile, mask=store_mask)
            if not HALF_DOT:
                k_tile = k_tile.to(tl.float32)
                v_tile = v_tile.to(tl.float32)
            sees_causal = row_causal[:, None] & key_causal[None, :] & (j[None, :] <= row[:, None])
            sees_block = row_block[:, None] & key_live[None, :]
            valid = sees_causal | sees_block
            m_i, l_i, acc = _online_softmax_update(q, k_tile, v_tile, valid, m_i, l_i, acc, scale,
                                                   HALF_DOT, INPUT_PRECISION)
    else:
        # Not min(start + split_len, L): start + split_len, up to capacity + 64 x splits, may pass 2^31.
        end = start + tl.minimum(split_len, length - start)
        for n0 in range(start, end, BLOCK_N):
            slots = n0 + n_idx
            page, offset, ok = _cache_rows(slots, slots < end, b, block_table_ptr, stride_btb, stride_btp,
                                           page_size, num_pages, PAGED)
            kv_mask = ok[:, None] & d_ok[None, :]
            k_tile = tl.load(_tile_ptrs(k_cache_base, page * stride_kcp + offset * stride_kcs,
                                        d_idx, 1, ALIGNED), mask=kv_mask, other=0.0)
            v_tile = tl.load(_tile_ptrs(v_cache_base, page * stride_vcp + offset * stride_vcs,
                                        d_idx, 1, ALIGNED), mask=kv_mask, other=0.0)
            if not HALF_DOT:
                k_tile = k_tile.to(tl.float32)
                v_tile = v_tile.to(tl.float32)
            valid = row_live[:, None] & ok[None, :]
            m_i, l_i, acc = _online_softmax_update(q, k_tile, v_tile, valid, m_i, l_i, acc, scale,
                                                   HALF_DOT, INPUT_PRECISION)

    # Partial state [B * Hkv, 1 + splits, M] (+ [D]) in fp32; rows past M are not stored.
    state = (pid_bh.to(tl.int64) * num_splits + split) * M + m_idx
    m_ok = m_idx < M
    tl.store(part_m_ptr + state, m_i, mask=m_ok)
    tl.store(part_l_ptr + state, l_i, mask=m_ok)
    tl.store(_tile_ptrs(part_acc_ptr, state * D, d_idx, 1, ALIGNED), acc, mask=m_ok[:, None] & d_ok[None, :])


@unspecialised_jit
def _attention_combine_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, cache_seqlens_ptr, out_ptr, lse_ptr,
    stride_len, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    Hkv, G, D, M, pairs, capacity, split_len, num_splits,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr,
):
    """Log-sum-exp merge of the live splits of one (sequence, KV head, row tile); writes out and lse."""
    pid_bh, pid_m = _pair_and_tile(pairs)
    b = pid_bh // Hkv
    h = (pid_bh % Hkv).to(tl.int64)
    length = tl.minimum(tl.maximum(tl.load(cache_seqlens_ptr + b.to(tl.int64) * stride_len), 0), capacity)
    live_splits = 1 + tl.cdiv(length, split_len)

    m_idx = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m_idx < M
    d_idx = tl.arange(0, BLOCK_D)
    tile_ok = m_ok[:, None] & _head_dim_mask(d_idx, D, out_ptr, ALIGNED)[None, :]
    m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for split in range(live_splits):
        state = (pid_bh.to(tl.int64) * num_splits + split) * M + m_idx
        m_s = tl.load(part_m_ptr + state, mask=m_ok, other=float("-inf"))
        l_s = tl.load(part_l_ptr + state, mask=m_ok, other=0.0)
        acc_s = tl.load(_tile_ptrs(part_acc_ptr, state * D, d_idx, 1, ALIGNED), mask=tile_ok, other=0.0)
        m_new = tl.maximum(m_run, m_s)
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        scale_run = tl.exp2((m_run - m_base) * _LOG2E)
        scale_s = tl.exp2((m_s - m_base) * _LOG2E)
        l_run = l_run * scale_run + l_s * scale_s
        acc = acc * scale_run[:, None] + acc_s * scale_s[:, None]
        m_run = m_new

    # l = 0: no key, or -inf scores only (out 0, lse -inf). A NaN or +inf score left l NaN (e^(t - m) is NaN
    # for t = NaN, and for t = m = +inf), which must reach out and lse: `l > 0` is False for NaN, `l != 0` True.
    has_keys = l_run != 0.0
    out = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_run, 1.0)[:, None], 0.0)
    lse = tl.where(has_keys, m_run + tl.log2(tl.where(has_keys, l_run, 1.0)) * _LN2, float("-inf"))
    row = (m_idx // G).to(tl.int64)
    q_head = h * G + m_idx % G
    tl.store(_tile_ptrs(out_ptr + b.to(tl.int64) * stride_ob, row * stride_os + q_head * stride_oh, d_idx, 1,
                        ALIGNED), out.to(out_ptr.dtype.element_ty), mask=tile_ok)
    tl.store(lse_ptr + b.to(tl.int64) * stride_lb + q_head * stride_lh + row, lse, mask=m_ok)


class _Config(NamedTuple):
    """Compile-time choices of one launch (all picked from shapes, dtype and alignment)."""

    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int
    half_dot: bool
    input_precision: str
    paged: bool
    aligned: bool


class _SplitPlan(NamedTuple):
    """How the cache is cut: split n >= 1 covers slots [(n-1) * split_len, n * split_len)."""

    m_tiles: int
    split_len: int
    num_splits: int  # 1 (the new rows) + cache splits


def _pick_config(head_dim: int, rows: int, dtype: torch.dtype, paged: bool, aligned: bool,
                 on_gpu: bool) -> _Config:
    """Tiles by dtype, alignment and head dim (_TILES), BLOCK_M by the M = S * G rows of a KV group; dot
    operands: fp16/bf16 on GPU tensor cores, 3xTF32 for fp32 (plain fp32 at D > 128; 3xTF32 matches fp32 for
    elements below 2^128 - 2^116 in magnitude, see the module docstring), fp32 when interpreted."""
    half = dtype != torch.float32
    block_d = max(16, next_power_of_2(head_dim))
    tiles = _tiles(half, aligned, block_d)
    block_m = min(tiles.max_block_m, max(16, next_power_of_2(rows)))
    input_precision = "tf32x3" if on_gpu and not half and block_d <= 128 else "ieee"
    return _Config(block_m, tiles.block_n, block_d, tiles.num_warps, tiles.num_stages, on_gpu and half,
                   input_precision, paged, aligned)


def _plan_splits(dims: AttentionDims, config: _Config, target_programs: int) -> _SplitPlan:
    """Cache splits from the capacity (an upper bound of every L_b): about `target_programs` programs
    (PROGRAMS_PER_SM per SM), but no split shorter than MIN_SPLIT_LEN slots. No query row (Hq = 0): split 0
    of one M tile, which appends the causal rows' K/V to the cache and attends nothing."""
    rows = dims.seq * (dims.q_heads // dims.kv_heads)
    if rows == 0:
        return _SplitPlan(1, config.block_n, 1)
    m_tiles = cdiv(rows, config.block_m)
    by_occupancy = cdiv(target_programs, dims.batch * dims.kv_heads * m_tiles)
    by_length = cdiv(dims.capacity, MIN_SPLIT_LEN)
    cache_splits = max(1, min(by_occupancy, by_length))
    split_len = max(config.block_n, cdiv(cdiv(dims.capacity, cache_splits), config.block_n)
                    * config.block_n)
    cache_splits = max(1, cdiv(dims.capacity, split_len))
    return _SplitPlan(m_tiles, split_len, 1 + cache_splits)


def check_int32_indices(dims: AttentionDims) -> None:
    """Raise RuntimeError naming the argument when the cache capacity plus C or the query rows per KV head
    pass MAX_INDEX (the C++ kernel and the oracle take any size)."""
    if dims.capacity + dims.num_causal_slots > MAX_INDEX:
        holder = (f"block_table ({dims.capacity // dims.page_size} pages of {dims.page_size} slots)" if dims.paged
                  else "k_cache")
        raise RuntimeError(f"sbd.block_attention_with_kvcache: {holder} holds {dims.capacity} cache slots per "
                           f"sequence and q C = {dims.num_causal_slots} causal rows; the Triton kernels take "
                           f"capacity + C at most 2^31 - 2^16 (int32 slot indices)")
    rows = dims.seq * max(dims.q_heads // dims.kv_heads, 1)
    if rows > MAX_INDEX:
        raise RuntimeError(f"sbd.block_attention_with_kvcache: q has S x Hq / Hkv = {rows} query rows per KV head; "
                           f"the Triton kernels take at most 2^31 - 2^16 (int32 row indices)")


def _launch_grids(pairs: int, plan: _SplitPlan, rows: int) -> tuple[tuple[int, int], tuple[int]]:
    """Grids of the split and the combine launch for `pairs` = B * Hkv (sequence, KV head) pairs of `rows` =
    S * G query rows each: (pairs * M tiles, 1 + cache splits) and (pairs * combine tiles,), program
    tile * pairs + pair along axis 0 (`_pair_and_tile`).

    Why one axis: CUDA launches up to 2^31 - 1 programs along axis 0 (MAX_GRID_X) but 65535 along axes 1 and
    2, fewer than the M tiles of a long prefill (B = 1, S = 131072, Hq = 64, Hkv = 8: 65536 tiles of 16 rows,
    as fp32 or unaligned rows take; 524288 with Hkv = 1), whose launch then failed. The pairs
    numbered fastest keep the programs and their order those of the grids (pairs, M tiles, splits) and
    (pairs, combine tiles) this replaces, for one integer division more per program. The splits (at most
    1 + PROGRAMS_PER_SM x SMs) stay on axis 1."""
    return (pairs * plan.m_tiles, plan.num_splits), (pairs * cdiv(rows, COMBINE_BLOCK_M),)


def _attention_launches(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor, num_causal: torch.Tensor, block_size: int,
    block_table: torch.Tensor | None = None, softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[KernelLaunch]]:
    """Everything the launcher does but run the kernels: the checks, out and lse, and the split and combine
    launches: none when there is nothing to compute nor append (B = 0, or out empty and C = 0), the split
    kernel alone when out is empty but causal rows may be appended (Hq = 0). On META tensors, the
    configuration a CUDA call would compile."""
    dims = check_block_attention_args(q, k, v, k_cache, v_cache, cache_seqlens, num_causal, block_size,
                                      block_table, softmax_scale)
    assert_block_attention_values(cache_seqlens, num_causal, dims, block_table)
    check_int32_indices(dims)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((dims.batch, dims.q_heads, dims.seq), dtype=torch.float32, device=q.device)
    if dims.batch == 0 or (out.numel() == 0 and dims.num_causal_slots == 0):
        return out, lse, []
    scale = dims.head_dim ** -0.5 if softmax_scale is None else softmax_scale
    group = dims.q_heads // dims.kv_heads
    rows = dims.seq * group
    bh = dims.batch * dims.kv_heads
    # The fp32 partial accumulator (a fresh allocation) has rows of D * 4 bytes: aligned when D % 4 == 0.
    # `out` (contiguous, q's dtype) has a head stride of D, so ALIGNED also means D * element size % 16 ==
    # 0, on which the head-dim mask's hint (`_head_dim_mask`) relies whatever the strides of q, k and v.
    aligned = rows_aligned(q, k, v, k_cache, v_cache, out) and dims.head_dim % 4 == 0
    config = _pick_config(dims.head_dim, rows, q.dtype, dims.paged, aligned, compiles_for_gpu(q.device))
    plan = _plan_splits(dims, config, PROGRAMS_PER_SM * sm_count(q.device))
    split_grid, combine_grid = _launch_grids(bh, plan, rows)
    if max(split_grid[0], combine_grid[0]) > MAX_GRID_X:
        raise RuntimeError(f"sbd.block_attention_with_kvcache: q [B={dims.batch}, S={dims.seq}, Hq={dims.q_heads}] "
                           f"needs {max(split_grid[0], combine_grid[0])} programs (B x Hkv x ceil(S x Hq / Hkv / "
                           f"{COMBINE_BLOCK_M})); the Triton kernels launch at most 2^31 - 1")
    part_m = torch.empty((bh, plan.num_splits, rows), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((bh, plan.num_splits, rows, dims.head_dim), dtype=torch.float32, device=q.device)
    table = block_table if dims.paged else cache_seqlens  # unread when not paged
    stride_btb, stride_btp = block_table.stride() if dims.paged else (0, 0)
    stride_qb, stride_qs, stride_qh, stride_qd = q.stride()
    stride_kb, stride_ks, stride_kh, stride_kd = k.stride()
    stride_vb, stride_vs, stride_vh, stride_vd = v.stride()
    stride_kcp, stride_kcs, stride_kch, _ = k_cache.stride()
    stride_vcp, stride_vcs, stride_vch, _ = v_cache.stride()
    split = KernelLaunch(_attention_split_kernel, split_grid, {
        "q_ptr": q, "k_ptr": k, "v_ptr": v, "k_cache_ptr": k_cache, "v_cache_ptr": v_cache,
        "cache_seqlens_ptr": cache_seqlens, "num_causal_ptr": num_causal, "block_table_ptr": table,
        "part_acc_ptr": part_acc, "part_m_ptr": part_m, "part_l_ptr": part_l,
        "stride_qb": stride_qb, "stride_qs": stride_qs, "stride_qh": stride_qh, "stride_qd": stride_qd,
        "stride_kb": stride_kb, "stride_ks": stride_ks, "stride_kh": stride_kh, "stride_kd": stride_kd,
        "stride_vb": stride_vb, "stride_vs": stride_vs, "stride_vh": stride_vh, "stride_vd": stride_vd,
        "stride_kcp": stride_kcp, "stride_kcs": stride_kcs, "stride_kch": stride_kch,
        "stride_vcp": stride_vcp, "stride_vcs": stride_vcs, "stride_vch": stride_vch,
        "stride_len": cache_seqlens.stride(0), "stride_nc": num_causal.stride(0),
        "stride_btb": stride_btb, "stride_btp": stride_btp,
        # G = 1 when Hq = 0: the kernel divides row indices by G; M = 0 masks every row.
        "S": dims.seq, "C": dims.num_causal_slots, "Hkv": dims.kv_heads, "G": max(group, 1), "D": dims.head_dim,
        "M": rows, "pairs": bh, "capacity": dims.capacity, "page_size": dims.page_size,
        "num_pages": dims.num_pages,
        "split_len": plan.split_len, "num_splits": plan.num_splits, "softmax_scale": scale,
    }, {
        "PAGED": config.paged, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_D": config.block_d,
        "HALF_DOT": config.half_dot, "INPUT_PRECISION": config.input_precision, "ALIGNED": config.aligned,
    }, config.num_warps, config.num_stages)
    combine = KernelLaunch(_attention_combine_kernel, combine_grid, {
        "part_acc_ptr": part_acc, "part_m_ptr": part_m, "part_l_ptr": part_l, "cache_seqlens_ptr": cache_seqlens,
        "out_ptr": out, "lse_ptr": lse, "stride_len": cache_seqlens.stride(0),
        "stride_ob": out.stride(0), "stride_os": out.stride(1), "stride_oh": out.stride(2),
        "stride_lb": lse.stride(0), "stride_lh": lse.stride(1),
        "Hkv": dims.kv_heads, "G": group, "D": dims.head_dim, "M": rows, "pairs": bh, "capacity": dims.capacity,
        "split_len": plan.split_len, "num_splits": plan.num_splits,
    }, {"BLOCK_M": COMBINE_BLOCK_M, "BLOCK_D": config.block_d, "ALIGNED": config.aligned},
        COMBINE_WARPS[config.aligned])
    return out, lse, [split, combine] if rows else [split]


def block_attention_with_kvcache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor, num_causal: torch.Tensor, block_size: int,
    block_table: torch.Tensor | None = None, softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of the op (same signature and side effect); CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1. Returns out [B, S, Hq, D] (dtype of q) and lse [B, Hq, S] fp32. No host sync."""
    out, lse, launches = _attention_launches(q, k, v, k_cache, v_cache, cache_seqlens, num_causal, block_size,
                                             block_table, softmax_scale)
    launch(launches)
    return out, lse


_TRITON_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_BLOCK_D_CHOICES = (16, 32, 64, 128, 256)  # next power of two >= D (>= 16), D <= 256


def _spec_name(kl: KernelLaunch) -> str:
    """Readable id of the configuration a launch compiles: its dtype and constexprs."""
    c = kl.constexprs
    alignment = "aligned" if c["ALIGNED"] else "unaligned"
    if kl.kernel is _attention_combine_kernel:
        return f"attention/combine {_TRITON_DTYPES[kl.args['out_ptr'].dtype]} D{c['BLOCK_D']} {alignment}"
    return (f"attention/split {_TRITON_DTYPES[kl.args['q_ptr'].dtype]} M{c['BLOCK_M']} N{c['BLOCK_N']} "
            f"D{c['BLOCK_D']} {'paged' if c['PAGED'] else 'contig'} {alignment}")


def specs_of_launches(launches: list[KernelLaunch]) -> list[KernelSpec]:
    """The compile job of each launch, named by its configuration."""
    return [spec_of_launch(_spec_name(kl), kl) for kl in launches]


def meta_launches(batch: int, length: int, q_heads: int, kv_heads: int, head_dim: int, causal: int, block: int,
                  dtype: torch.dtype, paged: bool = False, page_size: int = 16) -> list[KernelLaunch]:
    """The launches of a call on fresh contiguous META tensors (no memory): q/k/v [B, C + K, H, D], a cache
    of `length` slots per sequence (paged: pages of `page_size`), [B] int32 index tensors. What a CUDA
    call with these shapes compiles; its rows are 16-byte aligned when D % 4 == 0."""
    meta = {"dtype": dtype, "device": "meta"}
    seq = causal + block
    q = torch.empty(batch, seq, q_heads, head_dim, **meta)
    k = torch.empty(batch, seq, kv_heads, head_dim, **meta)
    v = torch.empty_like(k)
    block_table = None
    cache_shape = (batch, length, kv_heads, head_dim)
    if paged:
        pages = cdiv(length, page_size)
        block_table = torch.empty(batch, pages, dtype=torch.int32, device="meta")
        cache_shape = (batch * pages, page_size, kv_heads, head_dim)
    k_cache, v_cache = torch.empty(cache_shape, **meta), torch.empty(cache_shape, **meta)
    cache_seqlens = torch.empty(batch, dtype=torch.int32, device="meta")
    num_causal = torch.empty_like(cache_seqlens)
    return _attention_launches(q, k, v, k_cache, v_cache, cache_seqlens, num_causal, block, block_table)[2]


def aot_specs() -> list[KernelSpec]:
    """Every configuration the launcher can pick on a GPU, from the launches of representative calls:
    dtype x head dim (D = BLOCK_D: aligned rows; D = BLOCK_D - 1: unaligned) x M = S * G rows of a KV
    group (G = 4, S = 4, 8, 16: each BLOCK_M) x contiguous / paged cache. A stage-1 configuration is
    dtype x alignment x BLOCK_D x BLOCK_M x paged, a combine one dtype x alignment x BLOCK_D."""
    launches = [kl for dtype in _TRITON_DTYPES for block_d in _BLOCK_D_CHOICES for head_dim in (block_d, block_d - 1)
                for seq in (4, 8, 16) for paged in (False, True)
                for kl in meta_launches(2, 1024, 8, 2, head_dim, seq // 2, seq // 2, dtype, paged)]
    return unique_specs(specs_of_launches(launches))


def picked_specs(batch: int, length: int, q_heads: int, kv_heads: int, head_dim: int, causal: int, block: int,
                 dtype: torch.dtype, paged: bool = False) -> list[str]:
    """Names (as in `aot_specs()`) of the split and combine configurations a CUDA call on fresh contiguous
    tensors of these shapes compiles (`meta_launches`)."""
    return [spec.name for spec in specs_of_launches(meta_launches(batch, length, q_heads, kv_heads, head_dim,
                                                                   causal, block, dtype, paged))]
