"""Sliding-window layers: which layers apply a window (`attention_window`, `layer_window`), their masks
(`window_band`, `mask_by_layer_type`), and their attention in a decode pass that reaches past the window
(`windowed_block_attention`).

HF's windowed layer lets the query at position p attend to the keys at positions p - W < kv <= p. SBD keeps that
bound for every row of a windowed layer, on top of its own rules: in a decode pass (besides the op's row layout:
causal rows see the cache and the causal rows up to themselves, block rows the cache, all causal rows and the
whole block) and in training (besides the SBD training mask, positions counted within each half), a row at
position p sees only keys at positions > p - W. So a block row at position p weighs the same keys in training as
in decoding. While a pass spans at most W positions (the cache's slots plus the block) no key is that far back
and the op itself computes the windowed layer; past that, `sbd_attention` calls `windowed_block_attention`, which
applies the bound. Full layers always run the op.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from sbd_kernels.model import decode_positions
from sbd_kernels.ops.attention._checks import assert_block_attention_values, check_block_attention_args

# Families whose attention layers read config.sliding_window only where config.layer_types says
# "sliding_attention" (and whose masks HF builds by layer type), read in their modeling code: for them the layer
# types alone say whether a window applies. dots.llm1 configs keep the default window of 4096 with every layer typed
# full (its windowed layers would start at max_window_layers = 62, past the last). Other families pass the window to
# every layer (Mistral, Mixtral, Phi-3, StarCoder2, Qwen3-MoE), so a window in their config applies whatever the
# layer types.
LAYER_TYPED_WINDOW_MODEL_TYPES = ("qwen2", "qwen3", "qwen2_moe", "dots1", "exaone4", "gemma3_text", "olmo3", "cohere2",
                                  "ministral", "cwm", "exaone_moe", "afmoe", "mellum", "laguna", "kolibri1", "beam")


def attention_window(config: Any) -> int | None:
    """W, the window of the config's sliding-window layers, or None when every layer attends to its whole prefix.
    HF's windowed layer lets the query at index q attend to the keys at q - W < kv <= q. A sliding_window of 0 means
    none (Qwen2-MoE configs store 0 when use_sliding_window is off); in LAYER_TYPED_WINDOW_MODEL_TYPES it applies
    only when a layer is typed sliding_attention (dots.llm1 configs keep 4096 with every layer full)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    if (getattr(config, "model_type", None) in LAYER_TYPED_WINDOW_MODEL_TYPES
            and "sliding_attention" not in (getattr(config, "layer_types", None) or ())):
        return None
    return int(window)


def layer_window(config: Any, layer_idx: int) -> int | None:
    """The window of layer `layer_idx`, as HF builds its mask: the config's window (`attention_window`) in every
    layer, or in LAYER_TYPED_WINDOW_MODEL_TYPES only in the layers typed sliding_attention; None for a full layer."""
    window = attention_window(config)
    if window is None or getattr(config, "model_type", None) not in LAYER_TYPED_WINDOW_MODEL_TYPES:
        return window
    return window if config.layer_types[layer_idx] == "sliding_attention" else None


def windowed_rows_mask(seqlens: Tensor, num_causal: Tensor, num_slots: int, block_size: int, reach: int,
                       window: int) -> tuple[Tensor, Tensor]:
    """(allowed `[B, S, reach + S]` bool, past slots `[B, reach]` int64) of one windowed decode pass.

    Keys are the `reach` cache slots before L_b (slot s holds position s; slots below 0 are never allowed) and then
    the pass's own S = C + K rows. Row layout as the op's: causal row i < c_b (position L_b + i) sees the cache and
    causal rows j <= i; padding rows see nothing; block row j (position L_b + c_b + j) sees the cache, the c_b causal
    rows and the block. On top, a row at position p sees only keys at positions > p - W."""
    device = seqlens.device
    batch, rows = seqlens.shape[0], num_slots + block_size
    lengths, causal = seqlens.long()[:, None], num_causal.long()[:, None]
    past = lengths - reach + torch.arange(reach, device=device)                          # [B, reach]
    row = torch.arange(rows, device=device).expand(batch, rows)                           # [B, S]
    row_pos = decode_positions(seqlens, num_causal, num_slots, block_size)                # [B, S]
    is_causal, is_block = row < causal, row >= num_slots
    key_pos = torch.cat([past, row_pos], dim=1)                                           # [B, reach + S]
    key_row = torch.cat([torch.full_like(past, -1), row], dim=1)
    key_is_past = torch.cat([past >= 0, torch.zeros_like(is_causal)], dim=1)
    key_is_causal = torch.cat([torch.zeros_like(past, dtype=torch.bool), is_causal], dim=1)
    key_is_block = torch.cat([torch.zeros_like(past, dtype=torch.bool), is_block], dim=1)
    causal_rows_see = key_is_past[:, None] | (key_is_causal[:, None] & (key_row[:, None] <= row[..., None]))
    block_rows_see = (key_is_past | key_is_causal | key_is_block)[:, None]
    allowed = (is_causal[..., None] & causal_rows_see) | (is_block[..., None] & block_rows_see)
    allowed &= row_pos[..., None] - key_pos[:, None] < window
    return allowed, past


@dataclass(frozen=True)
class WindowedPass:
    """What every windowed layer of one decode pass shares (`plan_windowed_pass`): built once per pass, each layer
    then costs its gathers, one SDPA call and its cache writes. Both are host-bound at decode sizes: one bf16 row,
    W = 32, 4 query heads of 64 on the 2-core EPYC at one thread took 0.56 ms per layer with the plan built in
    every layer, 0.26 ms for the plan and 0.23 ms per layer after it (the op: 0.015 ms).

    allowed `[B, 1, S, N]` bool over the keys [the `reach` cache slots before L_b ; the pass's S rows]
    (`windowed_rows_mask`); past_slots `[B, reach]` those slots, clamped into the cache; key_unused `[B, N, 1, 1]`
    keys no row attends to (zeroed before attention); row_without_key `[B, S, 1, 1]` (padding rows: out 0);
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


def plan_windowed_pass(cache_seqlens: Tensor, num_causal: Tensor, num_slots: int, block_size: int, capacity: int,
                       window: int) -> WindowedPass:
    """The `WindowedPass` of a pass with C = num_slots causal slots, K = block_size block rows, caches of
    `capacity` slots and a window of W. Lengths are clamped into range, as the kernels do (the values are checked
    by `assert_block_attention_values`). The writes: every causal slot row writes, those past c_b repeating the
    last causal row's write (the same value to the same slot), and with c_b = 0 slot min(L_b, S_max - 1) gets its
    own value back: static shapes, no host sync, no slot outside the cache."""
    device = cache_seqlens.device
    lengths = cache_seqlens.long().clamp(0, capacity)[:, None]
    causal = num_causal.long().clamp(0, num_slots)[:, None]
    reach = min(window - 1, capacity)
    allowed, past = windowed_rows_mask(lengths[:, 0], causal[:, 0], num_slots, block_size, reach, window)
    rows = torch.minimum(torch.arange(num_slots, device=device), causal - 1)                # [B, C]; -1 if c_b = 0
    keep_old = causal == 0
    slots = torch.where(keep_old, lengths, lengths + rows).clamp(0, max(capacity - 1, 0))
    return WindowedPass(allowed=allowed[:, None], past_slots=past.clamp(0, max(capacity - 1, 0)),
                        key_unused=~allowed.any(dim=1)[..., None, None],
                        row_without_key=~allowed.any(dim=2)[..., None, None], write_slots=slots,
                        write_rows=rows.clamp(min=0), keep_old=keep_old[..., None, None],
                        batch=torch.arange(lengths.shape[0], device=device)[:, None])


def append_causal_rows(cache: Tensor, new: Tensor, plan: WindowedPass) -> None:
    """cache[b, L_b + i] = new[b, i] for i < c_b (the op's side effect), by the writes of `plan`. new `[B, C, Hkv, D]`."""
    if new.shape[1] == 0 or cache.shape[1] == 0:
        return
    batch, slots = plan.batch, plan.write_slots
    cache[batch, slots] = torch.where(plan.keep_old, cache[batch, slots], new[batch, plan.write_rows])


def windowed_block_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                             cache_seqlens: Tensor, num_causal: Tensor, block_size: int, window: int,
                             softmax_scale: float | None = None,
                             plans: dict[int, WindowedPass] | None = None) -> Tensor:
    """`sbd.block_attention_with_kvcache` of a sliding-window layer: the op's arguments, row layout, checks and
    side effect (the causal rows' K/V written to cache slots [L_b, L_b + c_b)), contiguous cache only, and every
    row at position p attending only to keys at positions > p - W (`windowed_rows_mask`).

    q `[B, S, Hq, D]`, k / v `[B, S, Hkv, D]`, caches `[B, S_max, Hkv, D]` -> out `[B, S, Hq, D]` (q's dtype;
    padding rows 0). Reads the min(W - 1, S_max) cache slots before L_b, the oldest any row of the pass can reach,
    whatever L_b: O(W) per row however long the cache, static shapes, no host sync (CUDA-graph safe). Attention is
    `scaled_dot_product_attention` with the boolean mask over [past slots ; the pass's rows], keys unused by every
    row zeroed first (a padding row's values are never read, as in the op). plans: the `WindowedPass`es of the
    pass by window, shared by its windowed layers: the one of W is built here, with the op's value checks, when
    missing, and added."""
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"windowed_block_attention: window must be an int >= 1, got {window!r}")
    dims = check_block_attention_args(q, k, v, k_cache, v_cache, cache_seqlens, num_causal, block_size, None,
                                      softmax_scale, aliasing=not torch.compiler.is_compiling())
    plans = {} if plans is None else plans
    if window not in plans:
        assert_block_attention_values(cache_seqlens, num_causal, dims)
        plans[window] = plan_windowed_pass(cache_seqlens, num_causal, dims.num_causal_slots, block_size,
                                           dims.capacity, window)
    plan = plans[window]
    batch, slots = plan.batch, plan.past_slots
    keys = torch.cat([k_cache[batch, slots], k], dim=1).masked_fill(plan.key_unused, 0)
    values = torch.cat([v_cache[batch, slots], v], dim=1).masked_fill(plan.key_unused, 0)
    group = dims.q_heads // dims.kv_heads
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=2), values.repeat_interleave(group, dim=2)
    scale = dims.head_dim ** -0.5 if softmax_scale is None else softmax_scale
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=plan.allowed, scale=scale)
    out = out.transpose(1, 2).masked_fill(plan.row_without_key, 0)
    append_causal_rows(k_cache, k[:, :dims.num_causal_slots], plan)
    append_causal_rows(v_cache, v[:, :dims.num_causal_slots], plan)
    return out


def window_band(positions: Tensor, window: int) -> Tensor:
    """`[B, T, T]` bool: key j lies fewer than W positions behind query i (positions[b, i] - positions[b, j] < W),
    the bound a windowed layer adds to any mask (positions `[B, T]`; keys ahead of the query pass it)."""
    return positions[:, :, None] - positions[:, None, :] < window


def mask_by_layer_type(config: Any, build: Callable[[int | None], Any]) -> Any:
    """The attention mask a model takes, from `build(window)` (window None: no window): `build(None)` for a model
    without sliding-window layers; for one with them, `build(W)` alone for the families that window every layer,
    or a dict keyed by layer type, `{"full_attention": build(None), "sliding_attention": build(W)}`, for
    LAYER_TYPED_WINDOW_MODEL_TYPES (their models index it with each layer's `config.layer_types` entry). HF takes a
    given mask as it is: without this, a windowed layer would attend past its window."""
    window = attention_window(config)
    if window is None:
        return build(None)
    if getattr(config, "model_type", None) not in LAYER_TYPED_WINDOW_MODEL_TYPES:
        return build(window)
    return {"full_attention": build(None), "sliding_attention": build(window)}
