"""The exact-KV check of any `SbdModel` (docs/algorithm.md §3.10): what `sbd demo` runs on the bundled
models and `sbd_kernels.hf.check` runs on a user's model.

Two parts, both at temperature 0:
1. block logits computed with the KV cache (a first block pass with the previous block as causal rows, then a
   later pass) equal those of a full recompute without a cache, within the tolerance row of the model's dtype
   (atol widened 10x for the sum over layers), on every prompt;
2. the cached decode with the given kernels gives the same tokens and NFE as the full-recompute oracle decode
   (`oracle_decode`: no cache, naive kernels), for NTP and for SBD.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sbd_kernels.generate import (
    DecodeConfig,
    DecodeOps,
    block_logit_error,
    fused_ops,
    generate,
    oracle_decode,
)
from sbd_kernels.protocol import SbdModel
from sbd_kernels.testing import tolerance


@dataclass
class ExactKvReport:
    """Outcome of `exact_kv_check`.

    max_logit_error: max |cached - recomputed| block logit over the prompts; logit_bound: the bound it is held to
    (for the prompt with the largest logits). decode_mismatches: "method: first differing prompt" entries.
    """

    max_logit_error: float
    logit_bound: float
    logits_ok: bool
    decode_mismatches: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.logits_ok and not self.decode_mismatches

    def summary(self, what: str) -> str:
        decodes = "yes" if not self.decode_mismatches else "NO (" + "; ".join(self.decode_mismatches) + ")"
        return (f"exact-KV check ({what}): max |cached - recomputed| block logit {self.max_logit_error:.2e} "
                f"({'within' if self.logits_ok else 'OUTSIDE'} the bound {self.logit_bound:.2e}); cached decode == "
                f"full-recompute decode (NTP, SBD): {decodes} -> {'PASS' if self.passed else 'FAIL'}")


def exact_kv_check(model: SbdModel, prompts: list[list[int]], answers: list[list[int]] | None, block_size: int, *,
                   eos_id: int | Sequence[int], pad_id: int, max_new_tokens: int, gamma: float = 0.1,
                   ops: DecodeOps | None = None) -> ExactKvReport:
    """Runs both parts on `prompts` (token lists). answers: the tokens that follow each prompt, used as the
    committed block of the logit check (None: the model's own greedy NTP continuation)."""
    ops = ops or fused_ops()
    dtype = next(model.parameters()).dtype
    atol, rtol = tolerance(dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32)
    if answers is None:
        cfg = DecodeConfig(method="ntp", max_new_tokens=2 * block_size)
        answers = generate(model, prompts, cfg, eos_id=-1, pad_id=pad_id, ops=ops).tokens
    worst, bound, logits_ok = 0.0, 0.0, True
    for prompt, answer in zip(prompts, answers):
        err, scale = block_logit_error(model, prompt, answer, block_size, ops)
        limit = 10 * atol + rtol * scale
        logits_ok &= err <= limit
        worst, bound = max(worst, err), max(bound, limit)
    report = ExactKvReport(worst, bound, logits_ok)
    for method in ("ntp", "sbd"):
        cfg = DecodeConfig(method=method, block_size=block_size, gamma=gamma, max_new_tokens=max_new_tokens)
        cached = generate(model, prompts, cfg, eos_id=eos_id, pad_id=pad_id, ops=ops)
        oracle = oracle_decode(model, prompts, cfg, eos_id=eos_id, pad_id=pad_id)
        for i, (a, b) in enumerate(zip(cached.tokens, oracle.tokens)):
            if a != b or int(cached.nfe[i]) != int(oracle.nfe[i]):
                report.decode_mismatches.append(f"{method}: prompt {i}")
                break
    return report
