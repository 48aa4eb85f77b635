"""`trusted_values()`: skip the per-call value checks of the Python backends for values the caller validated.

The Triton launchers check the values of their index and control tensors (lengths, num_causal and page ids of
attention; temperature and filter entries of sampling; gamma of scatter) with `torch._assert_async`: no host
sync, but a few small kernels per call (lengths .to(int64), comparisons, .all(), the assert), i.e. per layer
and per pass of a decode. A decode loop that builds these tensors itself, or validated its settings once,
gains nothing from them. Inside `trusted_values()` the `assert_*_values` checks of `ops/<family>/_checks.py`
return at once, in the Triton launchers and in the oracles alike. The kernels stay memory-safe without them:
attention clamps L, c and page ids before any load or store; in sampling and scatter the checked values only
enter comparisons, never an address. A bad value then gives a wrong result instead of an error, never a write
out of bounds. The C++ CPU kernels check values on the host whatever this flag says (no device round trip).

The flag is per thread (a serving thread that validated its batch does not switch off the checks of another
thread) and nests. It is read when a launcher runs, so it holds for ops called eagerly, from a
`torch.compile`d graph, or captured into a CUDA graph (the checks are then not captured either).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_STATE = threading.local()


@contextlib.contextmanager
def trusted_values() -> Iterator[None]:
    """Inside the block, the Python backends of the `sbd` ops skip their value checks (this thread only).

    >>> from sbd_kernels.ops import trusted_values
    >>> from sbd_kernels.ops._trusted import values_trusted
    >>> with trusted_values():
    ...     values_trusted()
    True
    >>> values_trusted()
    False
    """
    depth = getattr(_STATE, "depth", 0)
    _STATE.depth = depth + 1
    try:
        yield
    finally:
        _STATE.depth = depth


def values_trusted() -> bool:
    """Whether this thread is inside `trusted_values()`."""
    return getattr(_STATE, "depth", 0) > 0
