"""Test set-up: where the Triton kernels run, and how a run is split into shards.

By default (SBD_TEST_DEVICE unset or "cpu") the Triton kernels run on CPU tensors through Triton's
interpreter: TRITON_INTERPRET=1 is set here, before any Triton kernel module is imported. With
SBD_TEST_DEVICE=cuda they run compiled, on CUDA tensors (TRITON_INTERPRET stays unset, and must not be set),
the CUDA-only tests run, and the oracles still run on the CPU (`sbd_kernels.testing.on_device`). Both
settings collect the same tests.

SBD_TEST_SHARD=i/n keeps the i-th of n shards (0 <= i < n) of the tests dealt by their recorded durations
(tests/durations.json; the tests of one `same_shard` name count as one unit), so that n pytest processes
started side by side run the suite once between them and end close together (`make test` does, one per core,
and `sbd gpu-check`, to compile Triton kernels on several cores). On CUDA the tests run in
`gpu_run_order`: the `cuda_only` ones first, then the kernel test files in turns.
SBD_TEST_PLAN=path writes the node ids about to run there, in order, unless the file exists.
SBD_TEST_DURATIONS=folder writes the seconds of every test run there (`tools/run_tests.py --record-durations`).
"""
import json
import os

from sbd_kernels.testing import (
    DURATIONS_VARIABLE,
    PLAN_VARIABLE,
    SHARD_VARIABLE,
    configure_triton_environment,
    gpu_run_order,
    load_test_durations,
    patch_the_interpreter_once_per_launch,
    select_shard,
)

TRITON_DEVICE = configure_triton_environment(os.environ)
DURATIONS_FILE = os.path.join(os.path.dirname(__file__), "durations.json")
# Taken out of the environment, so that the pytest runs that tests start record nothing.
_RECORD_DURATIONS_IN = os.environ.pop(DURATIONS_VARIABLE, None)
_recorded: dict[str, float] = {}
if os.environ.get("TRITON_INTERPRET") == "1":
    patch_the_interpreter_once_per_launch()

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


def shard_group(item) -> str | None:
    """The name of `@pytest.mark.same_shard(name)`: tests that share an expensive module fixture run in one
    shard (a CMake build of the library took 112-125 s in each of two shards). The group weighs its tests'
    recorded durations, the build's included."""
    marker = item.get_closest_marker("same_shard")
    if marker is None:
        return None
    if len(marker.args) != 1 or not isinstance(marker.args[0], str) or marker.kwargs:
        raise pytest.UsageError(f"{item.nodeid}: same_shard takes one name, the group's, e.g. "
                                f"@pytest.mark.same_shard(\"cmake_build\"); got {marker.args!r} {marker.kwargs!r}")
    return marker.args[0]


def shard_weight():
    """What a test weighs when the tests are dealt to shards: its recorded seconds on the CPU setting, where they
    were recorded; on CUDA, where the Triton tests compile instead of running in the interpreter and the CMake
    tests skip, every test weighs the same."""
    if TRITON_DEVICE != "cpu":
        return lambda item: 1.0
    durations = load_test_durations(DURATIONS_FILE)
    return lambda item: durations.of(item.nodeid)


def pytest_collection_modifyitems(config, items):
    if TRITON_DEVICE == "cuda":
        items[:] = gpu_run_order(items, lambda item: item.path.name,
                                 lambda item: item.get_closest_marker("cuda_only") is not None)
    spec = os.environ.get(SHARD_VARIABLE)
    if spec:
        kept, dropped = select_shard(items, spec, shard_group, shard_weight())
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_runtest_logreport(report):
    """SBD_TEST_DURATIONS: each test's setup, call and teardown seconds, summed per node id."""
    if _RECORD_DURATIONS_IN is not None:
        _recorded[report.nodeid] = _recorded.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    if _RECORD_DURATIONS_IN is not None:
        with open(os.path.join(_RECORD_DURATIONS_IN, f"{os.getpid()}.json"), "w") as handle:
            json.dump(_recorded, handle)


def pytest_collection_finish(session):
    """SBD_TEST_PLAN: the node ids about to run, once every selection is applied (this shard's, then pytest's
    own --deselect, -k and -m, which come after this file's pytest_collection_modifyitems): a test left out
    is not counted as one the run did not reach."""
    plan = os.environ.get(PLAN_VARIABLE)
    if plan:
        try:  # written once: the pytest runs that tests start inherit the variable and must not overwrite it
            with open(plan, "x") as handle:
                handle.writelines(item.nodeid + "\n" for item in session.items)
        except FileExistsError:
            pass


@pytest.fixture(scope="session", autouse=True)
def _triton_device_is_present():
    """SBD_TEST_DEVICE=cuda on a machine where torch sees no GPU stops the run with one line, at the first test
    (collection alone works anywhere)."""
    if TRITON_DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.exit(f"SBD_TEST_DEVICE=cuda, but torch {torch.__version__} sees no CUDA device", returncode=4)


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
