"""Benchmark of sbd.entropy_sample: the C++ op against the oracle, eager torch and torch.compile.

    python -m pytest bench/bench_sampling.py -q         # or: python -m bench.report --only sampling
    SBD_BENCH_QUICK=1 python -m pytest bench/bench_sampling.py -q  # B = 1, V in {32000, 128256} only

Providers on the same inputs: `sbd` (torch.ops.sbd.entropy_sample on CPU), `naive` (the oracle: int64
Philox over every entry, seconds per call, so only on the small cases), `eager` (what a user would write:
log_softmax, entropy, and the exponential race argmax(p / E), E ~ Exp(1), which is Gumbel-max with one log
instead of two), `compile` (torch.compile of eager) and, where CUDA is present, `triton`. All sample at
temperature 1, the case that needs the random numbers.

GB/s = bytes_moved / time with bytes_moved = logits bytes read once (B K V x dtype size) + outputs
(B K x (8 + 4 + 4 + 1)); the report sets it against this machine's measured copy bandwidth.
"""
from __future__ import annotations

import pytest
import torch

from bench.common import DTYPES_BY_NAME, quick_grid, record, run_timed
from sbd_kernels.ops.sampling import naive

FAMILY = "sampling"
PROVIDERS = ["sbd", "naive", "eager", "compile", "triton"]
TEMPERATURE = 1.0
# Every V x K x B x dtype of the design: Llama-2 / Llama-3 / Qwen vocabularies, one position and a k = 16
# block, batch 1 and 8. SBD_BENCH_QUICK=1 keeps batch 1 and the first two vocabularies.
if quick_grid():
    VOCABS, POSITIONS, BATCHES = [32000, 128256], [1, 16], [1]
else:
    VOCABS, POSITIONS, BATCHES = [32000, 128256, 151936], [1, 16], [1, 8]
DTYPES = ["fp32", "bf16"]
# The oracle draws int64 Philox words for every entry: ~1 s per 32000-entry row on this loaded machine, so
# it is timed only up to 32768 entries per call, with 3 rounds, and the correctness gate runs it on the
# first CHECKED_POSITIONS positions of batch row 0 (rows are independent; the tests check batch invariance).
NAIVE_MAX_ENTRIES = 1 << 15
NAIVE_ROUNDS = 3
CHECKED_POSITIONS = 2


def eager_entropy_sample(logits: torch.Tensor, temperature: float):
    """The same four outputs in plain torch. argmax(p / E) with E = -log(U) ~ Exp(1) is argmax(log p + G),
    G = -log(E) ~ Gumbel: a draw from p, with one log per entry; torch's exponential_ is slower here."""
    x = logits.float()
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    entropy = -(p * logp).sum(-1)
    probs = p if temperature == 1.0 else torch.softmax(x / temperature, dim=-1)
    tokens = (probs / -torch.log(torch.rand_like(probs))).argmax(-1)
    logprob = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    valid = ~torch.isnan(x).any(-1) & torch.isfinite(x).any(-1)
    return tokens, entropy, logprob, valid


_COMPILED = {}


def compiled_eager():
    """torch.compile of the eager version, compiled once with dynamic shapes for every case."""
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(eager_entropy_sample, dynamic=True)
    return _COMPILED["fn"]


def make_inputs(batch: int, positions: int, vocab: int, dtype: torch.dtype, device: str = "cpu"):
    """N(0, 3^2) logits (a spread like a language model's over its vocabulary), one seed per row."""
    gen = torch.Generator().manual_seed(vocab + 97 * positions + batch)
    logits = (3.0 * torch.randn(batch, positions, vocab, generator=gen)).to(dtype)
    seed = torch.randint(0, 2**62, (batch,), generator=gen)
    offset = torch.arange(batch, dtype=torch.int64)
    return logits.to(device), seed.to(device), offset.to(device)


def provider_fn(provider: str):
    """(function of (logits, seed, offset), device) of one provider."""
    if provider == "sbd":
        return lambda x, s, o: torch.ops.sbd.entropy_sample(x, s, o, None, TEMPERATURE), "cpu"
    if provider == "naive":
        return lambda x, s, o: naive.entropy_sample(x, s, o, temperature_val=TEMPERATURE), "cpu"
    if provider == "eager":
        return lambda x, s, o: eager_entropy_sample(x, TEMPERATURE), "cpu"
    if provider == "compile":
        compiled = compiled_eager()
        return lambda x, s, o: compiled(x, TEMPERATURE), "cpu"
    from sbd_kernels.ops.sampling import triton as sampling_triton
    return lambda x, s, o: sampling_triton.entropy_sample(x, s, o, temperature_val=TEMPERATURE), "cuda"


def matches_oracle(fn, logits, seed, offset) -> bool:
    """Whether `fn` gives the oracle's outputs at the first CHECKED_POSITIONS positions of batch row 0."""
    got = fn(logits, seed, offset)
    ref = naive.entropy_sample(logits[:1, :CHECKED_POSITIONS].cpu(), seed[:1].cpu(), offset[:1].cpu(),
                               temperature_val=TEMPERATURE)
    tokens, entropy, logprob, valid = (t[:1, :CHECKED_POSITIONS].cpu() for t in got)
    atol = rtol = 1e-4  # fp32 sums over up to 151936 entries; tokens and valid must match exactly
    return (torch.equal(tokens, ref[0]) and torch.equal(valid, ref[3])
            and torch.allclose(entropy, ref[1], atol=atol, rtol=rtol)
            and torch.allclose(logprob, ref[2], atol=atol, rtol=rtol))


def bytes_moved(logits: torch.Tensor) -> int:
    """Logits read once, plus tokens (8), entropy (4), logprob (4) and valid (1) per position."""
    batch, positions, _ = logits.shape
    return logits.numel() * logits.element_size() + batch * positions * (8 + 4 + 4 + 1)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("batch", BATCHES)
def test_entropy_sample(benchmark, batch, positions, vocab, dtype_name, provider):
    if provider == "triton" and not torch.cuda.is_available():
        pytest.skip("triton provider: no CUDA device on this machine (the CPU set runs instead)")
    if provider == "naive" and batch * positions * vocab > NAIVE_MAX_ENTRIES:
        pytest.skip(f"naive provider: timed only up to {NAIVE_MAX_ENTRIES} entries (seconds per call)")
    try:
        fn, device = provider_fn(provider)
        logits, seed, offset = make_inputs(batch, positions, vocab, DTYPES_BY_NAME[dtype_name], device)
        # eager / compile draw from torch's generator: same distribution, other tokens; not checked.
        correct = matches_oracle(fn, logits, seed, offset) if provider in ("sbd", "triton") else None
    except Exception as err:  # torch.compile failing on this machine is a result, not a crash
        if provider != "compile":
            raise
        pytest.skip(f"compile provider: torch.compile of the eager version failed: {type(err).__name__}: {err}")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def call():
        out = fn(logits, seed, offset)
        sync()
        return out

    record(benchmark, family=FAMILY, case=f"B={batch} K={positions} V={vocab} {dtype_name}", provider=provider,
           baseline="eager", bytes_moved=bytes_moved(logits), correct=correct)
    run_timed(benchmark, call, rounds=NAIVE_ROUNDS if provider == "naive" else None)
