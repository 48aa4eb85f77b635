"""SBD and NTP decoding of a Hugging Face model through the `torch.ops.sbd` kernels.

Two entry points, one decode loop (`sbd_kernels.generate.generate`, through the `SbdCausalLM` adapter):

    out = sbd_kernels.hf.generate(model, input_ids, attention_mask, max_new_tokens=64, method="sbd", gamma=0.1)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64, custom_generate=sbd_kernels.hf.sbd_generate,
                         return_dict_in_generate=True, gamma=0.1)

Both return HF's `GenerateDecoderOnlyOutput` fields (`sequences`: the prompts as given, then the new tokens, EOS
included, `pad_token_id` after it) plus `nfe` (forward passes per sequence), `generated` (new tokens per sequence)
and `accepted_hist` (passes by tokens accepted). Prompts may be left- or right-padded: `attention_mask` says which
tokens are real, and position ids are built inside (real tokens at 0, 1, ...).

Generation settings read from HF: `max_new_tokens` (or `max_length`), `eos_token_id` (one or several), `do_sample`
with `temperature`, `top_k`, `top_p` and `min_p` (greedy unless do_sample), `pad_token_id`; through
`model.generate` they mean what they mean to HF's own generate (`eos_token_id=None`: no EOS stop; `pad_token_id=None`:
pad with the first EOS id). Logits processors and
stopping criteria the fused kernels do not implement (repetition penalty, bad words, stop strings, ...) are
refused by name rather than ignored, and so are processors / criteria of the handled kinds passed to `generate`
with other settings than the generation config's (the decode reads the config, not the processors).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import transformers
from packaging.version import Version
from torch import Tensor
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

try:
    from transformers.distributed.fsdp import is_fsdp_managed_module
except ImportError:  # transformers 5.13 keeps it in integrations (distributed.fsdp came in 5.14)
    from transformers.integrations.fsdp import is_fsdp_managed_module

from sbd_kernels.generate import DecodeConfig, DecodeOps, DecodeResult, fused_ops, vocab_size_of
from sbd_kernels.generate import generate as decode
from sbd_kernels.hf.model import SbdCausalLM


@dataclass
class SbdGenerateOutput(GenerateDecoderOnlyOutput):
    """HF's decoder-only generate output plus SBD statistics.

    nfe: `[B]` int64 forward passes each sequence took part in. generated: `[B]` int64 new tokens (EOS included).
    accepted_hist: `[K + 1]` int64, passes (per sequence) that revealed a tokens (NTP: K = 1).
    stopped_early: `[B]` bool, sequences cut short before EOS or the length limit by NaN / +inf logits (their
    sequences hold the tokens completed before; `sbd_kernels.generate.DecodeResult.stopped_early`).
    """

    nfe: Tensor | None = None
    generated: Tensor | None = None
    accepted_hist: Tensor | None = None
    stopped_early: Tensor | None = None


def prompts_from_batch(input_ids: Tensor, attention_mask: Tensor | None) -> list[list[int]]:
    """Token lists of the real tokens of each row (`attention_mask` 1), whatever side the padding is on."""
    if input_ids.dim() != 2:
        raise ValueError(f"generate: input_ids must be [B, P], got shape {tuple(input_ids.shape)}")
    rows = input_ids.tolist()
    if attention_mask is None:
        return rows
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"generate: attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape "
                         f"{tuple(input_ids.shape)}")
    keep = attention_mask.bool().tolist()
    prompts = [[t for t, k in zip(row, mask) if k] for row, mask in zip(rows, keep)]
    if any(not p for p in prompts):
        raise ValueError("generate: every row needs at least one real token (attention_mask all 0 in a row)")
    return prompts


def _eos_ids(eos_token_id: int | Sequence[int] | Tensor | None) -> tuple[int, ...]:
    if eos_token_id is None:
        return ()
    if isinstance(eos_token_id, Tensor):
        return tuple(int(e) for e in eos_token_id.flatten().tolist())
    return (int(eos_token_id),) if isinstance(eos_token_id, int) else tuple(int(e) for e in eos_token_id)


def _sequences(input_ids: Tensor, result: DecodeResult, pad_id: int) -> Tensor:
    """[B, P + longest new] int64: the prompts as given, then each row's new tokens, pad_id after."""
    width = max((len(t) for t in result.tokens), default=0)
    new = torch.full((input_ids.shape[0], width), pad_id, dtype=torch.int64)
    for i, tokens in enumerate(result.tokens):
        new[i, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.int64)
    return torch.cat([input_ids, new.to(input_ids.device)], dim=1)


def _pad_id(sbd_model: SbdCausalLM, pad_token_id: int | None, eos_ids: tuple[int, ...], caller: str) -> int:
    """The id written after each sequence's end and into the prompts' padding: pad_token_id, or when it is None the
    first EOS id (HF's generate pads so: `_prepare_special_tokens`), or 0 without EOS ids (no sequence then ends
    early but one cut short by NaN logits). Raises ValueError naming pad_token_id when the id is outside the
    vocabulary: the padded prompts are looked up in the embeddings."""
    source = ""
    if pad_token_id is None and eos_ids:
        pad_token_id, source = eos_ids[0], " (the first eos_token_id, as pad_token_id is None)"
    pad_id = 0 if pad_token_id is None else int(pad_token_id)
    vocab = vocab_size_of(sbd_model)
    if vocab is not None and not 0 <= pad_id < vocab:
        raise ValueError(f"{caller}: pad_token_id {pad_id}{source} is outside the model's vocabulary [0, {vocab})")
    return pad_id


def _decode_batch(sbd_model: SbdCausalLM, input_ids: Tensor, attention_mask: Tensor | None, caller: str, *,
                  eos_token_id: int | Sequence[int] | Tensor | None, pad_token_id: int | None,
                  block_size: int | None, batch_size: int | None, ops: DecodeOps | None, cuda_graph: bool,
                  **settings: Any) -> SbdGenerateOutput:
    """The decode of both entry points, with eos_token_id and pad_token_id taken as given, as HF's generate takes
    those of its resolved generation config: None (or no id) never stops on EOS, and pad_token_id None pads as
    `_pad_id` says. settings: the other `DecodeConfig` fields."""
    reason = host_sync_reason(sbd_model.hf_model) if cuda_graph else None
    if reason is not None:
        raise ValueError(f"{caller}: cuda_graph=True captures the decode steps in CUDA graphs, which cannot hold a "
                         f"host sync, and {reason}; decode with cuda_graph=False")
    eos_ids = _eos_ids(eos_token_id)
    pad_id = _pad_id(sbd_model, pad_token_id, eos_ids, caller)
    if block_size is None:
        block_size = sbd_model.block_size
    cfg = DecodeConfig(block_size=block_size, **settings)
    prompts = prompts_from_batch(input_ids, attention_mask)
    # (-1,): no end token, every sequence runs to max_new_tokens.
    result = decode(sbd_model, prompts, cfg, eos_id=eos_ids or (-1,), pad_id=pad_id, batch_size=batch_size,
                    ops=ops or fused_ops(), cuda_graph=cuda_graph)
    return SbdGenerateOutput(sequences=_sequences(input_ids, result, pad_id), nfe=result.nfe,
                             generated=result.generated, accepted_hist=result.accepted_hist,
                             stopped_early=result.stopped_early)


def generate(model: Any, input_ids: Tensor, attention_mask: Tensor | None = None, *, max_new_tokens: int,
             eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None, method: str = "sbd",
             block_size: int | None = None, gamma: float = 0.1, rule: str = "eb", temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int = 0, batch_size: int | None = None, ops: DecodeOps | None = None,
             cuda_graph: bool = False) -> SbdGenerateOutput:
    """SBD (`method="sbd"`) or NTP decoding of an HF model prepared by `enable_sbd` (or its `SbdCausalLM`).

    input_ids `[B, P]` int64 with optional attention_mask `[B, P]` (left or right padding); eos_token_id: one id or
    several (default: the model's generation config's; `[]`: no EOS stop); pad_token_id: default the model's
    generation config's, else the first EOS id (as HF), else 0; block_size: default the one recorded by
    `enable_sbd`; temperature > 0 samples, after the top_k / top_p / min_p filters (0 / 1 / 0 = off), sequence i
    with seed `seed + i`; cuda_graph: replay the decode steps from CUDA graphs (model on a CUDA device; a model
    whose pass would sync with the host or copy host data to the GPU is refused, `host_sync_reason`). Returns
    `SbdGenerateOutput` (see the module docstring). A model sharded over several ranks (DeepSpeed ZeRO-3, FSDP) is
    refused (`refuse_synced_gpus`).
    """
    sbd_model = model if isinstance(model, SbdCausalLM) else SbdCausalLM(model)
    refuse_synced_gpus(sbd_model.hf_model)
    # The model's generation config fills what this call leaves out; `sbd_generate` gets HF's resolved one instead.
    generation_config = getattr(sbd_model.hf_model, "generation_config", None)
    if eos_token_id is None:
        eos_token_id = getattr(generation_config, "eos_token_id", None)
    if pad_token_id is None:
        pad_token_id = getattr(generation_config, "pad_token_id", None)
    return _decode_batch(sbd_model, input_ids, attention_mask, "generate", eos_token_id=eos_token_id,
                         pad_token_id=pad_token_id, block_size=block_size, batch_size=batch_size, ops=ops,
                         cuda_graph=cuda_graph, method=method, gamma=gamma, rule=rule, temperature=temperature,
                         max_new_tokens=max_new_tokens, seed=seed, top_k=top_k, top_p=top_p, min_p=min_p)


def _synced_gpus_reason(model: Any) -> str | None:
    """Why HF would generate with `model` in synced-GPU mode (its own rule: parameters sharded by DeepSpeed
    ZeRO-3 or FSDP, in a process group of more than one rank), or None."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world < 2:
        return None
    if is_deepspeed_zero3_enabled():
        return f"DeepSpeed ZeRO-3 over {world} ranks"
    if is_fsdp_managed_module(model):
        return f"{type(model).__name__} is FSDP-sharded over {world} ranks"
    return None


def refuse_synced_gpus(model: Any, synced_gpus: bool = False) -> None:
    """Raises ValueError when the decode would have to run in synced-GPU mode (`synced_gpus=True`, or `model`
    sharded over ranks): every forward of a sharded model gathers parameters from all ranks, so all ranks must
    run the same number of passes, while an SBD decode runs as many as its own sequences need (ranks would wait
    on each other forever)."""
    reason = "synced_gpus=True" if synced_gpus else _synced_gpus_reason(model)
    if reason is not None:
        raise ValueError(f"generate: synced-GPU decoding ({reason}) is not supported: each rank's decode runs its "
                         "own number of forward passes, and a sharded forward waits for every rank; decode with "
                         "an unsharded copy of the model (e.g. the full state dict loaded on one process)")


# Families whose decode pass, in the only code transformers gives them, reads device values on the host or copies
# host data to the device in every pass, which a CUDA graph capture refuses (tests/test_hf.py scans every family's
# pass with `graphs.host_syncs`).
HOST_SYNC_FAMILIES = {
    "dbrx": "dbrx's MoE layers loop over the experts their tokens hit (a host sync in every such layer; transformers "
            "gives this family no other experts implementation)",
    "phimoe": "phimoe's rotary embedding computes its inverse frequencies on the host in every pass and copies them to "
              "the GPU (transformers' PhimoeRotaryEmbedding.forward)",
}


# Families whose decode pass synced with the host in every pass before a transformers release (model_type prefix ->
# (the release that fixed it, what the older code does)); found by `graphs.host_syncs` on the releases named.
HOST_SYNC_BEFORE = {
    "gemma3n": (Version("5.23"), ("text model copies a host tensor to the device in every pass (AltUp's magnitude "
                                  "normalisation builds torch.tensor(1e-5) on the host; 5.13-5.22)")),
    "aria": (Version("5.18"), ("experts read their token counts on the host in every MoE layer "
                               "(AriaGroupedExpertsGemm: tokens_per_expert.cpu(); 5.13-5.17)")),
}


def family_host_sync_reason(config: Any) -> str | None:
    """The part of `host_sync_reason` that the family's own code decides, whatever runs its experts: the families of
    HOST_SYNC_FAMILIES, those of HOST_SYNC_BEFORE on the transformers releases before the fix, and Gemma 3n's
    activation sparsity. What it names, `graphs.host_syncs` sees on any device."""
    if config.model_type in HOST_SYNC_FAMILIES:
        return HOST_SYNC_FAMILIES[config.model_type]
    installed = Version(transformers.__version__)
    for prefix, (fixed_in, what) in HOST_SYNC_BEFORE.items():
        if config.model_type.startswith(prefix) and installed < fixed_in:
            return (f"{config.model_type}'s {what} in transformers {installed} (fixed in {fixed_in}); upgrade: "
                    f'pip install "transformers>={fixed_in}"')
    if any(p > 0 for p in getattr(config, "activation_sparsity_pattern", None) or ()):
        return (f"{config.model_type}'s MLPs with activation sparsity (activation_sparsity_pattern) build their "
                "Gaussian cut-off with torch.tensor(..., device=...) in every pass, a copy from the host (transformers' "
                "_gaussian_topk)")
    return None


def host_sync_reason(model: Any) -> str | None:
    """Why a decode pass of the HF `model` would synchronise with the host on a GPU (or copy host data to it),
    which a CUDA graph cannot capture, or None. The cases: the families of HOST_SYNC_FAMILIES; Gemma 3n's
    activation sparsity (its MLPs build their Gaussian cut-off with `torch.tensor(..., device=...)` in every pass);
    and MoE experts: transformers' "eager" experts implementation reads on the host which experts its tokens hit and
    loops over them; its "grouped_mm" runs torch's grouped GEMM, which CUDA computes in one kernel for bf16 weights
    only (torch's docs) and otherwise by a loop over the experts whose token offsets it reads on the host;
    "batched_mm" gathers each token's expert weights and runs on the device alone. Every other part of a supported
    family's decode pass runs nothing a capture refuses (tests/test_hf.py). Whether torch takes its one-kernel path
    for bf16 depends on the GPU and the torch version and is not checked here: where it does not, the capture fails
    with an error that says so (`sbd_kernels.graphs`)."""
    reason = family_host_sync_reason(model.config)
    if reason is not None:
        return reason
    for name, module in model.named_modules():
        if not _is_dispatched_experts(module):
            continue
        implementation = module.config._experts_implementation
        dtype = next(module.parameters()).dtype
        if implementation == "eager":
            return (f"its experts ({name}, ...) run transformers' 'eager' experts implementation, a loop over the "
                    "experts their tokens hit (a host sync in every MoE layer); "
                    "model.set_experts_implementation('grouped_mm') with bf16 weights, or 'batched_mm', has none")
        if implementation == "grouped_mm" and dtype != torch.bfloat16:
            return (f"its experts ({name}, ...) run transformers' 'grouped_mm' on {dtype} weights, which torch's CUDA "
                    "grouped GEMM takes in bf16 only, looping over the experts with their token offsets read on the "
                    "host otherwise; load the model in bf16, or model.set_experts_implementation('batched_mm')")
    return None


def _is_dispatched_experts(module: torch.nn.Module) -> bool:
    """Whether `module` is an experts module that transformers dispatches by `config._experts_implementation`: its
    `use_experts_implementation` decorator sets `is_transposed` and `is_concatenated` on every instance in 5.13-5.25
    (the `_is_expert_parallel` flag it also sets came in 5.18: keyed on it, the experts of every MoE model went
    unseen on 5.13-5.17)."""
    return (hasattr(module, "is_transposed") and hasattr(module, "is_concatenated")
            and hasattr(getattr(module, "config", None), "_experts_implementation"))


# Processors / criteria HF builds from generation settings that the fused decode applies itself, by exact type (a
# subclass may filter otherwise): the sampling warpers, each with the generation-config setting it applies.
_WARPER_SETTINGS = {TemperatureLogitsWarper: "temperature", TopKLogitsWarper: "top_k", TopPLogitsWarper: "top_p",
                    MinPLogitsWarper: "min_p"}
_HANDLED_PROCESSORS = (*_WARPER_SETTINGS, SuppressTokensLogitsProcessor)
_HANDLED_CRITERIA = (MaxLengthCriteria, EosTokenCriteria)
# Fields of HF's generate output that the fused decode does not produce (it keeps no per-step scores or states).
_OUTPUT_FLAGS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def _check_warper(warper: Any, generation_config: Any, sampling: dict[str, Any]) -> None:
    """Raises ValueError when a sampling warper (passed to `generate`, or built by HF from the generation config)
    filters otherwise than the fused sampler, which applies `sampling` (`_sampling_settings` of the config)."""
    name = type(warper).__name__
    if not generation_config.do_sample:
        raise ValueError(f"sbd_generate: {name} given with do_sample=False, where the fused decode is greedy; set "
                         "do_sample=True and the sampling settings in the generation config instead")
    setting = _WARPER_SETTINGS[type(warper)]
    value = getattr(warper, setting)
    if value != sampling[setting]:
        raise ValueError(f"sbd_generate: {name}({setting}={value}) differs from the generation config's {setting}="
                         f"{sampling[setting]}; the fused decode samples with the generation config's settings, so "
                         f"pass {setting}={value} to generate instead of the logits processor")
    kept = getattr(warper, "min_tokens_to_keep", 1), getattr(warper, "filter_value", -float("inf"))
    if kept != (1, -float("inf")):
        raise ValueError(f"sbd_generate: {name} with min_tokens_to_keep={kept[0]}, filter_value={kept[1]} is not "
                         "supported (the fused filters keep at least 1 token and drop the others entirely)")


def _check_criterion(criterion: Any, generation_config: Any, max_length: int) -> None:
    """Raises ValueError when a max-length or EOS criterion (passed to `generate`, or built by HF) stops otherwise
    than the fused decode: at `max_length` tokens (prompt included) or on the generation config's EOS ids."""
    if isinstance(criterion, MaxLengthCriteria) and criterion.max_length != max_length:
        raise ValueError(f"sbd_generate: MaxLengthCriteria(max_length={criterion.max_length}) differs from the "
                         f"generation config's length limit ({max_length}, prompt included); pass max_new_tokens or "
                         "max_length to generate instead")
    if isinstance(criterion, EosTokenCriteria):
        given, configured = set(_eos_ids(criterion.eos_token_id)), set(_eos_ids(generation_config.eos_token_id))
        if given != configured:
            raise ValueError(f"sbd_generate: EosTokenCriteria(eos_token_id={sorted(given)}) differs from the "
                             f"generation config's eos_token_id {sorted(configured)}; pass eos_token_id to generate "
                             "instead")


def _refuse_unsupported(logits_processor: Any, stopping_criteria: Any, generation_config: Any,
                        mask_token_id: int, sampling: dict[str, Any], max_length: int) -> None:
    """Raises ValueError naming any HF generation feature or setting this decode would otherwise silently ignore:
    processors / criteria it does not implement, handled ones whose settings differ from the generation config's
    (the decode reads only the config), beams, and output fields it does not produce."""
    unsupported = [type(p).__name__ for p in logits_processor or [] if type(p) not in _HANDLED_PROCESSORS]
    unsupported += [type(c).__name__ for c in stopping_criteria or [] if type(c) not in _HANDLED_CRITERIA]
    if unsupported:
        raise ValueError(f"sbd_generate: {', '.join(unsupported)} not supported by the fused SBD decode (it samples "
                         "inside sbd.entropy_sample and stops on EOS / length); remove the settings that add them")
    for proc in logits_processor or []:
        if isinstance(proc, SuppressTokensLogitsProcessor):
            if set(proc.suppress_tokens.tolist()) - {mask_token_id}:
                raise ValueError("sbd_generate: suppress_tokens other than the mask token are not supported")
        else:
            _check_warper(proc, generation_config, sampling)
    for criterion in stopping_criteria or []:
        _check_criterion(criterion, generation_config, max_length)
    if getattr(generation_config, "num_beams", 1) != 1:
        raise ValueError("sbd_generate: beam search is not supported (num_beams must be 1)")
    requested = [flag for flag in _OUTPUT_FLAGS if getattr(generation_config, flag, False)]
    if requested:
        raise ValueError(f"sbd_generate: {', '.join(f'{flag}=True' for flag in requested)} not supported: the fused "
                         "decode samples inside sbd.entropy_sample and keeps no per-step scores, logits or states "
                         "(the output has sequences, nfe, generated, accepted_hist)")


def _sampling_settings(generation_config: Any) -> dict[str, Any]:
    """temperature / top_k / top_p / min_p of an HF generation config (greedy unless do_sample), as HF applies
    them: the fused sampler runs the same filters in the same order."""
    if not generation_config.do_sample:
        return {"temperature": 0.0}
    return {"temperature": generation_config.temperature, "top_k": generation_config.top_k or 0,
            "top_p": 1.0 if generation_config.top_p is None else generation_config.top_p,
            "min_p": getattr(generation_config, "min_p", None) or 0.0}


def sbd_generate(model: Any, input_ids: Tensor, logits_processor: Any = None, stopping_criteria: Any = None,
                 generation_config: Any = None, synced_gpus: bool = False, streamer: Any = None, *,
                 method: str = "sbd", block_size: int | None = None, gamma: float = 0.1, rule: str = "eb",
                 seed: int = 0, ops: DecodeOps | None = None, cuda_graph: bool = False,
                 **model_kwargs: Any) -> SbdGenerateOutput | Tensor:
    """`model.generate(..., custom_generate=sbd_generate, gamma=..., block_size=..., method=..., seed=...,
    cuda_graph=...)`.

    HF prepares the inputs and the generation config, then calls this with them; the decode is `generate` above.
    Returns `SbdGenerateOutput` with `return_dict_in_generate=True`, else the sequences tensor (as HF does).
    output_scores / output_logits / output_attentions / output_hidden_states are refused (the fused decode keeps
    none of them), as are logits processors and stopping criteria whose settings differ from the generation
    config's (the decode reads only the config), and `inputs_embeds` (the decode looks token ids up itself).

    HF does not forward `streamer` or `synced_gpus` to a callable custom_generate (transformers 5 rebuilds its
    keyword arguments from the callable's own parameters): a streamer given to `model.generate` receives the
    prompt from HF and nothing after it, and synced-GPU mode (a model sharded by DeepSpeed ZeRO-3 or FSDP over
    several ranks), which this decode cannot run in, is worked out here from the model and refused. Passed to this
    function directly, a streamer or `synced_gpus=True` is refused too.
    """
    sbd_model = SbdCausalLM(model)
    if streamer is not None:
        raise ValueError("sbd_generate: streamers are not supported")
    refuse_synced_gpus(model, synced_gpus)
    if model_kwargs.get("inputs_embeds") is not None:
        # HF hands a callable custom_generate empty [B, 0] input_ids beside the embeddings.
        raise ValueError("sbd_generate: inputs_embeds is not supported: the fused decode looks the prompt's token ids "
                         "up in the embeddings itself, in every pass; pass input_ids")
    prompt_len = input_ids.shape[1]
    max_new = generation_config.max_new_tokens or generation_config.max_length - prompt_len
    sampling = _sampling_settings(generation_config)
    _refuse_unsupported(logits_processor, stopping_criteria, generation_config, sbd_model.mask_token_id, sampling,
                        prompt_len + max_new)
    # HF has resolved generation_config from the model's and the call's settings: an eos_token_id or pad_token_id
    # of None here was asked for (eos_token_id=None, no EOS stop), and must not fall back to the model's again.
    out = _decode_batch(sbd_model, input_ids, model_kwargs.get("attention_mask"), "sbd_generate",
                        eos_token_id=generation_config.eos_token_id, pad_token_id=generation_config.pad_token_id,
                        block_size=block_size, batch_size=None, ops=ops, cuda_graph=cuda_graph, method=method,
                        gamma=gamma, rule=rule, max_new_tokens=max_new, seed=seed, **sampling)
    return out if generation_config.return_dict_in_generate else out.sequences
