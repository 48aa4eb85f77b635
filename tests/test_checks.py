"""The exact-KV check's judgement of decode differences (sbd_kernels.checks): which oracle decisions are
near-ties, and that a difference with no tie before it still fails the check."""
from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from sbd_kernels.checks import decisions_are_robust, exact_kv_check
from sbd_kernels.generate import DecodeConfig, OraclePass, fused_ops, oracle_decode
from sbd_kernels.model import ModelConfig, Transformer
from sbd_kernels.testing import tolerance

ATOL, RTOL = tolerance(torch.float32)
V = 64


def one_hot_logits(tokens: list[int], height: float, runner_up: float = 0.0) -> torch.Tensor:
    """[K, V] fp32 logits: `height` at each position's token, `runner_up` at the next id, 0 elsewhere."""
    x = torch.zeros(len(tokens), V)
    for j, t in enumerate(tokens):
        x[j, t] = height
        x[j, (t + 1) % V] = runner_up
    return x


def entropy_of(x: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(x, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def step_of(x: torch.Tensor, accepted: list[bool], candidates: list[bool] | None = None,
            mask_token_id: int | None = None) -> OraclePass:
    """The pass of logits x [K, V], with the entropies the sampler computes (mask column left out)."""
    k = len(x)
    seen = x.clone()
    if mask_token_id is not None:
        seen[:, mask_token_id] = -math.inf
    return OraclePass(prompt=0, start=0, logits=x, entropy=entropy_of(seen),
                      candidates=torch.tensor(candidates or [True] * k), accepted=torch.tensor(accepted),
                      mask_token_id=mask_token_id)


def test_clear_decisions_are_robust():
    """Guards against a judge that calls every pass a tie (the decode comparison could then never fail)."""
    x = one_hot_logits([3, 9, 20], 12.0)
    x[1] *= 0.75                                   # position 1 less certain than 0
    x[2] *= 0.5                                    # position 2 the least certain
    h = entropy_of(x)
    assert h[0] < h[1] < h[2]
    step = step_of(x, [True, True, False])
    gamma = float(h[0] + h[1]) * 0.5 + float(h[0]) * 0.5   # between H0 and H0 + H1: accepts 0 and 1
    assert decisions_are_robust(step, gamma, "eb", ATOL, RTOL)
    assert decisions_are_robust(step_of(x, [True, True, False]), float(h[1] + h[2]) / 2, "threshold", ATOL, RTOL)


def test_a_near_tie_of_a_revealed_token_is_a_tie():
    """Guards against calling a decode difference a mismatch where the oracle's own argmax was within the
    logit bound, and against judging argmax ties at positions the pass did not reveal."""
    x = one_hot_logits([3, 9], 10.0)
    x[1, 10] = 10.0 - 1e-4                         # position 1 torn between tokens 9 and 10
    assert decisions_are_robust(step_of(x, [True, False]), 0.0, "eb", ATOL, RTOL)
    assert not decisions_are_robust(step_of(x, [False, True], [False, True]), 0.0, "eb", ATOL, RTOL)


def test_entropy_order_and_gamma_cut_near_ties():
    """Guards against missing the EB rule's two fragile decisions: which position ranks first, and whether
    the entropy sum of those before a position reaches gamma."""
    x = one_hot_logits([3, 9, 20], 6.0)
    x[1] = x[0].roll(6)                                       # same entropy as position 0: order is a tie
    x[1, 0] += 1e-5
    assert not decisions_are_robust(step_of(x, [True, False, False]), 0.0, "eb", ATOL, RTOL)
    x = one_hot_logits([3, 9], 6.0)
    x[1] *= 0.5
    h = entropy_of(x)
    assert decisions_are_robust(step_of(x, [True, False]), float(h[0]) * 0.5, "eb", ATOL, RTOL)
    assert not decisions_are_robust(step_of(x, [True, False]), float(h[0]) + 1e-7, "eb", ATOL, RTOL)
    assert not decisions_are_robust(step_of(x, [True, False]), float(h[1]) - 1e-7, "threshold", ATOL, RTOL)


def test_an_unknown_rule_is_an_error():
    """Guards against a misspelt rule ("EB") being judged quietly as the threshold rule."""
    x = one_hot_logits([3, 9], 12.0)
    with pytest.raises(ValueError, match="rule must be one of"):
        decisions_are_robust(step_of(x, [True, False]), 0.1, "EB", ATOL, RTOL)


def test_nan_rows_are_not_candidates():
    """Guards against a pass with a flagged (NaN) row making the judge raise or call it a tie."""
    x = one_hot_logits([3, 9], 12.0)
    x[1] = math.nan
    assert decisions_are_robust(step_of(x, [True, False], [True, False]), 0.1, "eb", ATOL, RTOL)


def test_the_mask_column_is_left_out_of_the_decisions():
    """Guards against judging ties on the mask token's logit, which the sampler never draws: a mask column on
    top hid a real near-tie between the two best tokens, and a mask logit just above the real best one made a
    clear argmax look tied."""
    mask = 2
    torn = one_hot_logits([5], 5.0, runner_up=5.0 - 1e-6)     # tokens 5 and 6 within 1e-6
    torn[0, mask] = 12.0
    assert not decisions_are_robust(step_of(torn, [True], mask_token_id=mask), 0.1, "eb", ATOL, RTOL)
    clear = one_hot_logits([5], 12.0)
    clear[0, mask] = 12.0 + 1e-6
    assert decisions_are_robust(step_of(clear, [True], mask_token_id=mask), 0.1, "eb", ATOL, RTOL)


def test_oracle_passes_name_the_mask_token(sharp_model):
    """Guards against the oracle's observer losing the mask id, so that the judge would see the mask column."""
    steps = []
    oracle_decode(sharp_model, [[3, 4, 5]], DecodeConfig(block_size=4, max_new_tokens=4), eos_id=-1, pad_id=0,
                  observer=steps.append)
    assert steps and all(step.mask_token_id == sharp_model.mask_token_id for step in steps)


@pytest.fixture(scope="module")
def sharp_model():
    """A reference model at std 1: sharp, varied predictions, so its greedy decisions are far from ties."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                    max_seq_len=128, mask_token_id=V - 1)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0)
    return model


def test_a_difference_without_a_tie_fails_the_check(sharp_model):
    """Guards against the near-tie judgement excusing a real difference: a cached decode whose sampler picks
    the second-best token fails, with no tie reported for it."""
    ops = fused_ops()

    def second_best(logits, *args, **kwargs):
        _, entropy, logprob, valid = ops.entropy_sample(logits, *args, **kwargs)
        return logits.float().topk(2, dim=-1).indices[..., 1], entropy, logprob, valid

    prompts = [[3, 4, 5], [6, 7, 8, 9]]
    honest = exact_kv_check(sharp_model, prompts, None, 4, eos_id=-1, pad_id=0, max_new_tokens=8, gamma=0.5)
    assert honest.passed and not honest.decode_ties, honest.summary("sharp")
    broken = exact_kv_check(sharp_model, prompts, None, 4, eos_id=-1, pad_id=0, max_new_tokens=8, gamma=0.5,
                            ops=dataclasses.replace(ops, entropy_sample=second_best))
    assert not broken.passed and broken.decode_mismatches and not broken.decode_ties, broken.summary("broken")
    assert "FAIL" in broken.summary("broken")


@pytest.mark.parametrize("answers,words", [([[10, 11, 12]], r"answers holds 1 token lists for 2 prompts"),
                                           ([[10, 11], [12], [13]], r"answers holds 3 token lists for 2 prompts"),
                                           ([[10, 11], []], r"answers\[1\] is empty")])
def test_answers_must_give_one_block_per_prompt(sharp_model, answers, words):
    """Guards against zip silently checking fewer prompts than given, and an IndexError on an empty answer."""
    with pytest.raises(ValueError, match=f"exact_kv_check: {words}"):
        exact_kv_check(sharp_model, [[3, 4, 5], [6, 7, 8, 9]], answers, 4, eos_id=-1, pad_id=0, max_new_tokens=4)


def test_a_model_with_invalid_logits_fails_the_check(sharp_model):
    """Guards against the check hanging on a model with NaN logits (the oracle decode never ended) or passing it:
    every decode stops at its first pass, and the report fails, naming the stopped prompts."""
    broken = copy.deepcopy(sharp_model)
    with torch.no_grad():
        broken.output.weight[7] = math.nan                       # logit 7 is NaN at every position
    report = exact_kv_check(broken, [[3, 4, 5], [6, 7, 8, 9]], None, 4, eos_id=-1, pad_id=0, max_new_tokens=8)
    assert not report.passed and "FAIL" in report.summary("broken")
    assert any("stopped early" in entry for entry in report.decode_mismatches), report.summary("broken")
