"""sbd.mask_scatter_: EB / threshold acceptance, in place, on the C++ CPU kernel and the Triton kernel
(interpreter, or compiled on CUDA with SBD_TEST_DEVICE=cuda), against the oracle in naive.py and against
hand-written cases of docs/algorithm.md §3.5."""
from __future__ import annotations

import functools

import pytest
import torch

import sbd_kernels
from sbd_kernels import testing
from sbd_kernels.ops.scatter import naive
from sbd_kernels.ops.scatter import triton as scatter_triton
from sbd_kernels.testing import noncontiguous, poison_

INF = float("inf")
NAN = float("nan")
SENTINEL = -7777  # what poison_ writes into int64 buffers


# The implementation under test: C++, the Triton launcher on the test device (in-place results copied back),
# or the oracle (on the tensors as given for inputs every backend rejects on the host).
op_for = functools.partial(testing.backend_op, "mask_scatter_")
op_on_given_tensors = functools.partial(testing.op_on_given_tensors, "mask_scatter_")


BACKENDS = ["cpu", "triton"]
ALL_BACKENDS = ["naive", "cpu", "triton"]


def run_hand_case(backend, entropy, masked=None, valid=None, gamma=0.1, rule="eb"):
    """Runs one row given as lists; returns (accepted positions, tokens after, is_masked after, n, done).

    Tokens start at SENTINEL and sampled[j] = 100 + j, so every write is visible.
    """
    k = len(entropy)
    entropy_t = torch.tensor([entropy], dtype=torch.float32)
    masked_t = torch.tensor([masked if masked is not None else [True] * k], dtype=torch.bool)
    valid_t = None if valid is None else torch.tensor([valid], dtype=torch.bool)
    tokens = torch.full((1, k), SENTINEL, dtype=torch.int64)
    sampled = torch.arange(100, 100 + k, dtype=torch.int64).view(1, k)
    accepted, n, done = op_for(backend)(tokens, masked_t, sampled, entropy_t, gamma_val=gamma, rule=rule,
                                        valid=valid_t)
    positions = [j for j in range(k) if accepted[0, j]]
    return positions, tokens[0].tolist(), masked_t[0].tolist(), int(n[0]), bool(done[0])


# (entropies, gamma, accepted positions, what it shows). EB: rank r accepted iff r == 0 or the entropies
# ranked before it sum to <= gamma.
EB_CASES = [
    ([0.30, 0.05, 0.02, 0.90], 0.1, [0, 1, 2], "ranks 2,1,0,3; sums before 0, .02, .07 <= .1, .37 > .1"),
    ([0.2, 0.1, 0.1, 0.1], 0.15, [1, 2], "ties: lower position first, so 1 and 2 (sum .1), not 3"),
    ([0.5, 0.25, 0.25, 1.0], 0.5, [0, 1, 2], "sum before position 0 is exactly gamma: <= accepts it"),
    ([0.3, 0.0, 0.2, 0.0], 0.0, [1, 2, 3], "gamma 0: zero entropies sum to 0 <= 0, so 0.2 still goes"),
    ([0.3, 0.4, 0.2, 0.5], 0.0, [2], "gamma 0, positive entropies: only the lowest"),
    ([3.0, 1.0, 2.0, 4.0], 1e9, [0, 1, 2, 3], "gamma huge: everything"),
    ([5.0, 7.0, 6.0], 0.1, [0], "every entropy above gamma: the lowest one is forced"),
    ([0.7], 0.1, [0], "K = 1"),
]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("case", EB_CASES, ids=[c[3] for c in EB_CASES])
def test_eb_rule_hand_cases(backend, case):
    """Guards against a wrong EB rule: off-by-one in the sum, < instead of <=, unstable ties, gamma 0."""
    entropy, gamma, expected, _ = case
    positions, tokens, masked, n, done = run_hand_case(backend, entropy, gamma=gamma)
    assert positions == expected
    assert tokens == [100 + j if j in expected else SENTINEL for j in range(len(entropy))]
    assert masked == [j not in expected for j in range(len(entropy))]
    assert n == len(expected)
    assert done == (len(expected) == len(entropy))


THRESHOLD_CASES = [
    ([0.30, 0.05, 0.02, 0.90], 0.1, [1, 2], "entropy < gamma"),
    ([0.30, 0.05, 0.02, 0.90], 0.01, [2], "nothing below gamma: the lowest one is forced"),
    ([0.5, 0.25, 0.5, 0.125], 0.5, [1, 3], "strict <: entropy equal to gamma is not accepted"),
    ([0.5, 0.5, 0.5], 0.1, [0], "ties above gamma: the forced one is the lowest position"),
    ([0.0, 0.0, 0.3], 0.0, [0], "gamma 0: only the forced one"),
]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("case", THRESHOLD_CASES, ids=[c[3] for c in THRESHOLD_CASES])
def test_threshold_rule_hand_cases(backend, case):
    """Guards against the threshold rule using <=, forgetting the forced lowest one, or breaking ties."""
    entropy, gamma, expected, _ = case
    positions, tokens, _, n, _ = run_hand_case(backend, entropy, gamma=gamma, rule="threshold")
    assert positions == expected
    assert tokens == [100 + j if j in expected else SENTINEL for j in range(len(entropy))]
    assert n == len(expected)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("rule", ["eb", "threshold"])
def test_only_masked_positions_are_candidates(backend, rule):
    """Guards against revealing (overwriting) a position that is already revealed."""
    entropy = [0.0, 0.3, 0.0, 0.05, 0.2]  # the already revealed positions 0 and 2 have the lowest entropy
    masked = [False, True, False, True, True]
    positions, tokens, masked_after, n, done = run_hand_case(backend, entropy, masked=masked, gamma=0.1,
                                                             rule=rule)
    expected = [3, 4] if rule == "eb" else [3]
    assert positions == expected
    assert tokens == [100 + j if j in expected else SENTINEL for j in range(5)]
    assert masked_after == [False, True, False, False, rule == "threshold"]
    assert (n, done) == (len(expected), False)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("rule", ["eb", "threshold"])
def test_nothing_masked_accepts_nothing_and_is_done(backend, rule):
    """Guards against a forced acceptance in a finished row (a write into a revealed block)."""
    positions, tokens, masked, n, done = run_hand_case(backend, [0.1, 0.2, 0.3], masked=[False] * 3, rule=rule)
    assert (positions, tokens, masked, n, done) == ([], [SENTINEL] * 3, [False] * 3, 0, True)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_all_masked_accepts_the_whole_block_with_huge_gamma(backend):
    """Guards against block_done being computed before the update instead of after."""
    positions, _, masked, n, done = run_hand_case(backend, [0.1, 0.2, 0.3, 0.4], gamma=100.0)
    assert (positions, n, done) == ([0, 1, 2, 3], 4, True)
    assert masked == [False] * 4


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_invalid_positions_are_skipped(backend):
    """Guards against revealing a position whose prediction is invalid (NaN logits, not computed)."""
    entropy = [0.01, 0.3, 0.02, 0.04]
    positions, _, masked, n, done = run_hand_case(backend, entropy, valid=[False, True, True, True],
                                                  gamma=0.05)
    assert positions == [2, 3]  # position 0 has the lowest entropy but is invalid: ranks 2, 3, 1
    assert masked == [True, True, False, False]
    assert (n, done) == (2, False)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("rule", ["eb", "threshold"])
def test_all_masked_positions_invalid_accepts_nothing(backend, rule):
    """Guards against forcing the 'at least one' acceptance onto an invalid position."""
    positions, tokens, masked, n, done = run_hand_case(backend, [0.1, 0.2], masked=[True, False],
                                                       valid=[False, True], rule=rule)
    assert (positions, tokens, masked, n, done) == ([], [SENTINEL] * 2, [True, False], 0, False)


INF_CASES = [
    ("eb", [INF, INF, INF], 0.1, [0], "all +inf: only the forced lowest position"),
    ("eb", [0.1, INF, 0.2], 10.0, [0, 1, 2], "+inf ranks last; accepted since .3 <= gamma before it"),
    ("eb", [INF, 0.1, INF, 0.2], 10.0, [0, 1, 3], "the first +inf blocks the second (sum before = inf)"),
    ("eb", [INF, 0.1, INF], INF, [0, 1, 2], "gamma = +inf accepts everything"),
    ("eb", [NAN, 0.1, INF], 1.0, [0, 1], "NaN ranks as +inf, before a later-position +inf"),
    ("threshold", [INF, INF, 0.5], 0.1, [2], "threshold: +inf is never below gamma"),
    ("threshold", [INF, INF], INF, [0], "threshold with gamma +inf: inf < inf is false, forced one only"),
]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("case", INF_CASES, ids=[c[4] for c in INF_CASES])
def test_infinite_and_nan_entropies(backend, case):
    """Guards against +inf / NaN entropies ranking differently on the backends (NaN breaks comparisons)."""
    rule, entropy, gamma, expected, _ = case
    positions, _, _, n, _ = run_hand_case(backend, entropy, gamma=gamma, rule=rule)
    assert positions == expected
    assert n == len(expected)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_eb_sums_in_fp32_in_rank_order(backend):
    """Guards against a backend summing in another precision or order (decisions differ at the boundary).

    fp32(0.2) + fp32(0.3) + fp32(0.6) summed in fp32 in rank order is fp32(1.1), while the exact (or fp64)
    sum of the same three fp32 values is above fp32(1.1): with gamma = fp32(1.1) the fourth candidate is
    accepted only by the fp32 rank-order sum, and one ulp less of gamma rejects it.
    """
    values = torch.tensor([0.2, 0.3, 0.6], dtype=torch.float32)
    fp32_sum = (values[0] + values[1]) + values[2]
    assert sum(float(v) for v in values) > float(fp32_sum)  # the case discriminates
    entropy = [0.6, 0.3, 0.7, 0.2]  # ranks: 3 (.2), 1 (.3), 0 (.6), 2 (.7)
    gamma = float(fp32_sum)
    assert run_hand_case(backend, entropy, gamma=gamma)[0] == [0, 1, 2, 3]
    below = float(torch.nextafter(fp32_sum, torch.tensor(-INF)))
    assert run_hand_case(backend, entropy, gamma=below)[0] == [0, 1, 3]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("rule", ["eb", "threshold"])
def test_gamma_tensor_is_per_row(backend, rule):
    """Guards against reading gamma[0] (or gamma_val) for every row of a [B] gamma tensor."""
    entropy = torch.tensor([[0.125, 0.25, 0.375, 0.5]] * 3)
    gamma = torch.tensor([0.0, 0.375, 10.0])
    tokens = torch.zeros(3, 4, dtype=torch.int64)
    masked = torch.ones(3, 4, dtype=torch.bool)
    sampled = torch.ones(3, 4, dtype=torch.int64)
    _, n, done = op_for(backend)(tokens, masked, sampled, entropy, gamma, 5.0, rule)
    expected = [1, 3, 4] if rule == "eb" else [1, 2, 4]
    assert n.tolist() == expected
    assert done.tolist() == [False, False, True]


def random_inputs(batch: int, k: int, seed: int, with_gamma: bool, with_valid: bool):
    """Random inputs with many exact ties: entropies and gammas on a grid of 1/16 (exact in fp32)."""
    gen = torch.Generator().manual_seed(seed)
    entropy = torch.randint(0, 12, (batch, k), generator=gen).to(torch.float32) / 16
    entropy[torch.rand(batch, k, generator=gen) < 0.05] = INF
    is_masked = torch.rand(batch, k, generator=gen) < 0.7
    is_masked[0] = True  # at least one fully masked row
    tokens = torch.randint(0, 1000, (batch, k), generator=gen)
    tokens[is_masked] = SENTINEL  # poisoned: a write to a non-accepted masked position shows
    sampled = torch.randint(1000, 2000, (batch, k), generator=gen)
    gamma = torch.randint(0, 16, (batch,), generator=gen).to(torch.float32) / 16 if with_gamma else None
    valid = (torch.rand(batch, k, generator=gen) < 0.9) if with_valid else None
    return tokens, is_masked, sampled, entropy, gamma, valid


def check_against_oracle(backend, batch, k, rule="eb", with_gamma=True, with_valid=True, seed=0,
                         layout=lambda t: t.clone()):
    """Runs `backend` and the oracle on the same inputs (laid out by `layout`); everything must be equal."""
    tokens, masked, sampled, entropy, gamma, valid = random_inputs(batch, k, seed, with_gamma, with_valid)
    ref_tokens, ref_masked = tokens.clone(), masked.clone()
    ref = naive.mask_scatter_(ref_tokens, ref_masked, sampled, entropy, gamma, 0.25, rule, valid)

    args = [layout(t) if t is not None else None for t in (tokens, masked, sampled, entropy, gamma, valid)]
    got = op_for(backend)(args[0], args[1], args[2], args[3], args[4], 0.25, rule, args[5])
    for name, a, e in zip(("accepted", "num_accepted", "block_done"), got, ref):
        assert a.dtype == e.dtype and a.shape == e.shape, name
        assert torch.equal(a, e), f"{name}: {a} != {e}"
    assert torch.equal(args[0], ref_tokens), "block_tokens"
    assert torch.equal(args[1], ref_masked), "is_masked"
    return args


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_random_batch_sizes_match_oracle(backend, batch):
    """Guards against rows interfering (wrong row stride, a parallel chunk reading its neighbour)."""
    check_against_oracle(backend, batch, 16, seed=batch)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", [1, 2, 16, 32, 64])
@pytest.mark.parametrize("rule", ["eb", "threshold"])
def test_random_block_sizes_match_oracle(backend, k, rule):
    """Guards against block-size bugs: padding lanes taken as candidates, K not a power of two, K = 1."""
    check_against_oracle(backend, 3, k, rule=rule, seed=k)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_gamma", [True, False])
@pytest.mark.parametrize("with_valid", [True, False])
def test_random_optional_arguments_match_oracle(backend, with_gamma, with_valid):
    """Guards against the optional gamma / valid paths (constexpr branches) diverging."""
    check_against_oracle(backend, 5, 13, with_gamma=with_gamma, with_valid=with_valid, seed=7)


def test_cpu_handles_blocks_beyond_the_triton_limit():
    """Guards against a fixed-size buffer in the C++ kernel (it has no K limit)."""
    check_against_oracle("cpu", 2, 300, seed=3)


def test_triton_rejects_blocks_beyond_its_limit():
    """Guards against the Triton kernel silently truncating a row longer than its block."""
    tokens, masked, sampled, entropy, gamma, _ = random_inputs(1, 257, 0, True, True)
    with pytest.raises(RuntimeError, match="block_tokens has K = 257 positions"):
        op_on_given_tensors("triton")(tokens, masked, sampled, entropy, gamma)


def test_triton_rejects_more_rows_than_its_grid_takes():
    """Guards against a launch of more programs than CUDA's grid axis 0 takes (2^31 - 1, one per row), which
    fails with a launch error instead of naming the argument; META tensors (no memory)."""
    assert len(scatter_triton.meta_launches(2**31 - 1, 16)) == 1
    with pytest.raises(RuntimeError, match="block_tokens has B = 2147483648 rows; the Triton kernel supports "
                                           "B <= 2\\^31 - 1"):
        scatter_triton.meta_launches(2**31, 16)


@pytest.mark.skipif(testing.triton_test_device() == "cuda",
                    reason="the tensors are views of sparse host file mappings (about 2^32 elements)")
def test_triton_positions_past_int32(tmp_path):
    """Guards against int32 position offsets: position j times a stride below 2^31 (typed i32) wrapped to
    before the tensor once it passed 2^31 elements, and the kernel read zeros and wrote its tokens there.
    Every [B, K] argument here has positions 2^26 elements apart, so positions 32-39 of K = 40 lie past 2^31;
    they hold the lowest entropies, so the EB rule accepts them first."""
    tokens, masked, sampled, entropy, gamma, valid = random_inputs(2, 40, 13, True, True)
    entropy[:, 32:] = 0.0
    masked[:, 32:] = True
    valid[:, 32:] = True
    ref_tokens, ref_masked = tokens.clone(), masked.clone()
    ref = naive.mask_scatter_(ref_tokens, ref_masked, sampled, entropy, gamma, 0.25, "eb", valid)
    wide = {name: testing.sparse_strided_copy(t, 1, 2**26, tmp_path / name) for name, t in
            {"tokens": tokens, "masked": masked, "sampled": sampled, "entropy": entropy, "valid": valid}.items()}
    got = op_on_given_tensors("triton")(wide["tokens"], wide["masked"], wide["sampled"], wide["entropy"], gamma,
                                        0.25, "eb", wide["valid"])
    for name, a, e in zip(("accepted", "num_accepted", "block_done"), got, ref):
        assert torch.equal(a, e), f"{name}: {a} != {e}"
    assert torch.equal(wide["tokens"], ref_tokens) and torch.equal(wide["masked"], ref_masked)


@pytest.mark.parametrize("backend", BACKENDS)
def test_noncontiguous_inputs_updated_in_place(backend):
    """Guards against a kernel assuming unit stride, or writing into a temporary copy of an in-place view."""
    args = check_against_oracle(backend, 4, 16, seed=11, layout=noncontiguous)
    tokens_view, masked_view = args[0], args[1]
    assert tokens_view.stride(-1) == 2 and masked_view.stride(-1) == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_writes_stay_inside_the_view(backend):
    """Guards against writes through the wrong stride landing between the elements of an in-place view."""
    tokens, masked, sampled, entropy, gamma, valid = random_inputs(3, 8, 5, True, True)
    tokens_wide = poison_(torch.empty(3, 16, dtype=torch.int64))
    masked_wide = torch.zeros(3, 16, dtype=torch.bool)  # the gaps stay False; the view gets is_masked
    tokens_view, masked_view = tokens_wide[:, ::2], masked_wide[:, ::2]
    tokens_view.copy_(tokens)
    masked_view.copy_(masked)
    op_for(backend)(tokens_view, masked_view, sampled, entropy, gamma, 0.25, "eb", valid)
    assert torch.all(tokens_wide[:, 1::2] == SENTINEL)
    assert not masked_wide[:, 1::2].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    """Guards against a launch over zero rows failing (empty decode batch)."""
    empty = torch.empty(0, 4)
    out = op_for(backend)(empty.long(), empty.bool(), empty.long(), empty.float())
    assert [tuple(t.shape) for t in out] == [(0, 4), (0,), (0,)]


def bad_input_cases():
    """(name, argument overrides, message fragment) for every checked argument."""
    return [
        ("tokens dtype", {"block_tokens": torch.zeros(2, 3, dtype=torch.int32)}, "block_tokens must be int64"),
        ("tokens 1-D", {"block_tokens": torch.zeros(6, dtype=torch.int64)}, "block_tokens must be a 2-D"),
        ("tokens expanded", {"block_tokens": torch.zeros(1, 3, dtype=torch.int64).expand(2, 3)},
         "block_tokens is written in place and must not have elements sharing memory"),
        ("masked expanded", {"is_masked": torch.ones(2, 1, dtype=torch.bool).expand(2, 3)},
         "is_masked is written in place and must not have elements sharing memory"),
        ("masked dtype", {"is_masked": torch.ones(2, 3, dtype=torch.uint8)}, "is_masked must be bool"),
        ("masked shape", {"is_masked": torch.ones(2, 4, dtype=torch.bool)}, "is_masked must have shape"),
        ("sampled dtype", {"sampled": torch.zeros(2, 3, dtype=torch.float32)}, "sampled must be int64"),
        ("sampled shape", {"sampled": torch.zeros(3, 3, dtype=torch.int64)}, "sampled must have shape"),
        ("entropy dtype", {"entropy": torch.zeros(2, 3, dtype=torch.float16)}, "entropy must be float"),
        ("entropy shape", {"entropy": torch.zeros(2, 3, 1)}, "entropy must have shape"),
        ("valid dtype", {"valid": torch.ones(2, 3, dtype=torch.int64)}, "valid must be bool"),
        ("valid shape", {"valid": torch.ones(2, 2, dtype=torch.bool)}, "valid must have shape"),
        ("gamma dtype", {"gamma": torch.zeros(2, dtype=torch.float64)}, "gamma must be float"),
        ("gamma shape", {"gamma": torch.zeros(3)}, "gamma must have shape"),
        ("gamma negative", {"gamma": torch.tensor([0.1, -0.1])}, "gamma must be >= 0"),
        ("gamma NaN", {"gamma": torch.tensor([NAN, 0.1])}, "gamma must be >= 0"),
        ("gamma_val negative", {"gamma_val": -0.5}, "gamma must be >= 0"),
        ("gamma_val NaN", {"gamma_val": NAN}, "gamma must be >= 0"),
        ("rule unknown", {"rule": "topk"}, "rule must be 'eb' or 'threshold', got 'topk'"),
    ]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("case", bad_input_cases(), ids=[c[0] for c in bad_input_cases()])
def test_bad_inputs_name_the_argument(backend, case):
    """Guards against cryptic errors, or a bad call writing anything before it fails."""
    _, overrides, message = case
    tokens = torch.full((2, 3), SENTINEL, dtype=torch.int64)
    masked = torch.ones(2, 3, dtype=torch.bool)
    args = {"block_tokens": tokens, "is_masked": masked, "sampled": torch.ones(2, 3, dtype=torch.int64),
            "entropy": torch.zeros(2, 3), "gamma": None, "gamma_val": 0.1, "rule": "eb", "valid": None}
    args.update(overrides)
    with pytest.raises(RuntimeError, match=f"sbd.mask_scatter_: {message}"):
        op_on_given_tensors(backend)(**args)
    assert torch.all(tokens == SENTINEL) and torch.all(masked)


@pytest.mark.parametrize("backend", ["naive", "triton"])
def test_wrong_device_names_the_argument(backend):
    """Guards against a tensor on another device being read through a host pointer."""
    tokens = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="sbd.mask_scatter_: entropy must be on the device of block_tokens"):
        op_on_given_tensors(backend)(tokens, torch.ones(2, 3, dtype=torch.bool), tokens.clone(),
                                     torch.zeros(2, 3, device="meta"))


@pytest.mark.parametrize("with_gamma", [True, False])
@pytest.mark.parametrize("rule", ["eb", "threshold"])
def test_opcheck(with_gamma, rule):
    """Guards against a fake kernel or schema that disagrees with the real kernel (mutation, shapes)."""
    tokens, masked, sampled, entropy, gamma, valid = random_inputs(3, 8, 1, with_gamma, True)
    torch.library.opcheck(torch.ops.sbd.mask_scatter_.default,
                          (tokens, masked, sampled, entropy, gamma, 0.25, rule, valid))


def test_compiles_with_fullgraph():
    """Guards against a graph break (or a wrong functionalisation of the in-place update) under compile."""

    def reveal(tokens, masked, sampled, entropy, gamma):
        accepted, num_accepted, done = sbd_kernels.mask_scatter_(tokens, masked, sampled, entropy, gamma)
        return accepted, num_accepted.sum(), done

    tokens, masked, sampled, entropy, gamma, _ = random_inputs(4, 16, 2, True, False)
    eager_tokens, eager_masked = tokens.clone(), masked.clone()
    expected = reveal(eager_tokens, eager_masked, sampled, entropy, gamma)
    compiled = torch.compile(reveal, fullgraph=True, backend="inductor")
    got = compiled(tokens, masked, sampled, entropy, gamma)
    for a, e in zip(got, expected):
        assert torch.equal(a, e)
    assert torch.equal(tokens, eager_tokens) and torch.equal(masked, eager_masked)


def small_args(batch: int = 2, k: int = 5, **overrides):
    """Keyword arguments of a valid call (tokens SENTINEL, all masked, entropies on a 1/16 grid)."""
    args = {"block_tokens": torch.full((batch, k), SENTINEL, dtype=torch.int64),
            "is_masked": torch.ones(batch, k, dtype=torch.bool),
            "sampled": torch.arange(batch * k, dtype=torch.int64).view(batch, k) + 100,
            "entropy": (torch.arange(batch * k, dtype=torch.float32).view(batch, k) % 7) / 16,
            "gamma": None, "gamma_val": 0.25, "rule": "eb", "valid": None}
    args.update(overrides)
    return args


def copies(args):
    """The same call on fresh contiguous copies of every tensor."""
    return {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in args.items()}


OVERLAPPING_IN_PLACE = [
    ("block_tokens", lambda: torch.full((16,), SENTINEL, dtype=torch.int64).as_strided((2, 5), (1, 1))),
    ("is_masked", lambda: torch.ones(16, dtype=torch.bool).as_strided((2, 5), (2, 1))),
    ("block_tokens", lambda: torch.full((1, 7), SENTINEL, dtype=torch.int64).expand(2, 7)[:, :5]),
]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("case", range(len(OVERLAPPING_IN_PLACE)),
                         ids=["tokens rows overlap", "masked rows overlap", "tokens expanded and sliced"])
def test_in_place_arguments_with_overlapping_rows_are_rejected(backend, case):
    """Guards against writing through an in-place argument whose rows overlap without being expanded
    (stride 0): rows would race in the parallel kernels and overwrite each other's results."""
    name, make = OVERLAPPING_IN_PLACE[case]
    view = make()
    before = view.clone()
    with pytest.raises(RuntimeError, match=f"sbd.mask_scatter_: {name} is written in place and must not have "
                                           "elements sharing memory"):
        op_on_given_tensors(backend)(**small_args(**{name: view}))
    assert torch.equal(view, before)


def shared_buffer_views(batch=2, k=5):
    """Views of one 4 KiB allocation for building aliased arguments: `at(byte_offset, dtype)` is a
    contiguous [batch, k] view starting `byte_offset` bytes in, holding the values of a valid call."""
    raw = torch.zeros(4096, dtype=torch.uint8)
    defaults = small_args(batch, k, valid=torch.ones(batch, k, dtype=torch.bool))

    def at(byte_offset, name):
        value = defaults[name]
        view = raw[byte_offset: byte_offset + value.numel() * value.element_size()].view(value.dtype)
        view = view.view(value.shape)
        view.copy_(value)
        return view

    return raw, at


# (argument written in place, argument sharing its last bytes)
ALIASED_PAIRS = [
    ("block_tokens", "is_masked"), ("block_tokens", "sampled"), ("block_tokens", "entropy"),
    ("block_tokens", "valid"), ("is_masked", "sampled"), ("is_masked", "entropy"), ("is_masked", "valid"),
]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("pair", ALIASED_PAIRS, ids=[f"{a} and {b}" for a, b in ALIASED_PAIRS])
def test_in_place_argument_sharing_memory_with_another_is_rejected(backend, pair):
    """Guards against an in-place write changing an argument that is still to be read (the result would
    depend on the order of writes and reads, which differs between backends)."""
    written, other = pair
    raw, at = shared_buffer_views()
    written_view = at(512, written)
    last_byte = 512 + written_view.numel() * written_view.element_size() - 1
    item = small_args(valid=torch.ones(2, 5, dtype=torch.bool))[other].element_size()
    other_view = at(last_byte // item * item, other)  # its first element covers the written one's last byte
    before = raw.clone()
    args = small_args(**{written: written_view, other: other_view})
    with pytest.raises(RuntimeError, match=f"sbd.mask_scatter_: {written} is written in place and must not "
                                           f"share memory with {other}"):
        op_on_given_tensors(backend)(**args)
    assert torch.equal(raw, before)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("written", ["block_tokens", "is_masked"])
def test_in_place_argument_sharing_memory_with_gamma_is_rejected(backend, written):
    """Guards against gamma being overwritten by the reveal of an earlier row before a later row reads it."""
    raw, at = shared_buffer_views()
    written_view = at(512, written)
    gamma = raw[512: 520].view(torch.float32)
    gamma.fill_(0.25)
    with pytest.raises(RuntimeError, match=f"sbd.mask_scatter_: {written} is written in place and must not "
                                           "share memory with gamma"):
        op_on_given_tensors(backend)(**small_args(**{written: written_view, "gamma": gamma}))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("pair", [("block_tokens", "sampled"), ("is_masked", "valid")],
                         ids=["sampled is block_tokens", "valid is is_masked"])
def test_argument_identical_to_the_in_place_one_is_accepted(backend, pair):
    """Guards against rejecting a harmless alias: each element of `sampled` (`valid`) is read only for the
    position of `block_tokens` (`is_masked`) it is, before that position is written."""
    written, other = pair
    args = small_args()
    args["is_masked"][0, 1] = False
    args[other] = args[written]
    expected_args = copies(args)
    expected = naive.mask_scatter_(**expected_args)
    got = op_for(backend)(**args)
    for a, e in zip(got, expected):
        assert torch.equal(a, e)
    assert torch.equal(args["block_tokens"], expected_args["block_tokens"])
    assert torch.equal(args["is_masked"], expected_args["is_masked"])


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_in_place_arguments_in_disjoint_parts_of_one_allocation_are_accepted(backend):
    """Guards against a byte-range check rejecting block_tokens and is_masked carved out of one allocation
    (a decode state kept in one buffer), interleaved: tokens in even 8-byte words, masks in odd words."""
    raw = torch.zeros(2 * 5 * 16, dtype=torch.uint8)
    words = raw.view(torch.int64).view(2, 5, 2)
    tokens = words[:, :, 0]
    masked = raw.view(2, 5, 16)[:, :, 8]
    args = small_args()
    tokens.copy_(args["block_tokens"])
    masked.view(torch.bool).copy_(args["is_masked"])
    expected_args = copies(args)
    expected = naive.mask_scatter_(**expected_args)
    got = op_for(backend)(**{**args, "block_tokens": tokens, "is_masked": masked.view(torch.bool)})
    for a, e in zip(got, expected):
        assert torch.equal(a, e)
    assert torch.equal(tokens, expected_args["block_tokens"])
    assert torch.equal(masked.view(torch.bool), expected_args["is_masked"])
    assert not raw.view(2, 5, 16)[:, :, 9:].any()  # the bytes around the masks were not written


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_undecidable_aliasing_is_an_error_that_says_so(backend):
    """Guards against a layout whose aliasing the checks cannot decide being accepted (it may race)."""
    buffer = torch.zeros(10**6, dtype=torch.int64)
    tokens = buffer.as_strided((1, 150000), (1, 6), 2)
    sampled = buffer.as_strided((1, 150000), (1, 3), 0)
    args = small_args(1, 150000, block_tokens=tokens, sampled=sampled)
    with pytest.raises(RuntimeError, match="sbd.mask_scatter_: block_tokens is written in place and may share "
                                           "memory with sampled"):
        op_on_given_tensors(backend)(**args)


@pytest.mark.parametrize("name", ["sampled", "entropy", "is_masked", "valid", "gamma"])
def test_cpu_op_rejects_an_argument_on_meta(name):
    """Guards against a meta argument routing the CPU call to the fake kernel, which returned
    uninitialised CPU tensors instead of a device error."""
    batch, k = 2, 5
    args = small_args(batch, k, valid=torch.ones(batch, k, dtype=torch.bool), gamma=torch.full((batch,), 0.25))
    args[name] = args[name].to("meta")
    with pytest.raises(RuntimeError, match=f"sbd.mask_scatter_: {name} must be on the device of block_tokens "
                                           r"\(cpu\), got meta"):
        torch.ops.sbd.mask_scatter_(**args)


def metadata_bad_input_cases():
    """The bad inputs of `bad_input_cases` that the fake kernel can see: all but the gamma tensor values."""
    return [case for case in bad_input_cases() if case[0] not in ("gamma negative", "gamma NaN")]


@pytest.mark.parametrize("case", metadata_bad_input_cases(), ids=[c[0] for c in metadata_bad_input_cases()])
def test_fake_kernel_runs_the_argument_checks(case):
    """Guards against the fake (meta) kernel accepting any call: under torch.compile a bad call passed
    tracing, and meta tensors got output shapes for nonsense inputs."""
    _, overrides, message = case
    args = small_args(2, 3)
    args.update(overrides)
    meta_args = {name: torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
                 if isinstance(value, torch.Tensor) else value for name, value in args.items()}  # strides kept
    with pytest.raises(RuntimeError, match=f"sbd.mask_scatter_: {message}"):
        torch.ops.sbd.mask_scatter_(**meta_args)


def test_bad_call_fails_while_tracing_under_compile():
    """Guards against torch.compile accepting a bad call at trace time (the fake kernel checking
    nothing), so that a compiled graph is built and the error only comes from the first real run."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def reveal(tokens, masked, sampled, entropy):
        return sbd_kernels.mask_scatter_(tokens, masked, sampled, entropy)

    args = small_args()
    bad_entropy = args["entropy"].to(torch.float64)
    compiled = torch.compile(reveal, backend=record, fullgraph=True)
    with pytest.raises(RuntimeError, match="sbd.mask_scatter_: entropy must be float32"):
        compiled(args["block_tokens"], args["is_masked"], args["sampled"], bad_entropy)
    assert graphs == []


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("gamma_val", [3.4028234663852886e38, 3.5e38, 1e300, INF])
@pytest.mark.parametrize("rule", ["eb", "threshold"])
def test_huge_gamma_val_rounds_to_fp32(backend, gamma_val, rule):
    """Guards against a backend rejecting a gamma_val beyond the fp32 range (the oracle raised on 1e300)
    instead of rounding it to fp32 (+inf) like the others."""
    positions = run_hand_case(backend, [0.5, 2.0, INF, 1.0], gamma=gamma_val, rule=rule)[0]
    # eb: the sums before each candidate (0, .5, 1.5, 3.5) are <= gamma; threshold: inf < gamma is false
    assert positions == ([0, 1, 2, 3] if rule == "eb" else [0, 1, 3])
    # eb: the second +inf is accepted iff the sum before it (+inf) <= gamma, i.e. gamma rounds to +inf
    rounds_to_inf = gamma_val > 3.4028234663852886e38
    positions = run_hand_case(backend, [INF, INF], gamma=gamma_val, rule=rule)[0]
    assert positions == ([0, 1] if rule == "eb" and rounds_to_inf else [0])


# (id, positional arguments after entropy, keyword arguments, the gamma every row gets)
WRAPPER_GAMMA_CALLS = [
    ("gamma number", (), {"gamma": 0.25}, 0.25),
    ("gamma_val keyword", (), {"gamma_val": 0.25}, 0.25),
    ("gamma=None, gamma_val", (), {"gamma": None, "gamma_val": 0.25}, 0.25),
    ("no gamma: default 0.1", (), {}, 0.1),
    ("positional None, value", (None, 0.25), {}, 0.25),
    ("positional number", (0.375,), {}, 0.375),
    ("integer number", (), {"gamma": 0}, 0.0),
    ("tensor, gamma_val ignored", (torch.full((3,), 0.25), 99.0), {}, 0.25),
    ("tensor keyword", (), {"gamma": torch.full((3,), 0.25)}, 0.25),
]


@pytest.mark.parametrize("call", WRAPPER_GAMMA_CALLS, ids=[c[0] for c in WRAPPER_GAMMA_CALLS])
@pytest.mark.parametrize("rule", ["eb", "threshold"])
def test_wrapper_takes_gamma_as_tensor_or_number(call, rule):
    """Guards against the wrapper's `gamma: Tensor | float` mapping a number to the wrong schema argument,
    or breaking the existing gamma=None / gamma_val calls."""
    _, positional, keywords, row_gamma = call
    tokens, masked, sampled, entropy, _, valid = random_inputs(3, 9, 4, False, True)
    entropy = entropy / 4  # sums near 0.1 .. 0.375, so that the gamma used shows in the result
    ref_tokens, ref_masked = tokens.clone(), masked.clone()
    expected = naive.mask_scatter_(ref_tokens, ref_masked, sampled, entropy, None, row_gamma, rule, valid)
    got = sbd_kernels.mask_scatter_(tokens, masked, sampled, entropy, *positional, **keywords, rule=rule,
                                    valid=valid)
    for a, e in zip(got, expected):
        assert torch.equal(a, e)
    assert torch.equal(tokens, ref_tokens) and torch.equal(masked, ref_masked)


def test_wrapper_gamma_cases_discriminate():
    """The inputs of test_wrapper_takes_gamma_as_tensor_or_number give different results for each gamma
    it uses, so a wrapper passing the wrong one fails there."""
    tokens, masked, sampled, entropy, _, valid = random_inputs(3, 9, 4, False, True)
    counts = {g: naive.mask_scatter_(tokens.clone(), masked.clone(), sampled, entropy / 4, None, g, "eb",
                                     valid)[1].tolist() for g in (0.0, 0.1, 0.25, 0.375, 99.0)}
    assert len({tuple(c) for c in counts.values()}) == len(counts), counts


@pytest.mark.parametrize("gamma, gamma_val, message", [
    (0.3, 0.1, "gamma=0.3 is a number, so gamma_val=0.1 cannot also be given"),
    (True, None, "gamma must be a \\[B\\] float32 tensor, a number or None, got bool"),
    ("0.1", None, "gamma must be a \\[B\\] float32 tensor, a number or None, got str"),
])
def test_wrapper_rejects_ambiguous_gamma(gamma, gamma_val, message):
    """Guards against a number given twice (as gamma and as gamma_val) silently using one of them."""
    args = small_args()
    with pytest.raises(TypeError, match=f"sbd.mask_scatter_: {message}"):
        sbd_kernels.mask_scatter_(args["block_tokens"], args["is_masked"], args["sampled"], args["entropy"],
                                  gamma, gamma_val)


def test_wrapper_with_number_gamma_compiles_with_fullgraph():
    """Guards against the number-or-tensor dispatch of the wrapper breaking the graph under compile."""

    def reveal(tokens, masked, sampled, entropy):
        return sbd_kernels.mask_scatter_(tokens, masked, sampled, entropy, 0.25)

    tokens, masked, sampled, entropy, _, _ = random_inputs(4, 16, 2, False, False)
    eager_tokens, eager_masked = tokens.clone(), masked.clone()
    expected = reveal(eager_tokens, eager_masked, sampled, entropy)
    got = torch.compile(reveal, fullgraph=True, backend="inductor")(tokens, masked, sampled, entropy)
    for a, e in zip(got, expected):
        assert torch.equal(a, e)
    assert torch.equal(tokens, eager_tokens) and torch.equal(masked, eager_masked)
