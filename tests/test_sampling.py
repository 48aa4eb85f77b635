"""sbd.entropy_sample: both backends (C++ CPU, Triton under the interpreter, or compiled on CUDA with
SBD_TEST_DEVICE=cuda) against the oracle, the generator's contract and statistics, sentinels, bad inputs,
opcheck and torch.compile."""
import functools
import math

import pytest
import torch

from sbd_kernels import testing
from sbd_kernels.ops.sampling import naive
from sbd_kernels.ops.sampling import triton as sampling_triton
from sbd_kernels.testing import FLOAT_DTYPES, assert_close, noncontiguous

BACKENDS = ("cpu", "triton")
TEMPERATURE_MODES = ("greedy", "sample", "per_row")


# The op under test: C++, the Triton launcher on the test device, or the oracle (on the tensors as given for
# inputs every backend rejects on the host).
backend_op = functools.partial(testing.backend_op, "entropy_sample")
op_on_given_tensors = functools.partial(testing.op_on_given_tensors, "entropy_sample")


def make_logits(batch, positions, vocab, dtype=torch.float32, scale=3.0):
    return (torch.randn(batch, positions, vocab) * scale).to(dtype)


def make_seeds(batch):
    """Full-range int64 seeds and offsets, so both 32-bit halves of key and counter are exercised."""
    seed = torch.randint(-2**62, 2**62, (batch,), dtype=torch.int64)
    offset = torch.randint(0, 2**40, (batch,), dtype=torch.int64)
    return seed, offset


def temperature_args(mode, batch):
    if mode == "greedy":
        return {"temperature_val": 0.0}
    if mode == "sample":
        return {"temperature_val": 1.0}
    cycle = torch.tensor([0.0, 1.0, 0.5, 2.0], dtype=torch.float32)
    return {"temperature": cycle.repeat(batch)[:batch].contiguous()}


def assert_matches_oracle(out, ref):
    tokens, entropy, logprob, valid = out
    assert tokens.dtype == torch.int64 and entropy.dtype == torch.float32
    assert logprob.dtype == torch.float32 and valid.dtype == torch.bool
    assert torch.equal(valid, ref[3]), "valid differs"
    mismatch = (tokens != ref[0]).nonzero().tolist()
    assert not mismatch, f"tokens differ at {mismatch[:5]}: {tokens[tuple(zip(*mismatch[:5]))]} " \
                         f"vs {ref[0][tuple(zip(*mismatch[:5]))]}"
    assert_close(entropy, ref[1], dtype=torch.float32, name="entropy")
    assert_close(logprob, ref[2], dtype=torch.float32, name="logprob")


def check_backend(backend, logits, seed, offset, **kwargs):
    ref = naive.entropy_sample(logits, seed, offset, **kwargs)
    out = backend_op(backend)(logits, seed, offset, **kwargs)
    assert_matches_oracle(out, ref)
    return out


# ---------------------------------------------------------------------------------------------- oracle
def test_philox_known_answers():
    """Guards against a generator that is not Philox4x32-10 (Random123 known-answer vectors)."""
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]
    for counter, key, expected in cases:
        words = naive.philox4x32_10(tuple(torch.tensor([c]) for c in counter), tuple(torch.tensor([k]) for k in key))
        assert tuple(int(w) for w in words) == expected


def test_uniform_is_open_interval_and_exact():
    """Guards against u == 0 or 1 (infinite Gumbel noise) and against a non-exact float conversion."""
    seed, offset = torch.tensor([7]), torch.tensor([3])
    u = naive.philox_uniform(seed, offset, 4, 4096)
    assert u.dtype == torch.float32
    assert float(u.min()) >= 2.0**-24 and float(u.max()) <= 1 - 2.0**-24
    assert torch.equal(u * 2**24 % 2, torch.ones_like(u))  # odd multiples of 2^-24: exact conversions
    assert abs(float(u.mean()) - 0.5) < 0.01


def test_oracle_entropy_extremes():
    """Guards against an entropy formula off by a constant: uniform logits give log V, a spike gives 0."""
    seed, offset = make_seeds(1)
    logits = torch.zeros(1, 2, 1000)
    logits[0, 1, 5] = 200.0
    _, entropy, logprob, valid = naive.entropy_sample(logits, seed, offset)
    assert valid.all()
    assert_close(entropy[0, 0], torch.tensor(math.log(1000)), dtype=torch.float32)
    assert_close(entropy[0, 1], torch.tensor(0.0), dtype=torch.float32)
    assert_close(logprob[0, 1], torch.tensor(0.0), dtype=torch.float32)


# --------------------------------------------------------------------------------- against the oracle
@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 1, 7), (3, 5, 1000), (2, 32, 7), (5, 1, 4099)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mode", TEMPERATURE_MODES)
def test_cpu_matches_oracle_shapes(cpu_isa, shape, mode):
    """Guards against wrong tile / vector tails, chunk splits and their combine, on every ISA variant."""
    logits = make_logits(*shape)
    seed, offset = make_seeds(shape[0])
    check_backend("cpu", logits, seed, offset, **temperature_args(mode, shape[0]))


@pytest.mark.parametrize("shape", [(1, 3, 50257), (1, 1, 100003), (2, 1, 151936)],
                         ids=lambda s: "x".join(map(str, s)))
def test_cpu_matches_oracle_large_vocabulary(cpu_isa, shape):
    """Guards against errors that only show with real vocabularies: many tiles, a row split over items."""
    logits = make_logits(*shape)
    seed, offset = make_seeds(shape[0])
    check_backend("cpu", logits, seed, offset, **temperature_args("per_row", shape[0]))


@pytest.mark.parametrize("scale, temperature", [(0.01, 1.0), (1.0, 0.05), (20.0, 1.0), (20.0, 20.0)])
def test_cpu_skipped_noise_never_changes_the_token(cpu_isa, scale, temperature):
    """Guards against the CPU kernel's Gumbel skips (group and per-entry bounds) dropping the true winner:
    flat, unit and peaked logits at low, unit and high temperature, against the full argmax of the oracle."""
    logits = make_logits(2, 4, 3000, scale=scale)
    seed, offset = make_seeds(2)
    check_backend("cpu", logits, seed, offset, temperature_val=temperature)


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 1, 7), (3, 5, 100), (2, 3, 1000)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mode", TEMPERATURE_MODES)
def test_triton_matches_oracle_shapes(shape, mode):
    """Guards against wrong block tails, vocabulary splits and the combine stage of the Triton kernels."""
    logits = make_logits(*shape)
    seed, offset = make_seeds(shape[0])
    check_backend("triton", logits, seed, offset, **temperature_args(mode, shape[0]))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_dtypes(backend, dtype):
    """Guards against fp16 / bf16 logits read with the wrong width or rounded before the fp32 math."""
    logits = make_logits(3, 4, 300, dtype)
    seed, offset = make_seeds(3)
    check_backend(backend, logits, seed, offset, **temperature_args("per_row", 3))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_cpu_dtypes_every_isa(cpu_isa, dtype):
    """Guards against the per-ISA fp16 / bf16 to fp32 conversion in the vectorised loads."""
    logits = make_logits(2, 3, 5003, dtype)
    seed, offset = make_seeds(2)
    check_backend("cpu", logits, seed, offset, **temperature_args("per_row", 2))


@pytest.mark.parametrize("layout", ["strided_vocab", "transposed", "sliced_rows"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_noncontiguous_logits(backend, layout):
    """Guards against kernels that assume contiguous logits (wrong rows read, or a stride ignored)."""
    base = make_logits(2, 3, 257)
    if layout == "strided_vocab":
        logits = noncontiguous(base)
    elif layout == "transposed":
        logits = base.transpose(1, 2).contiguous().transpose(1, 2)
    else:
        logits = make_logits(2, 3, 300)[:, :, 20:277]
    assert not logits.is_contiguous()
    seed, offset = make_seeds(2)
    check_backend(backend, logits, seed, offset, **temperature_args("per_row", 2))


@pytest.mark.parametrize("backend", BACKENDS)
def test_noncontiguous_per_row_inputs(backend):
    """Guards against seed / offset / temperature / compute_mask read as if contiguous."""
    batch, positions = 3, 4
    logits = make_logits(batch, positions, 130)
    seed, offset = make_seeds(2 * batch)
    temperature = torch.tensor([1.0, 9.0, 0.0, 9.0, 0.7, 9.0])[::2]
    compute_mask = torch.rand(positions, batch) > 0.3
    check_backend(backend, logits, seed[::2], offset[::2], temperature=temperature,
                  compute_mask=compute_mask.t())


# ---------------------------------------------------------------------------------- sampling behaviour
# The interpreter runs one program per row (~0.1 s each here): Triton gets 192 draws over 4 tokens.
@pytest.mark.parametrize("backend, temperature, batch, positions, vocab",
                         [("cpu", 1.0, 32, 64, 10), ("cpu", 0.5, 32, 64, 10), ("triton", 0.7, 8, 24, 4)])
def test_frequencies_match_softmax(backend, temperature, batch, positions, vocab):
    """Guards against a biased sampler (wrong noise, wrong temperature scaling, reused random numbers)."""
    row = torch.linspace(-2.0, 2.0, vocab)
    logits = row.expand(batch, positions, vocab).contiguous()
    seed = torch.full((batch,), 1234, dtype=torch.int64)
    offset = torch.arange(batch, dtype=torch.int64)  # one step counter per row: fresh noise everywhere
    tokens, *_ = backend_op(backend)(logits, seed, offset, temperature_val=temperature)
    freq = torch.bincount(tokens.flatten(), minlength=vocab).double()
    expected = torch.softmax(row.double() / temperature, dim=0)
    cosine = torch.nn.functional.cosine_similarity(freq, expected, dim=0)
    assert cosine > 0.99, (freq / freq.sum(), expected)
    assert (freq / freq.sum() - expected).abs().max() < 0.05, (freq / freq.sum(), expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_seed_reproduces_and_seeds_differ(backend):
    """Guards against hidden state (global RNG, call counters) and against a key that ignores the seed."""
    logits = make_logits(2, 8, 64, scale=0.1)  # nearly flat: every token is a plausible draw
    seed, offset = make_seeds(2)
    op = backend_op(backend)
    first = op(logits, seed, offset, temperature_val=1.0)[0]
    again = op(logits, seed, offset, temperature_val=1.0)[0]
    other_seed = op(logits, seed + 1, offset, temperature_val=1.0)[0]
    other_offset = op(logits, seed, offset + 1, temperature_val=1.0)[0]
    assert torch.equal(first, again)
    assert (first != other_seed).float().mean() > 0.5
    assert (first != other_offset).float().mean() > 0.5


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_row_seeds_and_batch_invariance(backend):
    """Guards against noise keyed on the batch index or on the launch shape instead of (seed, offset, j, v)."""
    batch, positions, vocab = 4, 2, 1000
    logits = make_logits(batch, positions, vocab, scale=0.5)
    seed, offset = make_seeds(batch)
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0])
    op = backend_op(backend)
    together = op(logits, seed, offset, temperature=temperature)
    for b in range(batch):
        alone = op(logits[b:b + 1], seed[b:b + 1], offset[b:b + 1], temperature=temperature[b:b + 1])
        for got, want in zip(alone, together):
            assert torch.equal(got[0], want[b]), f"row {b} differs alone and inside the batch"
    swapped = op(logits.flip(0), seed.flip(0), offset.flip(0), temperature=temperature.flip(0))
    assert torch.equal(swapped[0].flip(0), together[0])


def assert_rows_same_alone_and_together(op, logits, seed, offset, temperature, **kwargs):
    """Each row's four outputs, bit for bit, from a call on its batch entry alone and on the whole batch;
    returns the whole batch's outputs."""
    together = op(logits, seed, offset, temperature=temperature, **kwargs)
    for b in range(logits.shape[0]):
        alone = op(logits[b:b + 1], seed[b:b + 1], offset[b:b + 1], temperature=temperature[b:b + 1], **kwargs)
        for name, got, want in zip(("tokens", "entropy", "logprob", "valid"), alone, together):
            assert torch.equal(got[0], want[b]), f"batch entry {b}: {name} differs alone and inside the batch"
    return together


@pytest.mark.parametrize("filters", [{}, {"top_p_val": 0.9}, {"min_p_val": 0.01}], ids=["off", "top_p", "min_p"])
def test_cpu_multi_chunk_rows_same_in_any_batch_and_thread_count(filters):
    """Guards against the entropy / logprob of a row whose vocabulary takes several chunks depending on the
    rows beside it or on the thread count (the chunks once came from B * K and the threads, and the last
    bits of the chunks' combined sums changed with them): all four outputs, bit for bit, alone and in the
    batch, at 1, 2 and 3 threads (a row in one work item, in runs of 2 chunks, in runs of 1)."""
    batch, positions, vocab = 3, 2, 3 * 16384 + 851  # 4 chunks of the CPU kernel, a ragged last one
    logits = make_logits(batch, positions, vocab)
    seed, offset = make_seeds(batch)
    temperature = torch.tensor([1.0, 0.0, 0.7])
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(assert_rows_same_alone_and_together(torch.ops.sbd.entropy_sample, logits, seed, offset,
                                                            temperature, **filters))
    finally:
        torch.set_num_threads(threads)
    for n, run in zip((2, 3), runs[1:]):
        for name, got, want in zip(("tokens", "entropy", "logprob", "valid"), run, runs[0]):
            assert torch.equal(got, want), f"{name} differs at {n} threads and at 1"
    assert runs[0][3].all()


@pytest.mark.parametrize("vocab", [3000, 20000], ids=["small_tiles", "large_tiles"])
def test_triton_multi_chunk_rows_same_in_any_batch_and_sm_count(monkeypatch, vocab):
    """Guards against the Triton kernels' entropy / logprob of a row depending on the rows beside it or on
    the GPU's SM count (the vocabulary splits, and so the partial sums, once came from B * K and the SM
    count): all four outputs, bit for bit, alone and in the batch, for 1 SM (runs of several chunks a
    program) and 132 (one chunk a program). V = 3000: 6 chunks of 4 tiles of 128; 20000: 5 of 4 x 1024."""
    batch, positions = 3, 1
    logits = make_logits(batch, positions, vocab)
    seed, offset = make_seeds(batch)
    temperature = torch.tensor([1.0, 0.0, 0.7])
    op = backend_op("triton")
    runs = []
    for sms in (1, 132):
        monkeypatch.setattr(sampling_triton, "sm_count", lambda device, sms=sms: sms)
        runs.append(assert_rows_same_alone_and_together(op, logits, seed, offset, temperature))
    for name, got, want in zip(("tokens", "entropy", "logprob", "valid"), runs[1], runs[0]):
        assert torch.equal(got, want), f"{name} differs for 132 SMs and for 1"
    assert runs[0][3].all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_seed_and_offset_broadcast(backend):
    """Guards against a one-element seed / offset ([] or [1]) read beyond its single element."""
    logits = make_logits(3, 2, 100)
    op = backend_op(backend)
    full = op(logits, torch.full((3,), 99), torch.full((3,), 5), temperature_val=1.0)
    for seed, offset in [(torch.tensor(99), torch.tensor(5)), (torch.tensor([99]), torch.tensor([5]))]:
        assert torch.equal(op(logits, seed, offset, temperature_val=1.0)[0], full[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_cpu_and_triton_draw_same_tokens(backend):
    """Guards against the two backends drawing from different generators (tokens not reproducible)."""
    logits = make_logits(3, 4, 700, scale=1.0)
    seed, offset = make_seeds(3)
    cpu = torch.ops.sbd.entropy_sample(logits, seed, offset, temperature_val=1.0)[0]
    other = backend_op(backend)(logits, seed, offset, temperature_val=1.0)[0]
    assert torch.equal(cpu, other)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_is_first_argmax(backend):
    """Guards against T == 0 sampling, and against ties broken towards a higher index."""
    logits = make_logits(2, 3, 500)
    logits[0, 0, [17, 300, 499]] = 50.0
    logits[1, 2, [0, 1]] = 50.0
    seed, offset = make_seeds(2)
    tokens, _, logprob, valid = backend_op(backend)(logits, seed, offset, temperature_val=0.0)
    assert torch.equal(tokens, logits.argmax(-1))
    assert tokens[0, 0] == 17 and tokens[1, 2] == 0
    assert valid.all()
    assert_close(logprob, torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0],
                 dtype=torch.float32)


@pytest.mark.parametrize("mode", ["greedy", "sample"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_token_never_drawn(backend, mode):
    """Guards against the mask token being drawn or counted in the entropy when it has the largest logit."""
    batch, positions, vocab, mask_id = 2, 16, 50, 7
    logits = make_logits(batch, positions, vocab, scale=0.3)
    logits[..., mask_id] = 30.0
    seed, offset = make_seeds(batch)
    args = temperature_args(mode, batch)
    tokens, entropy, _, valid = backend_op(backend)(logits, seed, offset, mask_token_id=mask_id, **args)
    assert valid.all() and (tokens != mask_id).all()
    without = torch.cat([logits[..., :mask_id], logits[..., mask_id + 1:]], dim=-1)
    p = torch.softmax(without.double(), -1)
    assert_close(entropy, -(p * p.log()).sum(-1), dtype=torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_neg_inf_logits_never_drawn(backend):
    """Guards against -inf logits drawn, or turning the entropy / log-prob into NaN."""
    logits = make_logits(2, 8, 300, scale=0.1)
    logits[..., ::2] = float("-inf")
    seed, offset = make_seeds(2)
    out = check_backend(backend, logits, seed, offset, temperature_val=1.0)
    assert (out[0] % 2 == 1).all() and torch.isfinite(out[1]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_compute_mask_positions_untouched(backend):
    """Guards against positions outside compute_mask returning a token or a finite entropy."""
    batch, positions = 3, 6
    logits = make_logits(batch, positions, 120)
    logits[0, 1] = float("nan")  # never read: must not matter
    compute_mask = torch.rand(batch, positions) > 0.5
    compute_mask[0, 1] = False
    seed, offset = make_seeds(batch)
    tokens, entropy, logprob, valid = check_backend(backend, logits, seed, offset, temperature_val=1.0,
                                                    compute_mask=compute_mask)
    off = ~compute_mask
    assert (tokens[off] == -1).all() and (entropy[off] == float("inf")).all()
    assert (logprob[off] == float("-inf")).all() and not valid[off].any()
    assert valid[compute_mask].all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter on NaN rows
@pytest.mark.parametrize("mode", ["greedy", "sample"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_rows_flagged(backend, mode):
    """Guards against NaN / +inf / all -inf rows reported valid, or with an out-of-range token."""
    logits = make_logits(1, 6, 90)
    logits[0, 0, 33] = float("nan")
    logits[0, 1, 89] = float("inf")
    logits[0, 2] = float("-inf")
    logits[0, 3, :] = float("nan")
    logits[0, 5, 7] = float("nan")  # the mask token: excluded, so the row stays valid
    seed, offset = make_seeds(1)
    tokens, entropy, logprob, valid = check_backend(backend, logits, seed, offset, mask_token_id=7,
                                                    **temperature_args(mode, 1))
    assert valid[0].tolist() == [False, False, False, False, True, True]
    assert (tokens[0, :4] == 0).all() and (entropy[0, :4] == float("inf")).all()
    assert (logprob[0, :4] == float("-inf")).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter on NaN rows
@pytest.mark.parametrize("mode", ["greedy", "sample"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_entry_anywhere_in_a_long_row_is_flagged(backend, mode):
    """Guards against a NaN / +inf lost by a vectorised max: in any lane, tile or vocabulary chunk."""
    vocab = 40_003  # several 2048-entry tiles and vocabulary chunks, a ragged last one
    places = [0, 13, 2047, 2048 + 17, 20_000, vocab - 1]
    logits = make_logits(2, len(places), vocab)
    for row, v in enumerate(places):
        logits[0, row, v] = float("nan")
        logits[1, row, v] = float("inf")
    seed, offset = make_seeds(2)
    tokens, entropy, _, valid = check_backend(backend, logits, seed, offset, **temperature_args(mode, 2))
    assert not valid.any()
    assert (tokens == 0).all() and (entropy == float("inf")).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_entry_vocabulary(backend):
    """Guards against V == 1: the only token has entropy 0, and is invalid once it is the mask token."""
    logits = make_logits(2, 3, 1)
    seed, offset = make_seeds(2)
    tokens, entropy, logprob, valid = check_backend(backend, logits, seed, offset, temperature_val=1.0)
    assert valid.all() and (tokens == 0).all() and (entropy == 0).all() and (logprob == 0).all()
    tokens, entropy, _, valid = check_backend(backend, logits, seed, offset, temperature_val=1.0,
                                              mask_token_id=0)
    assert not valid.any() and (tokens == 0).all() and (entropy == float("inf")).all()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the overflow is the point
@pytest.mark.parametrize("backend", BACKENDS)
def test_scores_overflowing_to_neg_inf_draw_the_largest_logit(backend):
    """Guards against no token (or a -inf one) when every logit / T overflows to -inf: the overflow rule's
    race on (x - m) / T draws the largest logit."""
    logits = torch.full((1, 2, 40), -1e30)
    logits[0, :, 13] = -9e29
    seed, offset = make_seeds(1)
    tokens, *_ = check_backend(backend, logits, seed, offset, temperature_val=1e-10)
    assert (tokens == 13).all()


ALL_BACKENDS = BACKENDS + ("naive",)
OVERFLOW_SEEDS = 40


def draws_over_seeds(backend, row, **kwargs):
    """Tokens [OVERFLOW_SEEDS] of one [V] row drawn with seeds 0, 1, ... (a batch of copies of the row)."""
    logits = row.expand(OVERFLOW_SEEDS, 1, -1).contiguous()
    seed = torch.arange(OVERFLOW_SEEDS, dtype=torch.int64)
    offset = torch.zeros(OVERFLOW_SEEDS, dtype=torch.int64)
    tokens, _, _, valid = backend_op(backend)(logits, seed, offset, **kwargs)
    assert valid.all()
    return tokens[:, 0]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the overflow is the point
@pytest.mark.parametrize("top, temperature", [(1.0, 1e-40), (1.0, 1e-39), (1.0, 1e-38), (1000.0, 1e-40),
                                              (1000.0, 1e-39), (1000.0, 1e-38), (-3e38, 1e-40), (-3e38, 1e-39),
                                              (-3e38, 1e-38), (-3e38, 0.5)])
def test_overflowing_race_keeps_tied_maxima_equally_likely(top, temperature):
    """Guards against x / T overflowing fp32 for tied maxima and the race always drawing the first: every
    tied maximum scored +inf (logit 1 at T = 1e-40, logit 1000 at T = 1e-38), or every logit -inf (-3e38 at
    T = 0.5) and the greedy fallback drew index 0. Over 40 seeds each of the four tied maxima is drawn, the
    lower logit never, on every backend, token for token the same. Logit 1 at T = 1e-38 does not overflow
    (x / T = 1e38): that race is the plain fp32 one, whose noise 1e38 rounds away (the lowest index, as
    documented), and it must not change."""
    lower = top - 1.0 if abs(top) < 1e30 else -3.4e38
    row = torch.tensor([top, top, lower, top, top])
    draws = {backend: draws_over_seeds(backend, row, temperature_val=temperature) for backend in ALL_BACKENDS}
    for backend in BACKENDS:
        assert torch.equal(draws[backend], draws["naive"]), (backend, draws[backend].tolist(), draws["naive"].tolist())
    overflows = math.isinf(float(torch.tensor(top) / torch.tensor(temperature)))
    assert overflows == ((top, temperature) != (1.0, 1e-38))
    assert set(draws["naive"].tolist()) == ({0, 1, 3, 4} if overflows else {0}), draws["naive"].tolist()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("temperature", [1e-40, 1e-38, 0.5])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_overflowing_race_draws_the_larger_of_two_huge_logits(backend, temperature):
    """Guards against the overflow rule losing the order of the logits: 3e38 and 3.1e38 both score +inf
    (at T = 0.5 too), the race drew the first; only 3.1e38 may win, also with the mask token on a larger
    one, and a row of -3e38 and -3.1e38 entries draws -3e38."""
    row = torch.tensor([3e38, 3e38, 3.1e38, -1.0, 3.2e38, 3e38])
    assert set(draws_over_seeds(backend, row, temperature_val=temperature, mask_token_id=4).tolist()) == {2}
    row = torch.tensor([-3e38, -3e38, -3.1e38, -3.2e38, -3e38])
    assert set(draws_over_seeds(backend, row, temperature_val=temperature).tolist()) == {0, 1, 4}


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    """Guards against launches or allocations that fail on B == 0 or K == 0."""
    for shape in [(0, 3, 10), (2, 0, 10)]:
        logits = torch.randn(*shape)
        seed, offset = make_seeds(shape[0])
        tokens, entropy, logprob, valid = backend_op(backend)(logits, seed, offset)
        assert tokens.shape == entropy.shape == logprob.shape == valid.shape == shape[:2]


def test_triton_rejects_more_rows_than_its_grid_takes():
    """Guards against a launch of more programs than CUDA's grid axis 0 takes (2^31 - 1, one per row of
    logits), which fails with a launch error instead of naming the argument; META tensors (no memory)."""
    assert len(sampling_triton.meta_launches(2**31 - 1, 1, 2, torch.bfloat16)) == 2
    with pytest.raises(RuntimeError, match="logits has B \\* K = 2147483648 rows; this backend takes at most "
                                           "2\\^31 - 1"):
        sampling_triton.meta_launches(2**16, 2**15, 2, torch.bfloat16)


@pytest.mark.skipif(testing.triton_test_device() == "cuda",
                    reason="the tensors are views of sparse host file mappings (about 2^32 elements)")
def test_triton_per_sequence_views_past_int32(tmp_path):
    """Guards against int32 per-sequence offsets: the sequence index times the stride of a seed, offset,
    temperature or filter view (below 2^31, typed i32) wrapped to before the tensor once it passed 2^31
    elements, and the kernels read zeros there. Each such view here has its sequences 2^30 elements apart,
    so sequence 2 of 3 lies past 2^31."""
    logits = make_logits(3, 4, 100)
    seed, offset = make_seeds(3)
    per_sequence = {"temperature": torch.tensor([1.0, 0.5, 2.0]), "top_k": torch.tensor([50, 20, 30]),
                    "top_p": torch.tensor([0.9, 0.8, 0.95]), "min_p": torch.tensor([0.0, 0.01, 0.02])}
    ref = naive.entropy_sample(logits, seed, offset, **per_sequence)
    wide = {name: testing.sparse_strided_copy(t, 0, 2**30, tmp_path / name)
            for name, t in {"seed": seed, "offset": offset, **per_sequence}.items()}
    out = op_on_given_tensors("triton")(logits, wide.pop("seed"), wide.pop("offset"), **wide)
    assert_matches_oracle(out, ref)


# Where a run of huge-negative logits sits in the row: whole tiles and vocabulary chunks of both backends
# (CPU: 2048-entry tiles, 16384-entry chunks at V = 128256; Triton: 128-entry tiles, 512-entry chunks at
# V = 3000). The values: -inf, each dtype's finfo.min (a common mask value in constrained decoding).
HUGE_NEGATIVE_PLACES = ("start", "middle", "end")


def with_huge_negative_run(logits, place, value, length):
    """logits with `length` entries at the start, middle or end of every row set to `value`."""
    vocab = logits.shape[-1]
    begin = {"start": 0, "middle": (vocab - length) // 2, "end": vocab - length}[place]
    logits = logits.clone()
    logits[..., begin:begin + length] = value
    return logits


@pytest.mark.parametrize("fill", ["-inf", "finfo.min"])
@pytest.mark.parametrize("place", HUGE_NEGATIVE_PLACES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("backend, vocab, length", [("cpu", 128256, 60000), ("triton", 3000, 1100)],
                         ids=["cpu", "triton"])
def test_huge_negative_chunks_are_like_neg_inf(backend, vocab, length, dtype, place, fill):
    """Guards against NaN entropy when whole tiles / chunks hold only finfo.min: the online log-sum-exp
    rescaled their sums by exp(-3.4e38) = 0 after multiplying them by -3.4e38 (-inf * 0 = NaN)."""
    value = float("-inf") if fill == "-inf" else torch.finfo(dtype).min
    logits = with_huge_negative_run(make_logits(2, 2, vocab), place, value, length).to(dtype)
    seed, offset = make_seeds(2)
    _, entropy, _, valid = check_backend(backend, logits, seed, offset, **temperature_args("per_row", 2))
    assert valid.all() and torch.isfinite(entropy).all()


@pytest.mark.parametrize("value", [-3e38, -1e38, -2e36])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend, vocab, length", [("cpu", 50000, 20000), ("triton", 3000, 1024)],
                         ids=["cpu", "triton"])
def test_huge_negative_first_tiles_then_ordinary_logits(backend, vocab, length, dtype, value):
    """Guards against NaN entropy when the first tiles hold huge negative (finite) logits and ordinary ones
    follow: rebasing the sums onto the larger max multiplied them by a shift that overflows."""
    logits = with_huge_negative_run(make_logits(1, 3, vocab), "start", value, length).to(dtype)
    seed, offset = make_seeds(1)
    check_backend(backend, logits, seed, offset, temperature_val=0.0)
    check_backend(backend, logits, seed, offset, temperature_val=1.0)


@pytest.mark.parametrize("as_tensor", [True, False], ids=["tensor", "scalar"])
@pytest.mark.parametrize("temperature", [1e-40, 1e-39])
@pytest.mark.parametrize("backend", BACKENDS)
def test_subnormal_temperature_keeps_ties_random(backend, temperature, as_tensor):
    """Guards against a subnormal temperature always drawing the lowest tied maximum: 1 / T overflows to
    inf, and the CPU prefilter's 0 * inf = NaN dropped every tied entry, falling back to greedy."""
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0, -1.0]]])
    args = {"temperature": torch.tensor([temperature])} if as_tensor else {"temperature_val": temperature}
    drawn = []
    for seed in range(20):
        tokens, *_ = check_backend(backend, logits, torch.tensor([seed]), torch.tensor([0]), **args)
        drawn.append(int(tokens))
    assert set(drawn) == {0, 1, 2, 3}, drawn



@pytest.mark.parametrize("backend", BACKENDS)
def test_scalar_temperature_is_rounded_to_fp32(backend):
    """Guards against a host temperature_val below fp32's normal range used unrounded (Triton typed 1e-46
    as fp64 and failed): every backend runs at fp32(T), i.e. greedy for 1e-46."""
    logits = make_logits(2, 8, 300)
    seed, offset = make_seeds(2)
    tokens, *_ = check_backend(backend, logits, seed, offset, temperature_val=1e-46)
    assert torch.equal(tokens, logits.argmax(-1))


TEMPERATURE_VAL_RULE = r"temperature_val must be finite and >= 0 as a float32 \(at most 3.4028235e\+38\)"
# Doubles at the ends of the temperature's float32 range (round to nearest even), with what their float32
# is: 3.4028235e38 (the largest float32 as Python prints it, above it as a double) and the double below
# 2^128 - 2^103 (the midpoint between the largest float32 and 2^128) round to the largest float32, the
# midpoint to inf; -2^-150 rounds to -0 (greedy), -2^-149 is itself a float32.
FLOAT32_MAX = torch.finfo(torch.float32).max
TEMPERATURE_EDGES = [(FLOAT32_MAX, FLOAT32_MAX), (3.4028235e38, FLOAT32_MAX),
                     (2.0**128 - 2.0**103 - 2.0**75, FLOAT32_MAX), (2.0**128 - 2.0**103, math.inf),
                     (-2.0**-150, -0.0), (-2.0**-149, -2.0**-149)]


@pytest.mark.parametrize(("value", "as_float32"), TEMPERATURE_EDGES, ids=[repr(v) for v, _ in TEMPERATURE_EDGES])
@pytest.mark.parametrize("backend", BACKENDS + ("naive",))
def test_scalar_temperature_is_checked_as_the_float32_used(backend, value, as_float32):
    """Guards against temperature_val checked as a double: 3.4028235e+38, the limit its own error message
    quoted, was rejected although it is the largest float32 the kernels would run at. A scalar temperature
    is accepted exactly when its float32 is finite and >= 0, and then samples as that float32 in a tensor
    does."""
    assert torch.tensor(value, dtype=torch.float64).float().item() == as_float32
    logits = make_logits(2, 3, 300)
    seed, offset = make_seeds(2)
    if not (math.isfinite(as_float32) and as_float32 >= 0):
        with pytest.raises(RuntimeError, match=f"{TEMPERATURE_VAL_RULE}, got "):
            backend_op(backend)(logits, seed, offset, temperature_val=value)
        return
    tokens = check_backend(backend, logits, seed, offset, temperature_val=value)[0]
    per_row = torch.full((2,), as_float32, dtype=torch.float32)
    assert torch.equal(tokens, naive.entropy_sample(logits, seed, offset, temperature=per_row)[0])


def every_dtype() -> set[torch.dtype]:
    """Every dtype torch has (an ATen ScalarType each)."""
    return {d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def every_dtype_but_int64():
    """Every dtype but int64 and the quantized ones, whose tensors dispatch to a quantized backend the op has
    no kernel for."""
    dtypes = every_dtype() - {torch.int64}
    return sorted((d for d in dtypes if not str(d).startswith(("torch.qint", "torch.quint"))), key=str)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
def test_dtype_names_are_aten_names_on_every_backend():
    """Guards against the Python checks naming a dtype missing from their hand-written table as Python does
    ("torch.float8_e4m3fn", "torch.uint64") where the C++ checks print ATen's name ("Float8_e4m3fn",
    "UInt64"): a seed of any dtype gets the same message on every backend."""
    logits, offset = torch.randn(2, 3, 10), torch.tensor([0, 0])
    dtypes = every_dtype_but_int64()
    assert {torch.float8_e4m3fn, torch.uint64, torch.complex32, torch.float64} <= set(dtypes)
    for dtype in dtypes:
        seed = torch.empty(2, dtype=dtype)
        messages = set()
        for backend in BACKENDS + ("naive",):
            with pytest.raises(RuntimeError, match="seed must be an int64 tensor, got ") as info:
                op_on_given_tensors(backend)(logits, seed, offset)
            messages.add(str(info.value).splitlines()[0])
        assert len(messages) == 1, (dtype, messages)


@pytest.mark.skipif(not hasattr(torch._C, "TensorType"), reason="this torch has no JIT tensor type to compare with")
def test_dtype_name_rule_gives_c10_names_for_every_dtype():
    """Guards against the checks' rule for ATen dtype names drifting from c10::toString on a dtype torch adds
    (the JIT's tensor type prints c10's name; the quantized dtypes included)."""
    from sbd_kernels.ops.sampling._checks import _dtype_name

    dtypes = every_dtype()
    assert len(dtypes) > 40
    for dtype in dtypes:
        assert _dtype_name(dtype) == torch._C.TensorType.get().with_dtype(dtype).scalarType(), dtype


# ------------------------------------------------------------------------------------------- bad inputs
def _bad_cases():
    logits = torch.randn(2, 3, 10)
    seed, offset = torch.tensor([1, 2]), torch.tensor([0, 0])
    good = {"logits": logits, "seed": seed, "offset": offset}
    return [
        ("logits_rank", dict(good, logits=torch.randn(2, 10)), "logits must be a 3-D tensor"),
        ("logits_dtype", dict(good, logits=logits.double()), "logits must be float32, float16 or bfloat16"),
        ("empty_vocab", dict(good, logits=torch.randn(2, 3, 0)), "vocabulary dimension V >= 1"),
        ("seed_dtype", dict(good, seed=seed.int()), "seed must be an int64 tensor"),
        ("seed_shape", dict(good, seed=torch.tensor([1, 2, 3])), "seed must have shape"),
        ("offset_dtype", dict(good, offset=offset.float()), "offset must be an int64 tensor"),
        ("offset_shape", dict(good, offset=torch.zeros(2, 1, dtype=torch.int64)), "offset must have shape"),
        ("temperature_dtype", dict(good, temperature=torch.ones(2, dtype=torch.float64)),
         "temperature must be a float32 tensor"),
        ("temperature_shape", dict(good, temperature=torch.ones(3)), "temperature must have shape"),
        ("temperature_negative", dict(good, temperature=torch.tensor([1.0, -0.5])),
         "temperature must be finite and >= 0"),
        ("temperature_nan", dict(good, temperature=torch.tensor([float("nan"), 1.0])),
         "temperature must be finite and >= 0"),
        ("temperature_val_negative", dict(good, temperature_val=-1.0), f"{TEMPERATURE_VAL_RULE}, got -1$"),
        ("temperature_val_above_float32", dict(good, temperature_val=1e39),
         rf"{TEMPERATURE_VAL_RULE}, got 1e\+39 \(inf as a float32\)$"),
        ("temperature_val_inf_as_float32", dict(good, temperature_val=2.0**128 - 2.0**103),
         rf"{TEMPERATURE_VAL_RULE}, got 3.4028235677973366e\+38 \(inf as a float32\)$"),
        ("temperature_val_nan", dict(good, temperature_val=float("nan")), f"{TEMPERATURE_VAL_RULE}, got nan$"),
        ("compute_mask_dtype", dict(good, compute_mask=torch.ones(2, 3, dtype=torch.int32)),
         "compute_mask must be a bool tensor"),
        ("compute_mask_shape", dict(good, compute_mask=torch.ones(3, 2, dtype=torch.bool)),
         "compute_mask must have shape"),
        ("mask_token_id_too_large", dict(good, mask_token_id=10), "mask_token_id must be -1"),
        ("mask_token_id_negative", dict(good, mask_token_id=-2), "mask_token_id must be -1"),
    ]


BAD_CASES = _bad_cases()


@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
@pytest.mark.parametrize("backend", BACKENDS + ("naive",))
def test_bad_inputs_name_the_argument(backend, case):
    """Guards against bad inputs silently producing garbage, or errors that do not name the argument."""
    _, kwargs, message = case
    with pytest.raises(RuntimeError, match=message):
        op_on_given_tensors(backend)(**kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_mismatch_names_the_argument(backend):
    """Guards against per-row tensors on another device than logits (a meta tensor stands in)."""
    logits = torch.randn(2, 3, 10)
    with pytest.raises(RuntimeError, match="seed must be on the device of logits"):
        op_on_given_tensors(backend)(logits, torch.tensor([1, 2], device="meta"), torch.tensor([0, 0]))


# ----------------------------------------------------------------------------------- torch integration
def test_opcheck():
    """Guards against a fake kernel or schema that disagrees with the real kernel (shapes, dtypes)."""
    logits = make_logits(2, 5, 300)
    seed, offset = make_seeds(2)
    args = (logits, seed, offset, torch.tensor([0.0, 1.0]), 0.0, torch.rand(2, 5) > 0.3, 4)
    torch.library.opcheck(torch.ops.sbd.entropy_sample.default, args)
    torch.library.opcheck(torch.ops.sbd.entropy_sample.default, (logits.half(), seed, offset, None, 0.8))


def test_torch_compile_fullgraph():
    """Guards against a graph break (missing or wrong fake kernel) in a compiled decode step."""
    import sbd_kernels

    def step(logits, seed, offset):
        tokens, entropy, _, valid = sbd_kernels.entropy_sample(logits * 2.0, seed, offset,
                                                               temperature_val=0.7)
        return tokens, entropy.sum(), valid

    logits = make_logits(2, 4, 100)
    seed, offset = make_seeds(2)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(logits, seed, offset)
    want = step(logits, seed, offset)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])


# -------------------------------------------------------------------------------------- python wrapper
def test_wrapper_takes_temperature_as_tensor_or_number():
    """Guards against the wrapper's `temperature: Tensor | float` mapping a number to the wrong schema
    argument, or breaking the schema's own keywords (temperature=None, temperature_val=...)."""
    import sbd_kernels

    logits = make_logits(2, 4, 300)
    seed, offset = make_seeds(2)
    want = torch.ops.sbd.entropy_sample(logits, seed, offset, None, 0.7)
    for kwargs in ({"temperature": 0.7}, {"temperature": None, "temperature_val": 0.7},
                   {"temperature_val": 0.7}, {"temperature": torch.tensor([0.7, 0.7])},
                   {"temperature": torch.tensor([0.7, 0.7]), "temperature_val": 3.0}):
        got = sbd_kernels.entropy_sample(logits, seed, offset, **kwargs)
        for g, w in zip(got, want):
            assert torch.equal(g, w), kwargs
    greedy = sbd_kernels.entropy_sample(logits, seed, offset)[0]
    assert torch.equal(greedy, logits.argmax(-1))
    assert torch.equal(sbd_kernels.entropy_sample(logits, seed, offset, 0)[0], greedy)  # positional int
    with pytest.raises(ValueError, match="pass temperature either as a number or as temperature_val"):
        sbd_kernels.entropy_sample(logits, seed, offset, temperature=0.7, temperature_val=0.7)


def test_wrapper_number_temperature_compiles():
    """Guards against a graph break when the wrapper maps a Python number temperature inside a compiled
    decode step."""
    import sbd_kernels

    def step(logits, seed, offset):
        return sbd_kernels.entropy_sample(logits, seed, offset, temperature=0.7)[0]

    logits = make_logits(2, 4, 100)
    seed, offset = make_seeds(2)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(logits, seed, offset), step(logits, seed, offset))
