"""Test set-up: Triton kernels run on CPU tensors through the interpreter.

TRITON_INTERPRET must be set before any Triton kernel module is imported.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

import sbd_kernels  # noqa: F401


def supported_cpu_isas() -> list[str]:
    """Instruction-set variants of the CPU kernels that this machine can run."""
    names = []
    for name in ("default", "avx2", "avx512"):
        try:
            torch.ops.sbd._set_cpu_isa(name)
            names.append(name)
        except RuntimeError:
            pass
    return names


_BEST_ISA = torch.ops.sbd._cpu_isa()
CPU_ISAS = supported_cpu_isas()
torch.ops.sbd._set_cpu_isa(_BEST_ISA)


@pytest.fixture(params=CPU_ISAS)
def cpu_isa(request):
    """Runs a test once per instruction-set variant of the CPU kernels this machine supports."""
    torch.ops.sbd._set_cpu_isa(request.param)
    yield request.param
    torch.ops.sbd._set_cpu_isa(_BEST_ISA)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Runs a test on one torch thread. Model and decode tests multiply small matrices (1-80 rows x 128):
    on this shared 2-core machine a second OpenMP thread made one forward of the small model ~10x slower
    (measured 65 ms on one thread vs 630 ms on two) by spinning on a busy core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
