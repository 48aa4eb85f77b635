"""The exact-KV check of any `SbdModel` (docs/algorithm.md §3.10): what `sbd demo` runs on the bundled
models and `sbd_kernels.hf.check` runs on a user's model.

Two parts, both at temperature 0:
1. block logits computed with the KV cache (a first block pass with the previous block as causal rows, then a
   later pass) equal those of a full recompute without a cache, within the tolerance row of the model's dtype
   (atol widened 10x for the sum over layers), on every prompt;
2. the cached decode with the given kernels gives the same tokens and NFE as the full-recompute oracle decode
   (`oracle_decode`: no cache, naive kernels), for NTP and for SBD, near-ties aside: where the decodes differ,
   the difference is a tie if a decision of the oracle decode at or before it (an argmax, the order of two
   entropies, an entropy sum against gamma) would flip under a change of its logits within the bound of part 1.
   Models in bf16 with near-uniform predictions (HF's default random init) tie at nearly every pass; a trained
   model rarely does. A difference with no tie before it fails the check, and so does a sequence that either
   decode stopped early (no valid logits at a position it needed, or the pass limit: `DecodeResult.stopped_early`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sbd_kernels.generate import (
    DecodeConfig,
    DecodeOps,
    OraclePass,
    block_logit_error,
    fused_ops,
    generate,
    oracle_decode,
)
from sbd_kernels.ops.scatter._checks import RULES
from sbd_kernels.protocol import SbdModel
from sbd_kernels.testing import tolerance


@dataclass
class ExactKvReport:
    """Outcome of `exact_kv_check`.

    max_logit_error: max |cached - recomputed| block logit over the prompts; logit_bound: the bound it is held to
    (for the prompt with the largest logits); both NaN when the model's logits hold one. decode_mismatches: "method:
    prompt i" entries, for differences with no near-tie before them and for sequences either decode stopped early;
    decode_ties: the same for differences at a near-tie.
    """

    max_logit_error: float
    logit_bound: float
    logits_ok: bool
    decode_mismatches: list[str] = field(default_factory=list)
    decode_ties: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.logits_ok and not self.decode_mismatches

    def summary(self, what: str) -> str:
        if self.decode_mismatches:
            decodes = "NO (" + "; ".join(self.decode_mismatches) + ")"
        elif self.decode_ties:
            decodes = "yes up to near-ties (" + "; ".join(self.decode_ties) + ")"
        else:
            decodes = "yes"
        return (f"exact-KV check ({what}): max |cached - recomputed| block logit {self.max_logit_error:.2e} "
                f"({'within' if self.logits_ok else 'OUTSIDE'} the bound {self.logit_bound:.2e}); cached decode == "
                f"full-recompute decode (NTP, SBD): {decodes} -> {'PASS' if self.passed else 'FAIL'}")


def exact_kv_check(model: SbdModel, prompts: list[list[int]], answers: list[list[int]] | None, block_size: int, *,
                   eos_id: int | Sequence[int], pad_id: int, max_new_tokens: int, gamma: float = 0.1,
                   ops: DecodeOps | None = None) -> ExactKvReport:
    """Runs both parts on `prompts` (token lists). answers: one non-empty token list per prompt, the tokens that
    follow it, used as the committed block of the logit check (None: the model's own greedy NTP continuation).
    Raises ValueError when answers does not hold one non-empty list per prompt."""
    ops = ops or fused_ops()
    dtype = next(model.parameters()).dtype
    atol, rtol = tolerance(dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32)
    if answers is None:
        cfg = DecodeConfig(method="ntp", max_new_tokens=2 * block_size)
        continuations = generate(model, prompts, cfg, eos_id=-1, pad_id=pad_id, ops=ops).tokens
        # A continuation cut short by invalid logits may be empty; any token serves as the committed block of
        # the logit check (it compares logits, not tokens), and the decode part reports the stopped sequence.
        answers = [tokens or prompt[-1:] for prompt, tokens in zip(prompts, continuations)]
    _check_answers(prompts, answers)
    worst, bound, logits_ok = 0.0, 0.0, True
    for prompt, answer in zip(prompts, answers):
        err, scale = block_logit_error(model, prompt, answer, block_size, ops)
        limit = 10 * atol + rtol * scale
        logits_ok &= err <= limit                     # False for a NaN error too
        worst, bound = _max_keeping_nan(worst, err), _max_keeping_nan(bound, limit)
    report = ExactKvReport(worst, bound, logits_ok)
    for method in ("ntp", "sbd"):
        cfg = DecodeConfig(method=method, block_size=block_size, gamma=gamma, max_new_tokens=max_new_tokens)
        cached = generate(model, prompts, cfg, eos_id=eos_id, pad_id=pad_id, ops=ops)
        ties: list[list[int]] = [[] for _ in prompts]   # per prompt: `start` of each pass with a near-tie

        def record(step: OraclePass, cfg=cfg, ties=ties) -> None:
            if not decisions_are_robust(step, cfg.gamma, cfg.rule, atol, rtol):
                ties[step.prompt].append(step.start)

        oracle = oracle_decode(model, prompts, cfg, eos_id=eos_id, pad_id=pad_id, observer=record)
        for i, (a, b) in enumerate(zip(cached.tokens, oracle.tokens)):
            if bool(cached.stopped_early[i] | oracle.stopped_early[i]):
                report.decode_mismatches.append(f"{method}: prompt {i} stopped early (invalid logits or the pass "
                                                "limit)")
                continue
            if a == b and int(cached.nfe[i]) == int(oracle.nfe[i]):
                continue
            first_difference = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            tied = any(start <= first_difference for start in ties[i])
            (report.decode_ties if tied else report.decode_mismatches).append(f"{method}: prompt {i}")
    return report


def _max_keeping_nan(a: float, b: float) -> float:
    """max(a, b), NaN if either is (Python's max keeps its first argument against a NaN): the report of a model
    with NaN logits shows them."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _check_answers(prompts: list[list[int]], answers: list[list[int]]) -> None:
    """ValueError naming `answers` unless it holds one non-empty token list per prompt."""
    if len(answers) != len(prompts):
        raise ValueError(f"exact_kv_check: answers holds {len(answers)} token lists for {len(prompts)} prompts; "
                         "give one per prompt (or None)")
    empty = next((i for i, answer in enumerate(answers) if len(answer) == 0), None)
    if empty is not None:
        raise ValueError(f"exact_kv_check: answers[{empty}] is empty; each answer needs at least one token")


def decisions_are_robust(step: OraclePass, gamma: float, rule: str, atol: float, rtol: float) -> bool:
    """Whether every decision of a greedy oracle pass holds when each of its logits moves by at most
    delta = 10 atol + rtol max|logit| (the bound of part 1 for these rows).

    The decisions are judged on the logits the sampler reads: the mask token's column (`step.mask_token_id`)
    left out, as the sampler never draws it and leaves it out of the entropy; delta still counts it, as the
    bound of part 1 does.

    Argmax: the revealed tokens' top-two logit gap exceeds 2 delta. Entropies: to first order,
    |dH| <= delta * E_p|log p + H| (dH = -Cov_p(log p, dx)), plus 1e-5 (1 + H) for fp32 rounding; call that e.
    With A the accepted candidates and R the rejected ones (entropies H, margins e):
    - "eb": the order between A and R holds (max_A (H + e) < min_R (H - e)), the last of A is still accepted
      (sum_A (H + e) - max_A (H - e) <= gamma, when |A| >= 2), the first of R still rejected
      (sum_A (H - e) > gamma, when R is not empty);
    - "threshold": no candidate's entropy is within e of gamma, and a candidate accepted for being ranked
      first (H >= gamma) stays first (H + e < min over the others of H - e).
    """
    if rule not in RULES:
        raise ValueError(f"decisions_are_robust: rule must be one of {RULES}, got {rule!r}")
    cand = step.candidates.cpu()
    if not bool(cand.any()):
        return True
    x = step.logits.cpu()[cand]                                         # [C, V] fp32
    delta = 10 * atol + rtol * float(torch.where(x.isfinite(), x.abs(), 0).max())
    if step.mask_token_id is not None:
        x = x.clone()
        x[:, step.mask_token_id] = -math.inf
    finite = x.isfinite()
    accepted = step.accepted.cpu()[cand]
    top2 = torch.where(finite, x, -math.inf).topk(min(2, x.shape[1]), dim=1).values
    if top2.shape[1] == 2 and bool((top2[accepted, 0] - top2[accepted, 1] <= 2 * delta).any()):
        return False
    if len(x) == 1 or not bool(accepted.any()):                        # nothing to order
        return True
    logp = torch.log_softmax(torch.where(finite, x, -math.inf), dim=1)
    p = logp.exp()
    h = step.entropy.cpu()[cand].double()
    spread = (p * (torch.where(p > 0, logp, 0) + h[:, None].float()).abs()).sum(dim=1).double()
    e = delta * spread + 1e-5 * (1 + h)
    a_h, a_e, r_h, r_e = h[accepted], e[accepted], h[~accepted], e[~accepted]
    if rule == "eb":
        if len(r_h) and float((a_h + a_e).max()) >= float((r_h - r_e).min()):
            return False
        if len(a_h) >= 2 and float((a_h + a_e).sum() - (a_h - a_e).max()) > gamma:
            return False
        return not (len(r_h) and float((a_h - a_e).sum()) <= gamma)
    if bool(((h - gamma).abs() <= e).any()):
        return False
    first = int(torch.argmin(h))
    others = torch.cat([h[:first] - e[:first], h[first + 1:] - e[first + 1:]])
    return not (float(h[first]) >= gamma and float(h[first] + e[first]) >= float(others.min()))
