"""`torch_block_attention`: `sbd.block_attention_with_kvcache` in PyTorch, with what some HF layers ask for and the
op has no input for: a sliding window (keys W or more positions behind a row cut), attention-score soft-capping
(Gemma 2: scores s become c * tanh(s / c) before the softmax) and attention sinks (GPT-OSS: one learned logit per
head joins each row's softmax and weighs no value).

`sbd_attention` calls it for a layer whose window cuts keys in the pass (the pass spans more than W positions:
the cache's slots plus the block), whose scores are soft-capped or which has sinks; every other layer runs the op. Same arguments
(contiguous cache only), checks, row layout and side effect as the op: causal row i < c_b (position L_b + i) sees
the cache and causal rows j <= i; padding rows see nothing (out 0); block row j (position L_b + c_b + j) sees the
cache, the c_b causal rows and the block; the causal rows' K/V are written to cache slots [L_b, L_b + c_b). Static
shapes, no host sync: CUDA-graph safe and traceable by torch.compile(fullgraph=True).

What a pass's layers share (the mask, the cache slots read, the write indices) is built once per pass and window
(`PassPlan`); each layer then gathers its keys, attends and writes its cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from sbd_kernels.model import decode_positions
from sbd_kernels.ops.attention._checks import assert_block_attention_values, check_block_attention_args

# Query rows per chunk of the soft-capped attention, which holds its scores [B, Hq, rows, N] in fp32: at most this
# many elements (2^26: 256 MiB), so a long prefill does not hold a prompt-squared score matrix at once.
SCORE_ELEMENTS_PER_CHUNK = 2**26


@dataclass(frozen=True)
class PassPlan:
    """What every layer of one decode pass with the same window shares (`plan_pass`), built once per pass: each
    layer then costs its gathers, its attention and its cache writes. Both are host-bound at decode sizes: one bf16
    row, W = 32, 4 query heads of 64 on the 2-core EPYC at one thread took 0.56 ms per layer with the plan built in
    every layer, 0.26 ms for the plan and 0.23 ms per layer after it (the op: 0.015 ms).

    allowed `[B, 1, S, N]` bool over the keys [the `reach` cache slots before L_b ; the pass's S rows]
    (`pass_rows_mask`); past_slots `[B, reach]` those slots, clamped into the cache; key_unused `[B, N, 1, 1]` keys
    no row attends to (zeroed before attention); row_without_key `[B, S, 1, 1]` (padding rows: out 0);
    write_slots, write_rows `[B, C]` where `append_causal_rows` writes which row; keep_old `[B, C, 1, 1]` the
    sequences with no causal row (their writes put a slot's own value back); batch `[B, 1]` the batch index."""

    allowed: Tensor
    past_slots: Tensor
    key_unused: Tensor
    row_without_key: Tensor
    write_slots: Tensor
    write_rows: Tensor
    keep_old: Tensor
    batch: Tensor


def pass_rows_mask(seqlens: Tensor, num_causal: Tensor, num_slots: int, block_size: int, reach: int,
                   window: int | None) -> tuple[Tensor, Tensor]:
    """(allowed `[B, S, reach + S]` bool, past slots `[B, reach]` int64) of one decode pass.

    Keys are the `reach` cache slots before L_b (slot s holds position s; slots below 0 are never allowed) and then
    the pass's own S = C + K rows, in the op's row layout (module docstring). With a window W, a row at position p
    sees only keys at positions > p - W."""
    device = seqlens.device
    batch, rows = seqlens.shape[0], num_slots + block_size
    lengths, causal = seqlens.long()[:, None], num_causal.long()[:, None]
    past = lengths - reach + torch.arange(reach, device=device)                          # [B, reach]
    row = torch.arange(rows, device=device).expand(batch, rows)                           # [B, S]
    is_causal, is_block = row < causal, row >= num_slots
    key_row = torch.cat([torch.full_like(past, -1), row], dim=1)                          # [B, reach + S]
    key_is_past = torch.cat([past >= 0, torch.zeros_like(is_causal)], dim=1)
    key_is_causal = torch.cat([torch.zeros_like(past, dtype=torch.bool), is_causal], dim=1)
    key_is_block = torch.cat([torch.zeros_like(past, dtype=torch.bool), is_block], dim=1)
    causal_rows_see = key_is_past[:, None] | (key_is_causal[:, None] & (key_row[:, None] <= row[..., None]))
    block_rows_see = (key_is_past | key_is_causal | key_is_block)[:, None]
    allowed = (is_causal[..., None] & causal_rows_see) | (is_block[..., None] & block_rows_see)
    if window is not None:
        row_pos = decode_positions(seqlens, num_causal, num_slots, block_size)            # [B, S]
        key_pos = torch.cat([past, row_pos], dim=1)
        allowed &= row_pos[..., None] - key_pos[:, None] < window
    return allowed, past


def plan_pass(cache_seqlens: Tensor, num_causal: Tensor, num_slots: int, block_size: int, capacity: int,
              window: int | None) -> PassPlan:
    """The `PassPlan` of a pass with C = num_slots causal slots, K = block_size block rows, caches of `capacity`
    slots and a window of W (None: none; every cache slot is then read). Lengths are clamped into range, as the
    kernels do (the values are checked by `assert_block_attention_values`). The writes: every causal slot row
    writes, those past c_b repeating the last causal row's write (the same value to the same slot), and with
    c_b = 0 slot min(L_b, S_max - 1) gets its own value back: static shapes, no host sync, no slot outside the
    cache."""
    device = cache_seqlens.device
    lengths = cache_seqlens.long().clamp(0, capacity)[:, None]
    causal = num_causal.long().clamp(0, num_slots)[:, None]
    reach = capacity if window is None else min(window - 1, capacity)
    allowed, past = pass_rows_mask(lengths[:, 0], causal[:, 0], num_slots, block_size, reach, window)
    last_slot = max(capacity - 1, 0)
    rows = torch.minimum(torch.arange(num_slots, device=device), causal - 1)                # [B, C]; -1 if c_b = 0
    keep_old = causal == 0
    slots = torch.where(keep_old, lengths, lengths + rows).clamp(0, last_slot)
    return PassPlan(allowed=allowed[:, None], past_slots=past.clamp(0, last_slot),
                    key_unused=~allowed.any(dim=1)[..., None, None],
                    row_without_key=~allowed.any(dim=2)[..., None, None], write_slots=slots,
                    write_rows=rows.clamp(min=0), keep_old=keep_old[..., None, None],
                    batch=torch.arange(lengths.shape[0], device=device)[:, None])


def append_causal_rows(cache: Tensor, new: Tensor, plan: PassPlan) -> None:
    """cache[b, L_b + i] = new[b, i] for i < c_b (the op's side effect), by the writes of `plan`. new `[B, C, Hkv, D]`."""
    if new.shape[1] == 0 or cache.shape[1] == 0:
        return
    batch, slots = plan.batch, plan.write_slots
    cache[batch, slots] = torch.where(plan.keep_old, cache[batch, slots], new[batch, plan.write_rows])


def explicit_attention(q: Tensor, keys: Tensor, values: Tensor, allowed: Tensor, scale: float,
                       softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """Attention with the scores in hand, in fp32, in HF's eager order: s = scale q.k, capped to c * tanh(s / c),
    masked, then softmax over the row's keys and, with sinks, the head's sink logit z (weight
    exp(s_j) / (exp(z) + sum_i exp(s_i)) on value j; the sink's share weighs nothing). q `[B, Hq, S, D]`,
    keys / values `[B, Hq, N, D]`, allowed `[B, 1, S, N]`, sinks `[Hq]` -> `[B, Hq, S, D]` fp32 (a row without a
    key: NaN without sinks, 0 with them). Chunks of query rows keep each score block within
    SCORE_ELEMENTS_PER_CHUNK."""
    keys, values = keys.float(), values.float()
    batch, heads, rows, _ = q.shape
    sink = None if sinks is None else sinks.float().reshape(1, heads, 1, 1)
    chunk = max(1, SCORE_ELEMENTS_PER_CHUNK // max(1, batch * heads * keys.shape[2]))
    outs = []
    for start in range(0, rows, chunk):
        scores = torch.matmul(q[:, :, start:start + chunk].float(), keys.transpose(-1, -2)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~allowed[:, :, start:start + chunk], float("-inf"))
        if sink is None:
            outs.append(torch.matmul(torch.softmax(scores, dim=-1), values))
            continue
        top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
        weights = torch.exp(scores - top)
        total = weights.sum(dim=-1, keepdim=True) + torch.exp(sink - top)
        outs.append(torch.matmul(weights / total, values))
    return torch.cat(outs, dim=2)


def torch_block_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                          num_causal: Tensor, block_size: int, softmax_scale: float | None = None, *,
                          window: int | None = None, softcap: float | None = None, sinks: Tensor | None = None,
                          plans: dict[int | None, PassPlan] | None = None) -> Tensor:
    """`sbd.block_attention_with_kvcache` of one layer (module docstring) with a sliding window of W (a row at
    position p attends only to keys at positions > p - W), soft-capped scores (c * tanh(s / c)) and / or sinks
    (`[Hq]`, one logit per query head in every row's softmax).

    q `[B, S, Hq, D]`, k / v `[B, S, Hkv, D]`, caches `[B, S_max, Hkv, D]` -> out `[B, S, Hq, D]` (q's dtype;
    padding rows 0). Reads the min(W - 1, S_max) cache slots before L_b with a window (the oldest any row of the pass
    can reach, whatever L_b: O(W) per row however long the cache), every slot without one. Attention is
    `scaled_dot_product_attention` with the boolean mask over [cache slots read ; the pass's rows], or with
    soft-capping or sinks `explicit_attention` (fp32); keys no row attends to are zeroed first (a padding row's values are
    never read, as in the op). plans: the `PassPlan`s of the pass by window, shared by its layers: the one of this
    window is built here, with the op's value checks, when missing, and added."""
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"torch_block_attention: window must be None or an int >= 1, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"torch_block_attention: softcap must be None or > 0, got {softcap!r}")
    if sinks is not None and tuple(sinks.shape) != (q.shape[2],):
        raise ValueError(f"torch_block_attention: sinks must have shape [Hq] = [{q.shape[2]}] (one logit per query "
                         f"head), got {list(sinks.shape)}")
    dims = check_block_attention_args(q, k, v, k_cache, v_cache, cache_seqlens, num_causal, block_size, None,
                                      softmax_scale, aliasing=not torch.compiler.is_compiling())
    plans = {} if plans is None else plans
    if window not in plans:
        assert_block_attention_values(cache_seqlens, num_causal, dims)
        plans[window] = plan_pass(cache_seqlens, num_causal, dims.num_causal_slots, block_size, dims.capacity,
                                  window)
    plan = plans[window]
    batch, slots = plan.batch, plan.past_slots
    keys = torch.cat([k_cache[batch, slots], k], dim=1).masked_fill(plan.key_unused, 0)
    values = torch.cat([v_cache[batch, slots], v], dim=1).masked_fill(plan.key_unused, 0)
    group = dims.q_heads // dims.kv_heads
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=2), values.repeat_interleave(group, dim=2)
    scale = dims.head_dim ** -0.5 if softmax_scale is None else softmax_scale
    q, keys, values = q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=plan.allowed, scale=scale)
    else:
        out = explicit_attention(q, keys, values, plan.allowed, scale, softcap, sinks).to(q.dtype)
    out = out.transpose(1, 2).masked_fill(plan.row_without_key, 0)
    append_causal_rows(k_cache, k[:, :dims.num_causal_slots], plan)
    append_causal_rows(v_cache, v[:, :dims.num_causal_slots], plan)
    return out
