"""sbd.entropy_sample fuzzed: random shapes, awkward rows and argument layouts, every backend against the
oracle.

Each case draws B, K, V (odd and tiny V included), a dtype, rows with -inf / finfo.min runs, NaN or +inf
entries, exact ties, flat rows; greedy, sampled and per-row temperatures (1e-39 among them, where x / T
overflows); a mask token and a compute_mask;
top-k / top-p / min-p filters as scalars or per-row tensors.
Every tensor argument is passed as a view into a larger poisoned buffer (`sbd_kernels.testing.Embedded`:
offset, strided, stride-0 views; logits with padded rows or a strided vocabulary), and each backend (C++
CPU, Triton under the interpreter or compiled on CUDA copies with SBD_TEST_DEVICE=cuda, the oracle itself)
runs on its own fresh copy. The reference is the
oracle on plain contiguous copies. Sampled tokens are compared through the oracle's Gumbel scores: the
backends compute -log(-log u) with different log implementations, so two scores within a few ulp may
legitimately swap; so may the kept sets of a row whose top-p cumulative mass or min-p ratio lies within
float rounding of its cut-off (the backends sum in fp32, the oracle in fp64); any other difference fails.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import pytest
import torch

from sbd_kernels import testing
from sbd_kernels.ops.sampling import naive
from sbd_kernels.testing import FLOAT_DTYPES, Embedded, assert_close, poison_

BACKENDS = ("cpu", "triton", "naive")
# Default run: tiny vocabularies (the interpreter runs ~0.5 ms per program). Slow run: up to several
# CPU tiles (2048) and Triton tiles (1024 from V = 4096) per row.
FAST_CASES, FAST_MAX_VOCAB = 300, 300
SLOW_CASES, SLOW_MAX_VOCAB = 300, 9000
ROW_KINDS = ("plain", "ties", "neg_inf_run", "finfo_min_run", "nan", "pos_inf", "all_neg_inf", "flat",
             "all_finfo_min", "huge_negative_head")
# A top-p cut-off whose cumulative mass is within this fraction of the total of top_p, or a min-p ratio
# within this of min_p, counts as tied: the kernels' fp32 sums of up to 10^4 weights are ~1e-6 off.
FILTER_NEAR_TIE = 1e-4
# Two sampled scores closer than this (relative to their magnitude, plus an absolute floor for scores
# near 0) count as tied: fp32 log differs by up to ~2 ulp between implementations, and -log(-log u)
# applies it twice.
SCORE_NEAR_TIE = 1e-6


backend_op = functools.partial(testing.backend_op, "entropy_sample")


@dataclass
class Case:
    """One fuzz case: the contiguous reference arguments and how each is laid out in memory."""
    logits: torch.Tensor
    seed: torch.Tensor
    offset: torch.Tensor
    temperature: torch.Tensor | None
    temperature_val: float
    compute_mask: torch.Tensor | None
    mask_token_id: int
    filters: dict = field(default_factory=dict)
    layouts: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)

    def describe(self) -> str:
        t = self.temperature.tolist() if self.temperature is not None else self.temperature_val
        filters = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in self.filters.items()}
        return (f"logits {list(self.logits.shape)} {self.logits.dtype}, T={t}, mask_token_id="
                f"{self.mask_token_id}, compute_mask={'yes' if self.compute_mask is not None else 'no'}, "
                f"filters={filters}, layouts={self.layouts}, rows={self.rows}")


def _row(kind: str, vocab: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """One row of logits (fp32 values exactly representable in dtype after the cast) of the given kind."""
    scale = float(torch.tensor([0.1, 1.0, 3.0, 10.0])[torch.randint(4, (1,), generator=gen)])
    x = torch.randn(vocab, generator=gen) * scale
    lowest = torch.finfo(dtype).min
    start = int(torch.randint(vocab, (1,), generator=gen))
    length = int(torch.randint(1, vocab + 1, (1,), generator=gen))
    place = int(torch.randint(vocab, (1,), generator=gen))
    if kind == "ties":
        top = x.max()
        x[torch.randint(vocab, (3,), generator=gen)] = top
    elif kind == "neg_inf_run":
        x[start:start + length] = float("-inf")
    elif kind == "finfo_min_run":
        x[start:start + length] = lowest
    elif kind == "nan":
        x[place] = float("nan")
    elif kind == "pos_inf":
        x[place] = float("inf")
    elif kind == "all_neg_inf":
        x[:] = float("-inf")
    elif kind == "flat":
        x[:] = 0.5
    elif kind == "all_finfo_min":
        x[:] = lowest
    elif kind == "huge_negative_head":
        x[:length] = -1e38 if dtype != torch.float16 else -6e4
    return x


def make_case(case_id: int, max_vocab: int) -> Case:
    gen = torch.Generator().manual_seed(1000 + case_id)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    batch, positions = pick([1, 1, 2, 3, 4]), pick([1, 2, 3])
    vocab = pick([1, 2, 63, 64, 65, 127, 129, int(torch.randint(1, max_vocab + 1, (1,), generator=gen))])
    dtype = pick(FLOAT_DTYPES)
    kinds = [pick(ROW_KINDS) if bool(torch.rand(1, generator=gen) < 0.4) else "plain"
             for _ in range(batch * positions)]
    logits = torch.stack([_row(k, vocab, dtype, gen) for k in kinds]).view(batch, positions, vocab).to(dtype)

    mode = pick(["greedy", "sample", "per_row", "per_row_equal"])
    temperature, temperature_val = None, 0.0
    if mode == "sample":
        temperature_val = pick([0.3, 1.0, 1.7, 1e-39])
    elif mode == "per_row":  # 1e-39: x / T overflows for most rows (the overflow rule)
        temperature = torch.tensor([0.0, 1.0, 0.3, 1.7, 1e-39])[torch.randint(5, (batch,), generator=gen)]
    elif mode == "per_row_equal":
        temperature = torch.full((batch,), pick([0.0, 0.8]))

    shared = bool(torch.rand(1, generator=gen) < 0.3)  # one seed / offset for every row
    seed = torch.randint(-2**62, 2**62, (1 if shared else batch,), generator=gen)
    offset = torch.randint(0, 2**40, (1 if shared else batch,), generator=gen)
    if shared and batch > 1 and bool(torch.rand(1, generator=gen) < 0.5):
        seed, offset = seed.expand(batch).clone(), offset.expand(batch).clone()  # [B], all rows equal
    elif shared and bool(torch.rand(1, generator=gen) < 0.5):
        seed, offset = seed[0], offset[0]  # shape []
    compute_mask = (torch.rand(batch, positions, generator=gen) < 0.7) if bool(
        torch.rand(1, generator=gen) < 0.4) else None
    mask_token_id = pick([-1, -1, int(torch.randint(vocab, (1,), generator=gen))])
    filters = _filters(pick(["none", "none", "top_k", "top_p", "min_p", "all", "per_row"]), batch, vocab, gen)

    layouts = {"logits": pick(["contiguous", "offset", "strided", "padded_rows", "transposed"])}
    for name, t in (("seed", seed), ("offset", offset), ("temperature", temperature),
                    ("compute_mask", compute_mask), *filters.items()):
        if not isinstance(t, torch.Tensor):
            continue
        if t is None:
            continue
        options = ["contiguous", "offset", "strided"]
        if t.dim() >= 1 and t.shape[0] > 1 and bool((t == t[:1]).all()):
            options.append("expanded")
        layouts[name] = pick(options if t.dim() else ["contiguous", "offset"])
    return Case(logits, seed, offset, temperature, temperature_val, compute_mask, mask_token_id, filters,
                layouts, kinds)


def _filters(kind: str, batch: int, vocab: int, gen: torch.Generator) -> dict:
    """Schema keywords of the filters: none, one of them or all three as scalars, or [B] tensors."""
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    top_k = pick([1, 2, 5, max(1, vocab // 2), vocab + 3])
    top_p = pick([0.3, 0.8, 0.95])
    min_p = pick([0.05, 0.2, 0.5])
    if kind == "none":
        return {}
    if kind in ("top_k", "top_p", "min_p"):
        return {f"{kind}_val": {"top_k": top_k, "top_p": top_p, "min_p": min_p}[kind]}
    if kind == "all":
        return {"top_k_val": top_k, "top_p_val": top_p, "min_p_val": min_p}
    rows = torch.randint(3, (3, batch), generator=gen)  # per row: off, or one of two settings
    return {"top_k": torch.tensor([0, 3, vocab])[rows[0]], "top_p": torch.tensor([1.0, 0.5, 0.9])[rows[1]],
            "min_p": torch.tensor([0.0, 0.1, 0.3])[rows[2]]}


def _logits_view(logits: torch.Tensor, layout: str) -> tuple[torch.Tensor, Embedded | None, torch.Tensor | None]:
    """(view, Embedded or None, padded buffer or None): logits placed as the layout says."""
    if layout == "padded_rows":  # vocabulary-contiguous rows in a wider, poisoned buffer (row stride > V)
        buffer = poison_(torch.empty(*logits.shape[:2], logits.shape[2] + 5, dtype=logits.dtype))
        view = buffer[..., 2:2 + logits.shape[2]]
        view.copy_(logits)
        return view, None, buffer
    if layout == "transposed":  # vocabulary stride K
        return logits.transpose(1, 2).contiguous().transpose(1, 2), None, None
    embedded = Embedded(logits, layout)
    return embedded.view, embedded, None


def run_backend(backend: str, case: Case):
    """Runs one backend on fresh views of the case's arguments; checks the read-only buffers afterwards."""
    logits, logits_embedded, padded = _logits_view(case.logits, case.layouts["logits"])
    padded_before = padded.clone() if padded is not None else None
    tensors = {"seed": case.seed, "offset": case.offset, "temperature": case.temperature,
               "compute_mask": case.compute_mask,
               **{k: v for k, v in case.filters.items() if isinstance(v, torch.Tensor)}}
    embedded = {name: Embedded(t, case.layouts[name]) for name, t in tensors.items() if t is not None}
    scalars = {k: v for k, v in case.filters.items() if not isinstance(v, torch.Tensor)}
    views = {name: e.view for name, e in embedded.items()}
    out = backend_op(backend)(logits, views.pop("seed"), views.pop("offset"), temperature=views.pop("temperature", None),
                              temperature_val=case.temperature_val, compute_mask=views.pop("compute_mask", None),
                              mask_token_id=case.mask_token_id, **views, **scalars)
    if logits_embedded is not None:
        logits_embedded.check_unchanged("logits")
    if padded is not None:
        assert torch.equal(padded.view(torch.uint8), padded_before.view(torch.uint8)), "logits were written"
    for name, e in embedded.items():
        e.check_unchanged(name)
    return out


def oracle_call(case: Case):
    return naive.entropy_sample(case.logits, case.seed, case.offset, case.temperature, case.temperature_val,
                                case.compute_mask, case.mask_token_id, **case.filters)


def _per_row(case: Case, name: str, default) -> torch.Tensor:
    """A filter's value per batch row b, from its tensor, its scalar or its default."""
    batch = case.logits.shape[0]
    if name in case.filters:
        return case.filters[name].double()
    return torch.full((batch,), float(case.filters.get(f"{name}_val", default)), dtype=torch.float64)


def filter_near_ties(case: Case) -> torch.Tensor:
    """Bool [B, K]: rows whose top-p cumulative mass or min-p ratio is within FILTER_NEAR_TIE of its cut-off
    (fp64, on the oracle's own top-k set), where fp32 sums may legitimately decide the other way."""
    batch, positions, vocab = case.logits.shape
    x = case.logits.double().clone()
    if case.mask_token_id >= 0:
        x[..., case.mask_token_id] = float("-inf")
    t = case.temperature.double() if case.temperature is not None else torch.full((batch,), case.temperature_val)
    t = torch.where(t > 0, t, 1.0).double().view(-1, 1, 1)
    top_k, top_p, min_p = (_per_row(case, "top_k", 0), _per_row(case, "top_p", 1.0), _per_row(case, "min_p", 0.0))
    near = torch.zeros(batch, positions, dtype=torch.bool)
    for b in range(batch):
        for j in range(positions):
            row = x[b, j]
            if not torch.isfinite(row).any() or torch.isnan(row).any() or (row == float("inf")).any():
                continue
            k = int(top_k[b])
            if 0 < k < vocab:
                row = torch.where(row >= row.sort(descending=True).values[k - 1], row, float("-inf"))
            q = torch.softmax(row / t[b], -1)
            if top_p[b] < 1:
                cumulative = q.sort(descending=True).values.cumsum(-1)
                near[b, j] |= bool(((cumulative - top_p[b]).abs() < FILTER_NEAR_TIE).any())
            if min_p[b] > 0:
                near[b, j] |= bool(((q / q.max() - min_p[b]).abs() < FILTER_NEAR_TIE).any())
    return near


def oracle_scores(case: Case) -> torch.Tensor:
    """The race's scores [B, K, V] in fp32 as the oracle computes them (the mask token at -inf): x / T + g,
    or (x - m) / T + g on rows where x / T overflowed for the maximum m (the oracle's overflow rule)."""
    batch, positions, vocab = case.logits.shape
    x = case.logits.float().clone()
    if case.mask_token_id >= 0:
        x[..., case.mask_token_id] = float("-inf")
    t = (case.temperature if case.temperature is not None else torch.full((batch,), case.temperature_val)).view(-1, 1, 1)
    seed = case.seed.reshape(-1).expand(batch)
    offset = case.offset.reshape(-1).expand(batch)
    noise = naive.gumbel_noise(seed, offset, positions, vocab)
    m = x.amax(-1, keepdim=True)
    return torch.where(torch.isinf(m / t), (x - m) / t + noise, x / t + noise)


def assert_same_draws(case: Case, out, ref) -> None:
    """Tokens equal, except a sampled token whose oracle score ties the oracle's winner to SCORE_NEAR_TIE."""
    tokens, _, logprob, valid = out
    differ = (tokens != ref[0]).nonzero().tolist()
    if not differ:
        assert_close(logprob, ref[2], dtype=torch.float32, name=f"logprob ({case.describe()})")
        return
    batch = case.logits.shape[0]
    t = case.temperature if case.temperature is not None else torch.full((batch,), case.temperature_val)
    scores = oracle_scores(case)
    near_cut = filter_near_ties(case) if case.filters else torch.zeros(tokens.shape, dtype=torch.bool)
    x = case.logits.float()
    for b, j in differ:
        got, want = int(tokens[b, j]), int(ref[0][b, j])
        assert float(t[b]) > 0 and bool(valid[b, j]), \
            f"token {got} != {want} at {(b, j)} (greedy or invalid position); {case.describe()}"
        s_got, s_want = float(scores[b, j, got]), float(scores[b, j, want])
        assert bool(near_cut[b, j]) or abs(s_got - s_want) <= SCORE_NEAR_TIE * (abs(s_want) + 1.0), \
            f"token {got} (score {s_got}) != {want} (score {s_want}) at {(b, j)}; {case.describe()}"
        # The log-prob must then be the one of the token drawn.
        row = x[b, j].double().clone()
        if case.mask_token_id >= 0:
            row[case.mask_token_id] = float("-inf")
        want_logprob = torch.log_softmax(row, -1)[got].float()
        assert_close(logprob[b, j], want_logprob, dtype=torch.float32, name="logprob of a near-tie token")
    same = tokens == ref[0]
    assert_close(logprob[same], ref[2][same], dtype=torch.float32, name=f"logprob ({case.describe()})")


def check_case(backend: str, case_id: int, max_vocab: int) -> None:
    case = make_case(case_id, max_vocab)
    ref = oracle_call(case)
    out = run_backend(backend, case)
    tokens, entropy, logprob, valid = out
    assert tokens.dtype == torch.int64 and entropy.dtype == logprob.dtype == torch.float32
    assert valid.dtype == torch.bool and tokens.shape == case.logits.shape[:2]
    assert torch.equal(valid, ref[3]), f"valid {valid.tolist()} != {ref[3].tolist()}; {case.describe()}"
    assert_close(entropy, ref[1], dtype=torch.float32, name=f"entropy ({case.describe()})")
    assert_same_draws(case, out, ref)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter on NaN rows
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # x / T of finfo.min rows
@pytest.mark.parametrize("case_id", range(FAST_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_fuzz_matches_oracle(backend, case_id):
    """Guards against any backend disagreeing with the oracle, reading an argument with the wrong strides
    or writing into one, on random shapes, awkward rows and argument layouts (tiny V)."""
    check_case(backend, case_id, FAST_MAX_VOCAB)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("case_id", range(FAST_CASES, FAST_CASES + SLOW_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_fuzz_matches_oracle_larger_vocabularies(backend, case_id):
    """Guards against the same on vocabularies of several tiles and vocabulary splits per row."""
    check_case(backend, case_id, SLOW_MAX_VOCAB)


def test_fuzz_cases_cover_every_kind():
    """Guards against a generator that silently stopped producing some awkward input."""
    cases = [make_case(i, FAST_MAX_VOCAB) for i in range(FAST_CASES)]
    kinds = {k for c in cases for k in c.rows}
    assert kinds == set(ROW_KINDS)
    layouts = {(name, layout) for c in cases for name, layout in c.layouts.items()}
    for name in ("seed", "offset", "temperature"):
        assert {(name, lay) for lay in ("contiguous", "offset", "strided", "expanded")} <= layouts, name
    assert {("logits", lay) for lay in ("contiguous", "offset", "strided", "padded_rows", "transposed")} <= layouts
    assert any(c.compute_mask is not None for c in cases) and any(c.mask_token_id >= 0 for c in cases)
    assert {c.logits.dtype for c in cases} == set(FLOAT_DTYPES)
    assert any(c.temperature is None and c.temperature_val > 0 for c in cases)
    assert any(c.temperature_val == 1e-39 for c in cases)
    assert any(c.temperature is not None and bool((c.temperature == 1e-39).any()) for c in cases)
    assert any(c.seed.dim() == 0 for c in cases)
    filters = {name for c in cases for name in c.filters}
    assert filters == {"top_k_val", "top_p_val", "min_p_val", "top_k", "top_p", "min_p"}
    assert {("top_p", lay) for lay in ("offset", "strided")} <= layouts
