"""A whole SBD decode step (entropy_sample, then mask_scatter_) under torch.compile(fullgraph=True): on CPU
tensors (the C++ kernels), or on CUDA tensors (the Triton kernels) with SBD_TEST_DEVICE=cuda."""
from __future__ import annotations

import pytest
import torch

import sbd_kernels
from sbd_kernels.testing import triton_test_device

MASK_TOKEN_ID = 5
DEVICE = triton_test_device()


def decode_step(logits, seed, offset, temperature, block_tokens, is_masked, gamma):
    """One pass (docs/algorithm.md §3.3-3.5) after the forward: sample masked positions, reveal by EB rule.

    logits [B, K, V]; seed, offset [B] int64; temperature, gamma [B] fp32; block_tokens [B, K] int64 and
    is_masked [B, K] bool are updated in place.
    """
    tokens, entropy, _, valid = sbd_kernels.entropy_sample(logits, seed, offset, temperature,
                                                           compute_mask=is_masked, mask_token_id=MASK_TOKEN_ID)
    accepted, num_accepted, block_done = sbd_kernels.mask_scatter_(block_tokens, is_masked, tokens, entropy,
                                                                   gamma, valid=valid)
    return accepted, num_accepted, block_done


def make_block(batch: int, k: int, vocab: int, temperature: float):
    gen = torch.Generator().manual_seed(batch * 100 + k)
    logits = torch.randn(batch, k, vocab, generator=gen) * 3
    seed = torch.randint(0, 2**62, (batch,), generator=gen)
    offset = torch.zeros(batch, dtype=torch.int64)
    temperatures = torch.full((batch,), temperature)
    block_tokens = torch.full((batch, k), MASK_TOKEN_ID, dtype=torch.int64)
    is_masked = torch.ones(batch, k, dtype=torch.bool)
    gamma = torch.linspace(0.0, 2.0, batch)
    return tuple(t.to(DEVICE) for t in (logits, seed, offset, temperatures, block_tokens, is_masked, gamma))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_compiled_decode_steps_equal_eager(temperature):
    """Guards against a graph break between the two ops, or a compiled graph that drops or reorders the
    in-place reveal (the next pass would then sample positions that are already revealed)."""
    logits, seed, offset, temps, tokens, masked, gamma = make_block(batch=3, k=8, vocab=37,
                                                                    temperature=temperature)
    eager_tokens, eager_masked = tokens.clone(), masked.clone()
    compiled = torch.compile(decode_step, fullgraph=True)
    for step in range(3):  # three passes of one block; the logits stand in for three forwards
        step_offset = offset + step
        expected = decode_step(logits, seed, step_offset, temps, eager_tokens, eager_masked, gamma)
        got = compiled(logits, seed, step_offset, temps, tokens, masked, gamma)
        for name, a, e in zip(("accepted", "num_accepted", "block_done"), got, expected):
            assert torch.equal(a, e), f"step {step}: {name} {a} != {e}"
        assert torch.equal(tokens, eager_tokens), f"step {step}: block_tokens"
        assert torch.equal(masked, eager_masked), f"step {step}: is_masked"
    assert not (tokens[~masked] == MASK_TOKEN_ID).any()  # revealed positions never hold the mask token
