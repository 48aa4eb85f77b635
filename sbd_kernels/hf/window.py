"""Sliding-window layers: which layers apply a window (`attention_window`, `layer_window`) and their masks
(`window_band`, `mask_by_layer_type`).

HF's windowed layer lets the query at position p attend to the keys at positions p - W < kv <= p. SBD keeps that
bound for every row of a windowed layer, on top of its own rules: in a decode pass (besides the op's row layout:
causal rows see the cache and the causal rows up to themselves, block rows the cache, all causal rows and the
whole block) and in training (besides the SBD training mask, positions counted within each half), a row at
position p sees only keys at positions > p - W. So a block row at position p weighs the same keys in training as
in decoding. While a pass spans at most W positions (the cache's slots plus the block) no key is that far back
and the op itself computes the windowed layer; past that, `sbd_attention` calls
`sbd_kernels.hf.torch_attention.torch_block_attention`, which applies the bound. Full layers run the op.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

# Families whose attention layers read config.sliding_window only where config.layer_types says
# "sliding_attention" (and whose masks HF builds by layer type), read in their modeling code: for them the layer
# types alone say whether a window applies. dots.llm1 configs keep the default window of 4096 with every layer typed
# full (its windowed layers would start at max_window_layers = 62, past the last). Other families pass the window to
# every layer (Mistral, Mixtral, Phi-3, StarCoder2, Qwen3-MoE), so a window in their config applies whatever the
# layer types.
LAYER_TYPED_WINDOW_MODEL_TYPES = ("qwen2", "qwen3", "qwen2_moe", "dots1", "exaone4", "gemma3_text", "olmo3", "cohere2",
                                  "ministral", "cwm", "exaone_moe", "afmoe", "mellum", "laguna", "kolibri1", "beam",
                                  "cohere2_moe", "gemma2", "vaultgemma", "gpt_oss", "granite_swa", "granitemoe_swa",
                                  "ergo", "gemma4_text", "gemma4_unified_text", "gemma3n_text")


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
