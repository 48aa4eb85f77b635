"""`sbd_kernels.ops.trusted_values()`: the value checks of the Python backends (Triton launchers, oracles) are
skipped inside it and only there, the kernels stay in bounds without them, and the decode loop uses it.

Bad values only ever reach the Triton kernels inside `trusted_values()` (no check to trip): with
SBD_TEST_DEVICE=cuda that runs the compiled kernels on them. Calls expected to fail a value check stay on
CPU tensors, where `torch._assert_async` raises at once.
"""
import doctest
import threading

import pytest
import torch
from attention_cases import embed_caches_in_nan_buffers, make_case
from test_attention_triton import triton_op

from sbd_kernels.generate import DecodeConfig, generate, naive_ops
from sbd_kernels.model import ModelConfig, Transformer
from sbd_kernels.ops import _trusted, trusted_values
from sbd_kernels.ops.attention import naive as attention_naive
from sbd_kernels.ops.sampling import naive as sampling_naive
from sbd_kernels.ops.sampling import triton as sampling_triton
from sbd_kernels.ops.scatter import naive as scatter_naive
from sbd_kernels.ops.scatter import triton as scatter_triton
from sbd_kernels.testing import on_device, triton_test_device

DEVICE = triton_test_device()


@pytest.fixture
def assert_async_calls(monkeypatch):
    """Messages of every torch._assert_async call (the call itself still happens)."""
    calls = []
    real = torch._assert_async

    def spy(*args):
        calls.append(args[1] if len(args) > 1 else "")
        return real(*args)

    monkeypatch.setattr(torch, "_assert_async", spy)
    return calls


def attention_case():
    """A small paged call: lengths, num_causal and page ids are all checked."""
    return make_case(B=2, C=2, K=2, L=5, Hq=2, Hkv=1, D=8, dtype=torch.float32, paged=True, page_size=4)


def sampling_kwargs():
    logits = torch.randn(2, 3, 40)
    return {"logits": logits, "seed": torch.tensor([1, 2]), "offset": torch.tensor([0, 5]),
            "temperature": torch.tensor([0.7, 1.0]), "top_k": torch.tensor([5, 0]), "top_p": torch.tensor([0.9, 1.0]),
            "min_p": torch.tensor([0.0, 0.05])}


def scatter_args():
    gen = torch.Generator().manual_seed(3)
    tokens = torch.full((3, 8), -1, dtype=torch.int64)
    masked = torch.rand(3, 8, generator=gen) < 0.8
    sampled = torch.randint(0, 100, (3, 8), generator=gen)
    entropy = torch.rand(3, 8, generator=gen)
    return tokens, masked, sampled, entropy, torch.tensor([0.3, 0.0, 1.0])


def valid_call(family: str, backend: str):
    """A function running one fixed valid call of `family` on `backend` ("triton": the launcher on copies on
    the Triton test device; "naive"), on fresh copies of its in-place arguments each time; returns every
    output and the in-place arguments after the call."""
    if family == "attention":
        case = attention_case()
        fn = on_device(triton_op, DEVICE) if backend == "triton" else attention_naive.block_attention_with_kvcache

        def call():
            args = case.with_cache_copies().args()
            return (*fn(*args), args[3], args[4])
        return call
    if family == "sampling":
        kwargs = sampling_kwargs()
        fn = on_device(sampling_triton.entropy_sample, DEVICE) if backend == "triton" else sampling_naive.entropy_sample
        return lambda: fn(**kwargs)
    tokens, masked, *rest = scatter_args()
    fn = on_device(scatter_triton.mask_scatter_, DEVICE) if backend == "triton" else scatter_naive.mask_scatter_

    def call():
        block, is_masked = tokens.clone(), masked.clone()
        return (*fn(block, is_masked, *rest), block, is_masked)
    return call


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where NaN (never-written cache slots hold NaN poison)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b).all())


# The sampling oracle raises its value errors itself (`bool(ok)`), without torch._assert_async.
SPIED = [("attention", "triton"), ("attention", "naive"), ("sampling", "triton"), ("scatter", "triton"),
         ("scatter", "naive")]


@pytest.mark.parametrize("family,backend", SPIED, ids=[f"{f}-{b}" for f, b in SPIED])
def test_value_checks_run_outside_and_are_skipped_inside(assert_async_calls, family, backend):
    """Guards against trusted_values() not reaching a backend's value checks (the host overhead stays), or
    leaking out of its block (checks silently off for everyone afterwards): the same call asserts its values
    before, not inside, and again after the block, with the same results each time."""
    call = valid_call(family, backend)
    before = call()
    checked = len(assert_async_calls)
    assert checked > 0
    with trusted_values():
        inside = call()
    assert len(assert_async_calls) == checked
    after = call()
    assert len(assert_async_calls) == 2 * checked
    for got, want, again in zip(inside, before, after):
        assert same(got, want) and same(again, want)


def test_sampling_oracle_skips_its_value_checks_inside():
    """Guards against the sampling oracle still rejecting a per-row value inside trusted_values() (the oracle
    decode would then fail where the kernels run), or accepting it outside."""
    kwargs = dict(sampling_kwargs(), temperature=torch.tensor([float("nan"), 1.0]))
    with pytest.raises(RuntimeError, match="temperature must be finite and >= 0"):
        sampling_naive.entropy_sample(**kwargs)
    with trusted_values():
        tokens, *_ = sampling_naive.entropy_sample(**kwargs)
    assert ((tokens >= 0) & (tokens < 40)).all()


def test_flag_nests_and_is_per_thread():
    """Guards against an inner block switching the checks back on for the outer one, and against one thread's
    block switching them off in another thread."""
    seen = []
    with trusted_values():
        with trusted_values():
            pass
        assert _trusted.values_trusted()
        worker = threading.Thread(target=lambda: seen.append(_trusted.values_trusted()))
        worker.start()
        worker.join()
    assert seen == [False] and not _trusted.values_trusted()


def test_docstring_example_runs():
    """Guards against the module's example drifting from the flag's behaviour."""
    result = doctest.testmod(_trusted)
    assert result.attempted > 0 and result.failed == 0


# ----------------------------------------------------------------------------------------------------
# Without the checks, bad values stay in bounds
# ----------------------------------------------------------------------------------------------------
def bad_attention_case(paged: bool):
    """Sequence 0 claims 9 cache slots more than its capacity, sequence 1 num_causal 3 above C; paged: a page
    id past the pool in sequence 1's table."""
    c = make_case(B=2, C=2, K=2, L=5, Hq=2, Hkv=1, D=8, dtype=torch.float32, paged=paged, page_size=4)
    capacity = c.block_table.shape[1] * 4 if paged else c.k_cache.shape[1]
    c.cache_seqlens[0] = capacity + 9
    c.num_causal[1] = 5
    if paged:
        c.block_table[1, 0] = c.k_cache.shape[0] + 3
    return c


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_attention_kernel_clamps_bad_values_inside(paged):
    """Guards against trusted_values() opening an out-of-bounds access: lengths past the capacity, num_causal
    past C and a page id past the pool are rejected outside the block; inside it the kernel writes nothing
    outside its caches (each a view into a larger NaN buffer), and sequence 1 (num_causal clamped to C, the
    bad page skipped) gets finite rows."""
    with pytest.raises(RuntimeError, match="num_causal must be in"):
        triton_op(*bad_attention_case(paged).args())
    c = bad_attention_case(paged)
    assert_rest_untouched = embed_caches_in_nan_buffers(c)
    with trusted_values():
        out, lse = on_device(triton_op, DEVICE)(*c.args())
    assert_rest_untouched()
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter on NaN / inf T
def test_sampling_kernel_takes_bad_values_inside():
    """Guards against a bad per-row value (NaN / infinite / negative temperature, negative top_k, NaN top_p,
    min_p >= 1) reaching an address in the kernels once unchecked: tokens stay in [0, V), every output is
    written, the logits are untouched."""
    kwargs = dict(sampling_kwargs(), temperature=torch.tensor([float("nan"), float("inf")]),
                  top_k=torch.tensor([-3, 2]), top_p=torch.tensor([float("nan"), 0.5]), min_p=torch.tensor([0.0, 2.0]))
    with pytest.raises(RuntimeError, match="temperature must be finite and >= 0"):
        sampling_triton.entropy_sample(**kwargs)
    logits = kwargs["logits"].clone()
    for temperature in (kwargs["temperature"], torch.tensor([-1.0, 0.5])):
        with trusted_values():
            tokens, entropy, _, valid = on_device(sampling_triton.entropy_sample, DEVICE)(
                **dict(kwargs, temperature=temperature))
        assert ((tokens >= 0) & (tokens < 40)).all() and valid.all() and torch.isfinite(entropy).all()
    assert torch.equal(kwargs["logits"], logits)


@pytest.mark.parametrize("rule", ["eb", "threshold"])
def test_scatter_kernel_takes_bad_gamma_inside(rule):
    """Guards against a NaN or negative gamma doing anything but what the docstring says once unchecked: the
    first-ranked candidate of each row is accepted, nothing else is written."""
    tokens, masked, sampled, entropy, _ = scatter_args()
    gamma = torch.tensor([float("nan"), -1.0, -0.0])
    with pytest.raises(RuntimeError, match="gamma must be >= 0"):
        scatter_triton.mask_scatter_(tokens.clone(), masked.clone(), sampled, entropy, gamma, rule=rule)
    got_tokens, got_masked = tokens.clone(), masked.clone()
    with trusted_values():
        accepted, num_accepted, _ = on_device(scatter_triton.mask_scatter_, DEVICE)(
            got_tokens, got_masked, sampled, entropy, gamma, rule=rule)
        expected = scatter_naive.mask_scatter_(tokens, masked, sampled, entropy, gamma, rule=rule)
    assert torch.equal(accepted, expected[0]) and torch.equal(got_tokens, tokens) and torch.equal(got_masked, masked)
    assert num_accepted[:2].tolist() == [1, 1]


# ----------------------------------------------------------------------------------------------------
# The decode loop
# ----------------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("method", ["ntp", "sbd"])
def test_decode_loop_runs_without_value_checks(assert_async_calls, method):
    """Guards against the decode loop paying the per-call value checks for lengths it builds itself (4-6 small
    kernels per layer and pass on CUDA): a whole decode through the oracles asserts nothing, while one direct
    oracle call outside the loop does."""
    model = Transformer(ModelConfig.preset("tiny")).eval()
    cfg = DecodeConfig(method=method, block_size=4, gamma=0.3, temperature=0.8, max_new_tokens=6, top_k=5)
    generate(model, [[5, 6, 7], [8, 9]], cfg, eos_id=2, pad_id=0, ops=naive_ops())
    assert assert_async_calls == []
    attention_naive.block_attention_with_kvcache(*attention_case().args())
    assert assert_async_calls
