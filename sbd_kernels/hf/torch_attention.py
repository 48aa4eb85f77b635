"""`torch_block_attention`: `sbd.block_attention_with_kvcache` in PyTorch, with what some HF layers ask for and the
op has no input for: a sliding window (keys W or more positions behind a row cut), attention-score soft-capping
(Gemma 2: scores s become c * tanh(s / c) before the softmax) and attention sinks (GPT-OSS: one learned logit per
head joins each row's softmax and weighs no value).

`sbd_attention` calls it for a layer whose window cuts keys in the pass (the pass spans more than W positions:
the cache's slots plus the block), whose scores are soft-capped, which has sinks or whose heads are larger than the
kernels take (MAX_HEAD_DIM); every other layer runs the op. Same arguments (contiguous cache only), checks (but the
head-size limit), row layout and side effect as the op: causal row i < c_b (position L_b + i) sees
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

# Pass rows per chunk of attention: a chunk of R rows holds its mask tiled per query head of a KV head [B, Hq / Hkv * R,
# N] and, with soft-capping or sinks, its scores [B, Hq, R, N] in fp32: at most this many elements (2^26: 256 MiB
# of scores), so that a long prefill does not hold a prompt-squared score matrix at once.
SCORE_ELEMENTS_PER_CHUNK = 2**26


@dataclass(frozen=True)
class PassPlan:
    """What every layer of one decode pass with the same window shares (`plan_pass`), built once per pass: each
    layer then costs its gathers, its attention and its cache writes. Both are host-bound at decode sizes: one bf16
    row, W = 32, 4 query heads of 64 on the 2-core EPYC at one thread took 0.56 ms per layer with the plan built in
    every layer, 0.26 ms for the plan and 0.14-0.15 ms per layer after it (the op: 0.015 ms).

    Keys are [the cache slots read ; the pass's S rows]: with a window the `reach` slots before L_b, gathered
    (past_slots `[B, reach]`, clamped into the cache), without one every slot in place (past_slots None).
    allowed `[B, 1, S, N]` bool (`pass_rows_mask`); key_unused `[B, N, 1, 1]` keys no row attends to (zeroed before
    attention); row_without_key `[B, S, 1, 1]` (padding rows: out 0); write_slots, write_rows `[B, C]` where
    `append_causal_rows` writes which row; keep_old `[B, C, 1, 1]` the sequences with no causal row (their writes
    put a slot's own value back); batch `[B, 1]` the batch index."""

    allowed: Tensor
    past_slots: Tensor | None
    key_unused: Tensor
    row_without_key: Tensor
    write_slots: Tensor
    write_rows: Tensor
    keep_old: Tensor
    batch: Tensor


def pass_rows_mask(seqlens: Tensor, num_causal: Tensor, num_slots: int, block_size: int, past: Tensor,
                   window: int | None) -> Tensor:
    """allowed `[B, S, P + S]` bool of one decode pass: may the pass's row attend to the key.

    Keys are P cache slots holding positions past `[B, P]` (only those in [0, L_b) hold keys: the others are never
    allowed) and then the pass's own S = C + K rows, in the op's row layout (module docstring). With a window W, a
    row at position p sees only keys at positions > p - W."""
    device = seqlens.device
    batch, rows = seqlens.shape[0], num_slots + block_size
    lengths, causal = seqlens.long()[:, None], num_causal.long()[:, None]
    row = torch.arange(rows, device=device).expand(batch, rows)                           # [B, S]
    is_causal, is_block = row < causal, row >= num_slots
    key_row = torch.cat([torch.full_like(past, -1), row], dim=1)                          # [B, P + S]
    key_is_past = torch.cat([(past >= 0) & (past < lengths), torch.zeros_like(is_causal)], dim=1)
    key_is_causal = torch.cat([torch.zeros_like(past, dtype=torch.bool), is_causal], dim=1)
    key_is_block = torch.cat([torch.zeros_like(past, dtype=torch.bool), is_block], dim=1)
    causal_rows_see = key_is_past[:, None] | (key_is_causal[:, None] & (key_row[:, None] <= row[..., None]))
    block_rows_see = (key_is_past | key_is_causal | key_is_block)[:, None]
    allowed = (is_causal[..., None] & causal_rows_see) | (is_block[..., None] & block_rows_see)
    if window is not None:
        row_pos = decode_positions(seqlens, num_causal, num_slots, block_size)            # [B, S]
        key_pos = torch.cat([past, row_pos], dim=1)
        allowed &= row_pos[..., None] - key_pos[:, None] < window
    return allowed


def plan_pass(cache_seqlens: Tensor, num_causal: Tensor, num_slots: int, block_size: int, capacity: int,
              window: int | None) -> PassPlan:
    """The `PassPlan` of a pass with C = num_slots causal slots, K = block_size block rows, caches of `capacity`
    slots and a window of W (None: none; every cache slot is then read in place). Lengths are clamped into range,
    as the kernels do (the values are checked by `assert_block_attention_values`). The writes: every causal slot
    row writes, those past c_b repeating the last causal row's write (the same value to the same slot), and with
    c_b = 0 slot min(L_b, S_max - 1) gets its own value back: static shapes, no host sync, no slot outside the
    cache."""
    device = cache_seqlens.device
    batch = cache_seqlens.shape[0]
    lengths = cache_seqlens.long().clamp(0, capacity)[:, None]
    causal = num_causal.long().clamp(0, num_slots)[:, None]
    last_slot = max(capacity - 1, 0)
    if window is None:
        past = torch.arange(capacity, device=device).expand(batch, capacity)              # slot s: position s
        past_slots = None
    else:
        reach = min(window - 1, capacity)                                                 # the oldest key in reach
        past = lengths - reach + torch.arange(reach, device=device)
        past_slots = past.clamp(0, last_slot)
    allowed = pass_rows_mask(lengths[:, 0], causal[:, 0], num_slots, block_size, past, window)
    rows = torch.minimum(torch.arange(num_slots, device=device), causal - 1)                # [B, C]; -1 if c_b = 0
    keep_old = causal == 0
    slots = torch.where(keep_old, lengths, lengths + rows).clamp(0, last_slot)
    return PassPlan(allowed=allowed[:, None], past_slots=past_slots,
                    key_unused=~allowed.any(dim=1)[..., None, None],
                    row_without_key=~allowed.any(dim=2)[..., None, None], write_slots=slots,
                    write_rows=rows.clamp(min=0), keep_old=keep_old[..., None, None],
                    batch=torch.arange(batch, device=device)[:, None])


def append_causal_rows(cache: Tensor, new: Tensor, plan: PassPlan) -> None:
    """cache[b, L_b + i] = new[b, i] for i < c_b (the op's side effect), by the writes of `plan`. new `[B, C, Hkv, D]`."""
    if new.shape[1] == 0 or cache.shape[1] == 0:
        return
    batch, slots = plan.batch, plan.write_slots
    cache[batch, slots] = torch.where(plan.keep_old, cache[batch, slots], new[batch, plan.write_rows])


def explicit_attention(q: Tensor, keys: Tensor, values: Tensor, allowed: Tensor, scale: float,
                       softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """Attention with the scores in hand, in fp32, in HF's eager order: s = scale q.k, capped to c * tanh(s / c),
    masked, then softmax over the row's keys and, with sinks, the row's sink logit z (weight
    exp(s_j) / (exp(z) + sum_i exp(s_i)) on value j; the sink's share weighs nothing). q `[B, H, R, D]`,
    keys / values `[B, H, N, D]`, allowed `[B, 1, R, N]`, sinks `[H, R]` -> `[B, H, R, D]` fp32 (a row without a
    key: NaN without sinks, 0 with them)."""
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), values.float())
    sink = sinks.float()[None, ..., None]                                                  # [1, H, R, 1]
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
    weights = torch.exp(scores - top)
    total = weights.sum(dim=-1, keepdim=True) + torch.exp(sink - top)
    return torch.matmul(weights / total, values.float())


def group_query_rows(x: Tensor, kv_heads: int) -> Tensor:
    """`[B, R, Hq, D]` -> `[B, Hkv, g * R, D]` (g = Hq / Hkv): the g query heads of a KV head as one head of g * R
    rows (row j * R + r: query head h * g + j, row r), so that attention reads each KV head's keys once instead of
    repeating them g times. On one core of the 2-core EPYC, 32 query heads of 128 over 8 KV heads, 9 bf16 rows: a
    layer with W = 4096 (8000 cached) took 44 ms against 85 ms with the keys and values repeated (35 ms of it the
    repeat), a soft-capped one over an 8192-slot cache 114 ms against 331 ms."""
    batch, rows, heads, dim = x.shape
    return x.transpose(1, 2).reshape(batch, kv_heads, heads // kv_heads * rows, dim)


def ungroup_query_rows(x: Tensor, q_heads: int) -> Tensor:
    """The inverse of `group_query_rows`: `[B, Hkv, g * R, D]` -> `[B, R, Hq, D]` (a view)."""
    batch, kv_heads, grouped_rows, dim = x.shape
    return x.reshape(batch, q_heads, grouped_rows // (q_heads // kv_heads), dim).transpose(1, 2)


def attend_grouped(q: Tensor, keys: Tensor, values: Tensor, allowed: Tensor, scale: float, softcap: float | None,
                   sinks: Tensor | None) -> Tensor:
    """Attention of q `[B, R, Hq, D]` over keys / values `[B, Hkv, N, D]` under allowed `[B, 1, R, N]`, with the
    query rows grouped by KV head (`group_query_rows`), in chunks of rows of at most SCORE_ELEMENTS_PER_CHUNK
    scores: `scaled_dot_product_attention`, or `explicit_attention` with soft-capping or sinks `[Hq]`. -> `[B, R,
    Hq, D]` in q's dtype."""
    batch, rows, heads, _ = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    chunk = max(1, SCORE_ELEMENTS_PER_CHUNK // max(1, batch * heads * keys.shape[2]))
    explicit = softcap is not None or sinks is not None
    if explicit:                                                         # upcast once, not once per chunk
        keys, values = keys.float(), values.float()
    outs = []
    for start in range(0, max(rows, 1), chunk):                         # a pass of no rows: one empty chunk
        q_rows, mask = q[:, start:start + chunk], allowed[:, :, start:start + chunk]
        size = q_rows.shape[1]
        grouped_q = group_query_rows(q_rows, kv_heads)
        mask = mask if group == 1 else mask.repeat(1, 1, group, 1)
        if not explicit:
            out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=mask, scale=scale)
        else:
            row_sinks = None if sinks is None else sinks.reshape(kv_heads, group).repeat_interleave(size, dim=1)
            out = explicit_attention(grouped_q, keys, values, mask, scale, softcap, row_sinks).to(q.dtype)
        outs.append(ungroup_query_rows(out, heads))
    return torch.cat(outs, dim=1)


def torch_block_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                          num_causal: Tensor, block_size: int, softmax_scale: float | None = None, *,
                          window: int | None = None, softcap: float | None = None, sinks: Tensor | None = None,
                          plans: dict[int | None, PassPlan] | None = None) -> Tensor:
    """`sbd.block_attention_with_kvcache` of one layer (module docstring) with a sliding window of W (a row at
    position p attends only to keys at positions > p - W), soft-capped scores (c * tanh(s / c)) and / or sinks
    (`[Hq]`, one logit per query head in every row's softmax).

    q `[B, S, Hq, D]`, k / v `[B, S, Hkv, D]`, caches `[B, S_max, Hkv, D]` -> out `[B, S, Hq, D]` (q's dtype;
    padding rows 0). Reads the min(W - 1, S_max) cache slots before L_b with a window (the oldest any row of the pass
    can reach, whatever L_b: O(W) per row however long the cache), every slot in place without one. Attention is
    `attend_grouped` with the boolean mask over [cache slots read ; the pass's rows]; keys no row attends to are
    zeroed first (a padding row's values are never read, as in the op). plans: the `PassPlan`s of the pass by
    window, shared by its layers: the one of this window is built here, with the op's value checks, when missing,
    and added."""
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"torch_block_attention: window must be None or an int >= 1, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"torch_block_attention: softcap must be None or > 0, got {softcap!r}")
    if sinks is not None and tuple(sinks.shape) != (q.shape[2],):
        raise ValueError(f"torch_block_attention: sinks must have shape [Hq] = [{q.shape[2]}] (one logit per query "
                         f"head), got {list(sinks.shape)}")
    dims = check_block_attention_args(q, k, v, k_cache, v_cache, cache_seqlens, num_causal, block_size, None,
                                      softmax_scale, aliasing=not torch.compiler.is_compiling(), max_head_dim=None)
    plans = {} if plans is None else plans
    if window not in plans:
        assert_block_attention_values(cache_seqlens, num_causal, dims)
        plans[window] = plan_pass(cache_seqlens, num_causal, dims.num_causal_slots, block_size, dims.capacity,
                                  window)
    plan = plans[window]
    past_keys, past_values = ((k_cache, v_cache) if plan.past_slots is None else
                              (k_cache[plan.batch, plan.past_slots], v_cache[plan.batch, plan.past_slots]))
    keys = torch.cat([past_keys, k], dim=1).masked_fill_(plan.key_unused, 0).transpose(1, 2)
    values = torch.cat([past_values, v], dim=1).masked_fill_(plan.key_unused, 0).transpose(1, 2)
    scale = dims.head_dim ** -0.5 if softmax_scale is None else softmax_scale
    out = attend_grouped(q, keys, values, plan.allowed, scale, softcap, sinks).masked_fill(plan.row_without_key, 0)
    append_causal_rows(k_cache, k[:, :dims.num_causal_slots], plan)
    append_causal_rows(v_cache, v[:, :dims.num_causal_slots], plan)
    return out
