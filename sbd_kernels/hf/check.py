"""`check(model, prompts)`: the exact-KV check on a user's Hugging Face model, before trusting SBD decodes of it.

    report = sbd_kernels.hf.check(model, tokenizer(["def f(x):", "The capital of"]).input_ids)
    print(report.summary("my model")); assert report.passed

It runs `sbd_kernels.checks.exact_kv_check` through the `SbdCausalLM` adapter: cached block logits against a full
recompute, and the cached decode (fused kernels) against the full-recompute oracle decode, NTP and SBD, greedy.
A failure means the cache, the position ids or the masks of this model disagree with a recompute: decodes would
silently differ from what the model computes without a cache. Decodes that differ only after a near-tie of the
recompute's own decisions (within the logit bound: e.g. a bf16 model at HF's default initialisation, whose
predictions are nearly uniform) pass, and the report names them (`report.decode_ties`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from sbd_kernels.checks import ExactKvReport, exact_kv_check
from sbd_kernels.generate import DecodeOps
from sbd_kernels.hf.generation import prompts_from_batch, refuse_synced_gpus
from sbd_kernels.hf.model import SbdCausalLM


def check(model: Any, prompts: Sequence[Sequence[int]] | Tensor, attention_mask: Tensor | None = None, *,
          block_size: int | None = None, max_new_tokens: int = 32, gamma: float = 0.1,
          ops: DecodeOps | None = None) -> ExactKvReport:
    """Exact-KV check of an HF model prepared by `enable_sbd` (or its `SbdCausalLM`) on a few prompts (token-id
    lists, or an `[B, P]` tensor with an optional attention_mask). Decodes run to `max_new_tokens` (no EOS), so
    every block position is exercised. block_size: default the one recorded by `enable_sbd`. A model sharded over
    several ranks is refused, as by `generate`. Returns the report; `report.passed` is the verdict."""
    sbd_model = model if isinstance(model, SbdCausalLM) else SbdCausalLM(model)
    refuse_synced_gpus(sbd_model.hf_model)
    if isinstance(prompts, Tensor):
        prompts = prompts_from_batch(prompts, attention_mask)
    prompt_lists = [list(map(int, p)) for p in prompts]
    if not prompt_lists or any(not p for p in prompt_lists):
        raise ValueError("check: give at least one non-empty prompt")
    if block_size is None:
        block_size = sbd_model.block_size
    if block_size < 1:
        raise ValueError(f"check: block_size must be >= 1, got {block_size}")
    pad_id = getattr(sbd_model.config, "pad_token_id", None) or 0
    return exact_kv_check(sbd_model, prompt_lists, None, block_size, eos_id=-1, pad_id=pad_id,
                          max_new_tokens=max_new_tokens, gamma=gamma, ops=ops)
