"""Shared test helpers: the one tolerance table, verbose comparisons, output poisoning, and where the Triton
kernels are tested.

Used by tests/ and by the benchmarks' correctness gate, so that a speedup is only ever reported for
inputs on which the op matches its oracle under these same tolerances.

The Triton kernels are tested on CPU tensors under Triton's interpreter by default, or compiled on CUDA
tensors with SBD_TEST_DEVICE=cuda (`configure_triton_environment`, run by tests/conftest.py). Tests build
their inputs on the CPU, where the oracles run; `on_device` runs a launcher on device copies of them.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, MutableMapping
from typing import Any

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


# Elements of a `sparse_strided_copy` mapping below the tensor it holds: an offset wrapped in int32 arithmetic
# (index * stride - 2^32 >= -2^31) still lands inside the mapping, so a kernel reads or writes wrong elements
# rather than unmapped memory.
WRAP_GUARD = 2**31


def sparse_strided_copy(t: torch.Tensor, dim: int, stride: int, path: str | os.PathLike) -> torch.Tensor:
    """A copy of CPU tensor `t` whose dimension `dim` has `stride` elements, the others packed below it (their
    extent must stay under `stride`), WRAP_GUARD elements into a sparse file mapping at `path`: the mapping
    spans gigabytes, but only the pages its elements touch take memory. For offsets past 2^31 elements on
    the interpreter, which wraps int32 products as a GPU does. The file is unlinked at once (the mapping
    stays until the tensor goes)."""
    strides, packed = [0] * t.dim(), 1
    for d in reversed([d for d in range(t.dim()) if d != dim]):
        strides[d], packed = packed, packed * t.shape[d]
    if t.shape[dim] > 1 and packed > stride:  # the slices would overlap and the copy keep only the last one
        raise ValueError(f"sparse_strided_copy: dimension {dim} of t {list(t.shape)} needs a stride of at least "
                         f"{packed} elements (the other dimensions packed), got {stride}")
    strides[dim] = stride
    size = WRAP_GUARD + 1 + sum((n - 1) * s for n, s in zip(t.shape, strides))
    with open(path, "wb") as f:
        f.truncate(size * t.element_size())
    storage = torch.from_file(str(path), shared=True, size=size, dtype=t.dtype)
    os.unlink(path)
    return storage.as_strided(t.shape, strides, WRAP_GUARD).copy_(t)


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


# ----------------------------------------------------------------------------------------------------
# Where the Triton kernels are tested
# ----------------------------------------------------------------------------------------------------
TEST_DEVICE_VARIABLE = "SBD_TEST_DEVICE"
TEST_DEVICES = ("cpu", "cuda")


def triton_test_device(environ: MutableMapping[str, str] | None = None) -> str:
    """Device of the tensors the Triton kernels are tested on: "cpu" (SBD_TEST_DEVICE unset, empty or "cpu":
    the interpreter) or "cuda" (SBD_TEST_DEVICE=cuda: the compiled kernels). `environ` defaults to
    os.environ. Raises ValueError for another value."""
    environ = os.environ if environ is None else environ
    device = environ.get(TEST_DEVICE_VARIABLE, "") or "cpu"
    if device not in TEST_DEVICES:
        raise ValueError(f"{TEST_DEVICE_VARIABLE} must be one of {', '.join(TEST_DEVICES)}, got {device!r}")
    return device


# How a CUDA-graph test replays the decode steps: captured from CUDA graphs (on a GPU), or rehearsed.
CUDA_GRAPH_MODES = ("cuda", "check")


def rehearse_cuda_graphs(monkeypatch: Any, mode: str) -> None:
    """Mode "check" (any device): a `cuda_graph=True` decode (`generate`, and `hf.generate` through it) runs its
    steps eagerly under the static-buffer checks of `graphs.graphed_steps(..., "check")` instead of refusing a
    CPU model, so that a CUDA-graph test's own code, its models' refusals and its token checks run where no GPU
    is; the capture alone needs one. Mode "cuda" changes nothing."""
    if mode not in CUDA_GRAPH_MODES:
        raise ValueError(f"rehearse_cuda_graphs: mode must be one of {CUDA_GRAPH_MODES}, got {mode!r}")
    if mode == "check":
        monkeypatch.setattr("sbd_kernels.generate._graph_mode", lambda device: "check")


def cuda_graph_mode_params(device: str) -> list:
    """The pytest parameters of a CUDA-graph test, for `rehearse_cuda_graphs`: "cuda" (captured and replayed; on
    a GPU only, marked `cuda_only` so that it runs first there) and "check" (rehearsed, on any device)."""
    import pytest

    on_a_gpu = [pytest.mark.cuda_only, pytest.mark.skipif(device != "cuda", reason="replays CUDA graphs (no GPU here)")]
    return [pytest.param("cuda", marks=on_a_gpu), "check"]


def configure_triton_environment(environ: MutableMapping[str, str]) -> str:
    """Sets up `environ` (os.environ in tests/conftest.py, before any Triton kernel is imported) for the
    device of `triton_test_device` and returns it: "cpu" sets TRITON_INTERPRET=1 unless already set; "cuda"
    leaves it unset, and raises ValueError when it is set to anything but "0" (the interpreter would run
    the "GPU" tests on the host)."""
    device = triton_test_device(environ)
    if device == "cpu":
        environ.setdefault("TRITON_INTERPRET", "1")
    elif environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise ValueError(f"{TEST_DEVICE_VARIABLE}=cuda tests the compiled Triton kernels: unset TRITON_INTERPRET "
                         f"(it is {environ['TRITON_INTERPRET']!r})")
    return device


class _AlreadyPatched:
    """The scope `_patch_lang` returns for a call that found triton.language patched already."""

    def restore(self) -> None:
        pass


def patch_the_interpreter_once_per_launch(interpreter: Any = None) -> bool:
    """Makes Triton's interpreter patch triton.language once per launch, not once per call of a @triton.jit
    helper; returns whether `interpreter` (default: `triton.runtime.interpreter`) was changed, False where it
    has no `_patch_lang`.

    The interpreter (triton 3.5-3.8) rebinds every builtin of the triton.language modules a function's
    globals hold (`_patch_lang`: `inspect.getmembers` over 5 modules) when a launch starts, and again at every
    call of a helper inside the kernel, where those modules are patched already and the new binding is the
    same as the old. The filtered sampling kernels call helpers ~120 times a program: the repatching took 38%
    of a filtered sampling test's time in a profile, and the test ran in 14 s instead of 24 s without it. A call
    whose modules are all patched is skipped here; a helper whose globals hold a module the launch did not
    patch is patched as before, and a launch's own patch is restored when the launch ends (from triton 3.6 on,
    `_LangPatchScope.restore`; triton 3.5 restores none)."""
    if interpreter is None:
        try:
            from triton.runtime import interpreter
        except ImportError:
            return False
    real = getattr(interpreter, "_patch_lang", None)
    if real is None or getattr(real, "patches_once", False):
        return real is not None
    language = (interpreter.tl, interpreter.tl.core)
    patched: set[int] = set()  # ids of the language modules patched by the launch in progress

    @functools.cache
    def modules_of(fn) -> frozenset[int]:  # a module's globals: a few hundred entries to scan per call
        return frozenset(id(value) for value in fn.__globals__.values() if any(value is m for m in language))

    def patch_lang(fn):
        modules = modules_of(fn)
        if patched and modules <= patched:
            return _AlreadyPatched()
        scope = real(fn)
        patched.update(modules)
        restore = getattr(scope, "restore", None)
        if restore is not None:
            def restore_and_forget():
                patched.clear()
                restore()

            scope.restore = restore_and_forget
        return scope

    patch_lang.patches_once = True
    interpreter._patch_lang = patch_lang
    return True


SHARD_VARIABLE = "SBD_TEST_SHARD"
# A file to which the run writes the node ids it is about to run, one per line, in order, unless it exists
# (`sbd gpu-check` removes it first, and compares it with the JUnit outcomes to count the tests a budget-stopped
# run did not reach).
PLAN_VARIABLE = "SBD_TEST_PLAN"
# A folder in which each pytest process of a run writes the seconds of every test it ran (setup + call +
# teardown), as <pid>.json: `tools/run_tests.py --record-durations` merges them into tests/durations.json.
DURATIONS_VARIABLE = "SBD_TEST_DURATIONS"


def select_shard(items: list, spec: str, group_of: Callable[[Any], str | None] = lambda item: None,
                 weight_of: Callable[[Any], float] = lambda item: 1.0) -> tuple[list, list]:
    """(kept, dropped) for SBD_TEST_SHARD=`spec` "i/n", each in the items' order: the units are dealt heaviest
    first (in their order on a tie), each to the shard with the least weight so far (the lowest index on a tie),
    and shard i keeps its own, so n runs with i = 0..n-1 run each item once between them and end close together
    (longest-processing-time dealing: the shards' loads differ by at most the last unit dealt, one of the
    lightest). A unit is one item, or all the items of one `group_of` name (tests that share an expensive module
    fixture: one shard builds it, not every shard); it weighs the sum of its items' `weight_of` (seconds, from
    tests/durations.json). With equal weights and no groups this is every n-th item from the i-th on. Raises
    ValueError unless 0 <= i < n."""
    try:
        index, count = (int(part) for part in spec.split("/"))
    except ValueError:
        raise ValueError(f"{SHARD_VARIABLE} must be i/n, e.g. 0/4, got {spec!r}") from None
    if not 0 <= index < count:
        raise ValueError(f"{SHARD_VARIABLE}={spec}: needs 0 <= i < n")
    groups = [group_of(item) for item in items]
    unit_of = [position if group is None else group for position, group in enumerate(groups)]
    weights: dict[int | str, float] = {}  # in the order of each unit's first item
    for unit, item in zip(unit_of, items):
        weights[unit] = weights.get(unit, 0.0) + weight_of(item)
    shard_of: dict[int | str, int] = {}
    loads = [0.0] * count
    for unit in sorted(weights, key=lambda unit: -weights[unit]):  # stable: equal weights keep their order
        shard_of[unit] = loads.index(min(loads))
        loads[shard_of[unit]] += weights[unit]
    kept = [item for unit, item in zip(unit_of, items) if shard_of[unit] == index]
    dropped = [item for unit, item in zip(unit_of, items) if shard_of[unit] != index]
    return kept, dropped


@dataclasses.dataclass(frozen=True)
class RecordedDurations:
    """Recorded seconds per test node id (tests/durations.json), and what a test not among them weighs."""

    seconds: dict[str, float]
    default: float

    def of(self, node_id: str) -> float:
        return self.seconds.get(node_id, self.default)


def load_test_durations(path: str | os.PathLike) -> RecordedDurations:
    """The durations file written by `tools/run_tests.py --record-durations`; without one every test weighs 1."""
    try:
        with open(path) as handle:
            data = json.load(handle)
    except FileNotFoundError:
        return RecordedDurations({}, 1.0)
    return RecordedDurations(data["tests"], data["default_s"])


# Test files that run Triton kernels or `device=...` code: first in a run on a GPU (`gpu_run_order`), and
# first on `sbd gpu-check`'s command line.
GPU_TEST_FILES = ("test_attention_triton.py", "test_fuzz_attention.py", "test_sampling.py",
                  "test_sampling_filters.py", "test_fuzz_sampling.py", "test_scatter.py", "test_fuzz_scatter.py",
                  "test_trusted_values.py", "test_compile.py", "test_generate.py", "test_hf.py")


def gpu_run_order(items: list, file_of: Callable[[Any], str], cuda_only: Callable[[Any], bool]) -> list:
    """The order of a run on a GPU, which a time budget may stop early (`sbd gpu-check`): the CUDA-only tests,
    then the GPU_TEST_FILES taken in turns (one test of each in its collection order), then the other files'
    tests as collected. A run stopped after any number of tests has then checked every kernel family as evenly
    as it could: on the first H200 run, 4 processes ran 484 tests in 140 s, mostly compiling Triton kernels,
    and files in sequence were all the attention kernel's; in a second run, turns over every file spent the
    budget on CPU-bound builds and trainings."""
    first = [item for item in items if cuda_only(item)]
    by_file: dict[str, list] = {}
    rest = []
    for item in items:
        if cuda_only(item):
            continue
        if file_of(item) in GPU_TEST_FILES:
            by_file.setdefault(file_of(item), []).append(item)
        else:
            rest.append(item)
    queues = list(by_file.values())
    turns = [queue[i] for i in range(max(map(len, queues), default=0)) for queue in queues if i < len(queue)]
    return first + turns + rest


def run_torchrun(args: list[str], folder: str | os.PathLike, timeout: float) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node 2 ARGS` with this interpreter, one torch thread per rank, its output
    captured as text. `folder` is its temporary directory: torchrun's agent leaves a torchelastic_* folder there."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(folder)}
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env)


def on_device(fn: Callable, device: str) -> Callable:
    """`fn` called on `device` copies of its CPU tensor arguments, with its tensor results copied back to the
    CPU; `fn` itself when `device` is "cpu" (nothing copied, nothing changed).

    Each argument's whole storage is copied and viewed with the argument's own sizes, strides and storage
    offset, so a strided, offset or expanded (stride 0) view stays such a view on the device, and arguments
    that share a storage share one there too (the aliasing checks see the same layout). After the call
    every copied storage is written back in full: in-place results, and any stray write outside an
    argument, show up in the CPU tensors a test inspects (`Embedded` checks included). Tensors on another
    device (e.g. meta) and non-tensors are passed as they are.

    Not for calls meant to fail a value check: on CUDA, `torch._assert_async` fails as a device-side assert
    that leaves the process's CUDA context unusable; such calls stay on CPU tensors, where it raises at once.
    """
    if device == "cpu":
        return fn

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return call_on_copies(fn, device, *args, **kwargs)

    return call


OP_FAMILIES = {"block_attention_with_kvcache": "attention", "entropy_sample": "sampling", "mask_scatter_": "scatter"}
BACKENDS = ("cpu", "triton", "naive")


def op_on_given_tensors(name: str, backend: str) -> Callable:
    """The `sbd.<name>` implementation of `backend` called on the tensors as given: "cpu" (the C++ kernel
    through the dispatcher), "triton" (the launcher of ops/<family>/triton.py), "naive" (the oracle). For bad
    inputs, which every backend rejects on the host before any launch: a failed value check on a CUDA tensor
    would instead be a device-side assert that leaves the process's CUDA context unusable. Raises ValueError
    for another op or backend."""
    if name not in OP_FAMILIES or backend not in BACKENDS:
        raise ValueError(f"op_on_given_tensors: no {backend!r} implementation of {name!r}: ops "
                         f"{', '.join(OP_FAMILIES)}; backends {', '.join(BACKENDS)}")
    if backend == "cpu":
        return getattr(torch.ops.sbd, name)
    module = importlib.import_module(f"sbd_kernels.ops.{OP_FAMILIES[name]}.{backend}")
    return getattr(module, name)


def backend_op(name: str, backend: str) -> Callable:
    """The op under test: `op_on_given_tensors`, except that the Triton launcher runs on `triton_test_device()`
    copies of its CPU tensor arguments, results copied back (`on_device`): the interpreter on the CPU
    tensors by default, the compiled kernels on CUDA copies with SBD_TEST_DEVICE=cuda."""
    op = op_on_given_tensors(name, backend)
    return on_device(op, triton_test_device()) if backend == "triton" else op


def call_on_copies(fn: Callable, device: str, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` on `device` copies of the CPU tensor arguments, as `on_device` describes; copies
    even when `device` is "cpu" (which is how the copying itself is tested without a GPU)."""
    copies = _StorageCopies(device)
    result = fn(*(copies.of(a) for a in args), **{name: copies.of(v) for name, v in kwargs.items()})
    copies.write_back()
    return _to_cpu(result)


class _StorageCopies:
    """Device copies of CPU storages, one per storage however many arguments view it."""

    def __init__(self, device: str):
        self.device = device
        self.pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # address: (host bytes, device bytes)

    def of(self, value: Any) -> Any:
        if not (isinstance(value, torch.Tensor) and value.device.type == "cpu"):
            return value
        storage = value.untyped_storage()
        if storage.nbytes() == 0:  # no memory to share (empty storages may all sit at address 0)
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=self.device)
        if storage.data_ptr() not in self.pairs:
            host = torch.empty(0, dtype=torch.uint8).set_(storage)  # [nbytes] bytes of the whole storage
            self.pairs[storage.data_ptr()] = (host, host.to(self.device, copy=True))
        device_bytes = self.pairs[storage.data_ptr()][1]
        return torch.empty(0, dtype=value.dtype, device=self.device).set_(
            device_bytes.untyped_storage(), value.storage_offset(), value.shape, value.stride())

    def write_back(self) -> None:
        for host, device_bytes in self.pairs.values():
            host.copy_(device_bytes)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to("cpu", copy=True)
    if isinstance(value, tuple):
        return tuple(_to_cpu(v) for v in value)
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value
