"""`sbd.block_attention_with_kvcache`, Triton backend: the split-KV kernel against the oracle on the shared
cases (tests/attention_cases.py), its split / combine / alignment paths, errors and the AOT spec list.

By default the launcher runs on CPU tensors under TRITON_INTERPRET=1 (set by conftest); with
SBD_TEST_DEVICE=cuda the same tests run the compiled kernels on CUDA tensors, the oracle on CPU copies, and
the CUDA-only tests at the end run too. Bad inputs stay on CPU tensors either way: every error is raised
by the launcher's host-side checks before any launch.
Every temporary the launcher allocates (out, lse, the partial split states) is NaN-filled first, so an
element the kernels fail to write, or a partial state read although its split never ran, fails the test.
"""
import contextlib
from pathlib import Path

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
from test_attention import (
    DIM,
    HEAD,
    HKV,
    NON_FINITE_DTYPES,
    error_cases,
    forward,
    full_recompute,
    make_layers,
    sbd_decode_mask,
    two_value_errors,
)

from sbd_kernels.ops.attention import block_attention_with_kvcache, naive
from sbd_kernels.ops.attention import triton as attention_triton
from sbd_kernels.testing import assert_close, poison_, sparse_strided_copy, triton_test_device

DEVICE = triton_test_device()
ON_GPU = DEVICE == "cuda"
LAUNCH = attention_triton.block_attention_with_kvcache
# Long-cache cases use one KV head and B = 1: the interpreter runs programs one by one (~0.5 ms each).
LONG = {"B": 1, "C": 5, "K": 7, "L": 4099, "Hkv": 1, "D": 64}


@contextlib.contextmanager
def _poisoned_allocations():
    """torch.empty / torch.empty_like return NaN-filled tensors inside the block."""
    empty, empty_like = torch.empty, torch.empty_like
    torch.empty = lambda *a, **kw: poison_(empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: poison_(empty_like(*a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def triton_op(*args):
    """The Triton launcher with every buffer it allocates poisoned first."""
    with _poisoned_allocations():
        return LAUNCH(*args)


def case(**shape):
    return make_case(**shape, device=DEVICE)


def num_splits(c):
    """Into how many splits (1 + cache splits) the launcher cuts the cache of case `c`."""
    _, _, (split, _) = attention_triton._attention_launches(*c.args())
    return split.args["num_splits"]


AXIS_CASES = [(case_id, kw) for case_id, kw in axis_params() if kw["L"] < 1000]


@pytest.mark.parametrize("shape", [kw for _, kw in AXIS_CASES], ids=[i for i, _ in AXIS_CASES])
def test_triton_matches_oracle(shape):
    """Guards against wrong math, row-class masks, GQA packing of the M tile, paging or cache writes, on
    every axis of the shared grid (B, C incl. 0 and K, L 0/1/127, K 0..32, GQA 1/4/8, D 64/128, dtypes,
    page sizes 1/16/48); NaN-poisoned cache slots must stay untouched bit for bit and never leak."""
    assert_matches_oracle(case(**shape), triton_op)


@pytest.mark.parametrize("dtype,paged,hq", [(torch.float32, False, 1), (torch.bfloat16, True, 4)],
                         ids=["fp32", "bf16-paged-gqa4"])
def test_long_cache_is_split_and_combined(dtype, paged, hq):
    """Guards against errors in the split-KV path and its log-sum-exp combine: 4099 cached keys cut into
    several splits (checked), with the last split partial."""
    c = case(**LONG, Hq=hq, dtype=dtype, paged=paged, page_size=32)
    assert num_splits(c) > 3
    assert_matches_oracle(c, triton_op)


@pytest.mark.parametrize("L", [0, 37])
def test_splits_past_the_length_exit_unread(L):
    """Guards against a combine that reads partial states of splits that started past L_b (never written:
    NaN here) or a split that reads cache slots past L_b: a 2048-slot cache holds at most 40 slots."""
    c = case(B=2, C=3, K=4, L=L, Hq=4, Hkv=1, D=64, dtype=torch.float16)
    wide = torch.full((2, 2048, 1, 64), float("nan"), dtype=c.k_cache.dtype, device=DEVICE)
    c.k_cache = wide.clone().index_copy_(1, torch.arange(c.k_cache.shape[1], device=DEVICE), c.k_cache)
    c.v_cache = wide.clone().index_copy_(1, torch.arange(c.v_cache.shape[1], device=DEVICE), c.v_cache)
    assert num_splits(c) > 2
    assert_matches_oracle(c, triton_op)


def test_tiles_pairs_and_splits_of_the_folded_grid():
    """Guards against a wrong decomposition of grid axis 0 into (sequence, KV head) pair and M tile (swapped,
    or off by a tile): 2 x 2 pairs, 3 M tiles of 16 rows (12 rows x G = 4) and 2 cache splits, every
    program's state checked through the oracle (unwritten partial states are NaN)."""
    c = case(B=2, C=5, K=7, L=600, Hq=8, Hkv=2, D=16, dtype=torch.float32)
    _, _, (split, combine) = attention_triton._attention_launches(*c.args())
    assert split.grid == (2 * 2 * 3, 3) and combine.grid == (2 * 2 * 3,)
    assert_matches_oracle(c, triton_op)


# Long prefills: B = 1, S = 131072 query rows, Hq = 64 with Hkv = 8 (65536 M tiles of 16 rows) or 1 (524288).
LONG_PREFILLS = [(hkv, dtype, head_dim) for hkv in (8, 1) for dtype in (torch.float32, torch.bfloat16)
                 for head_dim in (128, 127)]


@pytest.mark.parametrize("hkv,dtype,head_dim", LONG_PREFILLS,
                         ids=[f"hkv{h}-{str(d)[6:]}-D{D}" for h, d, D in LONG_PREFILLS])
def test_launch_grids_of_long_prefills_fit_cuda(hkv, dtype, head_dim):
    """Guards against a launch grid past CUDA's limits (2^31 - 1 programs along axis 0, 65535 along axes 1
    and 2), which fails on the GPU: the M tiles of a long prefill on axis 1 passed 65535 with 16-row tiles
    (fp32, or unaligned rows: D = 127), and so did the combine's. The launches as a GPU call builds them, on
    META tensors (no memory)."""
    for kl in attention_triton.meta_launches(1, 131072 + 1024, 64, hkv, head_dim, 131072 - 16, 16, dtype):
        x, *yz = kl.grid
        assert len(kl.grid) <= 3 and 0 < x <= 2**31 - 1 and all(0 < n <= 65535 for n in yz), kl.grid


def test_more_programs_than_cuda_launches_name_q():
    """Guards against a launch of more programs than CUDA's grid axis 0 takes (2^31 - 1), which fails with a
    launch error instead of naming the argument: 64 pairs x 2^26 combine tiles of 16 rows."""
    with pytest.raises(RuntimeError, match="q \\[B=1, S=1073741824, Hq=64\\] needs 4294967296 programs"):
        attention_triton.meta_launches(1, 1024, 64, 64, 16, 2**30 - 16, 16, torch.bfloat16)


def test_int32_index_limits_name_the_argument():
    """Guards against int32 slot and row indices wrapping at 2^31 (a loop's counter or a tile's indices go one
    tile past the capacity or the rows; the append's slot L + j, for an L clamped to the capacity, passes it
    by up to C): a cache capacity + C or S x G query rows per KV head above MAX_INDEX (2^31 - 2^16) is
    rejected naming k_cache, block_table or q; MAX_INDEX itself launches (META tensors)."""
    limit = attention_triton.MAX_INDEX
    bf16 = torch.bfloat16
    assert len(attention_triton.meta_launches(1, limit - 16, 8, 8, 16, 16, 16, bf16)) == 2
    with pytest.raises(RuntimeError, match=f"k_cache holds {limit - 15} cache slots per sequence and q C = 16 "
                                           "causal rows; the Triton kernels take capacity \\+ C at most "
                                           "2\\^31 - 2\\^16"):
        attention_triton.meta_launches(1, limit - 15, 8, 8, 16, 16, 16, bf16)
    with pytest.raises(RuntimeError, match="block_table \\(32768 pages of 65536 slots\\) holds 2147483648"):
        attention_triton.meta_launches(1, limit + 1, 8, 8, 16, 0, 16, bf16, paged=True, page_size=2**16)
    rows = limit // 8
    assert len(attention_triton.meta_launches(1, 1024, 8, 1, 16, rows - 16, 16, bf16)) == 2
    with pytest.raises(RuntimeError, match=f"q has S x Hq / Hkv = {8 * (rows + 1)} query rows per KV head"):
        attention_triton.meta_launches(1, 1024, 8, 1, 16, rows - 15, 16, bf16)


def _tf32_high_part(x: float) -> float:
    """The high part 3xTF32 takes of fp32 x: PTX cvt.rna.tf32.f32, x rounded to 10 mantissa bits (the low 13
    of 23 cleared), ties away from zero."""
    bits = torch.tensor([x], dtype=torch.float32).view(torch.int32)
    return ((bits + 0x1000) & -0x2000).view(torch.float32).item()


def test_tf32x3_range_is_the_documented_one():
    """Guards against a misstated range of fp32 inputs for which the GPU's 3xTF32 dots (fp32, D <= 128) keep
    fp32 results: the TF32 high part is inf from |x| = 2^128 - 2^116 on (the dots then give inf or NaN where
    fp32 gives finite values) and finite just below; the op's docstring and docs/performance.md state that
    bound, and the launcher picks 3xTF32 exactly where they say."""
    limit = 2.0**128 - 2.0**116
    below = torch.nextafter(torch.tensor(limit), torch.tensor(0.0)).item()
    assert _tf32_high_part(limit) == float("inf") and _tf32_high_part(below) < float("inf")

    def precision(head_dim, dtype, on_gpu):
        return attention_triton._pick_config(head_dim, 64, dtype, False, True, on_gpu).input_precision

    assert precision(128, torch.float32, True) == "tf32x3"
    assert precision(129, torch.float32, True) == precision(128, torch.float32, False) == "ieee"
    docs = (Path(__file__).resolve().parents[1] / "docs" / "performance.md").read_text()
    for text in (block_attention_with_kvcache.__doc__, docs):
        assert f"2^128 - 2^116 = {limit:.7e}".replace("e+", "e") in text.replace("e+", "e")


@pytest.mark.parametrize("D", [256, 80, 33])
@pytest.mark.parametrize("dtype", AXES["dtype"], ids=str)
def test_head_dims(D, dtype):
    """Guards against BLOCK_D masking errors and the unaligned path: D = 256 (largest tile), 80 (padded
    to 128), 33 (odd: rows not 16-byte aligned, so the kernels run without vector hints)."""
    assert_matches_oracle(case(B=2, C=2, K=3, L=20, Hq=4, Hkv=2, D=D, dtype=dtype), triton_op)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_paged_low_precision(dtype, page_size):
    """Guards against paging errors that only show with the 64-row M tiles of fp16/bf16 (fp32 uses 16)."""
    assert_matches_oracle(case(**{**BASE, "dtype": dtype, "paged": True, "page_size": page_size}), triton_op)


@pytest.mark.parametrize("dtype", AXES["dtype"], ids=str)
def test_noncontiguous_inputs(dtype):
    """Guards against a kernel that assumes contiguous q / k / v (strided last dimension here)."""
    assert_matches_oracle(case(**{**BASE, "dtype": dtype, "contiguous": False}), triton_op)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_strided_caches(paged):
    """Guards against a kernel that assumes densely packed caches: each cache here is one slice of a
    larger NaN buffer (other outer strides, k_cache and v_cache differ); the rest must stay NaN."""
    c = case(**{**BASE, "paged": paged})
    assert_rest_untouched = embed_caches_in_nan_buffers(c)
    assert_matches_oracle(c, triton_op)
    assert_rest_untouched()


@pytest.mark.parametrize("layout", INDEX_LAYOUTS)
@pytest.mark.parametrize("name", INDEX_TENSORS)
def test_index_tensor_views(name, layout):
    """Guards against kernels that index cache_seqlens / num_causal / block_table as if contiguous: each
    is here a strided (stride 2), offset or expanded (stride 0) view of a poisoned buffer; ignoring the
    strides wrote K/V into other sequences' slots, read past a one-element allocation, or read the wrong
    pages."""
    c, embedded = index_view_case(name, layout, device=DEVICE)
    assert_matches_oracle(c, triton_op)
    embedded.check_unchanged(name)


@pytest.mark.parametrize("scale", [0.05, 3.0])
def test_softmax_scale(scale):
    """Guards against an ignored softmax_scale (3.0 also sharpens the softmax enough to expose a max taken
    before scaling)."""
    assert_matches_oracle(case(**BASE, softmax_scale=scale), triton_op)


@pytest.mark.parametrize("scale", [1e38, 2.5e38, 3.4028235e38])
def test_softmax_scale_up_to_the_largest_float32(scale):
    """Guards against the scale folded with log2(e) into one factor, which overflows fp32 from 2.36e38 (out
    off by 4 at 2.5e38) although the op accepts every scale that is finite as a float32: 3.4028235e38 rounds
    to FLT_MAX. q and k times 0.01 keep the scores s q . k finite (about 1e35); the softmax is then one-hot."""
    c = case(**BASE, softmax_scale=scale)
    for t in (c.q, c.k, c.k_cache):
        t.mul_(0.01)
    assert_matches_oracle(c, triton_op)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_no_query_head_still_appends_to_the_cache(paged):
    """Guards against skipping the cache append when out is empty: with Hq = 0 the launcher returned before
    any launch, leaving slots [L, L + c) NaN, while the oracle and the C++ kernel append k and v there."""
    assert_matches_oracle(case(**{**BASE, "Hq": 0, "paged": paged}), triton_op)


# A stride typed i32 (below 2^31) whose product with an index of 2 or more passes 2^31 elements.
WIDE_STRIDE = 2**30
# (dimension, stride) of the tensors given a wide stride, by layout; the other tensors stay packed. Head-major
# q, k, v and contiguous caches (heads 2 and up wrap), rows of q, k, v and slots of 8-slot pages (rows 2-3 and
# page offsets 4-7 wrap), a strided head dim of q, k, v (entries 8-15 of D = 16 wrap).
WIDE_LAYOUTS = {
    "heads": {"q": (2, WIDE_STRIDE), "k": (2, WIDE_STRIDE), "v": (2, WIDE_STRIDE),
              "k_cache": (2, WIDE_STRIDE), "v_cache": (2, WIDE_STRIDE)},
    "rows-paged": {"q": (1, WIDE_STRIDE), "k": (1, WIDE_STRIDE), "v": (1, WIDE_STRIDE),
                   "k_cache": (1, WIDE_STRIDE // 2), "v_cache": (1, WIDE_STRIDE // 2)},
    "head-dim": {"q": (3, WIDE_STRIDE // 4), "k": (3, WIDE_STRIDE // 4), "v": (3, WIDE_STRIDE // 4)},
}


@pytest.mark.skipif(ON_GPU, reason="the tensors are views of sparse host file mappings (about 2^32 elements)")
@pytest.mark.parametrize("layout", WIDE_LAYOUTS)
def test_offsets_past_int32(layout, tmp_path):
    """Guards against int32 offset arithmetic: an index times a stride below 2^31 (typed i32) wrapped to
    before the tensor once it passed 2^31 elements, e.g. KV head 31 of a head-major cache [B, 32, 600000,
    128], and the kernels read and wrote other memory. Here q, k, v and the caches have strides of
    2^28-2^30 elements, so heads, rows, page offsets or head-dim entries from 2 (8 for the head dim) on
    start past 2^31 (GQA: Hq = 6, Hkv = 3)."""
    c = make_case(B=2, C=2, K=2, L=5, Hq=6, Hkv=3, D=16, dtype=torch.float32, paged=layout == "rows-paged",
                  page_size=8)
    for name, (dim, stride) in WIDE_LAYOUTS[layout].items():
        setattr(c, name, sparse_strided_copy(getattr(c, name), dim, stride, tmp_path / name))
    assert_matches_oracle(c, triton_op)


def test_padding_rows_and_poisoned_inputs():
    """Guards against padding rows getting values and against reads of rows that must not be read: the
    padding rows of q, k and v are NaN, so any read of them reaches a result (0 * NaN = NaN). Padding
    rows must give out = 0 and lse = -inf, every other output must be finite."""
    c = case(B=3, C=6, K=4, L=50, Hq=4, Hkv=2, D=64, dtype=torch.float32)
    for b, n in enumerate(c.num_causal.tolist()):
        for t in (c.q, c.k, c.v):
            t[b, n:6] = float("nan")
    out, lse = triton_op(*c.args())
    for b, n in enumerate(c.num_causal.tolist()):
        assert torch.equal(out[b, n:6], torch.zeros_like(out[b, n:6]))
        assert torch.equal(lse[b, :, n:6], torch.full_like(lse[b, :, n:6], float("-inf")))
        assert torch.isfinite(out[b, :n]).all() and torch.isfinite(out[b, 6:]).all()
        assert torch.isfinite(lse[b, :, :n]).all() and torch.isfinite(lse[b, :, 6:]).all()


# The interpreter's numpy warns on what these tests feed it on purpose: HUGE * HUGE overflows, inf - inf, the
# max of a tile of NaN scores.
NUMPY_NON_FINITE_WARNINGS = pytest.mark.filterwarnings(
    "ignore:(overflow|invalid value) encountered|All-NaN slice:RuntimeWarning")


@NUMPY_NON_FINITE_WARNINGS
@pytest.mark.parametrize("dtype", NON_FINITE_DTYPES, ids=str)
@pytest.mark.parametrize("where", NON_FINITE)
def test_non_finite_scores(where, dtype):
    """Guards against a NaN or +inf score read as a row without keys: the combine decided `l > 0`, False for
    the NaN l such a score leaves, and wrote out 0, lse -inf where the contract (and the oracle and the C++
    kernel) give NaN. A -inf score must weigh 0, a row of -inf scores have no keys (out 0, lse -inf)."""
    c, nan_rows, empty_rows = non_finite_case(where, dtype, 5, device=DEVICE)
    assert_non_finite_rows(*triton_op(*c.with_cache_copies().args()), nan_rows, empty_rows)
    assert_matches_oracle(c, triton_op)


@NUMPY_NON_FINITE_WARNINGS
@pytest.mark.parametrize("dtype", NON_FINITE_DTYPES, ids=str)
@pytest.mark.parametrize("where", ["nan_q", "nan_cache", "inf_score", "neg_inf_scores"])
def test_non_finite_scores_in_one_split(where, dtype):
    """Guards against a NaN or +inf score lost in the combine of a split cache: slot L - 2 lies in the last
    of several splits only, whose partial l is NaN (its m may be finite or -inf), and the rows must come
    out NaN; -inf scores in every split (l = 0 in each) give no keys."""
    c, nan_rows, empty_rows = non_finite_case(where, dtype, 2100, device=DEVICE)
    assert num_splits(c) > 2
    assert_non_finite_rows(*triton_op(*c.with_cache_copies().args()), nan_rows, empty_rows)
    assert_matches_oracle(c, triton_op)


@NUMPY_NON_FINITE_WARNINGS
def test_scores_overflowing_once_scaled():
    """Guards against scores that overflow only when multiplied by the scale (softmax_scale = 1e38, which the
    op accepts: s q . k is +-inf wherever |q . k| > 3.4) read as rows without keys: rows with a +inf score
    must come out NaN as in the oracle, the others finite."""
    c = case(B=1, C=2, K=2, L=6, Hq=2, Hkv=1, D=8, dtype=torch.float32, softmax_scale=1e38)
    _, lse = triton_op(*c.with_cache_copies().args())
    assert lse.isnan().any() and lse.isfinite().any()
    assert_matches_oracle(c, triton_op)


@NUMPY_NON_FINITE_WARNINGS
@pytest.mark.parametrize("dtype", NON_FINITE_DTYPES, ids=str)
@pytest.mark.parametrize("where", ["nan_q", "nan_causal_k", "inf_score", "neg_inf_scores"])
def test_non_finite_score_of_a_single_key(where, dtype):
    """Guards against a row whose only key scores NaN (L = 0, one causal row, no block) coming out as a row
    without keys: maxnum (GPU, and np.fmax / np.nanmax in the interpreter) drops the NaN, m stays -inf, and
    only l carries the NaN; a lone +inf score must give NaN, a lone -inf score no keys."""
    c, nan_rows, empty_rows = non_finite_case(where, dtype, L=0, C=1, K=0, device=DEVICE)
    assert_non_finite_rows(*triton_op(*c.args()), nan_rows, empty_rows)


@pytest.mark.parametrize("gqa", AXES["gqa"], ids=str)
def test_agrees_with_sdpa(gqa):
    """Guards against the kernel and the oracle sharing a wrong reading of the contract: the kernel must
    equal torch SDPA (enable_gqa) over [cache ; k] with the SBD decode mask written independently."""
    hq, hkv = gqa
    c = case(B=3, C=4, K=5, L=40, Hq=hq, Hkv=hkv, D=64, dtype=torch.float32)
    cache_k, cache_v = c.k_cache.clone().cpu(), c.v_cache.clone().cpu()
    out, _ = triton_op(*c.args())
    for b, (length, causal) in enumerate(zip(c.cache_seqlens.tolist(), c.num_causal.tolist())):
        keys = torch.cat([cache_k[b, :length], c.k[b].cpu()]).transpose(0, 1)  # [Hkv, L + S, D], on the CPU
        values = torch.cat([cache_v[b, :length], c.v[b].cpu()]).transpose(0, 1)
        mask = sbd_decode_mask(length, causal, 4, 5)
        expected = F.scaled_dot_product_attention(c.q[b].cpu().transpose(0, 1), keys, values, attn_mask=mask,
                                                  enable_gqa=True).transpose(0, 1)
        assert_close(out[b, :causal], expected[:causal], name="causal rows")
        assert_close(out[b, 4:], expected[4:], name="block rows")


def test_cached_decode_equals_full_recompute():
    """Guards against any break of docs/algorithm.md §3.10 through the Triton kernel: prefill (K = 0), a first
    block pass with the previous block as causal rows and a later block-only pass must give the block
    outputs of a full recompute over the whole sequence (tiny random 2-layer transformer, RoPE, GQA)."""
    gen = torch.Generator().manual_seed(0)
    layers = make_layers(gen)
    prompt, previous, block = (torch.randn(n, DIM, generator=gen) for n in (11, 4, 4))
    caches = [tuple(torch.full((1, 32, HKV, HEAD), float("nan"), device=DEVICE) for _ in "kv") for _ in layers]
    length = 0

    def sbd_pass(causal_x, block_x):
        nonlocal length
        c, k = causal_x.shape[0], block_x.shape[0]
        lengths = torch.tensor([length], dtype=torch.int32, device=DEVICE)
        causal = torch.tensor([c], dtype=torch.int32, device=DEVICE)

        def attend(i, q, kk, v):  # the model runs on the CPU, the op on DEVICE
            q, kk, v = (t[None].to(DEVICE) for t in (q, kk, v))
            return triton_op(q, kk, v, *caches[i], lengths, causal, k)[0][0].cpu()
        out = forward(layers, torch.cat([causal_x, block_x]), length + torch.arange(c + k), attend)
        length += c
        return out[c:]

    sbd_pass(prompt, prompt[:0])
    cached = sbd_pass(previous, block)
    assert_close(cached, full_recompute(layers, torch.cat([prompt, previous, block]), 15)[15:], atol_scale=5,
                 name="first pass")
    revealed = block.clone()
    revealed[1] = torch.randn(DIM, generator=gen)
    cached = sbd_pass(revealed[:0], revealed)
    assert_close(cached, full_recompute(layers, torch.cat([prompt, previous, revealed]), 15)[15:],
                 atol_scale=5, name="later pass")
    for k_cache, _ in caches:
        assert torch.isfinite(k_cache[0, :15]).all() and torch.isnan(k_cache[0, 15:]).all()


@pytest.mark.parametrize("mutate,message", [e[1:] for e in error_cases()], ids=[e[0] for e in error_cases()])
def test_bad_inputs_name_the_argument(mutate, message):
    """Guards against silent out-of-bounds writes or cryptic failures on bad inputs (capacity overflow,
    Hq % Hkv != 0, wrong dtypes of lengths, device mismatch, ...): a RuntimeError naming the argument."""
    c = make_case(**BASE)
    mutate(c)
    before = c.k_cache.clone()
    with pytest.raises(RuntimeError, match=message):
        LAUNCH(*c.args())
    assert torch.equal(c.k_cache.isnan(), before.isnan())


@pytest.mark.parametrize("shape,mutate,message", [e[1:] for e in two_value_errors()],
                         ids=[e[0] for e in two_value_errors()])
def test_two_bad_values_report_the_first_condition(shape, mutate, message):
    """Guards against the launcher's value checks reporting another error than the C++ kernel's for the same
    call: with two bad values of different kinds in different sequences, the condition checked first."""
    c = make_case(**shape)
    mutate(c)
    with pytest.raises(RuntimeError, match=message):
        LAUNCH(*c.args())


@pytest.mark.parametrize("mutate,message", [e[1:] for e in aliasing_cases()], ids=[e[0] for e in aliasing_cases()])
def test_aliased_caches_are_rejected(mutate, message):
    """Guards against silent corruption from caches that alias themselves, each other or a read argument
    (on a GPU: sequences racing on the same slots): a RuntimeError naming both arguments."""
    c = make_case(**ALIASING_SHAPE)
    mutate(c)
    with pytest.raises(RuntimeError, match=message):
        LAUNCH(*c.args())


@pytest.mark.parametrize("layout", ["combined_paged", "combined_contiguous", "fused_qkv"])
def test_legal_shared_allocations(layout):
    """Guards against an aliasing check that rejects legal layouts whose byte ranges interleave: the
    halves of a combined kv allocation (paged or contiguous) and q / k / v sliced from one fused qkv."""
    c = case(**{**BASE, "paged": layout == "combined_paged"})
    if layout == "fused_qkv":
        fuse_qkv(c)
    else:
        combine_caches(c)
    assert_matches_oracle(c, triton_op)


def test_bad_page_id():
    """Guards against reading or writing a page outside the pool through a corrupt block_table."""
    c = make_case(**{**BASE, "paged": True})
    c.block_table[0, 1] = c.k_cache.shape[0]
    with pytest.raises(RuntimeError, match="block_table holds a page id outside"):
        LAUNCH(*c.args())


@pytest.mark.parametrize("share", list(WRITTEN_PAGE_SHARES))
def test_a_written_page_used_twice_is_refused(share):
    """Guards against a page the call appends to being read by another sequence, or mapped twice by its writer:
    the programs of different sequences run in parallel, so the write raced with the read."""
    c = share_pages(make_case(**SHARED_PAGE_CASE), WRITTEN_PAGE_SHARES[share])
    with pytest.raises(RuntimeError, match="block_table maps a page the call writes"):
        LAUNCH(*c.args())


def test_read_only_pages_may_be_shared():
    assert_matches_oracle(share_pages(make_case(**SHARED_PAGE_CASE), READ_ONLY_PAGE_SHARES), triton_op)


@pytest.mark.cuda_only
@pytest.mark.skipif(not ON_GPU or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_runs_on_the_device_of_its_tensors_not_the_current_one():
    """Guards against the CUDA registration launching on the current device: with the tensors on cuda:1 and
    cuda:0 current (a model spread over two GPUs), Triton launched on cuda:0 and its stream. The op must give
    the oracle's results and leave cuda:0 current."""
    c = make_case(**BASE).to("cuda:1")
    with torch.cuda.device(0):
        assert_matches_oracle(c, torch.ops.sbd.block_attention_with_kvcache)
        assert torch.cuda.current_device() == 0


@pytest.mark.cuda_only
@pytest.mark.skipif(not ON_GPU, reason="the CUDA registration runs on CUDA tensors (no GPU here)")
def test_opcheck_cuda():
    """Guards against the CUDA registration, fake kernel and aliasing of the Triton path being out of step."""
    c = case(B=2, C=2, K=3, L=9, Hq=4, Hkv=2, D=16, dtype=torch.float32, paged=True, page_size=4)
    torch.library.opcheck(torch.ops.sbd.block_attention_with_kvcache, c.args())


@pytest.mark.cuda_only
@pytest.mark.skipif(not ON_GPU, reason="compiles a CUDA decode step (no GPU here)")
def test_decode_step_compiles_fullgraph_cuda():
    """Guards against graph breaks or a host sync in the CUDA path of a compiled decode step."""
    def decode_step(*args):
        out, lse = torch.ops.sbd.block_attention_with_kvcache(*args)
        return out.float() * 2, lse

    c = case(B=2, C=2, K=3, L=9, Hq=4, Hkv=2, D=64, dtype=torch.bfloat16)
    expected_case = c.with_cache_copies().to("cpu")
    out, lse = torch.compile(decode_step, fullgraph=True)(*c.args())
    expected_out, expected_lse = naive.block_attention_with_kvcache(*expected_case.args())
    assert_close(out / 2, expected_out.float(), dtype=torch.bfloat16)
    assert_close(lse, expected_lse, dtype=torch.float32)
