"""The "sbd" attention implementation registered with transformers' `AttentionInterface`, and its mask function.

A model prepared by `sbd_kernels.hf.enable_sbd` runs every attention layer through `sbd_attention`:

- inside an SBD decode pass (`SbdCausalLM.decode_pass` passes `sbd_pass=SbdPass(...)` down through the model's
  kwargs, and records it for decoder layers that drop their kwargs: `active_pass`), it calls
  `sbd.block_attention_with_kvcache` on the layer's slice of the `SbdCache`: causal rows are appended to the cache,
  the block is never cached, and the mask is the op's row layout (no mask tensor); a sliding-window layer in a pass
  that spans more than its window, a layer with soft-capped scores (Gemma 2), one with attention sinks (GPT-OSS)
  and one whose heads are larger than the kernels take (Gemma 4's full layers: 512 > MAX_HEAD_DIM = 256) call
  `torch_block_attention` instead (the same in PyTorch, with the window, the cap and the sinks);
- in every other call (training, HF `generate`, a plain forward) it runs the attention implementation the model
  had before (`config.sbd_base_attn_implementation`: "sdpa", "eager" or "flex_attention"), with the mask HF or the
  SBD data collator built for that implementation. The mask function of "sbd" likewise delegates to the base
  implementation's, so HF builds the masks that implementation expects (a custom attention name without a mask
  function would receive `attention_mask=None` and silently attend everywhere).

HF passes q `[B, Hq, S, D]` and k / v `[B, Hkv, S, D]` (RoPE applied); the op takes `[B, S, H, D]`: the transposes
below are views, read in place by the op.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from sbd_kernels.hf.torch_attention import PassPlan, torch_block_attention
from sbd_kernels.hf.window import layer_window
from sbd_kernels.ops.attention._checks import MAX_HEAD_DIM

ATTN_IMPLEMENTATION = "sbd"
BASE_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention")

# The 4-D attention_mask of an SBD decode pass: HF returns any 4-D mask unchanged (no mask is built for the pass;
# the op's row layout is the mask), and `sbd_attention` checks that it received exactly this object.
SBD_PASS_MASK = torch.empty(0, 0, 0, 0, dtype=torch.bool)


@dataclass(frozen=True)
class SbdPass:
    """What an SBD decode pass hands every attention layer: the cache, the pass's row layout and the kernel.

    cache: the `SbdCache` of the decode. num_causal: `[B]` int32 causal rows of each sequence in this pass.
    block_size: K block rows at the end of every sequence's rows. attention_op: `sbd.block_attention_with_kvcache`
    or an implementation with its signature (the naive oracle). torch_plans: the `PassPlan` of each window (None:
    none) of the layers that run `torch_block_attention`, built by the first of them and shared by the others.
    """

    cache: Any
    num_causal: Tensor
    block_size: int
    attention_op: Callable
    torch_plans: dict[int | None, PassPlan] = field(default_factory=dict, compare=False, repr=False)


# The passes in flight, per thread, by the id of the model's config: the attention modules of every family share the
# model's config, also those whose decoder layers call attention without their keyword arguments (StableLM,
# Nemotron), where `sbd_pass` never arrives. Per thread, so that threads decoding with one model each find their own
# pass (a record on the config itself was overwritten and removed by the other threads' passes).
_ACTIVE_PASSES = threading.local()


def _thread_passes() -> dict[int, SbdPass]:
    if not hasattr(_ACTIVE_PASSES, "by_config"):
        _ACTIVE_PASSES.by_config = {}
    return _ACTIVE_PASSES.by_config


def current_pass(config: Any) -> SbdPass | None:
    """The decode pass this thread is running on the model of `config` (`active_pass`), or None."""
    return _thread_passes().get(id(config))


@contextlib.contextmanager
def active_pass(config: Any, sbd_pass: SbdPass) -> Iterator[None]:
    """Records `sbd_pass` as this thread's pass on the model of `config` for the duration of one decode pass
    (removed after, also on an error)."""
    passes = _thread_passes()
    passes[id(config)] = sbd_pass
    try:
        yield
    finally:
        del passes[id(config)]


def base_implementation(config: Any) -> str:
    """The attention implementation "sbd" delegates to outside decode passes (recorded by `enable_sbd`)."""
    base = getattr(config, "sbd_base_attn_implementation", None)
    if base not in BASE_IMPLEMENTATIONS:
        raise RuntimeError(
            f"sbd attention: the model config names no base attention implementation (got {base!r}); prepare the "
            "model with sbd_kernels.hf.enable_sbd(model, ...)")
    return base


def mask_implementation(config: Any, caller: str) -> str:
    """The implementation whose form an attention mask given to the model must take: the base `enable_sbd`
    recorded, while the model runs "sbd" (which hands masks to the base) or the base itself (a saved SBD model
    reloaded with that attn_implementation). `config` must be the model's own config object, which follows
    `set_attn_implementation`.

    Raises RuntimeError when the model runs another implementation (reloaded with another attn_implementation, or
    switched by set_attn_implementation after enable_sbd): a mask in the base's form reaches that implementation
    directly, outside the check of `sbd_attention`, and is misread with no error (eager attention adds the boolean
    sdpa mask to the scores as 1 / 0: a wrong training loss)."""
    base = base_implementation(config)
    current = getattr(config, "_attn_implementation", None)
    if current in (ATTN_IMPLEMENTATION, base):
        return base
    if current is None:
        raise RuntimeError(
            f"{caller}: the config does not say which attention implementation the model runs (a config loaded on "
            "its own?); pass the model's own config, model.config")
    raise RuntimeError(
        f"{caller}: the model runs attention implementation {current!r}, but enable_sbd recorded {base!r}, and a "
        f"mask built for {base!r} would be misread by {current!r} without an error (eager attention adds a boolean "
        "mask to the scores as 1 / 0). Call sbd_kernels.hf.enable_sbd(model) again after loading the model with "
        "another attn_implementation or switching it with set_attn_implementation: it records the one the model "
        "runs")


def _check_mask_form(base: str, attention_mask: Any) -> None:
    """Rejects a mask the base implementation would read differently from what the caller meant: eager attention
    adds the mask to the scores, so a boolean or integer 0 / 1 mask (1 = attend) would add 1 / 0 instead of
    0 / -inf. (A floating-point mask is taken as additive, as HF builds it.)"""
    if base == "eager" and isinstance(attention_mask, Tensor) and not attention_mask.is_floating_point():
        raise RuntimeError(
            "sbd attention: the model's base attention is 'eager', which adds attention_mask to the scores; a "
            f"{attention_mask.dtype} mask would be added as 1 / 0 instead of 0 / -inf. Build the SBD training mask "
            "with sbd_kernels.hf.sbd_training_mask(..., implementation='eager') or the SbdDataCollator, which give "
            "an additive mask")
    if base == "flex_attention" and isinstance(attention_mask, Tensor):
        raise RuntimeError(
            "sbd attention: the model's base attention is 'flex_attention', which takes a BlockMask, got a tensor "
            "mask; build it with sbd_kernels.hf.sbd_training_mask(..., implementation='flex_attention')")


def _mask_tensors(block_mask: Any) -> list[Tensor]:
    """The tensors a FlexAttention BlockMask reads: its block tensors, and those its mask_mod holds (an
    `SbdMaskMod`'s fields, or the index tensors a closure captured)."""
    tensors = [value for value in vars(block_mask).values() if isinstance(value, Tensor)]
    mask_mod = block_mask.mask_mod
    if hasattr(mask_mod, "tensors"):
        return tensors + list(mask_mod.tensors())
    cells = getattr(mask_mod, "__closure__", None) or ()
    # 0-d tensors are left out: PyTorch reads a 0-d CPU tensor as a scalar on any device.
    captured = [cell.cell_contents for cell in cells if isinstance(cell.cell_contents, Tensor)]
    return tensors + [t for t in captured if t.dim() > 0]


def _check_mask_device(attention_mask: Any, query: Tensor) -> None:
    """Rejects a FlexAttention BlockMask whose tensors are not on the query's device (the mask_mod would index a
    CPU tensor inside a CUDA kernel). A few attribute reads per layer; skipped while torch.compile traces."""
    if torch.compiler.is_compiling() or not hasattr(attention_mask, "mask_mod"):
        return
    devices = {t.device for t in _mask_tensors(attention_mask)}
    if devices - {query.device}:
        raise RuntimeError(
            f"sbd attention: the FlexAttention BlockMask's tensors are on {', '.join(sorted(map(str, devices)))}, "
            f"the query on {query.device}; move the mask with .to(device) (an SbdBlockMask from the "
            "SbdDataCollator moves whole, with the lengths and block size its mask_mod reads)")


def sbd_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                  scaling: float | None = None, dropout: float = 0.0, sbd_pass: SbdPass | None = None,
                  **kwargs: Any) -> tuple[Tensor, None]:
    """Attention of one HF layer: the SBD op inside decode passes, the base implementation elsewhere.

    query `[B, Hq, S, D]`, key / value `[B, Hkv, S, D]` (HF layout) -> (out `[B, S, Hq, D]`, None).
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if sbd_pass is None and attention_mask is SBD_PASS_MASK:
        sbd_pass = current_pass(module.config)                          # layers that drop their kwargs
        if sbd_pass is None:
            raise RuntimeError(
                f"sbd attention: layer {getattr(module, 'layer_idx', '?')} of {type(module).__name__} got a decode "
                "pass's mask outside a decode pass; call the model through SbdCausalLM.decode_pass")
    if sbd_pass is None:
        base = base_implementation(module.config)
        _check_mask_form(base, attention_mask)
        if base == "flex_attention":
            _check_mask_device(attention_mask, query)
        if base == "sdpa" and attention_mask is None and 1 < query.shape[2] < key.shape[2]:
            attention_mask = _last_rows_causal_mask(query.shape[2], key.shape[2], query.device)
        # "eager" is not in the registry: each modeling file defines its own eager_attention_forward.
        modeling = sys.modules[type(module).__module__]
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(base, modeling.eager_attention_forward)
        return attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if attention_mask is not SBD_PASS_MASK:
        raise RuntimeError(
            "sbd attention: a decode pass takes its mask from the op's row layout; it got another attention_mask "
            "(call the model through SbdCausalLM.decode_pass, which passes the right one)")
    if dropout:
        raise RuntimeError("sbd attention: decode passes run without dropout; put the model in eval mode")
    k_cache, v_cache = sbd_pass.cache.layer_buffers(module.layer_idx)
    args = (query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), k_cache, v_cache,
            sbd_pass.cache.seqlens, sbd_pass.num_causal, sbd_pass.block_size)
    window = _window_of(module, kwargs)
    # Static sizes decide (no sync): within W positions the window cuts no key.
    if window is not None and sbd_pass.cache.max_len + sbd_pass.block_size <= window:
        window = None
    # What HF layers pass besides the window that changes how a row weighs its keys: Gemma 2's score cap (softcap),
    # GPT-OSS's sinks (s_aux). The op has neither, nor heads above MAX_HEAD_DIM (Gemma 4's full layers: 512).
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if window is None and softcap is None and sinks is None and query.shape[-1] <= MAX_HEAD_DIM:
        out, _ = sbd_pass.attention_op(*args, None, scaling)
        return out, None
    return torch_block_attention(*args, scaling, window=window, softcap=softcap, sinks=sinks,
                                 plans=sbd_pass.torch_plans), None


def _last_rows_causal_mask(rows: int, keys: int, device: torch.device) -> Tensor:
    """`[1, 1, rows, keys]` bool: query row i (position keys - rows + i) sees keys 0 .. keys - rows + i. For a layer
    given no mask and fewer query rows than keys outside a decode pass: HF builds no sdpa mask only when every
    row sees every key or a row is alone (`is_causal`), so such a query holds the last rows of the sequence, which
    Gemma 4's KV-shared layers compute alone when a forward keeps the logits of the last rows (it skips that for
    models running sdpa itself, not for "sbd"). SDPA's is_causal would align the rows at the top left: row i seeing
    keys 0 .. i."""
    return torch.ones(1, 1, rows, keys, dtype=torch.bool, device=device).tril(keys - rows)


def _window_of(module: Any, kwargs: dict[str, Any]) -> int | None:
    """The window of the layer (`layer_window`: from the config, as HF builds the layer's mask). RuntimeError when
    the layer passes another sliding_window than that (a config changed after the model was built: HF's masks and
    its flash-attention path would then disagree about the window, and so would SBD with either)."""
    window = layer_window(module.config, module.layer_idx)
    passed = kwargs.get("sliding_window", window)
    if (passed or None) != window:
        raise RuntimeError(
            f"sbd attention: layer {module.layer_idx} passes sliding_window={passed}, but its config gives it a "
            f"window of {window} (the config changed after the model was built?); rebuild the model from its config")
    return window


def sbd_mask(*args: Any, config: Any = None, **kwargs: Any) -> Any:
    """Mask function of "sbd": the base implementation's mask function, so HF builds the mask that implementation
    reads (decode passes never get here: their 4-D `SBD_PASS_MASK` is returned unchanged by HF)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS[base_implementation(config)](*args, config=config, **kwargs)


def register() -> None:
    """Registers "sbd" with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, sbd_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sbd_mask)
