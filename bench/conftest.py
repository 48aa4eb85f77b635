"""Benchmarks time the compiled kernels: the Triton interpreter must be off, and the ops registered."""
import os

if os.environ.get("TRITON_INTERPRET") == "1":
    raise RuntimeError("bench: unset TRITON_INTERPRET; the interpreter would time Python, not kernels")

import sbd_kernels  # noqa: F401
