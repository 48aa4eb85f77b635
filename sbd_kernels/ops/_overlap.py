"""Memory overlap of strided tensors, decided from sizes, strides and data pointers only.

Two questions, for the argument checks of every Python backend (oracle, Triton launchers, fake kernels);
csrc/cpu/overlap.h answers them the same way, step for step, for the C++ CPU kernels:

- `internal_overlap(t)`: do two different indices of `t` address the same element?
- `views_overlap(a, b)`: do `a` and `b` share any byte of memory?

Neither reads data or synchronises a device. Both are exact for strided views, not conservative on byte
ranges: the two halves `kv[:, 0]`, `kv[:, 1]` of a combined paged KV allocation
`kv[num_pages, 2, page_size, H, D]`, the column slices of a fused qkv output and `big[:, ::2]` next to
`big[:, 1::2]` are disjoint, and are answered so in a few steps.

Method. A view is a set of addresses ``offset + sum_d i_d * stride_d`` (0 <= i_d < size_d). Size-1 dims
are dropped, dims sorted by stride and contiguous neighbours merged (stride_{d+1} == size_d * stride_d),
which keeps the set. Internal overlap: a dim of stride 0 overlaps; otherwise, going up the sorted dims,
dim d adds no collision when its stride exceeds the extent ``sum_{d' < d} (size_{d'} - 1) * stride_{d'}``
of the dims below it (every view made by slicing, stepping, transposing or reshaping a dense tensor
passes this test at every dim); when it does not, the copies of the lower dims shifted by
``m * stride_d`` (1 <= m, m * stride_d <= extent) are intersected with the unshifted ones. Two views
intersect only if their address ranges do; if so, the top dims are peeled off: with equal top strides S,
only the shifts ``m * S`` that bring the lower dims' ranges together are tried (at most two when the lower
dims span less than S: the paged-KV and fused-qkv cases); otherwise the view with the larger top stride is
split into the slices whose range meets the other view. Every step that passes the range test counts
against a budget of `SEARCH_STEPS`; past it the answer is `Overlap.MAYBE` ("may share memory"), which
callers treat as an error for arguments written in place.

Views of different dtypes (or offsets not a whole number of elements apart) are compared in bytes: each
element becomes an extra innermost dim of its byte size with stride 1.

Fake and meta tensors: `internal_overlap` works from their strides; `views_overlap` needs data pointers,
which they do not have, so the checks below skip that question there (the real kernel answers it when it
runs). Symbolic sizes or strides (dynamic shapes under `torch.compile`) skip both questions likewise.
"""
from __future__ import annotations

import enum

import torch
from torch._subclasses.fake_tensor import is_fake

# Steps of the exact search before it answers MAYBE. Ordinary views need 0-2 steps (paged KV halves, qkv
# slices, ::2 columns: 1); all 65536 steps took 0.12 s in Python and 0.3 ms in C++ (tests/test_overlap.py's
# undecidable case), spent only on layouts that as_strided interleaves element by element.
SEARCH_STEPS = 1 << 16


class Overlap(enum.IntEnum):
    """Answer to an overlap question. The values are those of the private ops `sbd::_internal_overlap`
    and `sbd::_views_overlap` (csrc/cpu/overlap.h)."""

    NO = 0
    YES = 1
    MAYBE = 2  # not decided within SEARCH_STEPS steps


Dims = list[tuple[int, int]]  # (size, stride) pairs, size >= 2, stride >= 1, ascending by stride


class _Budget:
    def __init__(self) -> None:
        self.steps = SEARCH_STEPS

    def spend(self) -> bool:
        """Takes one step; False when none is left."""
        if self.steps == 0:
            return False
        self.steps -= 1
        return True


def _normal_dims(sizes, strides, keep_zero_strides: bool) -> Dims:
    """Size-1 dims dropped (stride-0 dims too unless `keep_zero_strides`), sorted by (stride, size),
    contiguous neighbours merged. The set of addresses is unchanged."""
    dims = sorted((int(st), int(n)) for n, st in zip(sizes, strides) if n > 1 and (st != 0 or keep_zero_strides))
    merged: Dims = []
    for stride, size in dims:
        if merged and merged[-1][1] != 0 and stride == merged[-1][0] * merged[-1][1]:
            merged[-1] = (merged[-1][0] * size, merged[-1][1])
        else:
            merged.append((size, stride))
    return merged


def _extent(dims: Dims) -> int:
    """Largest address minus smallest: sum of (size - 1) * stride."""
    return sum((n - 1) * s for n, s in dims)


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


def _intersect(off_a: int, a: Dims, off_b: int, b: Dims, budget: _Budget) -> Overlap:
    """Do the address sets off_a + L(a) and off_b + L(b) intersect?"""
    ext_a, ext_b = _extent(a), _extent(b)
    if off_a + ext_a < off_b or off_b + ext_b < off_a:
        return Overlap.NO
    if not a and not b:
        return Overlap.YES  # two single addresses whose ranges meet: equal
    if not budget.spend():
        return Overlap.MAYBE
    top_a = a[-1][1] if a else 0
    top_b = b[-1][1] if b else 0
    if top_a == top_b:
        # off_a + i S + x == off_b + j S + y  <=>  off_a + x == off_b - m S + y with m = i - j.
        (size_a, step), (size_b, _) = a[-1], b[-1]
        low_a, low_b = a[:-1], b[:-1]
        gap = off_b - off_a
        first = max(-(size_b - 1), _ceil_div(gap - _extent(low_a), step))
        last = min(size_a - 1, (gap + _extent(low_b)) // step)
        candidates = ((off_a, low_a, off_b - m * step, low_b) for m in range(first, last + 1))
    else:
        if top_a < top_b:
            off_a, a, off_b, b, ext_b = off_b, b, off_a, a, ext_a
        size, step = a[-1]
        low = a[:-1]
        first = max(0, _ceil_div(off_b - off_a - _extent(low), step))
        last = min(size - 1, (off_b + ext_b - off_a) // step)
        candidates = ((off_a + i * step, low, off_b, b) for i in range(first, last + 1))
    for args in candidates:
        answer = _intersect(*args, budget)
        if answer != Overlap.NO:
            return answer  # YES, or MAYBE: the budget is spent, every later step would say MAYBE
    return Overlap.NO


def internal_overlap_of(sizes, strides) -> Overlap:
    """`internal_overlap` of a layout given as sizes and strides (in elements, >= 0)."""
    if any(n == 0 for n in sizes):
        return Overlap.NO
    dims = _normal_dims(sizes, strides, keep_zero_strides=True)
    if dims and dims[0][1] == 0:
        return Overlap.YES
    budget = _Budget()
    for d, (size, stride) in enumerate(dims):
        low = dims[:d]
        extent = _extent(low)
        for m in range(1, min(size - 1, extent // stride) + 1):
            answer = _intersect(0, low, m * stride, low, budget)
            if answer != Overlap.NO:
                return answer
    return Overlap.NO


def views_overlap_of(offset_a: int, sizes_a, strides_a, offset_b: int, sizes_b, strides_b) -> Overlap:
    """`views_overlap` of two layouts given as offsets, sizes and strides in one unit (elements or bytes)."""
    if any(n == 0 for n in sizes_a) or any(n == 0 for n in sizes_b):
        return Overlap.NO
    a = _normal_dims(sizes_a, strides_a, keep_zero_strides=False)
    b = _normal_dims(sizes_b, strides_b, keep_zero_strides=False)
    return _intersect(offset_a, a, offset_b, b, _Budget())


def _layout(t: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """(sizes, strides) as ints, or None when any is symbolic (dynamic shapes)."""
    sizes, strides = list(t.shape), list(t.stride())
    if all(isinstance(x, int) for x in sizes + strides):
        return sizes, strides
    return None


def _has_data_pointer(t: torch.Tensor) -> bool:
    return t.device.type != "meta" and not is_fake(t)


def internal_overlap(t: torch.Tensor) -> Overlap:
    """Do two different indices of `t` address the same element? From sizes and strides only (works on
    fake and meta tensors). Raises ValueError for symbolic sizes or strides."""
    layout = _layout(t)
    if layout is None:
        raise ValueError("internal_overlap: sizes and strides must be concrete, not symbolic")
    return internal_overlap_of(*layout)


def views_overlap(a: torch.Tensor, b: torch.Tensor) -> Overlap:
    """Do `a` and `b` share any byte of memory? From data pointers, sizes and strides (never reads data).

    Tensors on different devices share nothing. Raises ValueError for meta or fake tensors (no data
    pointer) and for symbolic sizes or strides.
    """
    if not (_has_data_pointer(a) and _has_data_pointer(b)):
        raise ValueError("views_overlap: meta and fake tensors have no data pointer to compare")
    layout_a, layout_b = _layout(a), _layout(b)
    if layout_a is None or layout_b is None:
        raise ValueError("views_overlap: sizes and strides must be concrete, not symbolic")
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return Overlap.NO
    (sizes_a, strides_a), (sizes_b, strides_b) = layout_a, layout_b
    item_a, item_b = a.element_size(), b.element_size()
    gap = b.data_ptr() - a.data_ptr()  # bytes
    if item_a == item_b and gap % item_a == 0:
        return views_overlap_of(0, sizes_a, strides_a, gap // item_a, sizes_b, strides_b)
    return views_overlap_of(0, [*sizes_a, item_a], [s * item_a for s in strides_a] + [1],
                            gap, [*sizes_b, item_b], [s * item_b for s in strides_b] + [1])


def same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a` and `b` address the same bytes index for index: same data pointer, element size, shape and
    strides (strides of size-1 dims ignored). A kernel that reads b[i] only to write a[i] is then safe."""
    return (a.device == b.device and a.data_ptr() == b.data_ptr() and a.element_size() == b.element_size()
            and a.shape == b.shape
            and all(sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()) if n > 1))


def _strides_text(t: torch.Tensor) -> str:
    return f"sizes {list(t.shape)}, strides {list(t.stride())}"


def check_writable(op: str, name: str, t: torch.Tensor) -> None:
    """RuntimeError naming `name` unless no two elements of `t` (written in place by `op`) share memory.

    Skipped for symbolic sizes or strides (the real kernel checks when it runs).
    """
    layout = _layout(t)
    if layout is None:
        return
    answer = internal_overlap_of(*layout)
    if answer == Overlap.YES:
        raise RuntimeError(f"{op}: {name} is written in place and must not have elements sharing memory "
                           f"(an expanded or overlapping view: {_strides_text(t)})")
    if answer == Overlap.MAYBE:
        raise RuntimeError(f"{op}: {name} is written in place and may have elements sharing memory (could not "
                           f"decide for {_strides_text(t)}); pass a view with non-overlapping strides")


def check_disjoint(op: str, written_name: str, written: torch.Tensor, other_name: str, other: torch.Tensor,
                   identical_ok: bool = False) -> None:
    """RuntimeError naming both arguments if `written` (written in place by `op`) shares memory with
    `other`. `identical_ok`: allow `other` to be the same elements as `written` index for index (for an
    argument read only at the position it is written to).

    Skipped for meta and fake tensors and symbolic sizes or strides (the real kernel checks when it runs).
    """
    if not (_has_data_pointer(written) and _has_data_pointer(other)):
        return
    if _layout(written) is None or _layout(other) is None:
        return
    if identical_ok and same_elements(written, other):
        return
    answer = views_overlap(written, other)
    if answer == Overlap.YES:
        raise RuntimeError(f"{op}: {written_name} is written in place and must not share memory with "
                           f"{other_name}")
    if answer == Overlap.MAYBE:
        raise RuntimeError(f"{op}: {written_name} is written in place and may share memory with {other_name} "
                           f"(could not decide for {written_name} {_strides_text(written)} and {other_name} "
                           f"{_strides_text(other)})")
