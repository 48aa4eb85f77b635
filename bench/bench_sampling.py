"""Benchmark of sbd.entropy_sample: the op against the oracle, eager torch and torch.compile.

    python -m pytest bench/bench_sampling.py -q         # or: sbd bench --only sampling
    SBD_BENCH_QUICK=1 python -m pytest bench/bench_sampling.py -q  # B = 1, V in {32000, 128256} only

Providers on the same inputs, all on `bench_device()` (the CPU, or the GPU where there is one): `sbd`
(torch.ops.sbd.entropy_sample: the C++ kernel on CPU tensors, the Triton kernels on CUDA ones), `naive`
(the oracle: int64 Philox over every entry, seconds per call on the CPU, so only on the small cases),
`eager` (what a user would write: log_softmax, entropy, and the exponential race argmax(p / E),
E ~ Exp(1), which is Gumbel-max with one log instead of two) and `compile` (torch.compile of eager). All
sample at temperature 1, the case that needs the random numbers.

Filtered cases (top-k 50, top-p 0.9): `sbd` runs the filter, `sbd plain` the same call without it (what the
filter costs), and `eager` filters as Hugging Face's warpers do (top-k: torch.topk; top-p: sort, softmax,
cumsum, mask) before the draw. The ratios of `sbd plain` are taken against `sbd` (time with the filter over
time without it), not against `eager`, which does the filter's work. `sbd` and `sbd plain` are checked against
the oracle with their own filters (none for `sbd plain`) on the benchmark inputs; a failed check withholds the
row's speedup.

GB/s = bytes_moved / time with bytes_moved = logits bytes read once (B K V x dtype size) + outputs
(B K x (8 + 4 + 4 + 1)); the report sets it against this machine's measured copy bandwidth, on CUDA against
the GPU's datasheet bandwidth.
"""
from __future__ import annotations

import pytest
import torch

from bench.harness import bench_device, build_provider, compiled, measure, parametrize_shapes
from sbd_kernels.benchmark_grid import TORCH_DTYPES, SamplingShape
from sbd_kernels.ops.sampling import naive

FAMILY = "sampling"
PROVIDERS = ["sbd", "sbd plain", "naive", "eager", "compile"]
DEVICE = bench_device()
# The oracle draws int64 Philox words for every entry: ~1 s per 32000-entry row on this loaded machine, so
# it is timed only up to 32768 entries per call, with 3 rounds, and the correctness gate runs it on the
# first CHECKED_POSITIONS positions of batch row 0 (rows are independent; the tests check batch invariance).
NAIVE_MAX_ENTRIES = 1 << 15
NAIVE_ROUNDS = 3
CHECKED_POSITIONS = 2


def hf_filtered_scores(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Hugging Face's TopK / TopP warpers on scores x / T: -inf outside the kept set."""
    if top_k:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(scores, dim=-1)
        remove = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        remove[..., -1] = False
        scores = scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return scores


def eager_entropy_sample(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """The same four outputs in plain torch. argmax(p / E) with E = -log(U) ~ Exp(1) is argmax(log p + G),
    G = -log(E) ~ Gumbel: a draw from p, with one log per entry; torch's exponential_ is slower here."""
    x = logits.float()
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    entropy = -(p * logp).sum(-1)
    if top_k or top_p < 1.0:
        probs = torch.softmax(hf_filtered_scores(x / temperature, top_k, top_p), dim=-1)
    else:
        probs = p if temperature == 1.0 else torch.softmax(x / temperature, dim=-1)
    tokens = (probs / -torch.log(torch.rand_like(probs))).argmax(-1)
    logprob = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    valid = ~torch.isnan(x).any(-1) & torch.isfinite(x).any(-1)
    return tokens, entropy, logprob, valid


def make_inputs(shape: SamplingShape, device: str = "cpu"):
    """N(0, 3^2) logits (a spread like a language model's over its vocabulary), one seed per row."""
    batch, positions, vocab, dtype = shape.batch, shape.positions, shape.vocab, TORCH_DTYPES[shape.dtype]
    gen = torch.Generator().manual_seed(vocab + 97 * positions + batch)
    logits = (3.0 * torch.randn(batch, positions, vocab, generator=gen)).to(dtype)
    seed = torch.randint(0, 2**62, (batch,), generator=gen)
    offset = torch.arange(batch, dtype=torch.int64)
    return logits.to(device), seed.to(device), offset.to(device)


def provider_filters(provider: str, shape: SamplingShape) -> dict:
    """The filters a provider's call applies, as entropy_sample's keyword arguments: none for `sbd plain` (the
    filtered case's call without them), the case's for the others."""
    if provider == "sbd plain":
        return {"top_k_val": 0, "top_p_val": 1.0}
    return {"top_k_val": shape.top_k, "top_p_val": shape.top_p}


def provider_baseline(provider: str) -> str:
    """The provider a row's ratios are taken against: `sbd` for `sbd plain` (same call with the filter: the
    filter's cost), `eager` for the others (the same work in torch)."""
    return "sbd" if provider == "sbd plain" else "eager"


def provider_fn(provider: str, shape: SamplingShape):
    """The function of (logits, seed, offset) of one provider (it runs where its inputs are)."""
    t = shape.temperature
    filters = provider_filters(provider, shape)
    if provider in ("sbd", "sbd plain"):
        return lambda x, s, o: torch.ops.sbd.entropy_sample(x, s, o, None, t, **filters)
    if provider == "naive":
        return lambda x, s, o: naive.entropy_sample(x, s, o, temperature_val=t, **filters)
    if provider == "eager":
        return lambda x, s, o: eager_entropy_sample(x, t, shape.top_k, shape.top_p)
    fn = compiled(eager_entropy_sample)
    return lambda x, s, o: fn(x, t, shape.top_k, shape.top_p)


def matches_oracle(fn, logits, seed, offset, shape: SamplingShape, filters: dict) -> bool:
    """Whether `fn` gives the outputs of the oracle with `filters` (`provider_filters`) at the first
    CHECKED_POSITIONS positions of batch row 0 (the oracle runs where the inputs are)."""
    got = fn(logits, seed, offset)
    ref = naive.entropy_sample(logits[:1, :CHECKED_POSITIONS], seed[:1], offset[:1],
                               temperature_val=shape.temperature, **filters)
    ref = [t.cpu() for t in ref]
    tokens, entropy, logprob, valid = (t[:1, :CHECKED_POSITIONS].cpu() for t in got)
    atol = rtol = 1e-4  # fp32 sums over up to 151936 entries; tokens and valid must match exactly
    return (torch.equal(tokens, ref[0]) and torch.equal(valid, ref[3])
            and torch.allclose(entropy, ref[1], atol=atol, rtol=rtol)
            and torch.allclose(logprob, ref[2], atol=atol, rtol=rtol))


def bytes_moved(logits: torch.Tensor) -> int:
    """Logits read once, plus tokens (8), entropy (4), logprob (4) and valid (1) per position."""
    batch, positions, _ = logits.shape
    return logits.numel() * logits.element_size() + batch * positions * (8 + 4 + 4 + 1)


def set_up(provider: str, shape: SamplingShape):
    """(function, inputs, oracle check) of one provider on DEVICE."""
    fn = provider_fn(provider, shape)
    inputs = make_inputs(shape, DEVICE)
    # eager / compile draw from torch's generator: same distribution, other tokens; not checked.
    checked = provider in ("sbd", "sbd plain")
    correct = matches_oracle(fn, *inputs, shape, provider_filters(provider, shape)) if checked else None
    return fn, inputs, correct


# Providers whose failure on a machine (torch.compile's) is a skip with the reason, not a failed run.
OPTIONAL = ("compile",)


@pytest.mark.parametrize("provider", PROVIDERS)
@parametrize_shapes(FAMILY)
def test_entropy_sample(benchmark, shape, provider):
    if provider == "naive" and shape.batch * shape.positions * shape.vocab > NAIVE_MAX_ENTRIES:
        pytest.skip(f"naive provider: timed only up to {NAIVE_MAX_ENTRIES} entries (seconds per call)")
    if provider == "sbd plain" and not (shape.top_k or shape.top_p < 1.0):
        pytest.skip("sbd plain: the unfiltered reference of the filtered cases (here `sbd` is the plain call)")
    fn, inputs, correct = build_provider(provider, lambda: set_up(provider, shape), optional=OPTIONAL)
    measure(benchmark, lambda: fn(*inputs), family=FAMILY, shape=shape, provider=provider,
            baseline=provider_baseline(provider), device=DEVICE, bytes_moved=bytes_moved(inputs[0]), correct=correct,
            rounds=NAIVE_ROUNDS if provider == "naive" else None, graph=provider != "naive", optional=OPTIONAL)
