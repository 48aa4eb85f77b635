"""Shared test helpers: the one tolerance table, verbose comparisons, output poisoning.

Used by tests/ and by the benchmarks' correctness gate, so that a speedup is only ever reported for
inputs on which the op matches its oracle under these same tolerances.
"""
from __future__ import annotations

import torch

# (atol, rtol) by the dtype in which a kernel *stores* its result. Kernels compute in fp32 inside, so a
# result stored in fp32 (entropy, log-prob, lse, fp32 outputs) only differs from the fp32 oracle by
# summation order; a result stored in fp16/bf16 adds one rounding of that dtype (eps 2^-10 / 2^-7).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for a result stored in `dtype`."""
    return TOLERANCES[dtype]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                 name: str = "output", atol_scale: float = 1.0) -> None:
    """Assert |actual - expected| <= atol + rtol |expected| elementwise, in fp32, with equal inf/NaN.

    `dtype` picks the tolerance row (default: actual's dtype). `atol_scale` widens atol for results that
    sum many terms (e.g. a 4099-long attention row); it never touches rtol. On failure the message lists
    the worst indices with both values.
    """
    dtype = dtype or actual.dtype
    atol, rtol = TOLERANCES[dtype]
    atol *= atol_scale
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a = actual.detach().to(torch.float32).cpu()
    e = expected.detach().to(torch.float32).cpu()
    same_special = (torch.isnan(a) & torch.isnan(e)) | (torch.isinf(e) & (a == e))
    err = torch.where(same_special, torch.zeros_like(a), (a - e).abs())
    err = torch.nan_to_num(err, nan=float("inf"))
    bound = atol + rtol * torch.nan_to_num(e.abs(), nan=0.0, posinf=0.0)
    bad = err > bound
    if bad.any():
        flat = (err - bound).flatten()
        worst = torch.topk(flat, min(5, int(bad.sum()))).indices
        rows = []
        for i in worst.tolist():
            idx = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), a.shape))
            rows.append(f"  at {idx}: actual {a[idx].item():.7g}, expected {e[idx].item():.7g}")
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {a.numel()} elements differ beyond atol={atol:g}, "
            f"rtol={rtol:g} (dtype {dtype}); worst:\n" + "\n".join(rows)
        )


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill `t` with a value no kernel writes legitimately (NaN, or a sentinel for ints / bools)."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(-7777)


def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` with the same values whose last dimension is strided (stride 2)."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    view = wide[..., ::2]
    view.copy_(t)
    return view


class Embedded:
    """A tensor argument placed inside a larger poisoned allocation, to catch strided-index bugs and
    writes outside the argument.

    layout:
        "contiguous": the tensor itself (a fresh copy), with poisoned slack after it;
        "offset":     a contiguous view starting `offset` elements into the buffer;
        "strided":    every dimension strided by `step` (elements in between are poison);
        "expanded":   stride 0 along dimension 0 (only for tensors whose rows are all equal: the view
                      reads row 0 for every row, like `torch.tensor([5]).expand(B)`).

    `view` is the argument to pass; `buffer` the allocation. `check_outside()` asserts that no element
    of the buffer outside the view changed; `check_unchanged()` that nothing in the buffer changed
    (for read-only arguments).
    """

    def __init__(self, t: torch.Tensor, layout: str = "strided", step: int = 2, offset: int = 3):
        if layout not in ("contiguous", "offset", "strided", "expanded"):
            raise ValueError(f"Embedded: unknown layout {layout!r}")
        shape = tuple(t.shape)
        if layout == "expanded":
            if t.dim() == 0 or not bool((t == t[:1]).all()):
                raise ValueError("Embedded: an expanded view needs a tensor whose rows are all equal")
            inner = _contiguous_strides(shape[1:])
            strides = (0, *inner)
            numel = max(1, t[0].numel())
            start = offset
        else:
            step = step if layout == "strided" else 1
            strides = tuple(s * step for s in _contiguous_strides(shape))
            start = offset if layout in ("offset", "strided") else 0
            numel = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if t.numel() else 0
        self.buffer = poison_(torch.empty(start + numel + offset, dtype=t.dtype, device=t.device))
        self.view = self.buffer.as_strided(shape, strides, start)
        if t.numel():
            source = t[:1] if layout == "expanded" else t
            self.buffer.as_strided(source.shape, _contiguous_strides(tuple(source.shape)) if layout == "expanded"
                                   else strides, start).copy_(source)
        self._covered = torch.zeros(self.buffer.numel(), dtype=torch.bool, device=t.device)
        if t.numel():
            self._covered.as_strided(shape, strides, start).fill_(True)
        self._snapshot = self.buffer.clone()

    def check_outside(self, name: str = "argument") -> None:
        """No element of the buffer outside the view changed (in-place arguments)."""
        _assert_same(self.buffer[~self._covered], self._snapshot[~self._covered], f"{name} (outside the view)")

    def check_unchanged(self, name: str = "argument") -> None:
        """No element of the buffer changed (read-only arguments)."""
        _assert_same(self.buffer, self._snapshot, name)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for n in reversed(shape):
        strides.append(running)
        running *= max(n, 1)
    return tuple(reversed(strides))


def _assert_same(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Bitwise equality, NaN == NaN (the poison is NaN for float buffers)."""
    if actual.is_floating_point():
        same = (actual == expected) | (torch.isnan(actual) & torch.isnan(expected))
    else:
        same = actual == expected
    if not bool(same.all()):
        bad = (~same).nonzero().flatten()[:5].tolist()
        raise AssertionError(f"{name}: {int((~same).sum())} elements were written, first at {bad}")
