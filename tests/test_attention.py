"""`sbd.block_attention_with_kvcache` on the CPU: the C++ kernel against the oracle, the oracle against
torch SDPA, the SBD exactness property, errors, opcheck and torch.compile.

The Triton backend is tested in test_attention_triton.py on the same cases (tests/attention_cases.py).
"""
import math
import re

import pytest
import torch
import torch.nn.functional as F
from attention_cases import (
    ALIASING_SHAPE,
    AXES,
    BASE,
    INDEX_LAYOUTS,
    INDEX_TENSORS,
    NON_FINITE,
    READ_ONLY_PAGE_SHARES,
    SHARED_PAGE_CASE,
    WRITTEN_PAGE_SHARES,
    aliasing_cases,
    assert_matches_oracle,
    assert_non_finite_rows,
    axis_params,
    combine_caches,
    embed_caches_in_nan_buffers,
    fuse_qkv,
    index_view_case,
    make_case,
    non_finite_case,
    share_pages,
)
from torch._subclasses.fake_tensor import FakeTensorMode

from sbd_kernels import block_attention_with_kvcache
from sbd_kernels.ops._float32 import exact_g
from sbd_kernels.ops.attention import naive
from sbd_kernels.testing import assert_close

OP = torch.ops.sbd.block_attention_with_kvcache
CASES = axis_params()
CASE_IDS = [case_id for case_id, _ in CASES]


@pytest.mark.parametrize("shape", [kw for _, kw in CASES], ids=CASE_IDS)
def test_cpu_matches_oracle(shape, cpu_isa):
    """Guards against wrong math, masks, GQA head mapping, paging or cache writes in any ISA variant,
    on every axis of the grid (B, C incl. 0 and K, L incl. 0 and 4099, K incl. 0, GQA 1/4/8, D, dtype,
    paged with page sizes 1, 16, 48); NaN-poisoned cache slots must stay untouched bit for bit."""
    if cpu_isa != "avx512" and shape["L"] > 1000:
        pytest.skip("the long cache runs on the widest variant only (the tile loop is shared)")
    assert_matches_oracle(make_case(**shape), OP)


@pytest.mark.parametrize("dtype", AXES["dtype"], ids=str)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_long_ragged_batch_splits_the_keys(dtype, paged):
    """Guards against errors in the split-KV path and its log-sum-exp merge: B=1 with one KV head makes
    the kernel split 4099+ keys over several items; ragged lengths leave some splits empty."""
    case = make_case(B=1, C=5, K=7, L=4099, Hq=4, Hkv=1, D=64, dtype=dtype, paged=paged, page_size=32)
    assert_matches_oracle(case, OP)
    case = make_case(B=3, C=5, K=7, L=2100, Hq=4, Hkv=1, D=128, dtype=dtype, paged=paged, page_size=32)
    assert_matches_oracle(case, OP)


@pytest.mark.parametrize("dtype", AXES["dtype"], ids=str)
@pytest.mark.parametrize("dim", [33, 256])
def test_odd_and_widest_head_dims(dim, dtype):
    """Guards against errors in the padding of an odd D (bf16 GEMMs pair up D) and at the largest D."""
    assert_matches_oracle(make_case(**{**BASE, "D": dim, "dtype": dtype}), OP)


@pytest.mark.parametrize("dtype", AXES["dtype"], ids=str)
def test_noncontiguous_inputs(dtype):
    """Guards against kernels that assume contiguous q / k / v (strided last dimension here)."""
    assert_matches_oracle(make_case(**{**BASE, "dtype": dtype, "contiguous": False}), OP)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_strided_caches(paged):
    """Guards against kernels that assume densely packed caches: here each cache is one layer / one
    half of a larger buffer (outer strides differ from the sizes, and k_cache and v_cache differ)."""
    case = make_case(**{**BASE, "paged": paged})
    assert_rest_untouched = embed_caches_in_nan_buffers(case)
    assert_matches_oracle(case, OP)
    assert_rest_untouched()


@pytest.mark.parametrize("layout", INDEX_LAYOUTS)
@pytest.mark.parametrize("name", INDEX_TENSORS)
def test_index_tensor_views(name, layout):
    """Guards against a kernel that reads cache_seqlens / num_causal / block_table as if contiguous: each
    is here a strided (stride 2), offset or expanded (stride 0) view of a poisoned buffer, so a wrong
    index reads poison or another sequence's value and the cache writes land in the wrong slots."""
    case, embedded = index_view_case(name, layout)
    assert_matches_oracle(case, OP)
    embedded.check_unchanged(name)


@pytest.mark.parametrize("scale", [0.05, 1.0, 3.0])
def test_softmax_scale(scale):
    """Guards against an ignored softmax_scale (3.0 also sharpens the softmax enough to expose a max taken
    before scaling)."""
    assert_matches_oracle(make_case(**BASE, softmax_scale=scale), OP)


def test_padding_rows_and_poison():
    """Guards against padding rows getting values, and NaN from unused cache slots leaking into outputs
    (0 * NaN = NaN): every non-padding output must be finite, padding out = 0 and lse = -inf."""
    case = make_case(B=3, C=6, K=4, L=50, Hq=4, Hkv=2, D=64, dtype=torch.float32)
    out, lse = OP(*case.args())
    for b, c in enumerate(case.num_causal.tolist()):
        assert torch.equal(out[b, c:6], torch.zeros_like(out[b, c:6]))
        assert torch.equal(lse[b, :, c:6], torch.full_like(lse[b, :, c:6], float("-inf")))
        assert torch.isfinite(out[b, :c]).all() and torch.isfinite(out[b, 6:]).all()
        assert torch.isfinite(lse[b, :, :c]).all() and torch.isfinite(lse[b, :, 6:]).all()


NON_FINITE_DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", NON_FINITE_DTYPES, ids=str)
@pytest.mark.parametrize("where", NON_FINITE)
def test_oracle_non_finite_scores(where, dtype):
    """Guards against an oracle that reads non-finite scores against the contract: logsumexp gave lse +inf
    for a +inf score (NaN wanted), and a row whose every score is -inf got out NaN from exp(-inf - -inf)
    (out 0, lse -inf wanted: no keys)."""
    case, nan_rows, empty_rows = non_finite_case(where, dtype, 5)
    assert_non_finite_rows(*naive.block_attention_with_kvcache(*case.args()), nan_rows, empty_rows)


@pytest.mark.parametrize("dtype", NON_FINITE_DTYPES, ids=str)
@pytest.mark.parametrize("length", [5, 300, 2100], ids=lambda n: f"L={n}")
@pytest.mark.parametrize("where", NON_FINITE)
def test_non_finite_scores(where, length, dtype, cpu_isa):
    """Guards against non-finite scores read as something else by the C++ kernel: a NaN or +inf score must
    make the row's out and lse NaN, a -inf score weigh 0, a row of -inf scores have no keys (out 0, lse
    -inf). It gave lse +inf when a NaN sat in the vectorised part of a later key tile (exp_u20(NaN) = +inf,
    and std::max dropped the NaN from the max: L = 300 puts the new rows and slot L - 2 in the second
    256-key tile) and out NaN for a row of -inf scores. L = 5 runs the scalar tails only, L = 2100 splits
    the keys (3 splits, the NaN in one)."""
    case, nan_rows, empty_rows = non_finite_case(where, dtype, length)
    assert_non_finite_rows(*OP(*case.with_cache_copies().args()), nan_rows, empty_rows)
    assert_matches_oracle(case, OP)


def test_scores_overflowing_once_scaled():
    """Guards against scores that overflow only when multiplied by the scale (softmax_scale = 1e38, which the
    op accepts: s q . k is +-inf wherever |q . k| > 3.4): rows with a +inf score must come out NaN in the
    oracle (logsumexp gave lse +inf) and in the C++ kernel, the others finite."""
    case = make_case(B=1, C=2, K=2, L=6, Hq=2, Hkv=1, D=8, dtype=torch.float32, softmax_scale=1e38)
    _, lse = naive.block_attention_with_kvcache(*case.with_cache_copies().args())
    assert lse.isnan().any() and lse.isfinite().any() and not (lse == float("inf")).any()
    assert_matches_oracle(case, OP)


@pytest.mark.parametrize("dtype", NON_FINITE_DTYPES, ids=str)
@pytest.mark.parametrize("where", ["nan_q", "nan_causal_k", "inf_score", "neg_inf_scores"])
@pytest.mark.parametrize("impl", ["cpu", "naive"])
def test_non_finite_score_of_a_single_key(impl, where, dtype):
    """Guards against a row whose only key scores NaN, +inf or -inf (L = 0, one causal row, no block) being
    judged by its max: std::max drops a NaN, so the max stays -inf while the row must still come out NaN;
    a lone -inf score must give no keys (out 0, lse -inf), not exp(-inf - -inf) = NaN."""
    case, nan_rows, empty_rows = non_finite_case(where, dtype, L=0, C=1, K=0)
    fn = OP if impl == "cpu" else naive.block_attention_with_kvcache
    assert_non_finite_rows(*fn(*case.args()), nan_rows, empty_rows)


def sbd_decode_mask(length: int, causal: int, causal_slots: int, block: int) -> torch.Tensor:
    """[S, L + C + K] bool over [cache ; all C causal slots ; block] for SDPA (padding rows see only
    padding key 0 so SDPA stays finite; they are not compared)."""
    seq = causal_slots + block
    mask = torch.zeros(seq, length + seq, dtype=torch.bool)
    mask[:, :length] = True
    for i in range(causal):
        mask[i, length:length + i + 1] = True
    mask[causal_slots:, :length + causal] = True
    mask[causal_slots:, length + causal_slots:] = True
    for i in range(causal, causal_slots):
        mask[i, length + i] = True
    return mask


@pytest.mark.parametrize("impl", ["cpu", "naive"])
@pytest.mark.parametrize("gqa", AXES["gqa"], ids=str)
def test_agrees_with_sdpa(impl, gqa):
    """Guards against the oracle and the kernel sharing a wrong reading of the contract: both must equal
    torch SDPA (enable_gqa) over [cache ; k] with the SBD decode mask written independently."""
    hq, hkv = gqa
    case = make_case(B=3, C=4, K=5, L=40, Hq=hq, Hkv=hkv, D=64, dtype=torch.float32)
    cache_k, cache_v = case.k_cache.clone(), case.v_cache.clone()
    fn = OP if impl == "cpu" else naive.block_attention_with_kvcache
    out, _ = fn(*case.args())
    for b, (length, causal) in enumerate(zip(case.cache_seqlens.tolist(), case.num_causal.tolist())):
        keys = torch.cat([cache_k[b, :length], case.k[b]]).transpose(0, 1)  # [Hkv, L + S, D]
        values = torch.cat([cache_v[b, :length], case.v[b]]).transpose(0, 1)
        mask = sbd_decode_mask(length, causal, 4, 5)
        expected = F.scaled_dot_product_attention(case.q[b].transpose(0, 1), keys, values, attn_mask=mask,
                                                  enable_gqa=True).transpose(0, 1)
        assert_close(out[b, :causal], expected[:causal], name="causal rows")
        assert_close(out[b, 4:], expected[4:], name="block rows")


# A tiny random transformer (RMSNorm, RoPE, GQA attention, SiLU MLP) for the exactness property.
DIM, HQ, HKV, HEAD, LAYERS = 32, 4, 2, 8, 2


def make_layers(generator: torch.Generator) -> list[dict]:
    def w(*shape):
        return torch.randn(*shape, generator=generator) / shape[0] ** 0.5
    return [{"wq": w(DIM, HQ * HEAD), "wk": w(DIM, HKV * HEAD), "wv": w(DIM, HKV * HEAD),
             "wo": w(HQ * HEAD, DIM), "w1": w(DIM, 4 * DIM), "w2": w(4 * DIM, DIM)} for _ in range(LAYERS)]


def rms_norm(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def rope(x, positions):
    """x [T, H, HEAD] rotated by positions [T]."""
    freqs = 1.0 / 10000 ** (torch.arange(0, HEAD, 2) / HEAD)
    angles = positions[:, None].float() * freqs[None]  # [T, HEAD / 2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


def forward(layers, x, positions, attend):
    """x [T, DIM] -> [T, DIM]; attend(layer_index, q, k, v) -> [T, HQ, HEAD]."""
    for i, p in enumerate(layers):
        h = rms_norm(x)
        q = rope((h @ p["wq"]).view(-1, HQ, HEAD), positions)
        k = rope((h @ p["wk"]).view(-1, HKV, HEAD), positions)
        v = (h @ p["wv"]).view(-1, HKV, HEAD)
        x = x + attend(i, q, k, v).reshape(-1, HQ * HEAD) @ p["wo"]
        h = rms_norm(x)
        x = x + F.silu(h @ p["w1"]) @ p["w2"]
    return x


def full_recompute(layers, x, block_start):
    """The whole sequence at once: causal up to block_start, block rows see all (docs/algorithm.md §3.10)."""
    total = x.shape[0]
    mask = torch.ones(total, total, dtype=torch.bool).tril()
    mask[block_start:] = True

    def attend(_, q, k, v):
        return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              attn_mask=mask, enable_gqa=True).transpose(0, 1)
    return forward(layers, x, torch.arange(total), attend)


class CachedStack:
    """The same layers decoding through the op, one contiguous cache per layer."""

    def __init__(self, layers, capacity):
        self.layers = layers
        self.caches = [(torch.full((1, capacity, HKV, HEAD), float("nan")),
                        torch.full((1, capacity, HKV, HEAD), float("nan"))) for _ in layers]
        self.length = 0

    def step(self, causal_x, block_x):
        """One SBD pass: causal rows (cached), then block rows (never cached). Returns the block's output."""
        c, k = causal_x.shape[0], block_x.shape[0]
        x = torch.cat([causal_x, block_x])
        positions = self.length + torch.arange(c + k)
        lengths = torch.tensor([self.length], dtype=torch.int32)
        causal = torch.tensor([c], dtype=torch.int32)

        def attend(i, q, kk, v):
            k_cache, v_cache = self.caches[i]
            out, _ = OP(q[None], kk[None], v[None], k_cache, v_cache, lengths, causal, k)
            return out[0]
        out = forward(self.layers, x, positions, attend)
        self.length += c
        return out[c:]


def test_cached_decode_equals_full_recompute():
    """Guards against breaking docs/algorithm.md §3.10 in the op: prefill (K = 0), a first block pass with
    the previous block's tokens as causal rows, and a later pass with only the block must all give the
    block outputs of a full recompute over the whole sequence; the cache must hold only causal K/V."""
    gen = torch.Generator().manual_seed(0)
    layers = make_layers(gen)
    prompt, previous, block = (torch.randn(n, DIM, generator=gen) for n in (11, 4, 4))
    stack = CachedStack(layers, capacity=32)
    assert stack.step(prompt, prompt[:0]).shape == (0, DIM)
    cached = stack.step(previous, block)
    sequence = torch.cat([prompt, previous, block])
    assert_close(cached, full_recompute(layers, sequence, 15)[15:], atol_scale=5, name="first pass")
    revealed = block.clone()
    revealed[1] = torch.randn(DIM, generator=gen)
    cached = stack.step(revealed[:0], revealed)
    sequence = torch.cat([prompt, previous, revealed])
    assert_close(cached, full_recompute(layers, sequence, 15)[15:], atol_scale=5, name="later pass")
    for k_cache, _ in stack.caches:
        assert torch.isfinite(k_cache[0, :15]).all() and torch.isnan(k_cache[0, 15:]).all()


SCALE_MESSAGE = "softmax_scale must be finite and > 0 as a float32"
# Doubles around the ends of float32's positive range (round to nearest even): FLT_MAX, the largest
# double that still rounds to it, the midpoint to 2^128 (rounds to inf), the smallest subnormal 2^-149,
# the midpoint 2^-150 (rounds to 0), the double above it (rounds to 2^-149).
SCALE_EDGES = (torch.finfo(torch.float32).max, 2.0**128 - 2.0**103 - 2.0**75, 2.0**128 - 2.0**103, 2.0**-149,
               2.0**-150, 2.0**-150 * (1 + 2.0**-52))


@pytest.mark.parametrize("scale", SCALE_EDGES, ids=lambda s: f"{s:.17g}")
def test_softmax_scale_is_checked_as_the_float32_used(scale):
    """Guards against a softmax_scale checked as a double but used as a float32: 1e39 passed the check,
    became inf and gave NaN. At the edges of float32's range the C++ and Python checks accept exactly the
    doubles whose float32 is finite and > 0, with the same message."""
    as_float32 = float(torch.tensor(scale, dtype=torch.float64).float())
    accepted = math.isfinite(as_float32) and as_float32 > 0
    for fn in (OP, naive.block_attention_with_kvcache):
        case = make_case(**BASE, softmax_scale=scale)
        if accepted:
            fn(*case.args())
        else:
            with pytest.raises(RuntimeError, match=re.escape(f"{SCALE_MESSAGE}, got {exact_g(scale)} ("
                                                             f"{exact_g(as_float32)} as a float32)")):
                fn(*case.args())


@pytest.mark.parametrize("scale,text", [(1e39, "got 1e+39 (inf as a float32)"),
                                        (1e-50, "got 1e-50 (0 as a float32)"),
                                        (3.4028236e38, "got 3.4028236e+38 (inf as a float32)"),
                                        (0.0, "got 0"), (-2.0, "got -2"), (math.inf, "got inf"),
                                        (math.nan, "got nan")])
def test_softmax_scale_message_prints_the_value_and_its_float32(scale, text):
    """Guards against a message that misreads the value it refuses: %g printed 3.4028236e38 (inf as a
    float32) as 3.40282e+38, below the largest float32. The C++ and Python checks print the value with the
    fewest digits that read back exactly and, when only the rounding puts it out of range, its float32."""
    for fn in (OP, naive.block_attention_with_kvcache):
        case = make_case(**BASE, softmax_scale=scale)
        with pytest.raises(RuntimeError, match=re.escape(f"{SCALE_MESSAGE}, {text}") + "$"):
            fn(*case.args())


# Errors about values inside the index tensors: the fake kernel cannot see them.
VALUE_ERRORS = ("capacity", "negative_length", "num_causal_range")


def error_cases():
    """(id, mutate(case) -> None, message fragment naming the argument)."""
    def set_(name, value):
        return lambda case: setattr(case, name, value)
    return [
        ("capacity", lambda c: c.cache_seqlens.fill_(c.k_cache.shape[1]), "exceeds the cache capacity"),
        ("negative_length", lambda c: c.cache_seqlens.fill_(-1), "cache_seqlens must be >= 0"),
        ("num_causal_range", lambda c: c.num_causal.fill_(BASE["C"] + 1), "num_causal must be in"),
        ("gqa", set_("q", torch.randn(3, 8, 3, 64)), "must be a multiple of k heads"),
        ("lengths_dtype", lambda c: setattr(c, "cache_seqlens", c.cache_seqlens.long()),
         "cache_seqlens must be int32"),
        ("num_causal_dtype", lambda c: setattr(c, "num_causal", c.num_causal.long()), "num_causal must be int32"),
        ("q_dtype", lambda c: setattr(c, "q", c.q.double()), "q must be float32, float16 or bfloat16"),
        ("cache_dtype", lambda c: setattr(c, "v_cache", c.v_cache.half()), "v_cache must have the dtype of q"),
        ("block_size", set_("block_size", 9), "block_size must be in"),
        ("device", lambda c: setattr(c, "num_causal", c.num_causal.to("meta")), "num_causal must be on the device"),
        ("scale_nan", set_("softmax_scale", float("nan")), f"{SCALE_MESSAGE}, got nan"),
        ("scale_inf", set_("softmax_scale", float("inf")), f"{SCALE_MESSAGE}, got inf"),
        ("scale_zero", set_("softmax_scale", 0.0), f"{SCALE_MESSAGE}, got 0"),
        ("scale_negative", set_("softmax_scale", -0.3), rf"{SCALE_MESSAGE}, got -0\.3"),
        ("scale_negative_nan", set_("softmax_scale", -float("nan")), f"{SCALE_MESSAGE}, got nan"),
        ("scale_tiny_negative", set_("softmax_scale", -1e-30), f"{SCALE_MESSAGE}, got -1e-30"),
        # Finite doubles that are inf or 0 as the float32 the kernels use.
        ("scale_1e39", set_("softmax_scale", 1e39), rf"{SCALE_MESSAGE}, got 1e\+39"),
        ("scale_1e300", set_("softmax_scale", 1e300), rf"{SCALE_MESSAGE}, got 1e\+300"),
        ("scale_1e-50", set_("softmax_scale", 1e-50), f"{SCALE_MESSAGE}, got 1e-50"),
        ("k_shape", lambda c: setattr(c, "k", c.k[:, :-1]), (r"k dimension 1 \(S\) is 7, q's is 8; q, k and v are "
         r"\[B, S, H, D\] \(Hugging Face attention passes \[B, H, S, D\]: call \.transpose\(1, 2\)")),
        ("hf_layout_qkv", lambda c: [setattr(c, t, getattr(c, t).transpose(1, 2)) for t in ("q", "k", "v")],
         r"k dimension 1 \(S\) is 2, q's is 8; q, k and v are \[B, S, H, D\]"),
        ("hf_layout_cache", lambda c: [setattr(c, t, getattr(c, t).transpose(1, 2)) for t in ("k_cache", "v_cache")],
         (r"k_cache dimension 2 \(Hkv\) is 44, k's is 2; caches are \[B, S_max, Hkv, D\].*StaticCache layer is "
         r"\[B, Hkv, S_max, D\]: call \.transpose\(1, 2\)")),
        ("cache_shapes", lambda c: setattr(c, "v_cache", c.v_cache[:, :-1]), r"v_cache shape \[3, 43, 2, 64\] must equal"),
        ("table_dtype", lambda c: setattr(c, "block_table", torch.zeros(3, 4, dtype=torch.int64)),
         "block_table must be int32, got torch.int64"),
        ("table_shape", lambda c: setattr(c, "block_table", torch.zeros(3, dtype=torch.int32)),
         r"block_table must have shape \[3, max_pages\], got \[3\]"),
    ]


def two_value_errors():
    """(id, shape for make_case, mutate(case), message): two bad values of different kinds in different
    sequences, the kind checked later in the earlier sequence. The values are checked one condition at a
    time over the whole batch (cache_seqlens >= 0, num_causal in range, capacity, page ids), so the message
    is that of the first condition. BASE has L_b = 37, 0, 1, c_b = 4, 0, 2 and 44 slots (paged: 3 pages of
    16, 11 in the pool)."""
    paged = {**BASE, "paged": True}

    def set_values(*changes):
        """mutate(case) that sets getattr(case, name)[index] = value for each (name, index, value)."""
        def mutate(case):
            for name, index, value in changes:
                getattr(case, name)[index] = value
        return mutate

    return [
        ("num_causal_in_0_negative_length_in_1", BASE,
         set_values(("num_causal", 0, BASE["C"] + 1), ("cache_seqlens", 1, -1)), "cache_seqlens must be >= 0"),
        ("capacity_in_0_num_causal_in_2", BASE,
         set_values(("cache_seqlens", 0, 44), ("num_causal", 2, -1)), "num_causal must be in"),
        ("page_id_in_0_capacity_in_2", paged,
         set_values(("block_table", (0, 0), 11), ("cache_seqlens", 2, 48)), "exceeds the cache capacity"),
        ("page_id_in_0_negative_length_in_1", paged,
         set_values(("block_table", (0, 1), -1), ("cache_seqlens", 1, -1)), "cache_seqlens must be >= 0"),
    ]


@pytest.mark.parametrize("impl", ["cpu", "naive"])
@pytest.mark.parametrize("mutate,message", [e[1:] for e in error_cases()], ids=[e[0] for e in error_cases()])
def test_bad_inputs_name_the_argument(impl, mutate, message):
    """Guards against silent out-of-bounds writes or cryptic failures on bad inputs: each must raise a
    RuntimeError naming the argument, before any cache write."""
    case = make_case(**BASE)
    mutate(case)
    before = case.k_cache.clone()
    fn = OP if impl == "cpu" else naive.block_attention_with_kvcache
    with pytest.raises(RuntimeError, match=message):
        fn(*case.args())
    assert torch.equal(case.k_cache.isnan(), before.isnan())


def all_error_cases():
    """(id, shape for make_case, mutate(case)) of every bad-input, aliasing and two-bad-values case."""
    return ([(name, BASE, mutate) for name, mutate, _ in error_cases()]
            + [(name, ALIASING_SHAPE, mutate) for name, mutate, _ in aliasing_cases()]
            + [(name, shape, mutate) for name, shape, mutate, _ in two_value_errors()])


@pytest.mark.parametrize("shape,mutate", [e[1:] for e in all_error_cases()], ids=[e[0] for e in all_error_cases()])
def test_cpu_and_python_checks_say_the_same(shape, mutate):
    """Guards against the C++ checks and the Python checks (oracle, Triton launcher, fake kernel) drifting
    apart: for every bad input both raise the same message, word for word. With two bad values in different
    sequences the C++ kernel checked sequence by sequence and named the first sequence's problem, the
    Python checks condition by condition over the batch."""
    messages = []
    for fn in (OP, naive.block_attention_with_kvcache):
        case = make_case(**shape)
        mutate(case)
        with pytest.raises(RuntimeError) as error:
            fn(*case.args())
        messages.append(str(error.value).splitlines()[0])
    assert messages[0] == messages[1]


@pytest.mark.parametrize("impl", ["cpu", "naive"])
@pytest.mark.parametrize("shape,mutate,message", [e[1:] for e in two_value_errors()],
                         ids=[e[0] for e in two_value_errors()])
def test_two_bad_values_report_the_first_condition(impl, shape, mutate, message):
    """Guards against the value checks' order depending on the backend: with two bad values of different
    kinds in different sequences, each raises the error of the condition checked first (the C++ kernel
    named the kind found in the earlier sequence)."""
    case = make_case(**shape)
    mutate(case)
    fn = OP if impl == "cpu" else naive.block_attention_with_kvcache
    with pytest.raises(RuntimeError, match=message):
        fn(*case.args())


@pytest.mark.parametrize("mutate,message", [e[1:] for e in error_cases() if e[0] not in VALUE_ERRORS],
                         ids=[e[0] for e in error_cases() if e[0] not in VALUE_ERRORS])
def test_fake_kernel_checks(mutate, message):
    """Guards against a fake kernel that lets through what the kernels reject (torch.compile would trace a
    call that fails, or worse, at run time): every metadata check raises under FakeTensorMode too."""
    case = make_case(**BASE)
    mutate(case)
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in case.args()]
        with pytest.raises(RuntimeError, match=message):
            OP(*args)


@pytest.mark.parametrize("impl", ["cpu", "naive"])
@pytest.mark.parametrize("mutate,message", [e[1:] for e in aliasing_cases()], ids=[e[0] for e in aliasing_cases()])
def test_aliased_caches_are_rejected(impl, mutate, message):
    """Guards against silent wrong results from caches that alias: an expanded k_cache made two sequences
    write the same slots, `k_cache is v_cache` let V overwrite K, and k as a view of the slots being
    appended changed the output. Each must raise a RuntimeError naming both arguments."""
    case = make_case(**ALIASING_SHAPE)
    mutate(case)
    fn = OP if impl == "cpu" else naive.block_attention_with_kvcache
    with pytest.raises(RuntimeError, match=message):
        fn(*case.args())


def test_fake_kernel_rejects_self_overlapping_cache():
    """Guards against torch.compile tracing a call with an expanded cache: internal overlap is decided
    from strides alone, so the fake kernel raises too (overlap between two arguments needs data
    pointers, which the real kernel checks when it runs)."""
    case = make_case(**ALIASING_SHAPE)
    case.k_cache = case.k_cache[:1].expand(case.k_cache.shape)
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in case.args()]
        with pytest.raises(RuntimeError, match="k_cache is written in place and must not have elements sharing"):
            OP(*args)


@pytest.mark.parametrize("layout", ["combined_paged", "combined_contiguous", "fused_qkv"])
def test_legal_shared_allocations(layout):
    """Guards against an aliasing check that rejects legal layouts whose byte ranges interleave:
    k_cache / v_cache as the halves of FlashInfer's kv[num_pages, 2, page_size, H, D] (or the contiguous
    kv[B, S_max, 2, H, D]), and q / k / v as head slices of one fused qkv projection output."""
    case = make_case(**{**BASE, "paged": layout == "combined_paged"})
    if layout == "fused_qkv":
        fuse_qkv(case)
    else:
        combine_caches(case)
    assert_matches_oracle(case, OP)


def test_remembered_safe_layouts_do_not_let_aliasing_through():
    """Guards against the Python checks' memory of layouts already found safe (which spares a decode loop
    the exact decision at every step) accepting an aliasing call whose shapes and strides match a safe
    one: the distance between the data pointers is part of what is remembered."""
    case = make_case(**{**BASE, "paged": True})
    combine_caches(case)
    for _ in range(2):  # decided, then remembered
        naive.block_attention_with_kvcache(*case.args())
    case.v_cache = case.k_cache.select(1, 0).unsqueeze(1).expand(case.k_cache.shape)
    with pytest.raises(RuntimeError, match="v_cache is written in place and must not have elements sharing"):
        naive.block_attention_with_kvcache(*case.args())
    case.v_cache = case.k_cache
    with pytest.raises(RuntimeError, match="k_cache is written in place and must not share memory with v_cache"):
        naive.block_attention_with_kvcache(*case.args())


@pytest.mark.parametrize("impl", ["cpu", "naive"])
def test_bad_page_id(impl):
    """Guards against reading or writing a page outside the pool through a corrupt block_table."""
    case = make_case(**{**BASE, "paged": True})
    case.block_table[0, 1] = case.k_cache.shape[0]  # sequence 0 uses its first 3 pages
    fn = OP if impl == "cpu" else naive.block_attention_with_kvcache
    with pytest.raises(RuntimeError, match="block_table holds a page id outside"):
        fn(*case.args())


@pytest.mark.parametrize("impl", ["cpu", "naive"])
@pytest.mark.parametrize("share", list(WRITTEN_PAGE_SHARES))
def test_a_written_page_used_twice_is_refused(impl, share):
    """Guards against a page the call appends to being read by another sequence (or mapped twice by its writer):
    the sequences run in parallel, so the write raced with the read (151 of 300 two-thread calls differed from
    the oracle) instead of failing."""
    case = share_pages(make_case(**SHARED_PAGE_CASE), WRITTEN_PAGE_SHARES[share])
    fn = OP if impl == "cpu" else naive.block_attention_with_kvcache
    with pytest.raises(RuntimeError, match=re.escape("block_table maps a page the call writes (slots [L_b, L_b + "
                                                     "c_b)) to more than one used entry")):
        fn(*case.args())


def test_read_only_pages_may_be_shared():
    """A common prefix: pages that no sequence writes may appear in several rows of the table."""
    assert_matches_oracle(share_pages(make_case(**SHARED_PAGE_CASE), READ_ONLY_PAGE_SHARES), OP)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_opcheck(paged):
    """Guards against a fake kernel, schema aliasing or dispatcher registration out of step with the kernel."""
    case = make_case(B=2, C=2, K=3, L=9, Hq=4, Hkv=2, D=16, dtype=torch.float32, paged=paged, page_size=4)
    torch.library.opcheck(OP, case.args())


def test_decode_step_compiles_fullgraph():
    """Guards against graph breaks (e.g. a missing fake kernel or a host sync) when a decode step that
    uses the op is compiled with fullgraph=True; the compiled step must match eager, caches included."""
    def decode_step(q, k, v, k_cache, v_cache, lengths, causal):
        out, lse = block_attention_with_kvcache(q, k, v, k_cache, v_cache, lengths, causal, 3)
        return out.float().sum(-1) + lse.transpose(1, 2).nan_to_num(neginf=0.0).sum(-1)[..., None], lengths + causal

    compiled = torch.compile(decode_step, fullgraph=True)
    eager_case = make_case(B=2, C=2, K=3, L=9, Hq=4, Hkv=2, D=16, dtype=torch.float32)
    compiled_case = eager_case.with_cache_copies()
    expected = decode_step(*eager_case.args()[:7])
    actual = compiled(*compiled_case.args()[:7])
    assert_close(actual[0], expected[0])
    assert torch.equal(actual[1], expected[1])
    assert torch.equal(compiled_case.k_cache.nan_to_num(7.0), eager_case.k_cache.nan_to_num(7.0))
