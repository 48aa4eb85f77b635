"""A whole SBD decode step (entropy_sample, then mask_scatter_) and a filtered entropy_sample under
torch.compile(fullgraph=True): on CPU tensors (the C++ kernels), or on CUDA tensors (the Triton kernels) with
SBD_TEST_DEVICE=cuda; there also a filtered entropy_sample captured in a CUDA graph and replayed."""
from __future__ import annotations

import contextlib

import pytest
import torch

import sbd_kernels
from sbd_kernels.ops import trusted_values
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


def filtered_sampling_inputs(vocab: int = 300) -> dict:
    """Arguments of `torch.ops.sbd.entropy_sample` for 3 rows of an 8-block at temperatures 0.7-1.3 with a
    different top-k / top-p / min-p per row (each filter off in one row), and a compute mask."""
    gen = torch.Generator().manual_seed(11)
    batch, k = 3, 8
    args = {
        "logits": torch.randn(batch, k, vocab, generator=gen) * 3,
        "seed": torch.randint(0, 2**62, (batch,), generator=gen),
        "offset": torch.tensor([0, 5, 9]),
        "temperature": torch.tensor([0.7, 1.0, 1.3]),
        "compute_mask": torch.rand(batch, k, generator=gen) < 0.75,
        "top_k": torch.tensor([0, 5, 40]),
        "top_p": torch.tensor([0.9, 1.0, 0.6]),
        "min_p": torch.tensor([0.05, 0.1, 0.0]),
    }
    return {name: t.to(DEVICE) for name, t in args.items()}


def filtered_sample(logits, seed, offset, temperature, compute_mask, top_k, top_p, min_p):
    return torch.ops.sbd.entropy_sample(logits, seed, offset, temperature, compute_mask=compute_mask,
                                        mask_token_id=MASK_TOKEN_ID, top_k=top_k, top_p=top_p, min_p=min_p)


def assert_same_samples(got, expected, what: str) -> None:
    for name, a, e in zip(("tokens", "entropy", "logprob", "valid"), got, expected):
        assert torch.equal(a, e), f"{what}: {name}\n{a}\n!=\n{e}"


@pytest.mark.parametrize("filters", ["tensors", "scalars"])
def test_compiled_filtered_sampling_equals_eager(filters):
    """Guards against the top-k / top-p / min-p arguments (per-row tensors, or the schema's scalars) breaking
    the graph or being dropped, reordered or baked in as constants once compiled: the compiled call gives
    the eager tokens, entropies, log-probs and valid flags, also after the filters change."""
    args = filtered_sampling_inputs()
    if filters == "scalars":
        def sample(logits, seed, offset, temperature, compute_mask, top_k, top_p, min_p):
            return torch.ops.sbd.entropy_sample(logits, seed, offset, temperature, compute_mask=compute_mask,
                                                mask_token_id=MASK_TOKEN_ID, top_k_val=40, top_p_val=0.8,
                                                min_p_val=0.05)
    else:
        sample = filtered_sample
    compiled = torch.compile(sample, fullgraph=True)
    assert_same_samples(compiled(**args), sample(**args), "compiled")
    args["top_k"].copy_(torch.tensor([3, 0, 7]))
    args["top_p"].copy_(torch.tensor([1.0, 0.5, 0.95]))
    args["offset"].add_(1)
    assert_same_samples(compiled(**args), sample(**args), "compiled, new filters")


@pytest.mark.cuda_only
@pytest.mark.skipif(DEVICE != "cuda", reason="captures a CUDA graph (SBD_TEST_DEVICE=cuda on a GPU)")
@pytest.mark.parametrize("checks", ["value checks", "trusted values"])
def test_cuda_graph_replay_of_filtered_sampling_equals_eager(checks):
    """Guards against a filtered entropy_sample that cannot be captured in a CUDA graph (a host sync, e.g. a
    value check that reads a filter back) or whose replay differs from an eager call: a replay after new
    logits, offsets and filters are copied into the captured inputs gives the eager outputs on those inputs.
    Captured with the per-row value checks (torch._assert_async) on, and inside `trusted_values()`."""
    args = filtered_sampling_inputs()
    context = trusted_values if checks == "trusted values" else contextlib.nullcontext
    with context():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: the Triton kernels compile here
            for _ in range(2):
                filtered_sample(**args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = filtered_sample(**args)
        graph.replay()
        assert_same_samples(captured, filtered_sample(**args), "first replay")
        gen = torch.Generator().manual_seed(12)
        args["logits"].copy_(torch.randn(args["logits"].shape, generator=gen) * 3)
        args["offset"].add_(1)
        args["top_k"].copy_(torch.tensor([3, 0, 7]))
        args["top_p"].copy_(torch.tensor([1.0, 0.5, 0.95]))
        args["min_p"].copy_(torch.tensor([0.0, 0.2, 0.01]))
        graph.replay()
        torch.cuda.synchronize()
        assert_same_samples(captured, filtered_sample(**args), "replay on new inputs")
