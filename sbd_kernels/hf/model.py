"""`enable_sbd` prepares a Hugging Face causal LM for SBD; `SbdCausalLM` is its `SbdModel` adapter.

    model = AutoModelForCausalLM.from_pretrained(...)            # or from a config
    sbd_model = enable_sbd(model, tokenizer, block_size=16)       # picks / adds the mask token, registers "sbd"

`enable_sbd` refuses, with the reason, what SBD cannot be applied to as implemented here: families other than
`SUPPORTED_MODEL_TYPES` (each tested), chunked attention layers (an SBD block attends to its whole prefix),
encoder-decoders / cross-attention, multimodal models, ALiBi attention biases, multi-head
latent attention (keys and values of different head sizes), and position
encodings whose values depend on the sequence length ("dynamic" / "longrope" RoPE scaling: the cached prefix would
have been encoded differently from the recomputed one). Every refusal names the reason and the supported families.

Sliding-window layers keep their window (`sbd_kernels.hf.window`): in decode passes (the op while a pass spans at
most W positions, `torch_block_attention` past that), in the training masks and in masks given to `forward`.
Layers with soft-capped attention scores (Gemma 2, VaultGemma) or attention sinks (GPT-OSS, Granite SWA) decode
through `torch_block_attention`, which applies them.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.attention.flex_attention import create_block_mask

from sbd_kernels.hf.attention import (
    ATTN_IMPLEMENTATION,
    BASE_IMPLEMENTATIONS,
    SBD_PASS_MASK,
    SbdPass,
    active_pass,
    mask_implementation,
    register,
)
from sbd_kernels.hf.cache import SbdCache
from sbd_kernels.hf.window import attention_window, mask_by_layer_type, window_band
from sbd_kernels.model import check_decode_pass, decode_positions

# Decoder-only families whose attention layers call transformers' AttentionInterface with RoPE applied before attention
# and no other position or mask input. The decode pass travels in the decoder layers' keyword arguments, and, for
# StableLM and Nemotron, whose layers call attention without them, as this thread's pass of the model's config
# (`active_pass`). Each is checked by tests/test_hf.py on a tiny config: HF greedy tokens, cached SBD passes against a
# recompute, the training masks of every base implementation. What sets them apart from Llama happens before or after
# the attention call, in the model's own code: embedding, residual and logit multipliers (gemma, granite, cohere,
# hyperclovax), logit soft-capping (nanochat), query scaling that grows with the position (ministral3, from the position
# ids a pass carries), rotary embeddings on part of the head or interleaved (phi, glm, glm4, cohere, gpt_neox,
# persimmon, glm4_moe, solar_open, minimax_m2, stablelm, nemotron), layers without RoPE (smollm3), q / k norms (qwen3,
# olmo2, cohere, persimmon, hunyuan_v1_dense, apertus, exaone4, nanochat, olmoe, flex_olmo, hunyuan_v1_moe, glm4_moe,
# dots1, minimax_m2, hy_v3), clipped q / k / v (dbrx), norms inside or after the sublayers (glm4, bitnet, exaone4,
# flex_olmo, hyperclovax), LayerNorm for RMSNorm (olmo, phi, cohere, starcoder2, gpt_neox, persimmon, phimoe, jais2,
# dbrx, stablelm, nemotron), attention and MLP in parallel (phi, cohere, gpt_neox), a fused QKV projection (gpt_neox,
# persimmon, phi3, dbrx), other MLP activations (arcee's, jais2's and nemotron's squared ReLU, apertus' xIELU), routed
# experts for the MLP (mixtral, qwen2_moe, qwen3_moe, granitemoe, olmoe, flex_olmo, phimoe, dbrx, minimax_m2; beside
# shared experts in qwen2_moe, granitemoeshared, ernie4_5_moe, hunyuan_v1_moe, glm4_moe, dots1, solar_open, hy_v3,
# aria_text, param2moe, sarvam_moe, minicpm5_moe; after dense first layers in ernie4_5_moe, glm4_moe, hy_v3, param2moe,
# sarvam_moe and minicpm5_moe), a sigmoid output gate after attention (minicpm5_moe): a token's experts follow from its
# own hidden state, so a cached pass routes as a recompute does. internlm3, iquestcoder and exaone (EXAONE 3.0 / 3.5)
# are Llama under their own names, apertus1p5_text is Apertus with an LM head pruned to the text ids
# (`output_vocab_size`; see `_ensure_embedding_row`); param2moe and sarvam_moe are GLM-4.5's MoE with RoPE over the
# whole head.
# Families with sliding-window layers (gemma3_text, olmo3, cohere2, ministral, cwm, exaone_moe, afmoe, mellum, laguna,
# kolibri1, beam, cohere2_moe, gemma2, vaultgemma, gpt_oss, granite_swa, granitemoe_swa, ergo; mistral, phi3,
# starcoder2, qwen2 and others when configured with one) decode and train with their windows (`sbd_kernels.hf.window`);
# their full layers may differ as well (cohere2's, kolibri1's and ergo's take no RoPE, gemma3's another RoPE base,
# ergo's scale their queries and keys before the cache), output gates follow attention (afmoe, laguna, beam), and most
# of them route experts. gemma2 and vaultgemma soft-cap their attention scores, and gpt_oss, granite_swa and
# granitemoe_swa add a sink logit per head to every row's softmax, which their decode passes apply in PyTorch
# (`torch_block_attention`). gemma4_text and gemma4_unified_text give their full layers another head size (512 in the
# released models, which the PyTorch path computes) and KV head count than their windowed ones (`layer_cache_shapes`);
# their and gemma3n_text's last layers attend to the keys and values of the last earlier layer of their type (KV
# sharing).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "granite", "olmo", "olmo2", "phi", "phi3",
                         "cohere", "glm", "glm4", "smollm3", "starcoder2", "gpt_neox", "persimmon", "helium",
                         "ernie4_5", "arcee", "apertus", "apertus1p5_text", "seed_oss", "hunyuan_v1_dense", "bitnet",
                         "exaone4", "nanochat", "internlm3", "iquestcoder", "exaone", "hyperclovax", "jais2",
                         "ministral3", "stablelm", "nemotron", "mixtral", "qwen2_moe", "qwen3_moe", "granitemoe",
                         "granitemoeshared", "olmoe", "flex_olmo", "phimoe", "ernie4_5_moe", "hunyuan_v1_moe",
                         "glm4_moe", "dots1", "solar_open", "dbrx", "minimax_m2", "hy_v3", "aria_text", "param2moe",
                         "sarvam_moe", "minicpm5_moe", "gemma3_text", "olmo3", "cohere2", "ministral", "cwm",
                         "exaone_moe", "afmoe", "mellum", "laguna", "kolibri1", "beam", "cohere2_moe", "gemma2",
                         "vaultgemma", "gpt_oss", "granite_swa", "granitemoe_swa", "ergo", "gemma4_text",
                         "gemma4_unified_text", "gemma3n_text")
# Families whose attention adds ALiBi biases (MPT and Falcon say so in their config: attn_config.alibi, alibi).
ALIBI_MODEL_TYPES = ("bloom",)
# Config parts of models with non-text inputs (sub-configs of Llava, Qwen2-VL, Whisper-style models, ...).
MULTIMODAL_PARTS = ("vision_config", "audio_config", "speech_config", "vision_tower", "audio_tower")
# RoPE variants whose frequencies depend on the current sequence length.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
# Special-token names that tokenizers reserve and leave unused (Llama 3: <|reserved_special_token_N|>).
RESERVED_TOKEN_MARKERS = ("reserved_special_token", "<|reserved", "<unused")
MASK_TOKEN_TEXT = "<|sbd_mask|>"
DEFAULT_BLOCK_SIZE = 16  # the SBD recipe's decode block size


class SbdUnsupportedModelError(ValueError):
    """The model cannot be decoded or trained with SBD as implemented here; the message says why."""


# Families whose forward runs the KV-shared layers on the rows whose logits it keeps (an int `logits_to_keep`),
# slicing their masks, unless the model's implementation is flex_attention (or flash); Gemma 3n's run every row.
KV_SHARED_ROW_SLICING_MODEL_TYPES = ("gemma4_text", "gemma4_unified_text")


def model_type_slices_kv_shared_rows(config: Any) -> bool:
    """A model of KV_SHARED_ROW_SLICING_MODEL_TYPES with KV-shared layers."""
    return config.model_type in KV_SHARED_ROW_SLICING_MODEL_TYPES and bool(getattr(config, "num_kv_shared_layers", 0))


def _unsupported(model_type: Any, reason: str) -> SbdUnsupportedModelError:
    return SbdUnsupportedModelError(
        f"{model_type}: {reason}. Supported families: {', '.join(SUPPORTED_MODEL_TYPES)} (decoder-only text "
        "models with RoPE and causal attention, full or within a sliding window, in every layer)")


def _is_multimodal(config: Any) -> bool:
    """A config with a vision or audio part (Llava, Qwen2-VL, ...): its sub-configs or their attributes."""
    parts = set(getattr(config, "sub_configs", None) or {}) | set(vars(config))
    return any(name in parts for name in MULTIMODAL_PARTS)


def check_supported(config: Any) -> None:
    """Raises SbdUnsupportedModelError naming the first property of `config` SBD cannot handle, in words (the
    kind of attention or input), and the supported families."""
    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        raise _unsupported(model_type, "encoder-decoder models are not supported (their decoder uses cross-attention "
                                       "to the encoder's output, which an SBD pass does not cache)")
    if getattr(config, "add_cross_attention", False):
        raise _unsupported(model_type, "decoders with cross-attention layers are not supported")
    if _is_multimodal(config):
        raise _unsupported(model_type, "multimodal models (image or audio inputs) are not supported")
    attn_config = getattr(config, "attn_config", None)
    if (model_type in ALIBI_MODEL_TYPES or getattr(config, "alibi", False)
            or getattr(attn_config, "alibi", False)):
        raise _unsupported(model_type, "ALiBi position biases are not supported (the SBD kernels take RoPE models: "
                                       "positions enter through the rotated keys, not as an attention bias)")
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if "sliding_attention" in layer_types and not getattr(config, "sliding_window", None):
        raise _unsupported(model_type, "the layer types name sliding_attention layers but the config has no "
                                       "sliding_window, so the window they apply is unknown")
    if getattr(config, "attention_chunk_size", None) or "chunked_attention" in layer_types:
        raise _unsupported(model_type, "chunked attention layers are not supported (attention_chunk_size="
                                       f"{getattr(config, 'attention_chunk_size', None)}): an SBD block must attend "
                                       "to the whole causal prefix")
    if getattr(config, "is_causal", True) is False or getattr(config, "use_bidirectional_attention", None) in (True,
                                                                                                         "all"):
        raise _unsupported(model_type, "bidirectional attention is not supported (use_bidirectional_attention="
                                       f"{getattr(config, 'use_bidirectional_attention', None)!r}, an embedding "
                                       "model's setting): SBD decodes causally, each row seeing only earlier rows")
    if getattr(config, "kv_lora_rank", None):
        raise _unsupported(model_type, "multi-head latent attention is not supported (kv_lora_rank="
                                       f"{config.kv_lora_rank}): its keys and values have different head sizes "
                                       "(qk_head_dim, v_head_dim), and the SBD cache and kernels take one head size")
    if not layer_types <= {"full_attention", "sliding_attention"}:
        raise _unsupported(model_type, f"only full and sliding-window attention layers are supported, the config has "
                                       f"layer types {sorted(layer_types)}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _unsupported(model_type, f"model type {model_type!r} is not supported")
    for layers, rope_type in rope_types(config).items():
        if rope_type in LENGTH_DEPENDENT_ROPE:
            raise _unsupported(model_type, f"RoPE scaling {rope_type!r} ({layers}) changes with the sequence length, "
                                           "so cached keys would not match a recompute; use a model without it")


def rope_types(config: Any) -> dict[str, str | None]:
    """The RoPE type of the config by the layers it applies to: {"all layers": type} for one set of parameters,
    {layer type: type} where `rope_parameters` holds one set per layer type (Gemma 3, Gemma 4, Ergo: a layer type
    mapped to None takes no RoPE and is left out)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return {}
    if any(isinstance(value, dict) or value is None for value in rope.values()):
        return {f"{layers} layers": params.get("rope_type", params.get("type"))
                for layers, params in rope.items() if isinstance(params, dict)}
    return {"all layers": rope.get("rope_type", rope.get("type"))}


def _special_token_ids(model: nn.Module, tokenizer: Any = None) -> dict[str, set[int]]:
    """The EOS / pad / BOS ids of the model's config and generation config (and of the tokenizer, if given), by
    name: ids the mask token must not be (the decode stops on EOS, and pads / BOS mean something else)."""
    sources = [s for s in (model.config, getattr(model, "generation_config", None), tokenizer) if s is not None]
    ids: dict[str, set[int]] = {"eos_token_id": set(), "pad_token_id": set(), "bos_token_id": set()}
    for source in sources:
        for name, found in ids.items():
            value = getattr(source, name, None)
            if isinstance(value, Tensor):
                value = value.tolist()
            found.update([value] if isinstance(value, int) else value or ())
    return ids


def _unused_reserved_token(tokenizer: Any, taken: set[int]) -> int | None:
    """The id of the last reserved special token of the tokenizer (e.g. Llama 3's reserved tokens) that is not in
    `taken` (a reserved token may have been made the pad token), or None."""
    candidates = [idx for tok, idx in tokenizer.get_vocab().items()
                  if any(marker in tok for marker in RESERVED_TOKEN_MARKERS) and idx not in taken]
    return max(candidates) if candidates else None


def _ensure_embedding_row(model: nn.Module, token_id: int) -> None:
    """Resizes the model's embeddings (and tied / untied LM head) so that `token_id` has a row. An LM head pruned
    to fewer ids than the embeddings (Apertus 1.5's `output_vocab_size`) is kept as it is: HF's resize would grow
    it to the new vocabulary, giving the ids past the pruned ones (image and audio codes) logits to be drawn."""
    rows = model.get_input_embeddings().weight.shape[0]
    if token_id < rows:
        return
    head = model.get_output_embeddings()
    pruned = getattr(model.config, "output_vocab_size", None) is not None
    model.resize_token_embeddings(token_id + 1)
    if pruned:
        model.set_output_embeddings(head)


def choose_mask_token(model: nn.Module, tokenizer: Any = None, mask_token_id: int | None = None) -> int:
    """The mask token id: `mask_token_id` if given (it must have an embedding row); else the tokenizer's
    `<|sbd_mask|>` (from an earlier `enable_sbd`); else an unused reserved special token of the tokenizer that is
    not its EOS / pad / BOS; else a new special token `<|sbd_mask|>` added to the tokenizer. The embeddings are
    resized when a `<|sbd_mask|>` id falls outside the model's vocabulary (a tokenizer extended for another copy of
    the model). Raises ValueError when neither a tokenizer nor an id is given."""
    vocab_size = model.get_input_embeddings().weight.shape[0]
    if mask_token_id is not None:
        if not 0 <= mask_token_id < vocab_size:
            raise ValueError(f"enable_sbd: mask_token_id {mask_token_id} outside the vocabulary [0, {vocab_size})")
        return mask_token_id
    if tokenizer is None:
        raise ValueError("enable_sbd: pass the tokenizer (to pick or add the mask token) or mask_token_id")
    if MASK_TOKEN_TEXT not in tokenizer.get_vocab():
        taken = set().union(*_special_token_ids(model, tokenizer).values())
        reserved = _unused_reserved_token(tokenizer, taken)
        if reserved is not None and reserved < vocab_size:
            return reserved
        tokenizer.add_special_tokens({"additional_special_tokens": [MASK_TOKEN_TEXT]})
    mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN_TEXT)
    _ensure_embedding_row(model, mask_id)
    return mask_id


def _refuse_special_mask_token(model: nn.Module, tokenizer: Any, mask_token_id: int) -> None:
    """Raises ValueError when the mask token is an EOS, pad or BOS token of the model (or tokenizer): the mask
    token is suppressed from every sample, so with it as EOS no decode could end, and as pad or BOS the model could
    not tell a masked slot from padding or a sequence start."""
    for name, ids in _special_token_ids(model, tokenizer).items():
        if mask_token_id in ids:
            raise ValueError(f"enable_sbd: mask_token_id {mask_token_id} is the {name} of the model or its "
                             f"tokenizer ({sorted(ids)}); the mask token must be a token of its own: pass another "
                             "id, or the tokenizer to pick a reserved token or add <|sbd_mask|>")


def _suppress_mask_token(generation_config: Any, mask_token_id: int, previous: int | None) -> None:
    """Puts the mask token in `generation_config.suppress_tokens` in place of `previous`, the mask id an earlier
    `enable_sbd` recorded (and so added there): a stale id left in would keep HF's generate from emitting a
    token that is no longer special, and make `sbd_generate` refuse suppress_tokens the user never set. (A
    previous mask id the user had suppressed as well cannot be told apart, and is taken out too.)"""
    suppressed = list(generation_config.suppress_tokens or [])
    if previous is not None and previous != mask_token_id:
        suppressed = [t for t in suppressed if t != previous]
    if mask_token_id not in suppressed:
        suppressed.append(mask_token_id)
    generation_config.suppress_tokens = suppressed


def enable_sbd(model: nn.Module, tokenizer: Any = None, *, block_size: int | None = None,
               mask_token_id: int | None = None) -> SbdCausalLM:
    """Prepares an HF causal LM for SBD training and decoding; returns its `SbdCausalLM` adapter.

    - Checks the model is supported (`check_supported`) and that its attention implementation is one the SBD
      training mask can be given to ("sdpa", "eager", "flex_attention").
    - Picks the mask token (`choose_mask_token`; an earlier `enable_sbd` recorded in the config is reused), and
      refuses one that is an EOS, pad or BOS id of the model or tokenizer.
    - Records `sbd_block_size`, `sbd_mask_token_id` and `sbd_base_attn_implementation` in `model.config`, so they
      are saved and loaded with `save_pretrained` / `from_pretrained` (call `enable_sbd` again after loading, and
      after `set_attn_implementation`: the SBD training masks refuse a model running another base).
    - Adds the mask token to `generation_config.suppress_tokens`, so HF's own `generate` never emits it (and
      takes out the one an earlier `enable_sbd` with another mask token added).
    - Registers the "sbd" attention implementation and its mask function, and switches the model to it: outside
      SBD decode passes it runs the base implementation unchanged.
    """
    config = model.config
    check_supported(config)
    current = config._attn_implementation
    base = getattr(config, "sbd_base_attn_implementation", None) if current == ATTN_IMPLEMENTATION else current
    if base not in BASE_IMPLEMENTATIONS:
        raise SbdUnsupportedModelError(
            f"attention implementation {current!r} cannot take the SBD training mask; load the model with "
            f"attn_implementation in {BASE_IMPLEMENTATIONS}")
    if base == "flex_attention" and model_type_slices_kv_shared_rows(config):
        # Gemma 4 slices its masks to the rows whose logits a forward keeps before its KV-shared layers unless the
        # model's implementation is flex_attention itself; under "sbd" a sliced FlexAttention BlockMask refuses
        # to run, so every plain forward of the model would fail.
        raise SbdUnsupportedModelError(
            f"{config.model_type} with KV-shared layers (num_kv_shared_layers={config.num_kv_shared_layers}) cannot "
            "run flex_attention under SBD: its forward slices FlexAttention masks, which then refuse to run; load "
            "the model with attn_implementation \"sdpa\" or \"eager\"")
    if block_size is None:
        block_size = getattr(config, "sbd_block_size", None) or DEFAULT_BLOCK_SIZE
    if block_size < 1:
        raise ValueError(f"enable_sbd: block_size must be >= 1, got {block_size}")
    if mask_token_id is None:
        mask_token_id = getattr(config, "sbd_mask_token_id", None)
    mask_token_id = choose_mask_token(model, tokenizer, mask_token_id)
    _refuse_special_mask_token(model, tokenizer, mask_token_id)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        _suppress_mask_token(generation_config, mask_token_id, getattr(config, "sbd_mask_token_id", None))
    config.sbd_mask_token_id = mask_token_id
    config.sbd_block_size = block_size
    config.sbd_base_attn_implementation = base
    register()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return SbdCausalLM(model)


def cache_argument_name(hf_model: nn.Module) -> str:
    """The name under which the model's forward takes its cache: "cache" from transformers 5.24 on (which still
    takes "past_key_values", with a FutureWarning on every call, until 5.40), "past_key_values" before."""
    parameters = inspect.signature(hf_model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


@dataclass(frozen=True)
class DenseMaskMod:
    """A FlexAttention `mask_mod(b, h, q, kv)` that reads a boolean mask tensor `allowed [B or 1, T, T]` (True =
    may attend): how a tensor mask reaches a flex_attention model. The tensor is a field, so the device check of
    the "sbd" attention finds it (`tensors`)."""

    allowed: Tensor

    def __call__(self, b: Tensor, h: Any, q: Tensor, kv: Tensor) -> Tensor:
        # FlexAttention calls the mask_mod with the query's batch index even when the BlockMask has batch 1.
        row = b if self.allowed.shape[0] > 1 else torch.zeros_like(b)
        return self.allowed[row, q, kv]

    def tensors(self) -> list[Tensor]:
        return [self.allowed]


def mask_for_implementation(allowed: Tensor, implementation: str, dtype: torch.dtype) -> Any:
    """A boolean mask (True = may attend, `[B or 1, T, T]`) in the form an HF attention implementation reads:
    `[B or 1, 1, T, T]` boolean for sdpa, additive (0 / dtype's lowest) for eager, and for flex_attention a
    BlockMask whose mask_mod indexes the tensor (`DenseMaskMod`; batch 1 broadcasts over the batch). The SBD
    training mask of flex_attention is built from its predicate instead (`sbd_kernels.hf.sbd_training_mask`),
    without a dense tensor."""
    if implementation == "sdpa":
        return allowed[:, None]
    if implementation == "eager":
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min)[:, None]
    if implementation == "flex_attention":
        batch, q_len, kv_len = allowed.shape
        return create_block_mask(DenseMaskMod(allowed), B=batch, H=None, Q_LEN=q_len, KV_LEN=kv_len,
                                 device=allowed.device)
    raise ValueError(f"mask_for_implementation: unknown attention implementation {implementation!r}, expected one "
                     f"of {BASE_IMPLEMENTATIONS}")


def _last_rows(length: int, keep_last: int, device: torch.device) -> Tensor:
    """`logits_to_keep` for the last `keep_last` of `length` rows (0: all): an index tensor, never an int. HF
    slices the hidden states with an int (`hidden[:, -keep:, :]`, a strided view) and the LM head's matmul
    can then take a bmm over the weight expanded per sequence: with weights created under
    torch.inference_mode, a copy of the whole [V, H] weight per sequence (a batch-16 SBD decode of a 32000-id
    model ran 3.5x slower here). Indexing with a tensor gathers the rows into a contiguous [B, keep, H]. And with
    an int Gemma 4 runs its KV-shared layers on the kept rows alone (and slices the pass's mask), where the op
    needs the pass's whole row layout."""
    keep = length if keep_last <= 0 else min(keep_last, length)
    return torch.arange(length - keep, length, device=device)


def layer_cache_shapes(config: Any) -> tuple[list[int], list[int], list[int | None]]:
    """Per layer of `config`: (KV heads, head size, the earlier layer whose keys and values it attends to or None).

    One size for every layer, except in configs with per-layer settings (`per_layer_config`: Gemma 4's full layers
    take `global_head_dim` and `num_global_key_value_heads`; `shape_before_per_layer_config` on releases before
    it); a layer HF marks "reuse" in `kv_sharing_modes` reads the keys and values that the "store" layer of its
    layer type computed in the same pass (the last `num_kv_shared_layers` of Gemma 4 and Gemma 3n)."""
    layers = config.num_hidden_layers
    types = getattr(config, "layer_types", None) or ["full_attention"] * layers
    # Each layer's view of the config: a config with per-layer values refuses to read them globally.
    per_layer = getattr(config, "per_layer_config", None)
    layer_configs = [config if per_layer is None else per_layer[i] for i in range(layers)]
    # Configs without grouped-query attention (GPT-NeoX) have no num_key_value_heads: one KV head per query head.
    shapes = [(getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
               getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads) for c in layer_configs]
    if per_layer is None:
        shapes = [shape_before_per_layer_config(config, types[i], shapes[i]) for i in range(layers)]
    return [heads for heads, _ in shapes], [dim for _, dim in shapes], kv_shared_with(config, types)


def shape_before_per_layer_config(config: Any, layer_type: str, shape: tuple[int, int]) -> tuple[int, int]:
    """(KV heads, head size) of one layer of a Gemma 4 config from before `per_layer_config` (transformers 5.13 and
    5.14), as that release's modeling code reads them: a layer that is not "sliding_attention" takes
    `global_head_dim` when set, and `num_global_key_value_heads` when `attention_k_eq_v`. Read as one size for
    every layer, the cache gave the full layers the sliding layers' shapes and the op refused them. Other configs,
    and the sliding layers, keep `shape`."""
    if not hasattr(config, "global_head_dim") or layer_type == "sliding_attention":
        return shape
    heads, dim = shape
    if getattr(config, "attention_k_eq_v", False):
        heads = getattr(config, "num_global_key_value_heads", None) or heads
    return heads, config.global_head_dim or dim


def kv_shared_with(config: Any, layer_types: list[str]) -> list[int | None]:
    """Per layer: the earlier layer whose keys and values it attends to (and then it keeps no cache), or None."""
    modes = kv_sharing_modes(config, layer_types)
    stores = {layer_types[i]: i for i in range(len(modes)) if modes[i] == "store"}
    return [stores[layer_types[i]] if mode == "reuse" else None for i, mode in enumerate(modes)]


def kv_sharing_modes(config: Any, layer_types: list[str]) -> list[str | None]:
    """Per layer: "reuse" (attends to the keys and values of the "store" layer of its type, and keeps no cache),
    "store" or None. transformers 5.23+ configs say it (`kv_sharing_modes`); before 5.23 the modeling code of Gemma
    3n and Gemma 4 derived it from `num_kv_shared_layers` (the last ones reuse; the last layer of each type before
    them stores), which this derives the same way: keyed on `kv_sharing_modes` alone, a cache on transformers
    5.13-5.22 held a second copy of the keys and values for each shared layer, never written nor read."""
    layers = config.num_hidden_layers
    modes = getattr(config, "kv_sharing_modes", None)
    if modes is not None:
        return list(modes)
    shared = getattr(config, "num_kv_shared_layers", 0) or 0
    first_shared = layers - shared
    if shared == 0:
        return [None] * layers
    producers = layer_types[:first_shared]
    if first_shared <= 0 or set(producers) != set(layer_types):
        raise ValueError(f"{config.model_type}: num_kv_shared_layers={shared} of {layers} layers leaves no earlier "
                         f"layer of each type ({sorted(set(layer_types))}) to compute the keys and values they share")
    modes = [None] * first_shared + ["reuse"] * shared
    for layer_type in set(layer_types):
        modes[first_shared - 1 - producers[::-1].index(layer_type)] = "store"
    return modes


def _check_block_mask_within_window(config: Any, positions: Tensor) -> None:
    """ValueError when a FlexAttention BlockMask given to `SbdCausalLM.forward` spans more positions than the model's
    sliding window: the mask reaches every layer as it is, so its windowed layers would attend past W (within W
    positions the window cuts no key). One sync, windowed models only."""
    window = attention_window(config)
    if window is None:
        return
    low, high = (int(p) for p in torch.aminmax(positions))
    if high - low + 1 > window:
        raise ValueError(f"SbdCausalLM.forward: a BlockMask's positions {low} to {high} span {high - low + 1} "
                         f"positions, past the model's sliding window of {window}, which a BlockMask cannot apply; "
                         "pass the mask as a boolean tensor (the window is then added for the windowed layers)")


class SbdCausalLM(nn.Module):
    """The `SbdModel` adapter of an HF causal LM prepared by `enable_sbd` (see `sbd_kernels.protocol`).

    `forward(tokens, positions, attn_mask)` runs the HF model without a cache, with a boolean mask converted to the
    base implementation's form (or a FlexAttention BlockMask passed through); `decode_pass` runs one cached SBD
    pass through the "sbd" attention. `hf_model` is the wrapped model (train, save and load it as usual).
    """

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        config = hf_model.config
        if config._attn_implementation != ATTN_IMPLEMENTATION or getattr(config, "sbd_mask_token_id", None) is None:
            raise ValueError("SbdCausalLM: prepare the model with sbd_kernels.hf.enable_sbd(model, tokenizer) first")
        self.hf_model = hf_model
        self._cache_argument = cache_argument_name(hf_model)

    @property
    def config(self) -> Any:
        return self.hf_model.config

    @property
    def mask_token_id(self) -> int:
        return self.config.sbd_mask_token_id

    @property
    def block_size(self) -> int:
        return self.config.sbd_block_size

    def forward(self, tokens: Tensor, positions: Tensor | None = None, attn_mask: Any = None) -> Tensor:
        """tokens `[B, T]` -> logits `[B, T, V]` fp32, no cache. positions: `[B, T]` (None: 0..T-1). attn_mask: None
        (causal in token order, whatever the positions), bool `[B or 1, T, T]` (True = may attend; any base), or a
        FlexAttention BlockMask (flex_attention base only)."""
        if attn_mask is None and positions is not None:
            # Explicit: given position ids that restart (the SBD training layout [0..n-1 ; 0..n-1]), HF reads a None
            # mask as packed sequences and attends block-diagonally. Without positions HF numbers the tokens 0..T-1
            # and its own causal mask is right.
            attn_mask = torch.ones(1, tokens.shape[1], tokens.shape[1], dtype=torch.bool, device=tokens.device).tril()
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        mask = attn_mask
        if attn_mask is not None:
            mask = self._mask_for_layers(attn_mask, positions)
        out = self.hf_model(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=False)
        return out.logits.float()

    def _mask_for_layers(self, attn_mask: Any, positions: Tensor) -> Any:
        """attn_mask in the base implementation's form, with the window's band (`window_band`) added for the
        sliding-window layers of the model (`mask_by_layer_type`). A FlexAttention BlockMask cannot take the band:
        one whose positions span more than the window is refused (one sync, windowed models only)."""
        implementation = mask_implementation(self.config, "SbdCausalLM.forward")
        if not isinstance(attn_mask, Tensor):
            _check_block_mask_within_window(self.config, positions)
            return attn_mask
        dtype = self.hf_model.get_input_embeddings().weight.dtype

        def build(window: int | None) -> Any:
            allowed = attn_mask if window is None else attn_mask & window_band(positions, window)
            return mask_for_implementation(allowed, implementation, dtype)

        return mask_by_layer_type(self.config, build)

    def new_cache(self, batch: int, max_len: int) -> SbdCache:
        """An empty `SbdCache` shaped for the model (`layer_cache_shapes`), in its dtype and on its device."""
        weight = self.hf_model.get_input_embeddings().weight
        kv_heads, head_dims, shared_with = layer_cache_shapes(self.config)
        return SbdCache(self.config.num_hidden_layers, batch, max_len, kv_heads, head_dims, weight.dtype,
                        weight.device, shared_with)

    def decode_pass(self, tokens: Tensor, num_causal: Tensor, block_size: int, cache: SbdCache,
                    attention_op: Any = None, keep_last: int = 0) -> Tensor:
        """One cached pass (the `SbdModel` contract): tokens `[B, C + K]`, num_causal `[B]` int32 -> logits
        `[B, C + K or keep_last, V]` in the model's dtype. Position ids are built here from the cache lengths (HF would derive
        them from one cache length for the whole batch, which is wrong for SBD rows)."""
        if not isinstance(cache, SbdCache):
            raise TypeError(f"SbdCausalLM.decode_pass: cache must be an SbdCache, got {type(cache).__name__}")
        check_decode_pass("SbdCausalLM.decode_pass", tokens, num_causal, block_size, cache.seqlens, keep_last)
        if attention_op is None:
            attention_op = torch.ops.sbd.block_attention_with_kvcache
        positions = decode_positions(cache.seqlens, num_causal, tokens.shape[1] - block_size, block_size)
        sbd_pass = SbdPass(cache, num_causal, block_size, attention_op)
        with cache.decode_pass(), active_pass(self.config, sbd_pass):
            out = self.hf_model(input_ids=tokens, position_ids=positions, attention_mask=SBD_PASS_MASK,
                                use_cache=True, logits_to_keep=_last_rows(tokens.shape[1], keep_last, tokens.device),
                                sbd_pass=sbd_pass, **{self._cache_argument: cache})
        cache.advance(num_causal)
        # In the model's dtype: `sbd.entropy_sample` reads bf16 / fp16 logits and computes in fp32, and an fp32
        # copy of [B, K, V] logits cost 8% of a batch-16 decode of a small model here.
        return out.logits
