"""Memory-overlap answers of sbd_kernels/ops/_overlap.py (Python) and csrc/cpu/overlap.h (C++, through the
private ops sbd::_internal_overlap / sbd::_views_overlap) against a brute-force enumeration of addresses."""
from __future__ import annotations

import random

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import sbd_kernels  # noqa: F401
from sbd_kernels.ops import _overlap
from sbd_kernels.ops._overlap import Overlap


def element_indices(t: torch.Tensor) -> torch.Tensor:
    """Index (in t's dtype, from the start of its storage) of every element of t, laid out like t."""
    storage_len = t.untyped_storage().nbytes() // t.element_size()
    return torch.arange(storage_len).as_strided(t.shape, t.stride(), t.storage_offset())


def brute_internal(t: torch.Tensor) -> Overlap:
    indices = element_indices(t).flatten()
    return Overlap(int(indices.unique().numel() < indices.numel()))


def byte_set(t: torch.Tensor) -> torch.Tensor:
    """Every byte (offset from the storage start) that an element of t covers."""
    item = t.element_size()
    return (element_indices(t).flatten()[:, None] * item + torch.arange(item)).flatten()


def brute_views(a: torch.Tensor, b: torch.Tensor) -> Overlap:
    """a and b views of one storage."""
    return Overlap(int(torch.isin(byte_set(a), byte_set(b)).any()))


def internal_both(t: torch.Tensor) -> tuple[Overlap, Overlap]:
    return _overlap.internal_overlap(t), Overlap(torch.ops.sbd._internal_overlap(t))


def views_both(a: torch.Tensor, b: torch.Tensor) -> tuple[Overlap, Overlap]:
    return _overlap.views_overlap(a, b), Overlap(torch.ops.sbd._views_overlap(a, b))


def random_as_strided(rng: random.Random, buffer: torch.Tensor) -> torch.Tensor:
    """A view of `buffer` with 1-4 dims of size 0-5, strides 0-9 and an offset 0-9 (extent < 160): any layout, also the
    irregular ones that only as_strided makes (stride 0, equal strides, strides smaller than the extent)."""
    ndim = rng.randint(1, 4)
    sizes = [rng.choice([1, 2, 2, 3, 4, 5, 0] if rng.random() < 0.05 else [1, 2, 2, 3, 4, 5]) for _ in range(ndim)]
    strides = [rng.randint(0, 9) for _ in range(ndim)]
    offset = rng.randint(0, 9)
    extent = sum((n - 1) * s for n, s in zip(sizes, strides)) if all(sizes) else 0
    assert offset + extent < buffer.numel()
    return buffer.as_strided(sizes, strides, offset)


def random_sliced(rng: random.Random, base: torch.Tensor) -> torch.Tensor:
    """A view of `base` made the ordinary way: per dim a start, a step and a length, then a permutation,
    sometimes a select; the layouts real callers pass (::2 columns, halves, transposes)."""
    view = base
    for dim in range(base.dim()):
        n = view.shape[dim]
        start = rng.randrange(n)
        step = rng.choice([1, 1, 2, 3])
        length = rng.randint(1, (n - start + step - 1) // step)
        view = view.narrow(dim, start, n - start)[(slice(None),) * dim + (slice(0, length * step, step),)]
    view = view.permute(rng.sample(range(view.dim()), view.dim()))
    if view.dim() > 1 and rng.random() < 0.3:
        view = view.select(rng.randrange(view.dim()), 0)
    return view


def random_base(rng: random.Random) -> torch.Tensor:
    return torch.zeros([rng.randint(1, 6) for _ in range(rng.randint(1, 4))], dtype=torch.int64)


@pytest.mark.parametrize("seed", range(4))
def test_internal_overlap_of_random_as_strided_views_matches_brute_force(seed):
    """Guards against a wrong overlap decision (conservative or unsound) for irregular strides, and the
    Python and C++ implementations disagreeing."""
    rng = random.Random(seed)
    buffer = torch.zeros(160, dtype=torch.int64)
    for _ in range(100):
        view = random_as_strided(rng, buffer)
        expected = brute_internal(view)
        assert internal_both(view) == (expected, expected), (view.shape, view.stride())


@pytest.mark.parametrize("seed", range(2))
def test_internal_overlap_of_sliced_views_is_no(seed):
    """Guards against rejecting an ordinary view (slice, step, transpose, select) as overlapping."""
    rng = random.Random(seed)
    for _ in range(100):
        view = random_sliced(rng, random_base(rng))
        assert internal_both(view) == (Overlap.NO, Overlap.NO), (view.shape, view.stride())


@pytest.mark.parametrize("seed", range(4))
def test_views_overlap_of_random_as_strided_views_matches_brute_force(seed):
    """Guards against two views of one allocation being called disjoint when they share an element (or
    the reverse), for irregular strides; Python and C++ must agree."""
    rng = random.Random(100 + seed)
    buffer = torch.zeros(160, dtype=torch.int64)
    for _ in range(100):
        a, b = random_as_strided(rng, buffer), random_as_strided(rng, buffer)
        expected = brute_views(a, b)
        assert views_both(a, b) == (expected, expected), (a.shape, a.stride(), a.storage_offset(),
                                                          b.shape, b.stride(), b.storage_offset())


@pytest.mark.parametrize("seed", range(2))
def test_views_overlap_of_sliced_views_matches_brute_force(seed):
    """Guards against wrong answers for two ordinary views of one tensor (disjoint halves, interleaved
    columns, a slice against a transpose)."""
    rng = random.Random(200 + seed)
    for _ in range(100):
        base = random_base(rng)
        a, b = random_sliced(rng, base), random_sliced(rng, base)
        expected = brute_views(a, b)
        assert views_both(a, b) == (expected, expected), (a.shape, a.stride(), a.storage_offset(),
                                                          b.shape, b.stride(), b.storage_offset())


DTYPES = [torch.bool, torch.int16, torch.float32, torch.int64]


@pytest.mark.parametrize("seed", range(2))
def test_views_overlap_across_dtypes_matches_brute_force(seed):
    """Guards against comparing element offsets of different dtypes as if they were one unit: a bool view
    and an int64 view of one allocation overlap when their byte ranges do, element by element."""
    rng = random.Random(300 + seed)
    raw = torch.zeros(160 * 8, dtype=torch.uint8)
    for _ in range(100):
        a = random_as_strided(rng, raw.view(rng.choice(DTYPES)))
        b = random_as_strided(rng, raw.view(rng.choice(DTYPES)))
        expected = brute_views(a, b)
        assert views_both(a, b) == (expected, expected), (a.dtype, a.shape, a.stride(), a.storage_offset(),
                                                          b.dtype, b.shape, b.stride(), b.storage_offset())


def paged_kv():
    """FlashInfer's combined paged KV layout kv[num_pages, 2, page_size, H, D]."""
    kv = torch.zeros(7, 2, 16, 4, 8)
    return kv[:, 0], kv[:, 1]


def fused_qkv():
    """Column slices of a fused qkv projection [T, (Hq + 2 Hkv) D], viewed as heads."""
    tokens, hq, hkv, d = 33, 8, 2, 16
    qkv = torch.zeros(tokens, (hq + 2 * hkv) * d)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(tokens, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(tokens, hkv, d)
    return q, k, v


def named_pairs():
    """(id, a, b, expected)"""
    k, v = paged_kv()
    q, qk, qv = fused_qkv()
    big = torch.zeros(20, 30)
    return [
        ("paged kv: k vs v", k, v, Overlap.NO),
        ("paged kv: k vs one page of k", k, k[3], Overlap.YES),
        ("paged kv: k vs one page of v", k, v[3], Overlap.NO),
        ("paged kv: k vs one element of v", k, v[3, 5, 1, 2], Overlap.NO),
        ("fused qkv: q vs k", q, qk, Overlap.NO),
        ("fused qkv: k vs v", qk, qv, Overlap.NO),
        ("fused qkv: q vs v", q, qv, Overlap.NO),
        ("fused qkv: v vs last token of v", qv, qv[-1], Overlap.YES),
        ("::2 vs 1::2 columns", big[:, ::2], big[:, 1::2], Overlap.NO),
        ("::2 vs 2::2 columns", big[:, ::2], big[:, 2::2], Overlap.YES),
        ("::2 rows vs 1::2 rows", big[::2], big[1::2], Overlap.NO),
        ("::2 columns vs ::3 columns", big[:, ::2], big[:, 1::3], Overlap.YES),
        ("tensor vs its transpose", big, big.t(), Overlap.YES),
        ("left half vs right half", big[:, :15], big[:, 15:], Overlap.NO),
        ("float32 vs its bytes 1::4", big, big.view(torch.uint8)[:, 1::4], Overlap.YES),
        ("int64 odd halves vs bool", big.view(torch.int64)[:, 1::2], big.view(torch.bool)[:, :8], Overlap.NO),
    ]


@pytest.mark.parametrize("case", named_pairs(), ids=[c[0] for c in named_pairs()])
def test_views_overlap_of_real_layouts(case):
    """Guards against rejecting legal layouts by byte range (paged KV halves, fused qkv slices, strided
    columns) and against missing a real overlap in them."""
    _, a, b, expected = case
    assert brute_views(a, b) == expected
    assert views_both(a, b) == (expected, expected)
    assert views_both(b, a) == (expected, expected)


def test_views_overlap_of_large_real_layouts_decides_in_few_steps():
    """Guards against the exact decision falling back to enumeration on production-sized layouts (it would
    answer MAYBE past the step budget and reject them)."""
    kv = torch.zeros(1024, 2, 16, 8, 128, dtype=torch.bfloat16)
    qkv = torch.zeros(4096, (32 + 2 * 8) * 128, dtype=torch.bfloat16)
    q = qkv[:, : 32 * 128].view(4096, 32, 128)
    k = qkv[:, 32 * 128: 40 * 128].view(4096, 8, 128)
    big = torch.zeros(4096, 4096)
    for a, b in ((kv[:, 0], kv[:, 1]), (q, k), (big[:, ::2], big[:, 1::2])):
        assert views_both(a, b) == (Overlap.NO, Overlap.NO)
        assert internal_both(a) == (Overlap.NO, Overlap.NO)


def test_views_in_different_allocations_do_not_overlap():
    """Guards against comparing element offsets of two storages as if they were one."""
    a, b = torch.zeros(10), torch.zeros(10)
    assert views_both(a, b) == (Overlap.NO, Overlap.NO)
    assert views_both(a[2:], b[:5]) == (Overlap.NO, Overlap.NO)


def test_empty_views_do_not_overlap():
    """Guards against an empty view (no elements) being reported as overlapping its neighbours."""
    buffer = torch.zeros(10)
    empty = buffer.as_strided((0, 3), (1, 1))
    assert internal_both(empty) == (Overlap.NO, Overlap.NO)
    assert views_both(empty, buffer) == (Overlap.NO, Overlap.NO)


def test_undecidable_layouts_answer_maybe_in_both_languages():
    """Guards against the step budget differing between Python and C++ (the same call would be accepted
    by one backend and rejected by another), and against a search that never ends.

    Every 6th element from 2 against every 3rd from 0: disjoint (2 + 6i is never a multiple of 3), but
    proving it element by element takes 150000 steps, beyond the budget.
    """
    buffer = torch.zeros(10**6)
    a = buffer.as_strided((150000,), (6,), 2)
    b = buffer.as_strided((300000,), (3,), 0)
    assert views_both(a, b) == (Overlap.MAYBE, Overlap.MAYBE)
    small_a = buffer.as_strided((1000,), (6,), 2)
    small_b = buffer.as_strided((2000,), (3,), 0)
    assert views_both(small_a, small_b) == (Overlap.NO, Overlap.NO)


def test_internal_overlap_of_meta_and_fake_tensors_from_strides():
    """Guards against the fake (compile-time) checks missing an expanded or overlapping in-place view."""
    meta = torch.empty(16, device="meta").as_strided((2, 5), (1, 1))
    assert internal_both(meta) == (Overlap.YES, Overlap.YES)
    assert internal_both(torch.empty(4, 4, device="meta")[:, ::2]) == (Overlap.NO, Overlap.NO)
    with FakeTensorMode():
        fake = torch.empty(16).as_strided((2, 5), (2, 1))
        assert _overlap.internal_overlap(fake) == Overlap.YES
        with pytest.raises(RuntimeError, match="x is written in place and must not have elements sharing"):
            _overlap.check_writable("op", "x", fake)
        _overlap.check_disjoint("op", "x", fake, "y", fake)  # storage identity unknown: skipped


def test_views_overlap_refuses_meta_tensors():
    """Guards against two meta tensors (no data pointer) being compared as if they were one allocation."""
    a = torch.empty(4, device="meta")
    with pytest.raises(ValueError, match="meta and fake tensors"):
        _overlap.views_overlap(a, a)
    with pytest.raises(RuntimeError, match="meta tensors have no data pointer"):
        torch.ops.sbd._views_overlap(a, a)


def test_check_messages_name_the_arguments():
    """Guards against an overlap error that does not say which argument is at fault, or what was found."""
    buffer = torch.zeros(16)
    with pytest.raises(RuntimeError, match=r"op: out is written in place and must not have elements sharing "
                                           r"memory \(an expanded or overlapping view: sizes \[2, 5\], "
                                           r"strides \[1, 1\]\)"):
        _overlap.check_writable("op", "out", buffer.as_strided((2, 5), (1, 1)))
    with pytest.raises(RuntimeError, match="op: out is written in place and must not share memory with src"):
        _overlap.check_disjoint("op", "out", buffer[:8], "src", buffer[4:])
    _overlap.check_disjoint("op", "out", buffer[:8], "src", buffer[:8], identical_ok=True)
    large = torch.zeros(10**6)
    with pytest.raises(RuntimeError, match="op: out is written in place and may share memory with src"):
        _overlap.check_disjoint("op", "out", large.as_strided((150000,), (6,), 2), "src",
                                large.as_strided((300000,), (3,), 0))
