"""Pure-PyTorch oracle of `sbd.block_attention_with_kvcache`: literal math in fp32, one sequence at a time.

For sequence b with L = cache_seqlens[b], c = num_causal[b], C = S - K causal slots, the keys are
`[cache[0:L] ; k[b, 0:c] ; k[b, C:S]]` (length L + c + K) and the explicit boolean mask is

    causal row i < c      : cache all, causal rows j <= i, block none
    padding row c <= i < C: nothing  (out = 0, lse = -inf)
    block row C <= i < S  : cache all, causal rows all,  block all

    lse = log sum_j exp(scale * q_i . k_j)   over the allowed j,   out_i = sum_j exp(scale q_i.k_j - lse) v_j

Non-finite scores: a NaN or +inf score among a row's allowed keys makes its out and lse NaN; a -inf score
weighs exp(-inf) = 0, and a row whose every allowed score is -inf has no keys, as a padding row (out = 0,
lse = -inf).

GQA: query head h reads KV head h // (Hq / Hkv). Afterwards the causal rows' K/V are written into cache
slots [L, L + c) (contiguous cache, or the pages named by block_table); nothing else in the cache changes.
"""
from __future__ import annotations

import torch

from sbd_kernels.ops.attention._checks import (
    AttentionDims,
    assert_block_attention_values,
    check_block_attention_args,
)


def _slot_index(b: int, length: int, dims: AttentionDims, block_table: torch.Tensor | None,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, offset) of cache slots 0..length-1 of sequence b. Contiguous cache: page = b."""
    slots = torch.arange(length, device=device)
    if block_table is None:
        return torch.full_like(slots, b), slots
    return block_table[b].to(torch.int64)[slots // dims.page_size], slots % dims.page_size


def _decode_mask(length: int, causal: int, dims: AttentionDims, device: torch.device) -> torch.Tensor:
    """[S, L + c + K] bool: which keys each query row of one sequence may attend to."""
    s, c_slots = dims.seq, dims.num_causal_slots
    row = torch.arange(s, device=device)[:, None]
    col = torch.arange(length + causal + dims.block_size, device=device)[None, :]
    is_causal_row, is_block_row = row < causal, row >= c_slots
    cache_col = col < length
    causal_col = (col >= length) & (col < length + causal)
    block_col = col >= length + causal
    causal_allowed = cache_col | (causal_col & (col - length <= row))
    block_allowed = cache_col | causal_col | block_col
    return (is_causal_row & causal_allowed) | (is_block_row & block_allowed)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [S, Hq, D], keys/values [N, Hkv, D], mask [S, N] -> out [S, Hq, D] fp32, lse [Hq, S] fp32."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)  # [N, Hq, D]
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("shd,nhd->hsn", q, keys) * scale  # [Hq, S, N]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, S]; -inf for rows with no key (or only -inf scores)
    lse = lse.masked_fill(lse == float("inf"), float("nan"))  # logsumexp gives +inf for a +inf score
    no_keys = lse == float("-inf")
    # Subtract 0 in rows without keys: exp(-inf - 0) = 0, where exp(-inf - lse) would be exp(NaN).
    base = lse.masked_fill(no_keys, 0.0)
    probs = torch.where(mask[None], torch.exp(scores - base[..., None]), torch.zeros_like(scores))
    out = torch.einsum("hsn,nhd->shd", probs, values)
    # A row without keys is 0 even where a value is NaN (0 * NaN in the sum above).
    out = out.masked_fill(no_keys.t()[..., None], 0.0)
    return out, lse


def block_attention_with_kvcache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor, num_causal: torch.Tensor, block_size: int,
    block_table: torch.Tensor | None = None, softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Oracle of the op (same signature and side effect). Returns out [B, S, Hq, D] (q.dtype), lse [B, Hq, S] fp32."""
    dims = check_block_attention_args(q, k, v, k_cache, v_cache, cache_seqlens, num_causal, block_size,
                                      block_table, softmax_scale)
    assert_block_attention_values(cache_seqlens, num_causal, dims, block_table)
    scale = dims.head_dim ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(dims.batch, dims.q_heads, dims.seq, dtype=torch.float32, device=q.device)
    c_slots = dims.num_causal_slots
    for b, (length, causal) in enumerate(zip(cache_seqlens.tolist(), num_causal.tolist())):
        page, offset = _slot_index(b, length, dims, block_table, q.device)
        keys = torch.cat([k_cache[page, offset], k[b, :causal], k[b, c_slots:]]).float()
        values = torch.cat([v_cache[page, offset], v[b, :causal], v[b, c_slots:]]).float()
        mask = _decode_mask(length, causal, dims, q.device)
        out[b], lse[b] = _attend(q[b].float(), keys, values, mask, scale)
        new_page, new_offset = _slot_index(b, length + causal, dims, block_table, q.device)
        k_cache[new_page[length:], new_offset[length:]] = k[b, :causal]
        v_cache[new_page[length:], new_offset[length:]] = v[b, :causal]
    return out.to(q.dtype), lse
