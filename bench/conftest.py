"""Benchmarks time the compiled kernels: the Triton interpreter must be off, and the ops registered. A run
stopped in the middle of a timing still writes the timings it finished."""
import os

if os.environ.get("TRITON_INTERPRET") == "1":
    raise RuntimeError("bench: unset TRITON_INTERPRET; the interpreter would time Python, not kernels")

import pytest

import sbd_kernels  # noqa: F401


@pytest.hookimpl(hookwrapper=True)
def pytest_benchmark_generate_json(config, benchmarks, include_data, machine_info, commit_info):
    """Drops the timings without one finished round before pytest-benchmark writes its JSON. A run stopped
    by SIGINT in the middle of a timing (`sbd gpu-check` stops a stage at its budget) leaves one such entry,
    and the writer would fail on it (min() of no data) and lose every timing taken before it."""
    benchmarks[:] = [bench for bench in benchmarks if bench]
    yield
