"""Test cases of `sbd.block_attention_with_kvcache`, shared by the CPU and Triton test files.

`make_case` builds one call with ragged lengths: sequence b has L_b cache slots filled and c_b causal rows,
every other cache slot (beyond L_b, spare pages) is NaN, so a kernel that reads or writes the wrong slot
fails. `assert_matches_oracle` runs an implementation and the oracle on copies of the same caches (the
oracle always on the CPU).
The shape grid (`BASE`, `AXES`) varies one axis at a time around a small base case.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sbd_kernels.ops.attention import naive
from sbd_kernels.testing import Embedded, assert_close, noncontiguous

# Base case and the values of each axis (one axis varied at a time). "C": "K" means C = block_size.
BASE = {"B": 3, "C": 4, "K": 4, "L": 37, "Hq": 8, "Hkv": 2, "D": 64, "dtype": torch.float32, "paged": False,
        "page_size": 16}
AXES = {
    "B": [1, 3],
    "C": [0, 1, "K"],
    "L": [0, 1, 127, 4099],
    "K": [0, 1, 4, 16, 32],
    "gqa": [(4, 4), (8, 2), (8, 1)],  # (Hq, Hkv): ratios 1, 4, 8
    "D": [64, 128],
    "dtype": [torch.float32, torch.float16, torch.bfloat16],
    "paged": [(True, 1), (True, 16), (True, 48)],  # (paged, page_size)
}
SLACK_SLOTS = 3  # NaN-poisoned slots past the largest L_b + c_b, to catch writes past the end


def axis_params() -> list[tuple[str, dict]]:
    """(id, shape kwargs for make_case) for every value of every axis in AXES, around BASE."""
    params = []
    for axis, values in AXES.items():
        for value in values:
            kw = dict(BASE)
            if axis == "gqa":
                kw["Hq"], kw["Hkv"] = value
            elif axis == "paged":
                kw["paged"], kw["page_size"] = value
            elif axis == "C" and value == "K":
                kw["C"] = kw["K"]
            else:
                kw[axis] = value
            label = str(value).replace("torch.", "").replace(" ", "")
            params.append((f"{axis}={label}", kw))
    return params


@dataclass
class AttentionCase:
    """Arguments of one call (the caches are modified in place by the op)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor
    num_causal: torch.Tensor
    block_size: int
    block_table: torch.Tensor | None = None
    softmax_scale: float | None = None

    def args(self) -> tuple:
        return (self.q, self.k, self.v, self.k_cache, self.v_cache, self.cache_seqlens, self.num_causal,
                self.block_size, self.block_table, self.softmax_scale)

    def with_cache_copies(self) -> AttentionCase:
        """The same call on fresh copies of the caches (for running two implementations side by side)."""
        return dataclasses.replace(self, k_cache=self.k_cache.clone(), v_cache=self.v_cache.clone())

    def to(self, device: str) -> AttentionCase:
        """The same call with every tensor on `device` (tensors already there are kept, not copied)."""
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device)
        return AttentionCase(**moved)


def ragged_lengths(B: int, C: int, L: int) -> tuple[list[int], list[int]]:
    """L_b and c_b per sequence: sequence 0 has the full L and C; the others are shorter or empty."""
    lengths = [L - (37 * b) % (L + 1) for b in range(B)]
    causal = [(C, 0, (C + 1) // 2)[b % 3] for b in range(B)]
    return lengths, causal


def _fill_cache(cache: torch.Tensor, lengths: list[int], page_size: int, table: torch.Tensor | None):
    """NaN everywhere, then random values in slots [0, L_b) of every sequence."""
    cache.fill_(float("nan"))
    for b, length in enumerate(lengths):
        for start in range(0, length, page_size):
            n = min(page_size, length - start)
            page = b if table is None else int(table[b, start // page_size])
            offset = start if table is None else 0
            cache[page, offset:offset + n] = torch.randn(n, *cache.shape[2:]).to(cache.dtype)


def make_case(B: int, C: int, K: int, L: int, Hq: int, Hkv: int, D: int, dtype: torch.dtype,
              paged: bool = False, page_size: int = 16, contiguous: bool = True,
              softmax_scale: float | None = None, device: str = "cpu") -> AttentionCase:
    """One call with ragged L_b <= L and c_b <= C; caches NaN outside the filled slots.

    Contiguous cache: [B, max(L_b + c_b) + SLACK_SLOTS, Hkv, D]. Paged: each sequence gets enough pages for
    the same capacity, shuffled over a pool with 2 spare pages. `contiguous=False` gives q, k, v a strided
    last dimension.
    """
    S = C + K
    lengths, causal = ragged_lengths(B, C, L)
    capacity = max(l + c for l, c in zip(lengths, causal)) + SLACK_SLOTS
    q = torch.randn(B, S, Hq, D).to(dtype)
    k = torch.randn(B, S, Hkv, D).to(dtype)
    v = torch.randn(B, S, Hkv, D).to(dtype)
    if paged:
        pages_per_seq = -(-capacity // page_size)
        num_pages = B * pages_per_seq + 2
        table = torch.randperm(num_pages)[: B * pages_per_seq].view(B, pages_per_seq).to(torch.int32)
        cache_shape, fill_page = (num_pages, page_size, Hkv, D), page_size
    else:
        table = None
        cache_shape, fill_page = (B, capacity, Hkv, D), capacity
    k_cache = torch.empty(cache_shape, dtype=dtype)
    v_cache = torch.empty(cache_shape, dtype=dtype)
    _fill_cache(k_cache, lengths, fill_page, table)
    _fill_cache(v_cache, lengths, fill_page, table)
    if not contiguous:
        q, k, v = noncontiguous(q), noncontiguous(k), noncontiguous(v)
    case = AttentionCase(q, k, v, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32),
                         torch.tensor(causal, dtype=torch.int32), K, table, softmax_scale)
    return case if device == "cpu" else case.to(device)


# Where `non_finite_case` puts its non-finite value (see there).
NON_FINITE = ("nan_q", "nan_causal_k", "nan_block_k", "nan_cache", "inf_score", "neg_inf_score", "neg_inf_scores")
# A finite input (fp32 and bf16) whose square overflows fp32 (1e40 > 3.4e38): the score of a query HUGE e_0
# is +-inf for a key whose k_0 is +-HUGE, and finite (about 1e20 k_0 s) for every other key.
HUGE = 1e20


def non_finite_case(where: str, dtype: torch.dtype, L: int, C: int = 3, K: int = 2,
                    device: str = "cpu") -> tuple[AttentionCase, torch.Tensor, torch.Tensor]:
    """One sequence (B = 1, L cache slots, C causal rows all live, K block rows, Hq = 2 heads of one KV head,
    D = 64) with one non-finite score source, and the [S, Hq] bool of the rows whose out and lse must be NaN
    and of the rows that must have no keys (out 0, lse -inf); every other row must be finite.

    Row r = C // 2, head 0 is the probed row; its probe key is cache slot L // 2 when L >= 2 (with L = 300 or
    2100, inside a C++ key tile's vectorised part, and in one split only), else its own causal key r.
    - nan_q: a NaN in q of row r, head 0: that row.
    - nan_causal_k: a NaN in k of causal row r: causal rows r.. and the block rows, both heads.
    - nan_block_k: a NaN in k of the last block row: the block rows.
    - nan_cache: a NaN in cache slot L - 2 (in the last key tile and the last split): every row.
    Scores (q[..., 0] = 0 except in row r, head 0, whose q is HUGE e_0, so that only its scores see k[..., 0]):
    - inf_score: k_0 = HUGE at the probe key: one +inf score in that row, the others finite: NaN.
    - neg_inf_score: k_0 = -HUGE at the probe key: one -inf score, weight 0: the row stays finite.
    - neg_inf_scores: k_0 = -HUGE at every key: that row has no keys.
    """
    S, r = C + K, C // 2
    case = make_case(B=1, C=C, K=K, L=L, Hq=2, Hkv=1, D=64, dtype=dtype)
    nan_rows = torch.zeros(S, 2, dtype=torch.bool)
    empty_rows = torch.zeros(S, 2, dtype=torch.bool)
    probe = case.k_cache[0, L // 2, 0] if L >= 2 else case.k[0, r, 0]
    if where == "nan_q":
        case.q[0, r, 0, 3] = float("nan")
        nan_rows[r, 0] = True
    elif where == "nan_causal_k":
        case.k[0, r, 0, 3] = float("nan")
        nan_rows[r:] = True
    elif where == "nan_block_k":
        case.k[0, S - 1, 0, 3] = float("nan")
        nan_rows[C:] = True
    elif where == "nan_cache":
        case.k_cache[0, L - 2, 0, 3] = float("nan")
        nan_rows[:] = True
    else:
        case.q[..., 0] = 0.0
        case.q[0, r, 0] = 0.0
        case.q[0, r, 0, 0] = HUGE
        if where == "inf_score":
            probe[0] = HUGE
            nan_rows[r, 0] = True
        elif where == "neg_inf_score":
            probe[0] = -HUGE
        elif where == "neg_inf_scores":
            case.k[0, :, 0, 0] = -HUGE
            case.k_cache[0, :L, 0, 0] = -HUGE
            empty_rows[r, 0] = True
        else:
            raise ValueError(f"unknown place {where!r}")
    return (case if device == "cpu" else case.to(device)), nan_rows, empty_rows


def assert_non_finite_rows(out: torch.Tensor, lse: torch.Tensor, nan_rows: torch.Tensor,
                           empty_rows: torch.Tensor) -> None:
    """out [1, S, Hq, D] and lse [1, Hq, S] of a `non_finite_case` call: out and lse NaN in `nan_rows`, out 0 and
    lse -inf in `empty_rows`, finite elsewhere. On failure lists every row as N (NaN), 0 (no keys), f (finite)
    or ? (anything else), against the expected table."""
    out, lse = out[0].float().cpu(), lse[0].t().cpu()  # [S, Hq, D], [S, Hq]
    is_nan = out.isnan().all(-1) & lse.isnan()
    is_empty = (out == 0).all(-1) & (lse == float("-inf"))
    is_finite = out.isfinite().all(-1) & lse.isfinite()
    expected = torch.where(nan_rows, 0, torch.where(empty_rows, 1, 2))
    got = torch.where(is_nan, 0, torch.where(is_empty, 1, torch.where(is_finite, 2, 3)))
    if not torch.equal(got, expected):
        table = ["".join("N0f?"[x] for x in row) for row in got.tolist()]
        wanted = ["".join("N0f?"[x] for x in row) for row in expected.tolist()]
        raise AssertionError(f"rows (query row: heads) {table}, expected {wanted}")


def embed_caches_in_nan_buffers(case: AttentionCase) -> Callable[[], None]:
    """Replaces the case's caches by slices of larger NaN buffers (k_cache: one layer of three; v_cache:
    every other KV head), so outer strides differ from the sizes and between k_cache and v_cache. Returns a
    check that everything outside the slices is still NaN."""
    device = case.k_cache.device
    stacked_k = torch.full((3, *case.k_cache.shape), float("nan"), device=device)
    stacked_v = torch.full((*case.v_cache.shape[:2], 2 * case.v_cache.shape[2], case.v_cache.shape[3]),
                           float("nan"), device=device)
    stacked_k[1] = case.k_cache
    stacked_v[:, :, 1::2] = case.v_cache
    case.k_cache, case.v_cache = stacked_k[1], stacked_v[:, :, 1::2]

    def assert_rest_untouched() -> None:
        assert torch.isnan(stacked_k[0]).all() and torch.isnan(stacked_k[2]).all()
        assert torch.isnan(stacked_v[:, :, 0::2]).all()

    return assert_rest_untouched


INDEX_TENSORS = ("cache_seqlens", "num_causal", "block_table")
INDEX_LAYOUTS = ("strided", "offset", "expanded")


def index_view_case(name: str, layout: str, device: str = "cpu") -> tuple[AttentionCase, Embedded]:
    """A small ragged call (B = 4, C = 3, K = 2, Hq = 2, Hkv = 1, D = 8) whose index tensor `name` is a
    view into a larger poisoned buffer (testing.Embedded): "strided" (stride 2 in every dimension, like a
    column of a [B, 2] state tensor or `table[:, ::2]`), "offset" (3 elements in), or "expanded" (stride 0
    along the batch, like `torch.tensor([5]).expand(B)`). For "expanded" the rows are made equal: lengths
    all min(L_b), num_causal all 2, and a shared page table (row 0) with num_causal all 0, so that no two
    sequences write the same slot. Returns the case and the Embedded (to check it was not written).
    """
    case = make_case(B=4, C=3, K=2, L=20, Hq=2, Hkv=1, D=8, dtype=torch.float32,
                     paged=name == "block_table", page_size=4, device=device)
    if layout == "expanded":
        if name == "cache_seqlens":
            case.cache_seqlens.fill_(int(case.cache_seqlens.min()))
        elif name == "num_causal":
            case.num_causal.fill_(2)
        else:
            case.block_table[:] = case.block_table[0].clone()
            case.num_causal.zero_()
    embedded = Embedded(getattr(case, name), layout)
    setattr(case, name, embedded.view)
    return case, embedded


# Paged case whose pages the shared-page tests remap: page size 4, L_b = 20, 4, 9 and c_b = 4, 0, 2, so sequence 0
# uses pages 0-5 and writes page 5, sequence 1 reads page 0, sequence 2 uses pages 0-2 and writes page 2.
SHARED_PAGE_CASE = {"B": 3, "C": 4, "K": 2, "L": 20, "Hq": 4, "Hkv": 2, "D": 16, "dtype": torch.float32,
                    "paged": True, "page_size": 4}
# (reader, its table entry) <- (owner, its table entry) remappings of SHARED_PAGE_CASE's table.
WRITTEN_PAGE_SHARES = {
    "read by another sequence": [((1, 0), (0, 5))],
    "mapped twice by its writer": [((2, 0), (2, 2))],
}
READ_ONLY_PAGE_SHARES = [((1, 0), (0, 0)), ((2, 0), (0, 0))]


def share_pages(case: AttentionCase, shares: list[tuple[tuple[int, int], tuple[int, int]]]) -> AttentionCase:
    """Points table entries at other entries' pages (a common prefix); the readers' slots then hold the owner's."""
    for (b, p), (owner, q) in shares:
        case.block_table[b, p] = case.block_table[owner, q]
    return case


def combine_caches(case: AttentionCase) -> None:
    """Replaces the case's caches by the two halves of one allocation, as FlashInfer lays out a paged
    cache: `kv[num_pages, 2, page_size, Hkv, D]` with k_cache = kv[:, 0], v_cache = kv[:, 1]; a contiguous
    cache as `kv[B, S_max, 2, Hkv, D]` with k_cache = kv[:, :, 0], v_cache = kv[:, :, 1]."""
    dim = 1 if case.block_table is not None else 2
    kv = torch.stack([case.k_cache, case.v_cache], dim=dim)
    case.k_cache, case.v_cache = kv.select(dim, 0), kv.select(dim, 1)


def fuse_qkv(case: AttentionCase) -> None:
    """Replaces q, k, v by head slices of one fused projection output [B, S, Hq + 2 Hkv, D]."""
    hq, hkv = case.q.shape[2], case.k.shape[2]
    qkv = torch.cat([case.q, case.k, case.v], dim=2)
    case.q, case.k, case.v = qkv[:, :, :hq], qkv[:, :, hq:hq + hkv], qkv[:, :, hq + hkv:]


def aliasing_cases() -> list[tuple[str, Callable[[AttentionCase], None], str]]:
    """(id, mutate(case), message) for caches that alias themselves, each other or a read argument, on
    `make_case(**ALIASING_SHAPE)` (contiguous cache of 10 slots, S = 4, L_0 = 5)."""
    def expanded_k_cache(c):
        c.k_cache = c.k_cache[:1].expand(c.k_cache.shape)

    def shifted_halves(c):  # v_cache starts one slot after k_cache in the same buffer
        kv = torch.zeros(c.k_cache.shape[0], c.k_cache.shape[1] + 1, *c.k_cache.shape[2:])
        c.k_cache, c.v_cache = kv[:, :-1], kv[:, 1:]

    def k_in_appended_slots(c):
        c.k = c.k_cache[:, 5:9]

    def q_shares_k_cache(c):  # q [B, S, 2, D] and k_cache [B, 10, 1, D] in one [B, 10, 2, D] buffer
        buffer = torch.zeros(c.k_cache.shape[0], c.k_cache.shape[1], 2, c.k_cache.shape[3])
        c.q, c.k_cache = buffer[:, :4], buffer[:, :, :1]

    def lengths_in_v_cache(c):
        c.cache_seqlens = c.v_cache.view(torch.int32)[:, 0, 0, 0]
        c.cache_seqlens.copy_(torch.tensor([5, 4], dtype=torch.int32))

    written = "is written in place and must not"
    return [
        ("expanded_k_cache", expanded_k_cache, f"k_cache {written} have elements sharing memory"),
        ("v_cache_is_k_cache", lambda c: setattr(c, "v_cache", c.k_cache), f"k_cache {written} share memory with v_cache"),
        ("shifted_halves", shifted_halves, f"k_cache {written} share memory with v_cache"),
        ("k_in_appended_slots", k_in_appended_slots, f"k_cache {written} share memory with k$"),
        ("v_in_v_cache", lambda c: setattr(c, "v", c.v_cache[:, :4]), f"v_cache {written} share memory with v$"),
        ("q_shares_k_cache", q_shares_k_cache, f"k_cache {written} share memory with q$"),
        ("lengths_in_v_cache", lengths_in_v_cache, f"v_cache {written} share memory with cache_seqlens"),
    ]


ALIASING_SHAPE = {"B": 2, "C": 2, "K": 2, "L": 5, "Hq": 2, "Hkv": 1, "D": 8, "dtype": torch.float32}


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Equal bit patterns (NaN poison included): cache writes are copies, never arithmetic."""
    int_dtype = {4: torch.int32, 2: torch.int16}[actual.element_size()]
    a, e = actual.cpu().view(int_dtype), expected.cpu().view(int_dtype)
    if not torch.equal(a, e):
        diff = (a != e).nonzero()
        raise AssertionError(f"{name}: {diff.shape[0]} elements differ, first at {diff[:5].tolist()}")


def assert_matches_oracle(case: AttentionCase, fn: Callable, atol_scale: float = 1.0) -> None:
    """Run `fn` (an implementation of the op) and the oracle on copies of the same caches, the oracle on the
    CPU whatever the case's device; compare out and lse under the tolerance table and the caches bit for bit."""
    expected_case = case.with_cache_copies().to("cpu")
    out, lse = fn(*case.args())
    expected_out, expected_lse = naive.block_attention_with_kvcache(*expected_case.args())
    assert out.dtype == case.q.dtype and lse.dtype == torch.float32
    assert_close(out, expected_out, name="out", atol_scale=atol_scale)
    assert_close(lse, expected_lse, dtype=torch.float32, name="lse", atol_scale=atol_scale)
    assert_bitwise_equal(case.k_cache, expected_case.k_cache, "k_cache")
    assert_bitwise_equal(case.v_cache, expected_case.v_cache, "v_cache")
