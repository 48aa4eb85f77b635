"""sbd.entropy_sample as a complete sampler: top-k, top-p and min-p per request on every backend (C++ CPU,
Triton under the interpreter or compiled on CUDA with SBD_TEST_DEVICE=cuda, the oracle), against the literal sort-based oracle and Hugging Face's
warpers, by statistics, on ties, in a batch, and with bad values."""
import contextlib
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_docs import tool_module
from test_sampling import BAD_CASES, backend_op, op_on_given_tensors
from torch._subclasses.fake_tensor import FakeTensorMode

from sbd_kernels import testing
from sbd_kernels.ops._aot import launch
from sbd_kernels.ops.sampling import naive
from sbd_kernels.ops.sampling import triton as sampling_triton
from sbd_kernels.testing import FLOAT_DTYPES, assert_close

BACKENDS = ("cpu", "triton")
ALL_BACKENDS = BACKENDS + ("naive",)
# Filter settings, as schema keywords; "mixed" gives every row its own (tensors, off rows included).
FILTERS = {
    "top_k": {"top_k_val": 5},
    "top_p": {"top_p_val": 0.8},
    "min_p": {"min_p_val": 0.1},
    "top_k_top_p_min_p": {"top_k_val": 40, "top_p_val": 0.9, "min_p_val": 0.02},
    "mixed": "per_row",
}


def make_logits(batch, positions, vocab, dtype=torch.float32, scale=3.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, positions, vocab, generator=gen) * scale).to(dtype)


def make_seeds(batch, seed=0):
    gen = torch.Generator().manual_seed(seed + 1)
    return (torch.randint(-2**62, 2**62, (batch,), generator=gen),
            torch.randint(0, 2**40, (batch,), generator=gen))


def filter_args(name, batch):
    """Schema keywords of a FILTERS entry; "per_row" cycles on / off settings over the rows."""
    if FILTERS[name] != "per_row":
        return dict(FILTERS[name])

    def cycle(values, dtype):
        return torch.tensor(values, dtype=dtype).repeat(batch)[:batch].contiguous()

    return {"top_k": cycle([0, 3, 50, 1, 0], torch.int64),
            "top_p": cycle([0.7, 1.0, 0.95, 1.0, 0.5], torch.float32),
            "min_p": cycle([0.0, 0.2, 0.0, 0.0, 0.05], torch.float32)}


def check_backend(backend, logits, seed, offset, **kwargs):
    """Runs the backend and the oracle; tokens equal, valid equal, entropy / logprob within tolerance."""
    ref = naive.entropy_sample(logits, seed, offset, **kwargs)
    out = backend_op(backend)(logits, seed, offset, **kwargs)
    assert torch.equal(out[3], ref[3]), "valid differs"
    mismatch = (out[0] != ref[0]).nonzero().tolist()
    assert not mismatch, f"tokens differ at {mismatch[:5]}: {out[0][out[0] != ref[0]][:5]} vs " \
                         f"{ref[0][out[0] != ref[0]][:5]}"
    assert_close(out[1], ref[1], dtype=torch.float32, name="entropy")
    assert_close(out[2], ref[2], dtype=torch.float32, name="logprob")
    return out


def kept(logits, temperature, top_k=0, top_p=1.0, min_p=0.0, mask_token_id=-1):
    """The oracle's kept set [B, K, V] for scalar settings."""
    x = logits.float().clone()
    if mask_token_id >= 0:
        x[..., mask_token_id] = float("-inf")
    batch = x.shape[0]
    return naive.kept_by_filters(x, torch.full((batch,), temperature), torch.full((batch,), top_k),
                                 torch.full((batch,), top_p), torch.full((batch,), min_p))


# ------------------------------------------------------------------------------- the oracle's meaning
def hugging_face_kept(x, temperature, top_k, top_p, min_p):
    """Bool [V]: what transformers' TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper and
    MinPLogitsWarper (in that order, min_tokens_to_keep=1) leave above -inf, for one fp64 row."""
    scores = x / temperature
    if top_k > 0:
        kth = torch.topk(scores, min(top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(scores)
        remove = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        remove[-1] = False
        scores = scores.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    if min_p > 0.0:
        probs = scores.softmax(-1)
        scores = scores.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return scores > float("-inf")


@pytest.mark.parametrize("case", range(60))
def test_oracle_keeps_what_hugging_face_keeps(case):
    """Guards against filters with another meaning or order than Hugging Face's (temperature, top-k,
    top-p on the renormalised rest, min-p), on rows without ties (where the tie rule cannot matter)."""
    gen = torch.Generator().manual_seed(case)
    vocab = int(torch.randint(2, 400, (1,), generator=gen))
    x = torch.randn(vocab, generator=gen, dtype=torch.float64) * float(torch.rand(1, generator=gen) * 4 + 0.2)
    x = x.float()
    assert x.unique().numel() == vocab
    temperature = float(torch.rand(1, generator=gen) * 1.5 + 0.1)
    top_k = int(torch.randint(0, vocab + 3, (1,), generator=gen)) if case % 4 != 1 else 0
    top_p = float(torch.rand(1, generator=gen) * 0.95 + 0.05) if case % 4 != 2 else 1.0
    min_p = float(torch.rand(1, generator=gen) * 0.3) if case % 4 != 3 else 0.0
    top_p, min_p = float(torch.tensor(top_p)), float(torch.tensor(min_p))  # the fp32 values the op uses
    want = hugging_face_kept(x.double(), temperature, top_k, top_p, min_p)
    got = kept(x.view(1, 1, -1), float(torch.tensor(temperature)), top_k, top_p, min_p)[0, 0]
    assert torch.equal(got, want), (temperature, top_k, top_p, min_p, (got != want).nonzero().tolist())


def test_oracle_tie_rule_keeps_whole_tie_groups():
    """Guards against a cut-off that splits a group of equal logits (by index or sort order): top-k and
    top-p keep every token tied with the last one kept, min-p keeps p >= min_p * p_max inclusive."""
    x = torch.tensor([[[1.0, 5.0, 3.0, 5.0, 3.0, 5.0, 0.0, 3.0]]])
    assert kept(x, 1.0, top_k=2)[0, 0].tolist() == [False, True, False, True, False, True, False, False]
    assert kept(x, 1.0, top_k=4)[0, 0].tolist() == [False, True, True, True, True, True, False, True]
    # The three 5s hold 3 e^5 / (3 e^5 + 3 e^3 + e + 1) = 0.87 of the mass: top-p 0.5 keeps all three,
    # top-p 0.9 reaches into the 3s and keeps all three of them.
    assert kept(x, 1.0, top_p=0.5)[0, 0].tolist() == [False, True, False, True, False, True, False, False]
    assert kept(x, 1.0, top_p=0.9)[0, 0].tolist() == [False, True, True, True, True, True, False, True]
    # min-p exactly at a ratio: e^(3 - 5) = p(3) / p(5); 0.1353 keeps the 3s, 0.1354 does not.
    assert kept(x, 1.0, min_p=0.1353)[0, 0].tolist() == [False, True, True, True, True, True, False, True]
    assert kept(x, 1.0, min_p=0.1354)[0, 0].tolist() == [False, True, False, True, False, True, False, False]


# ------------------------------------------------------------------------------- against the oracle
@pytest.mark.parametrize("filters", sorted(FILTERS))
@pytest.mark.parametrize("shape", [(1, 1, 7), (2, 3, 100), (3, 2, 700)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("backend", BACKENDS)
def test_filters_match_oracle(backend, shape, filters):
    """Guards against a threshold search (C++ selection, Triton pivot search) that keeps another set than
    the literal sort + cumsum + mask of the oracle, token for token on fixed seeds."""
    logits = make_logits(*shape)
    seed, offset = make_seeds(shape[0])
    temperature = torch.tensor([1.0, 0.6, 1.7])[: shape[0]].contiguous()
    check_backend(backend, logits, seed, offset, temperature=temperature, **filter_args(filters, shape[0]))


@pytest.mark.parametrize("filters", sorted(FILTERS))
@pytest.mark.parametrize("shape", [(1, 3, 128256), (2, 1, 151936)], ids=lambda s: "x".join(map(str, s)))
def test_cpu_filters_match_oracle_large_vocabulary(cpu_isa, shape, filters):
    """Guards against the CPU search going wrong on real vocabularies: top-k candidates over many tiles,
    the top-p selection over ~10^5 candidates, the restricted race over several vocabulary chunks."""
    logits = make_logits(*shape, seed=shape[2])
    seed, offset = make_seeds(shape[0])
    check_backend("cpu", logits, seed, offset, temperature_val=0.8, **filter_args(filters, shape[0]))


@pytest.mark.parametrize("filters", sorted(FILTERS))
def test_cpu_filters_every_isa(cpu_isa, filters):
    """Guards against the per-ISA candidate gathering (AVX-512 compress, scalar elsewhere), selections and
    list draws of the CPU filters, on rows that each fit one work item."""
    logits = make_logits(3, 4, 3001, scale=2.0)
    seed, offset = make_seeds(3)
    temperature = torch.tensor([1.0, 0.5, 1.3])
    check_backend("cpu", logits, seed, offset, temperature=temperature, mask_token_id=11,
                  **filter_args(filters, 3))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_filters_dtypes_mask_token_and_compute_mask(backend, dtype):
    """Guards against the filters reading fp16 / bf16 logits differently, keeping the mask token, or
    searching rows outside compute_mask."""
    batch, positions, vocab = 2, 4, 300
    logits = make_logits(batch, positions, vocab, dtype)
    logits[..., 7] = 40.0  # the mask token: the largest logit, yet never kept
    logits[0, 1] = float("nan")  # not computed: never read
    compute_mask = torch.ones(batch, positions, dtype=torch.bool)
    compute_mask[0, 1] = False
    seed, offset = make_seeds(batch)
    tokens, *_ = check_backend(backend, logits, seed, offset, temperature_val=1.0, compute_mask=compute_mask,
                               mask_token_id=7, top_k_val=20, top_p_val=0.9, min_p_val=0.01)
    assert (tokens != 7).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter on NaN rows
@pytest.mark.parametrize("backend", BACKENDS)
def test_filters_on_awkward_rows(backend):
    """Guards against the threshold search on rows with -inf / finfo.min runs, one live entry, all equal
    logits, NaN (invalid: flagged, not searched) and fewer live entries than top_k."""
    logits = make_logits(1, 6, 600)
    logits[0, 0, 100:500] = float("-inf")
    logits[0, 1, :300] = torch.finfo(torch.float32).min
    logits[0, 2, 1:] = float("-inf")
    logits[0, 3] = 1.5
    logits[0, 4, 17] = float("nan")
    logits[0, 5, 10:] = float("-inf")  # 10 live entries, top_k 50
    seed, offset = make_seeds(1)
    for kwargs in ({"top_k_val": 50}, {"top_p_val": 0.6}, {"min_p_val": 0.3},
                   {"top_k_val": 3, "top_p_val": 0.5, "min_p_val": 0.1}):
        _, _, _, valid = check_backend(backend, logits, seed, offset, temperature_val=1.0, **kwargs)
        assert valid[0].tolist() == [True, True, True, True, False, True]


@pytest.mark.parametrize("backend", ["cpu"])
def test_cpu_many_ties_and_large_k(backend):
    """Guards against the CPU top-k candidate buffer losing entries when ties outnumber its capacity, or
    when k itself is large, when the ties sit at the k-th largest (its cut then removes none of them and
    the buffer grows past its first size), and the top-p selection on rows of equal logits."""
    logits = make_logits(1, 5, 50000, scale=1.0)
    logits[0, 0, ::2] = 9.0      # 25000 tied maxima, top_k 5: all kept
    logits[0, 2] = 0.25          # flat row: every top-p keeps everything
    logits[0, 3, 1000:31000] = 4.0
    logits[0, 4, 7:] = torch.finfo(torch.float32).min  # 7 allowed tokens, the rest masked by a large negative
    seed, offset = make_seeds(1)
    for kwargs in ({"top_k_val": 5}, {"top_k_val": 20000}, {"top_p_val": 0.3}, {"top_k_val": 20000, "top_p_val": 0.5}):
        check_backend(backend, logits, seed, offset, temperature_val=1.0, **kwargs)


# ------------------------------------------------------------------------------ sampling behaviour
def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test of `counts` against `probs` (categories with probs > 0; a
    count where probs == 0 gives 0)."""
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    live = probs > 0
    expected = probs[live] * counts.sum()
    statistic = ((counts[live] - expected) ** 2 / expected).sum()
    dof = int(live.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


def filtered_softmax(row, temperature, **filters):
    """The distribution the filtered sampler must draw from: softmax(x / T) over the oracle's kept set."""
    keep = kept(row.view(1, 1, -1), temperature, **filters)[0, 0]
    return torch.softmax(torch.where(keep, row.double() / temperature, float("-inf")), -1)


def stat_seeds(draws: int, salt: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`draws` full-range (seed, offset) pairs, one per draw."""
    gen = torch.Generator().manual_seed(4321 + salt)
    return (torch.randint(-2**62, 2**62, (draws,), generator=gen),
            torch.randint(0, 2**40, (draws,), generator=gen))


def draw_many(backend, row, temperature, draws, salt=0, as_tensors=False, **filters):
    """Token counts of `draws` independent draws from one row: a batch of copies of it, each row with its
    own seed and offset (`stat_seeds`). filters: top_k / top_p / min_p numbers, passed as scalars or, with
    as_tensors, as [draws] tensors."""
    logits = row.expand(draws, 1, -1).contiguous()
    seed, offset = stat_seeds(draws, salt)
    if as_tensors:
        dtypes = {"top_k": torch.int64, "top_p": torch.float32, "min_p": torch.float32}
        args = {name: torch.full((draws,), value, dtype=dtypes[name]) for name, value in filters.items()}
    else:
        args = _schema(filters)
    tokens, *_ = backend_op(backend)(logits, seed, offset, temperature_val=temperature, **args)
    return torch.bincount(tokens.flatten(), minlength=row.numel()).double()


CHI_SQUARE_P_MIN = 1e-4
# CPU statistics: 4000 seeds per setting, a 12-token row at T = 1.5 where each setting removes 14-26% of
# the mass, so that a sampler (or an expected distribution) that skips the renormalisation is rejected
# (chi-square noncentrality > 170 for that error, against a critical value of ~25 at p = 1e-4).
STAT_ROW = torch.linspace(-2.0, 2.0, 12)
STAT_T = 1.5
STAT_DRAWS = 4000
STAT_FILTERS = {"top_k": {"top_k": 5}, "top_p": {"top_p": 0.8}, "min_p": {"min_p": 0.2},
                "all": {"top_k": 8, "top_p": 0.8, "min_p": 0.2}}
# Triton under the interpreter (~60 ms per filtered row): 256 seeds of an 8-token row with all three
# filters on, 3 tokens kept and 36% of the mass removed (noncentrality ~46 for a missing renormalisation).
TRITON_STAT_ROW = torch.linspace(-1.0, 1.0, 8)
TRITON_STAT_T = 1.0
TRITON_STAT_DRAWS = 256
TRITON_STAT_FILTERS = {"top_k": 6, "top_p": 0.7, "min_p": 0.3}


def _schema(filters):
    return {f"{name}_val": value for name, value in filters.items()}


def unrenormalised_softmax(row, temperature, **filters):
    """softmax(x / T) with the removed tokens' mass given to the largest logit: a sampler whose removed draws
    fall back to greedy, i.e. one that does not renormalise the kept set."""
    keep = kept(row.view(1, 1, -1), temperature, **filters)[0, 0]
    probs = torch.where(keep, torch.softmax(row.double() / temperature, -1), 0.0)
    probs[row.argmax()] += 1 - probs.sum()
    return probs


@pytest.mark.parametrize("as_tensors", [False, True], ids=["scalars", "tensors"])
@pytest.mark.parametrize("filters", sorted(STAT_FILTERS))
def test_draws_follow_the_filtered_softmax(filters, as_tensors):
    """Guards against a biased filtered sampler: draws outside the kept set, a kept set not renormalised,
    noise no longer Gumbel once restricted, or draws correlated across seeds (chi-square over 4000 CPU
    draws, one seed and offset each, against the renormalised softmax(x / T) of the kept set)."""
    settings = STAT_FILTERS[filters]
    counts = draw_many("cpu", STAT_ROW, STAT_T, STAT_DRAWS, salt=sorted(STAT_FILTERS).index(filters),
                       as_tensors=as_tensors, **settings)
    p_value = chi_square_p_value(counts, filtered_softmax(STAT_ROW, STAT_T, **settings))
    assert p_value > CHI_SQUARE_P_MIN, (p_value, counts.tolist())


def test_triton_draws_follow_the_filtered_softmax():
    """Guards against the same in the Triton kernels: 256 draws over 256 seeds (the interpreter runs ~3
    programs per row) of an 8-entry row with all three filters on (3 tokens kept)."""
    counts = draw_many("triton", TRITON_STAT_ROW, TRITON_STAT_T, TRITON_STAT_DRAWS, **TRITON_STAT_FILTERS)
    probs = filtered_softmax(TRITON_STAT_ROW, TRITON_STAT_T, **TRITON_STAT_FILTERS)
    assert int((probs > 0).sum()) == 3
    p_value = chi_square_p_value(counts, probs)
    assert p_value > CHI_SQUARE_P_MIN, (p_value, counts.tolist())
    unrenormalised = unrenormalised_softmax(TRITON_STAT_ROW, TRITON_STAT_T, **TRITON_STAT_FILTERS)
    assert chi_square_p_value(counts, unrenormalised) < CHI_SQUARE_P_MIN


@pytest.mark.parametrize("filters", sorted(STAT_FILTERS))
def test_chi_square_rejects_a_wrong_distribution(filters):
    """Guards against a distribution test that cannot fail: the same draws, held against the softmax
    without renormalisation, at a slightly wrong temperature, or of a filter one token too wide, are
    rejected."""
    settings = STAT_FILTERS[filters]
    counts = draw_many("cpu", STAT_ROW, STAT_T, STAT_DRAWS, **settings)
    assert chi_square_p_value(counts, filtered_softmax(STAT_ROW, STAT_T, **settings)) > CHI_SQUARE_P_MIN
    assert chi_square_p_value(counts, unrenormalised_softmax(STAT_ROW, STAT_T, **settings)) < 1e-12
    assert chi_square_p_value(counts, filtered_softmax(STAT_ROW, 1.1, **settings)) < CHI_SQUARE_P_MIN
    if "top_k" in settings:
        wider = dict(settings, top_k=settings["top_k"] + 1, top_p=1.0, min_p=0.0)
        assert chi_square_p_value(counts, filtered_softmax(STAT_ROW, STAT_T, **wider)) < 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_invariance_with_mixed_settings(backend):
    """Guards against one row's filters leaking into another's (per-row tensors read with the wrong
    index), or results that depend on the batch around a row."""
    batch, positions, vocab = 5, 2, 400
    logits = make_logits(batch, positions, vocab, scale=2.0)
    seed, offset = make_seeds(batch)
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0])
    args = filter_args("mixed", batch)
    op = backend_op(backend)
    together = op(logits, seed, offset, temperature=temperature, **args)
    for b in range(batch):
        alone = op(logits[b:b + 1], seed[b:b + 1], offset[b:b + 1], temperature=temperature[b:b + 1],
                   **{name: t[b:b + 1] for name, t in args.items()})
        for got, want in zip(alone, together):
            assert torch.equal(got[0], want[b]), f"row {b} differs alone and inside the batch"


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_filters_keeping_every_token_draw_the_unfiltered_token(backend):
    """Guards against the filtered path changing tokens when nothing is filtered: top_k >= V, top_p 1 and
    min_p 0 given as tensors (the threshold search runs) give exactly the unfiltered tokens."""
    batch, positions, vocab = 3, 4, 500
    logits = make_logits(batch, positions, vocab, scale=1.0)
    seed, offset = make_seeds(batch)
    op = backend_op(backend)
    plain = op(logits, seed, offset, temperature_val=0.9)
    for kwargs in ({"top_k": torch.tensor([vocab, 10**9, 0])}, {"top_p": torch.ones(batch)},
                   {"min_p": torch.zeros(batch)}, {"top_k_val": vocab, "top_p_val": 1.0, "min_p_val": 0.0}):
        filtered = op(logits, seed, offset, temperature_val=0.9, **kwargs)
        for got, want in zip(filtered, plain):
            assert torch.equal(got, want), kwargs


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_filters_keeping_one_token_draw_it(backend):
    """Guards against a filter that should keep only the largest logit letting another through: top_k 1,
    a tiny top_p, a min_p close to 1; with tied maxima, top_k 1 keeps them all and draws each."""
    batch, positions, vocab = 2, 16, 200
    logits = make_logits(batch, positions, vocab, scale=0.5)  # flat: unfiltered draws are spread
    seed, offset = make_seeds(batch)
    op = backend_op(backend)
    for kwargs in ({"top_k_val": 1}, {"top_p_val": 1e-6}, {"min_p_val": 0.999999}):
        tokens, *_ = op(logits, seed, offset, temperature_val=1.0, **kwargs)
        assert torch.equal(tokens, logits.argmax(-1)), kwargs
    logits[..., [3, 50, 120]] = 10.0
    tokens, *_ = op(logits, seed, offset, temperature_val=1.0, top_k_val=1)
    assert set(tokens.flatten().tolist()) == {3, 50, 120}


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_ties_at_the_cut_off_are_all_drawn(backend):
    """Guards against a backend breaking ties at a cut-off by index (the threshold rule keeps them all):
    with three equal logits straddling the top-k and top-p cut-offs, each of them is drawn."""
    batch, positions = 4, 16
    row = torch.tensor([1.0, 6.0, 2.0, 4.0, 0.5, 4.0, 3.0, 4.0, -1.0, 2.5])
    logits = row.expand(batch, positions, -1).contiguous()
    seed = torch.arange(batch, dtype=torch.int64)
    offset = torch.zeros(batch, dtype=torch.int64)
    op = backend_op(backend)
    # At T = 2, p(6) = 0.36; one 4 brings the mass to 0.49 and two to 0.62 >= 0.6, so Hugging Face's
    # top-p would keep two of the three 4s (in sort order); top-k 2 and top-p 0.6 both keep all three.
    for kwargs in ({"top_k_val": 2}, {"top_p_val": 0.6}):
        tokens, *_ = op(logits, seed, offset, temperature_val=2.0, **kwargs)
        assert set(tokens.flatten().tolist()) == {1, 3, 5, 7}, kwargs


# A row whose cut-offs fall on adjacent floats, signed zeros, the smallest denormals and finfo.min (groups
# from the top, count in brackets: 1 + 2^-23 [2] and 1 [2] (adjacent: a search range can hold these two keys
# alone), 0.5 [2], 1e-38 [4], 2^-149 [3], 0.0 [5] and -0.0 [5], -2^-149 [3], -1e-38 [4], -1 [8], -1e38 [2] and
# finfo.min [3] (within one pivot step of each other)); top-k values that cut at each group and inside it,
# top-p values between the groups' cumulated mass (0.13, 0.26, 0.35, 0.44, 0.52, 0.76, 0.83, 0.93 at T = 1).
CUT_OFF_LEVELS = [(1 + 2.0**-23, 2), (1.0, 2), (0.5, 2), (1e-38, 4), (2.0**-149, 3), (0.0, 5), (-0.0, 5),
                  (-(2.0**-149), 3), (-1e-38, 4), (-1.0, 8), (-1e38, 2), (torch.finfo(torch.float32).min, 3)]
CUT_OFF_TOP_K = [1, 2, 3, 4, 5, 7, 10, 11, 13, 14, 18, 19, 23, 24, 26, 27, 30, 31, 38, 39, 40, 41, 43]
CUT_OFF_TOP_P = [0.2, 0.3, 0.4, 0.48, 0.6, 0.8, 0.9, 0.97]
# (top_k, top_p) together: top-p needs every entry top-k keeps, so its search starts at a logit of the row.
CUT_OFF_BOTH = [(4, 0.9), (10, 0.97), (23, 0.99)]


def cut_off_case(positions, device="cpu"):
    """(logits [S, positions, 43] of the CUT_OFF_LEVELS row shuffled, top_k [S], top_p [S]): one request
    per setting S of CUT_OFF_TOP_K, CUT_OFF_TOP_P and CUT_OFF_BOTH."""
    row = torch.cat([torch.full((n,), v) for v, n in CUT_OFF_LEVELS])
    assert torch.signbit(row).sum() == 5 + 3 + 4 + 8 + 2 + 3 and row.unique().numel() == len(CUT_OFF_LEVELS) - 1
    row = row[torch.randperm(row.numel(), generator=torch.Generator().manual_seed(0))]
    settings = [(k, 1.0) for k in CUT_OFF_TOP_K] + [(0, p) for p in CUT_OFF_TOP_P] + CUT_OFF_BOTH
    top_k = torch.tensor([k for k, _ in settings])
    top_p = torch.tensor([p for _, p in settings])
    logits = row.expand(top_k.numel(), positions, -1).contiguous()
    return logits.to(device), top_k.to(device), top_p.to(device)


@pytest.mark.parametrize("backend", ["cpu"])
def test_cut_offs_on_adjacent_floats_signed_zeros_and_finfo_min(backend):
    """Guards against a CPU selection that orders -0.0 below 0.0, takes a denormal for zero, merges adjacent
    floats or drops a finfo.min tie group: token for token with the oracle, 8 draws a setting (the Triton
    search's cut-off itself is compared below)."""
    logits, top_k, top_p = cut_off_case(positions=8)
    seed, offset = make_seeds(top_k.numel())
    check_backend(backend, logits, seed, offset, temperature_val=1.0, top_k=top_k, top_p=top_p,
                  min_p=torch.zeros(top_k.numel()))


def threshold_launch_of(logits, temperature_val=1.0, candidates=sampling_triton.THRESHOLD_CANDIDATES, **kwargs):
    """The threshold kernel's launch of a Triton entropy_sample call (default T = 1; kwargs: filters, mask
    token), with `candidates` kept per lane (0: none), its output poisoned (NaN)."""
    seed, offset = (t.to(logits.device) for t in make_seeds(logits.shape[0]))
    _, launches = sampling_triton._sampling_launches(logits, seed, offset, temperature_val=temperature_val, **kwargs)
    threshold_launch = launches[0]
    assert threshold_launch.kernel is sampling_triton._sampling_threshold_kernel
    threshold_launch.args["threshold_ptr"].fill_(float("nan"))
    return threshold_launch._replace(constexprs={**threshold_launch.constexprs, "CANDIDATES": candidates})


def oracle_cut_off(logits, top_k, top_p):
    """[B * K] smallest logit the oracle keeps at T = 1 (per-request top_k, top_p), -inf where top_k >= V."""
    rows = logits.shape[0] * logits.shape[1]
    x = logits.cpu().float()
    kept = naive.kept_by_filters(x, torch.ones(x.shape[0]), top_k.cpu(), top_p.cpu(), torch.zeros(x.shape[0]))
    want = torch.where(kept, x, float("inf")).amin(-1).reshape(rows)
    want[top_k.cpu().repeat_interleave(logits.shape[1]) >= logits.shape[-1]] = float("-inf")
    return want


def assert_threshold_is_oracle_cut_off(threshold_launch, logits, top_k, top_p):
    launch([threshold_launch])
    want = oracle_cut_off(logits, top_k, top_p)
    got = threshold_launch.args["threshold_ptr"].cpu()
    assert torch.equal(got, want), [(s, float(g), float(w)) for s, (g, w) in enumerate(zip(got, want)) if g != w]


def test_triton_threshold_is_the_oracle_cut_off():
    """Guards the Triton threshold search itself (the draws above see a wrong kept set only when one of its
    extra or missing entries wins): on the CUT_OFF_LEVELS row, threshold[row] equals the smallest logit the
    oracle keeps, exactly, for every setting (-inf where nothing is filtered: top_k >= V)."""
    device = testing.triton_test_device()
    logits, top_k, top_p = cut_off_case(positions=1, device=device)
    threshold_launch = threshold_launch_of(logits, top_k=top_k, top_p=top_p, min_p=torch.zeros_like(top_p))
    assert_threshold_is_oracle_cut_off(threshold_launch, logits, top_k, top_p)


def lane_candidates(row, lanes=sampling_triton.THRESHOLD_BLOCK, keep=sampling_triton.THRESHOLD_CANDIDATES):
    """[keep, lanes]: each lane's (entry v: lane v % lanes) `keep` largest values of row, descending, -inf
    where a lane holds fewer."""
    tiles = -(-row.numel() // lanes)
    padded = torch.full((max(tiles, keep) * lanes,), float("-inf"))
    padded[:row.numel()] = row.float()
    return padded.view(-1, lanes).sort(dim=0, descending=True).values[:keep]


@pytest.mark.parametrize("vocab", [5000, 12288 + 77])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_threshold_kernel_keeps_each_lanes_largest_logits(vocab, dtype):
    """Guards what the searches run over when they can: after the threshold kernel, candidates[row] holds each
    lane's 8 largest logits in descending order, exactly, in the logits' dtype (-inf where a lane holds fewer
    entries, and for the mask token, which here is the row's largest logit); a row whose filters need no
    search (min-p alone) keeps none. Every entry is written (poisoned before)."""
    device = testing.triton_test_device()
    mask_token_id = 7
    logits = make_logits(3, 2, vocab, dtype)
    logits[..., mask_token_id] = 1000.0
    logits = logits.to(device)
    top_k = torch.tensor([50, 0, 0], device=device)
    top_p = torch.tensor([1.0, 0.9, 1.0], device=device)
    min_p = torch.tensor([0.0, 0.0, 0.1], device=device)
    threshold_launch = threshold_launch_of(logits, mask_token_id=mask_token_id, top_k=top_k, top_p=top_p,
                                           min_p=min_p)
    candidates = threshold_launch.args["candidates_ptr"]
    assert candidates.dtype == dtype
    candidates.fill_(float("nan"))
    launch([threshold_launch])
    got = candidates.cpu().float().view(6, sampling_triton.THRESHOLD_CANDIDATES, sampling_triton.THRESHOLD_BLOCK)
    for r, row in enumerate(logits.cpu().reshape(6, vocab)):
        row = row.float()
        row[mask_token_id] = float("-inf")
        want = lane_candidates(row) if r < 4 else torch.full_like(got[r], float("-inf"))
        assert torch.equal(got[r], want), (r, (got[r] != want).nonzero()[:4].tolist())


def lanes_hold_the_top(vocab, top, lane=5, seed=0):
    """A row of N(0, 1) logits whose `top` largest (10 + t / 10, t < top) all sit in one lane (entries lane +
    1024 t): the lane's 8 candidates miss the rest of them, which the other lanes cannot make up for."""
    row = make_logits(1, 1, vocab, scale=1.0, seed=seed).view(vocab)
    row[lane + sampling_triton.THRESHOLD_BLOCK * torch.arange(top)] = 10 + torch.arange(top) / 10
    return row


# (name, row, top_k, top_p, whether the candidates hold the answer): V = 12288, 12 tiles a lane.
CANDIDATE_CASES = [
    ("one lane top-k 5", lambda: lanes_hold_the_top(12288, 12), 5, 1.0, True),
    ("one lane top-k 10", lambda: lanes_hold_the_top(12288, 12), 10, 1.0, False),
    ("one lane top-k 10 top-p 0.5", lambda: lanes_hold_the_top(12288, 12), 10, 0.5, False),
    ("one lane top-k 5 top-p 0.5", lambda: lanes_hold_the_top(12288, 12), 5, 0.5, True),
    ("one lane top-p 0.9", lambda: lanes_hold_the_top(12288, 12), 0, 0.9, False),
    ("peaked top-p 0.9", lambda: make_logits(1, 1, 12288, scale=4.0).view(-1), 0, 0.9, True),
    ("flat top-p 0.9", lambda: make_logits(1, 1, 12288, scale=0.01).view(-1), 0, 0.9, False),
    ("flat top-k 300", lambda: make_logits(1, 1, 12288, scale=0.01).view(-1), 300, 1.0, True),
]


@pytest.mark.parametrize("candidates", [sampling_triton.THRESHOLD_CANDIDATES, 0], ids=["candidates", "row_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threshold_search_over_candidates_or_the_row(dtype, candidates):
    """Guards the choice between searching a row's candidates and the row: each CANDIDATE_CASES row is the
    oracle's cut-off, exactly, whether the candidates hold the answer (they are searched) or not (a search
    over them would be wrong: their k-th largest is not the row's, or they hold less than top_p of the row's
    mass), and with no candidates at all (CANDIDATES = 0: every search over the row)."""
    device = testing.triton_test_device()
    rows = [make().to(dtype) for _, make, _, _, _ in CANDIDATE_CASES]
    for (name, _, k, p, held), row in zip(CANDIDATE_CASES, rows):
        x = row.float()
        cands = lane_candidates(x)
        floor = cands[-1].max()  # the largest of the lanes' smallest candidates: no other entry is above it
        if k > 0:
            kth = x.sort(descending=True).values[k - 1]
            assert bool(cands.flatten().sort(descending=True).values[k - 1] == kth) == held, name
            assert bool(kth > floor) == held, name
        else:
            weight = torch.exp(x - x.max())
            assert bool(weight[x > floor].sum() >= p * weight.sum()) == held, name
    logits = torch.stack(rows).view(len(rows), 1, -1).to(device)
    top_k = torch.tensor([k for _, _, k, _, _ in CANDIDATE_CASES], device=device)
    top_p = torch.tensor([p for _, _, _, p, _ in CANDIDATE_CASES], device=device)
    threshold_launch = threshold_launch_of(logits, candidates=candidates, top_k=top_k, top_p=top_p,
                                           min_p=torch.zeros_like(top_p))
    assert_threshold_is_oracle_cut_off(threshold_launch, logits, top_k, top_p)


def mixed_rows(rows, vocab, seed=0):
    """[rows, 1, vocab] logits of every kind the threshold kernel meets: N(0, s^2) with s from 0.01 to 6,
    quarter-rounded (ties), runs of -inf, and a lane holding a row's 6-12 largest logits (CANDIDATE_CASES)."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.randn(rows, vocab, generator=gen) * torch.tensor([0.01, 0.5, 1.0, 3.0, 6.0]).repeat(rows)[:rows, None]
    out[1::3] = torch.round(out[1::3] * 4) / 4
    out[2::4, torch.randint(0, vocab, (150,), generator=gen)] = float("-inf")
    for r in range(0, rows, 3):
        top = 6 + r % 7
        out[r, 11 + sampling_triton.THRESHOLD_BLOCK * torch.arange(top)] = out[r].max() + 1 + torch.arange(top) / 8
    return out.view(rows, 1, vocab)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_threshold_is_the_same_over_candidates_or_the_row(dtype):
    """Guards the candidates against any answer the row would not give: on mixed rows of 12293 entries (a mask
    token, T = 0.7), with top-k, top-p and min-p on and off in 15 combinations (top-k 1-3000 and V, top-p
    0.3-0.99; top-k 50 alone on a row where one lane holds the 9 largest logits), the threshold is the same,
    exactly, with and without candidates."""
    device = testing.triton_test_device()
    rows, vocab = 15, 12293
    logits = mixed_rows(rows, vocab).to(dtype).to(device)
    top_k = torch.tensor([0, 2, 5, 50, 500, 3000, vocab, 0, 50, 12, 0, 500, 1, 0, 50], device=device)
    top_p = torch.tensor([0.3, 1.0, 0.9, 1.0, 0.99, 0.9, 0.9, 0.99, 0.5, 1.0, 1.0, 0.3, 0.99, 0.9, 1.0],
                         device=device)
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.05],
                         device=device)
    thresholds = []
    for candidates in (sampling_triton.THRESHOLD_CANDIDATES, 0):
        threshold_launch = threshold_launch_of(logits, 0.7, candidates, mask_token_id=13, top_k=top_k, top_p=top_p,
                                               min_p=min_p)
        launch([threshold_launch])
        thresholds.append(threshold_launch.args["threshold_ptr"].cpu())
    assert not thresholds[0].isnan().any()
    assert torch.equal(thresholds[0], thresholds[1]), (thresholds[0] != thresholds[1]).nonzero().flatten().tolist()


# Filter settings under an overflowing temperature: each keeps the four tied maxima (1000) and nothing else
# can win; "top_k" keeps the next logit (999) too, "wide" (top-k 2V/3) most of the row (the CPU's race over
# the row's tiles rather than over a candidate list).
OVERFLOW_FILTERS = ("top_k", "top_p", "min_p", "all", "wide")
OVERFLOW_TIES = [7, 31, 150, 299]


def overflow_filter_args(name, vocab):
    return {"none": {}, "top_k": {"top_k_val": 5}, "top_p": {"top_p_val": 0.5}, "min_p": {"min_p_val": 0.5},
            "all": {"top_k_val": 8, "top_p_val": 0.9, "min_p_val": 0.1}, "wide": {"top_k_val": 2 * vocab // 3}}[name]


def overflow_row(vocab):
    """[V] logits: N(0, 3^2), tied maxima 1000 at OVERFLOW_TIES (scaled into the row), 999 once."""
    row = make_logits(1, 1, vocab)[0, 0]
    ties = [i * vocab // 300 for i in OVERFLOW_TIES]
    row[ties] = 1000.0
    row[ties[1] + 1] = 999.0
    return row, set(ties)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # x / T overflows: the point
@pytest.mark.parametrize("temperature", [1e-40, 1e-38])
@pytest.mark.parametrize("filters", OVERFLOW_FILTERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_filters_under_an_overflowing_temperature(backend, filters, temperature):
    """Guards against the filtered paths (CPU: top-k candidate list, min-p threshold race, top-p check and
    redraw; Triton: threshold search, filtered race) drawing the first of tied maxima when x / T overflows
    to +inf: over 40 seeds each tied maximum is drawn, token for token as the oracle's overflow rule."""
    row, ties = overflow_row(300)
    batch = 40
    logits = row.expand(batch, 1, -1).contiguous()
    seed, offset = torch.arange(batch, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64)
    tokens, *_ = check_backend(backend, logits, seed, offset, temperature_val=temperature,
                               **overflow_filter_args(filters, 300))
    assert set(tokens.flatten().tolist()) == ties, tokens.flatten().tolist()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("filters", ["none", *OVERFLOW_FILTERS])
def test_cpu_overflowing_race_on_split_rows(filters):
    """Guards against the overflow rule missing the C++ rows split over several work items (4 rows of
    100000 entries: items whose partial best is +inf, combined) with and without filters: each tied maximum
    is drawn over 40 seeds, token for token as the oracle."""
    vocab, batch = 100_000, 4
    row, ties = overflow_row(vocab)
    logits = row.expand(batch, 1, -1).contiguous()
    drawn = set()
    for s in range(0, 40, batch):
        seed, offset = torch.arange(s, s + batch), torch.zeros(batch, dtype=torch.int64)
        tokens, *_ = check_backend("cpu", logits, seed, offset, temperature_val=1e-39,
                                   **overflow_filter_args(filters, vocab))
        drawn |= set(tokens.flatten().tolist())
    assert drawn == ties


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_greedy_ignores_filters_and_outputs_stay_unfiltered(backend):
    """Guards against filters applied at T == 0, and against entropy / logprob computed on the filtered
    distribution (they are the EB rule's input: softmax(logits) at temperature 1, unfiltered)."""
    batch, positions, vocab = 2, 5, 300
    logits = make_logits(batch, positions, vocab)
    seed, offset = make_seeds(batch)
    op = backend_op(backend)
    filters = {"top_k_val": 3, "top_p_val": 0.5, "min_p_val": 0.2}
    greedy = op(logits, seed, offset, temperature_val=0.0, **filters)
    assert torch.equal(greedy[0], logits.argmax(-1))
    sampled = op(logits, seed, offset, temperature_val=1.5, **filters)
    plain = op(logits, seed, offset, temperature_val=1.5)
    assert torch.equal(sampled[1], plain[1])
    log_p = torch.log_softmax(logits.double(), -1)
    assert_close(sampled[2], log_p.gather(-1, sampled[0].unsqueeze(-1))[..., 0], dtype=torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_subnormal_filter_values(backend):
    """Guards against a subnormal top_p / min_p scalar (Triton types it fp64) or temperature breaking the
    search: top_p 1e-40 keeps the largest logit alone, min_p 1e-40 keeps all but the far tail."""
    logits = make_logits(2, 3, 300)
    seed, offset = make_seeds(2)
    tokens, *_ = check_backend(backend, logits, seed, offset, temperature_val=1.0, top_p_val=1e-40)
    assert torch.equal(tokens, logits.argmax(-1))
    check_backend(backend, logits, seed, offset, temperature_val=1.0, min_p_val=1e-40)
    check_backend(backend, logits, seed, offset, temperature=torch.tensor([1e-40, 1.0]), top_k_val=2)


REPO = Path(__file__).resolve().parents[1]
# A row of 64 logits, 40 tied at the maximum: the CPU top-p selection's pivot (the median of three samples)
# is the maximum at once. Run in a process of its own, so that a crash fails the test instead of ending pytest.
TIED_MAXIMA_TOP_P = """
import sys
import torch
import sbd_kernels  # noqa: F401
torch.ops.sbd._set_cpu_isa(sys.argv[1])
logits = torch.full((1, 1, 64), -1.0)
logits[0, 0, :40] = 1.0
for top_p in map(float, sys.argv[2:]):
    try:
        tokens = torch.ops.sbd.entropy_sample(logits, torch.tensor([0]), torch.tensor([0]), None, 1.0,
                                              top_p_val=top_p)[0]
        print(int(tokens))
    except RuntimeError as error:
        print(str(error).splitlines()[0])
"""


def test_cpu_top_p_at_float32_zero_on_tied_maxima(cpu_isa):
    """Guards against a top_p_val that is 0 as a float32 (1e-50 passed the check as a double) crashing the
    process: the selection's target top_p * mass was 0, its split above a pivot at the maximum kept nothing,
    and it read the entry before its empty list. 1e-50 is now rejected, and 2^-149, the smallest top_p that
    is not 0 as a float32, keeps the tied maxima and draws the oracle's token."""
    smallest = 2.0**-149
    proc = subprocess.run([sys.executable, "-c", TIED_MAXIMA_TOP_P, cpu_isa, "1e-50", repr(smallest)], cwd=REPO,
                          capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 0, f"exit status {proc.returncode}: {proc.stderr[-2000:]}"
    logits = torch.full((1, 1, 64), -1.0)
    logits[0, 0, :40] = 1.0
    want = naive.entropy_sample(logits, torch.tensor([0]), torch.tensor([0]), temperature_val=1.0,
                                top_p_val=smallest)[0]
    assert proc.stdout.splitlines() == [
        "sbd.entropy_sample: top_p_val must be in (0, 1] as a float32 (1: off), got 1e-50 (0 as a float32)",
        str(int(want))]


# Doubles at the ends of the filters' float32 ranges (round to nearest even), with what their float32 is:
# 2^-150 is the midpoint between 0 and 2^-149 (rounds to 0), 1 + 2^-24 the midpoint between 1 and its next
# float (rounds to 1), 1 - 2^-25 the midpoint between 1 and the float below (rounds to 1), -2^-150 rounds to -0.
SCALAR_FILTER_EDGES = [
    ("top_p", 2.0**-150, 0.0), ("top_p", 2.0**-150 * (1 + 2.0**-52), 2.0**-149), ("top_p", 1e-50, 0.0),
    ("top_p", 1 + 2.0**-24, 1.0), ("top_p", 1 + 2.0**-24 + 2.0**-52, 1 + 2.0**-23),
    ("min_p", 1 - 2.0**-25, 1.0), ("min_p", 1 - 2.0**-25 - 2.0**-53, 1 - 2.0**-24), ("min_p", 1 - 1e-12, 1.0),
    ("min_p", -2.0**-150, -0.0), ("min_p", -2.0**-149, -2.0**-149),
]
FILTER_RANGES = {"top_p": (lambda p: 0 < p <= 1, r"in \(0, 1\] as a float32 \(1: off\)"),
                 "min_p": (lambda p: 0 <= p < 1, r"in \[0, 1\) as a float32 \(0: off\)")}


@pytest.mark.parametrize(("name", "value", "as_float32"), SCALAR_FILTER_EDGES,
                         ids=[f"{name}={value!r}" for name, value, _ in SCALAR_FILTER_EDGES])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_scalar_filters_are_checked_as_the_float32_used(backend, name, value, as_float32):
    """Guards against top_p_val / min_p_val checked as doubles but used as float32: top_p 1e-50 (0 as a
    float32; it crashed the C++ kernel) and min_p 1 - 1e-12 (1) were accepted, 1 + 2^-24 (1) rejected, where
    a tensor of the same float32 is judged the other way. A scalar is accepted exactly when its float32 is
    in range, and then samples as that float32 in a tensor does."""
    assert torch.tensor(value, dtype=torch.float64).float().item() == as_float32
    in_range, rule = FILTER_RANGES[name]
    logits = make_logits(2, 3, 300)
    seed, offset = make_seeds(2)
    if not in_range(as_float32):
        with pytest.raises(RuntimeError, match=f"{name}_val must be {rule}, got "):
            backend_op(backend)(logits, seed, offset, temperature_val=1.0, **{f"{name}_val": value})
        return
    tokens = check_backend(backend, logits, seed, offset, temperature_val=1.0, **{f"{name}_val": value})[0]
    per_row = torch.full((2,), as_float32, dtype=torch.float32)
    assert torch.equal(tokens, naive.entropy_sample(logits, seed, offset, temperature_val=1.0,
                                                    **{name: per_row})[0])


# ------------------------------------------------------------------------------------- bad values
def _bad_filter_cases():
    logits = torch.randn(2, 3, 10)
    good = {"logits": logits, "seed": torch.tensor([1, 2]), "offset": torch.tensor([0, 0]), "temperature_val": 1.0}
    return [
        ("top_k_dtype", dict(good, top_k=torch.tensor([1, 2], dtype=torch.int32)),
         "top_k must be an int64 tensor, got Int"),
        ("top_k_shape", dict(good, top_k=torch.tensor([1, 2, 3])), r"top_k must have shape \[B\] = \[2\], got \[3\]"),
        ("top_k_negative", dict(good, top_k=torch.tensor([1, -1])), r"top_k must be >= 0 \(0: off\)"),
        ("top_k_val_negative", dict(good, top_k_val=-3), r"top_k_val must be >= 0 \(0: off\), got -3"),
        ("top_p_dtype", dict(good, top_p=torch.tensor([0.5, 0.5], dtype=torch.float64)),
         "top_p must be a float32 tensor, got Double"),
        ("top_p_shape", dict(good, top_p=torch.ones(2, 1)), r"top_p must have shape \[B\] = \[2\], got \[2, 1\]"),
        ("top_p_zero", dict(good, top_p=torch.tensor([0.5, 0.0])), r"top_p must be in \(0, 1\] \(1: off\)"),
        ("top_p_above_one", dict(good, top_p=torch.tensor([1.5, 0.5])), r"top_p must be in \(0, 1\] \(1: off\)"),
        ("top_p_nan", dict(good, top_p=torch.tensor([float("nan"), 0.5])), r"top_p must be in \(0, 1\]"),
        ("top_p_val_zero", dict(good, top_p_val=0.0),
         r"top_p_val must be in \(0, 1\] as a float32 \(1: off\), got 0$"),
        ("top_p_val_nan", dict(good, top_p_val=float("nan")),
         r"top_p_val must be in \(0, 1\] as a float32 \(1: off\), got nan$"),
        ("top_p_val_zero_as_float32", dict(good, top_p_val=1e-50),
         r"top_p_val must be in \(0, 1\] as a float32 \(1: off\), got 1e-50 \(0 as a float32\)$"),
        ("min_p_dtype", dict(good, min_p=torch.tensor([0, 0])), "min_p must be a float32 tensor, got Long"),
        ("min_p_one", dict(good, min_p=torch.tensor([0.1, 1.0])), r"min_p must be in \[0, 1\) \(0: off\)"),
        ("min_p_negative", dict(good, min_p=torch.tensor([-0.1, 0.1])), r"min_p must be in \[0, 1\)"),
        ("min_p_nan", dict(good, min_p=torch.tensor([0.1, float("nan")])), r"min_p must be in \[0, 1\)"),
        ("min_p_val_one", dict(good, min_p_val=1.0),
         r"min_p_val must be in \[0, 1\) as a float32 \(0: off\), got 1$"),
        ("min_p_val_one_as_float32", dict(good, min_p_val=1 - 1e-12),
         r"min_p_val must be in \[0, 1\) as a float32 \(0: off\), got 0.999999999999 \(1 as a float32\)$"),
        ("min_p_val_negative", dict(good, min_p_val=-0.5),
         r"min_p_val must be in \[0, 1\) as a float32 \(0: off\), got -0.5$"),
    ]


BAD_FILTER_CASES = _bad_filter_cases()


@pytest.mark.parametrize("case", BAD_FILTER_CASES, ids=[c[0] for c in BAD_FILTER_CASES])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_bad_filter_values_name_the_argument(backend, case):
    """Guards against bad filter values silently sampling from garbage (a NaN top_p keeps nothing or
    everything), or errors that do not name the argument."""
    _, kwargs, message = case
    with pytest.raises(RuntimeError, match=message):
        op_on_given_tensors(backend)(**kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_filter_device_mismatch_names_the_argument(backend):
    """Guards against a filter tensor on another device than logits (a meta tensor stands in)."""
    logits = torch.randn(2, 3, 10)
    for name, t in (("top_k", torch.ones(2, dtype=torch.int64)), ("top_p", torch.ones(2)), ("min_p", torch.zeros(2))):
        with pytest.raises(RuntimeError, match=f"{name} must be on the device of logits"):
            op_on_given_tensors(backend)(logits, torch.tensor([1, 2]), torch.tensor([0, 0]),
                                         **{name: t.to("meta")})


def _error_message(op, kwargs) -> str:
    with pytest.raises(RuntimeError) as info:
        op(**kwargs)
    return str(info.value).split("\n")[0]


def test_error_messages_are_word_for_word_the_same():
    """Guards against the C++ checks and the Python checks (oracle, Triton launcher, fake kernel) drifting
    apart in wording: every bad case of both test files gives the same first line on every backend."""
    for name, kwargs, _ in BAD_FILTER_CASES + BAD_CASES:
        messages = {backend: _error_message(op_on_given_tensors(backend), kwargs) for backend in ALL_BACKENDS}
        assert len(set(messages.values())) == 1, (name, messages)


# Bad cases about the entries of a tensor (temperature, top_k, top_p, min_p values): a fake kernel has no
# data to check; the real kernels raise them when they run.
VALUE_CASES = {"temperature_negative", "temperature_nan", "top_k_negative", "top_p_zero", "top_p_above_one",
               "top_p_nan", "min_p_one", "min_p_negative", "min_p_nan"}
FAKE_KERNEL_CASES = [case for case in BAD_CASES + BAD_FILTER_CASES if case[0] not in VALUE_CASES]
BAD_VALUE_CASES = [case for case in BAD_CASES + BAD_FILTER_CASES if case[0] in VALUE_CASES]


@pytest.mark.parametrize("case", BAD_VALUE_CASES, ids=[c[0] for c in BAD_VALUE_CASES])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_bad_values_are_rejected_with_no_position(backend, case):
    """Guards against a backend skipping the per-row value checks when there is no row to sample (K = 0,
    B = 2): the Triton launcher returned before its checks, while the oracle and the C++ kernel raise."""
    _, kwargs, message = case
    with pytest.raises(RuntimeError, match=message):
        op_on_given_tensors(backend)(**dict(kwargs, logits=torch.randn(2, 0, 10)))


@pytest.mark.parametrize("mode", ["meta", "fake"])
@pytest.mark.parametrize("case", FAKE_KERNEL_CASES, ids=[c[0] for c in FAKE_KERNEL_CASES])
def test_fake_kernel_runs_the_argument_checks(case, mode):
    """Guards against the fake kernel accepting a bad call: torch.compile would trace it (the error only
    at the first run) and meta tensors would get output shapes for nonsense inputs. Every check that needs
    no tensor data raises its message on meta tensors (strides kept) and under FakeTensorMode."""
    _, kwargs, message = case
    with FakeTensorMode() if mode == "fake" else contextlib.nullcontext() as fake:
        def convert(value):
            if not isinstance(value, torch.Tensor):
                return value
            if mode == "fake":
                return fake.from_tensor(value)
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")

        args = {name: convert(value) for name, value in kwargs.items()}
        with pytest.raises(RuntimeError, match=message):
            torch.ops.sbd.entropy_sample(**args)


def test_fake_kernel_cases_cover_every_argument():
    """Guards against the fake-kernel test above checking only some arguments."""
    named = " ".join(message for _, _, message in FAKE_KERNEL_CASES)
    for name in ("logits", "seed", "offset", "temperature", "temperature_val", "compute_mask", "mask_token_id",
                 "top_k", "top_k_val", "top_p", "top_p_val", "min_p", "min_p_val"):
        assert f"{name} must" in named, name


# ------------------------------------------------------------------------------- torch integration
def test_opcheck_with_filters():
    """Guards against the fake kernel or schema disagreeing with the real kernel on the new arguments."""
    logits = make_logits(2, 5, 300)
    seed, offset = make_seeds(2)
    args = (logits, seed, offset, torch.tensor([0.5, 1.0]), 0.0, torch.rand(2, 5) > 0.3, 4,
            torch.tensor([3, 0]), 0, torch.tensor([0.9, 1.0]), 1.0, torch.tensor([0.0, 0.1]), 0.0)
    torch.library.opcheck(torch.ops.sbd.entropy_sample.default, args)
    torch.library.opcheck(torch.ops.sbd.entropy_sample.default,
                          (logits.bfloat16(), seed, offset, None, 0.8, None, -1, None, 20, None, 0.9, None, 0.05))


def test_wrapper_takes_filters_as_tensors_or_numbers_and_compiles():
    """Guards against the wrapper mapping top_k / top_p / min_p to the wrong schema pair, and against a
    graph break of a compiled filtered step."""
    import sbd_kernels

    logits = make_logits(2, 4, 300)
    seed, offset = make_seeds(2)
    want = torch.ops.sbd.entropy_sample(logits, seed, offset, None, 0.8, None, -1, None, 7, None, 0.9, None, 0.05)
    numbers = sbd_kernels.entropy_sample(logits, seed, offset, 0.8, top_k=7, top_p=0.9, min_p=0.05)
    tensors = sbd_kernels.entropy_sample(logits, seed, offset, 0.8, top_k=torch.tensor([7, 7]),
                                         top_p=torch.tensor([0.9, 0.9]), min_p=torch.tensor([0.05, 0.05]))
    for got in (numbers, tensors):
        for g, w in zip(got, want):
            assert torch.equal(g, w)

    def step(logits, seed, offset, top_k):
        return sbd_kernels.entropy_sample(logits, seed, offset, temperature=0.8, top_k=top_k, top_p=0.9)[0]

    top_k = torch.tensor([7, 2])
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(logits, seed, offset, top_k), step(logits, seed, offset, top_k))


def test_filter_distribution_is_not_degenerate():
    """Guards against the statistical fixtures testing nothing: each setting keeps several tokens and
    removes several (a test over a filter that keeps all or one could not tell the filters apart)."""
    for row, temperature, settings in [(STAT_ROW, STAT_T, s) for s in STAT_FILTERS.values()] + [
            (TRITON_STAT_ROW, TRITON_STAT_T, TRITON_STAT_FILTERS)]:
        kept_tokens = int(kept(row.view(1, 1, -1), temperature, **settings).sum())
        assert 2 < kept_tokens < row.numel(), settings
        assert math.isclose(float(filtered_softmax(row, temperature, **settings).sum()), 1.0)


@pytest.mark.parametrize(("setting", "vocab", "seed", "extremes_passes"),
                         [(("top_k", 50), 4000, 3, 1), (("top_k", 12), 4000, 3, 1), (("top_p", 0.9), 4000, 3, 0),
                          (("top_k", 1), 4000, 3, 0), (("top_k", 50), 12288, 3, 1), (("top_p", 0.5), 12288, 2, 0)],
                         ids=["top_k", "top_k_12", "top_p", "top_k_1", "top_k_candidates", "top_p_candidates"])
def test_pass_count_replay_follows_the_kernel(setting, vocab, seed, extremes_passes):
    """Guards the pass counts docs/performance.md quotes (tools/threshold_passes.py, a numpy replay of the
    search) against drifting from the kernel: the interpreted threshold kernel reaches the oracle's cut-off at
    MAX_ROUNDS = the replay's pass count, not one earlier (top-k 1: none, the row's maximum; top-k 12 and 50
    end with a pass that takes their range's extremes: the largest of 19 entries, the smallest of 4). On the
    rows of 12288 (12 tiles a lane, 8 kept), the search runs over the candidates, in fewer passes than the
    same search over the row would make: the count tells that the kernel searched the candidates."""
    if testing.triton_test_device() != "cpu":
        pytest.skip("the replay is checked against the interpreted kernel")
    tool = tool_module("threshold_passes")
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(vocab, generator=gen) * 2.5).numpy()
    x[:8] += 9.0
    search = tool.replay(x, setting)
    assert search.extremes_passes == extremes_passes
    assert search.candidate_passes == search.passes  # the candidates hold every answer here
    if setting == ("top_k", 1):
        assert search.passes == 0
    else:
        assert search.passes >= 2  # the row makes the search narrow its range more than once
    if vocab > sampling_triton.THRESHOLD_CANDIDATES * sampling_triton.THRESHOLD_BLOCK:
        assert tool.replay(x, setting, tool.DESIGNS["row only"]).passes != search.passes
    assert tool.kernel_passes(x, setting) == search.passes
