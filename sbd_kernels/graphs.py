"""Decode steps replayed from CUDA graphs: `generate(..., cuda_graph=True)`.

Called eagerly, a decode pass of a small model is host-bound: Python, the model's modules and each kernel launch
cost more than the GPU work (a forward of the small reference model took 4.0-6.4 ms eagerly and 0.35-1.7 ms
replayed on an H200: docs/performance.md §6.2). A CUDA graph records every kernel of one step once and
replays them with one launch. That is only correct when a replay touches the same memory the capture saw, so the
decode loop keeps every tensor a step reads or writes in static buffers: the per-sequence state (`NtpState`,
`SbdState`), the KV cache and its lengths are allocated once per batch and only ever updated in place, and a step
has no host sync inside.

`graphed_steps` wraps the two repeated steps (`ntp_decode_step`, and `sbd_block_step` once per row layout:
2K rows or K rows); the prefills run eagerly. Per layout, the first call runs eagerly (the warm-up CUDA graphs
need), the second captures, and every call from then on replays. Every later call checks, against the layout's
first call, the invariants replays rely on:
- the same state / cache / model objects, and the same data pointers of every state and cache tensor: a step
  that rebinds a buffer (e.g. `state.block = ...`) is an error here, not a silently stale replay;
- equal other arguments (`ops`, the decode constants `sp`: gamma, rule, temperature, ...), which a graph bakes in
  as the constants of its kernels;
- the same data pointers of the model's parameters and buffers, which a graph reads where they were (moving
  or re-assigning `param.data` is caught; replacing a parameter object by a new one is not: walking the model's
  modules every pass took 0.6 ms for a 32-layer model on a 2-core AMD EPYC Zen 4, more than a replay of the
  small model, while reading the recorded tensors' pointers took 0.02 ms).
Each violation raises RuntimeError naming the step and what changed. A step that cannot be captured (a model whose
forward synchronises with the host) raises RuntimeError naming the step and the likely cause, the CUDA error
chained.

On CPU tensors (`mode="check"`), nothing is captured: every call runs eagerly with the same checks, so the
static-buffer discipline is tested without a GPU, and every call a capture or replay would take runs under
`host_syncs`, which names the operations a capture would refuse (a host read such as `.item()` or `.nonzero()`,
a tensor built from Python data on a device, `torch.tensor(x, device=...)`): RuntimeError naming the step and them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from sbd_kernels.generate import StepFunctions

# What a CUDA graph capture refuses, on the GPU tensors of a step: reading their values on the host (`.item()`,
# `bool(t)`, a Python branch on a tensor, `torch.equal`) or sizing an output by them (the host reads the size to
# allocate). Dispatch shows these on any device; `.tolist()`, `.numpy()`, `.cpu()` and `.to("cpu")` of a CPU tensor
# dispatch nothing, and are seen as the Tensor methods they are (_READ_BACK_METHODS).
HOST_SYNC_OPS = frozenset({
    "aten._local_scalar_dense", "aten.is_nonzero", "aten.equal", "aten.nonzero", "aten.masked_select",
    "aten._unique", "aten._unique2", "aten.unique_dim", "aten.unique_consecutive", "aten.bincount",
})
# Indexing by a boolean mask (`x[mask]`, `x[mask] = v`) sizes its output by the mask's values.
_BOOL_INDEXING_OPS = frozenset({"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"})
# Factories: given a device, a tensor on the step's GPU (built from Python data, `torch.tensor(x, device=...)`, a
# copy from the host, which a capture refuses: pytorch/pytorch#124582); without one, a CPU tensor on a GPU too,
# whose values the host reads without a sync (torch.distributions' argument checks do).
_FROM_HOST_DATA = frozenset({torch.tensor, torch.as_tensor, torch.asarray})
# Tensor methods that copy a tensor to the host (`.to("cpu")` too: a device given by name, not a tensor's device).
_READ_BACK_METHODS = frozenset({torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu})
_FACTORIES = _FROM_HOST_DATA | {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.linspace,
                                torch.eye, torch.rand, torch.randn, torch.randint, torch.scalar_tensor}


class _Scan:
    """What one `host_syncs` call found, and the CPU tensors of the step (built without a device, or computed
    from such tensors alone), which stay on the host on a GPU too."""

    def __init__(self) -> None:
        self.found: list[str] = []
        self.host = torch.utils.weak.WeakIdKeyDictionary()

    def on_host(self, tensors: list[torch.Tensor]) -> bool:
        return bool(tensors) and all(t in self.host for t in tensors)

    def mark_host(self, value: Any) -> None:
        for t in _tensors_in(value):
            self.host[t] = True


def _tensors_in(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in torch.utils._pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


class _FactoryScan(TorchFunctionMode):
    """Marks the CPU tensors that factories build without a device; records tensors built from Python data on a
    device (`torch.tensor(x, device=...)`, `t.new_tensor(x)`), host tensors moved to a device (`.to(x.device)`,
    `.cuda()`), and device tensors copied to the host (`.tolist()`, `.cpu()`, ...)."""

    def __init__(self, scan: _Scan) -> None:
        super().__init__()
        self.scan = scan

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in _FACTORIES:
            if kwargs.get("device") is None:
                self.scan.mark_host(result)
            elif func in _FROM_HOST_DATA and args and not isinstance(args[0], torch.Tensor):
                self.scan.found.append(f"torch.{func.__name__}(<Python data>, device=...)")
        elif func is torch.Tensor.new_tensor:
            if self.scan.on_host(_tensors_in(args[:1])) and kwargs.get("device") is None:
                self.scan.mark_host(result)
            else:
                self.scan.found.append("Tensor.new_tensor(<Python data>) of a tensor on the device")
        elif func in (torch.Tensor.to, torch.Tensor.cuda) and self.scan.on_host(_tensors_in(args[:1])):
            target = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, torch.device)]
            if func is torch.Tensor.cuda or target:
                self.scan.found.append(f"Tensor.{func.__name__}(<a device>) of a CPU tensor")
            else:
                self.scan.mark_host(result)
        elif func in _READ_BACK_METHODS or (func is torch.Tensor.to and _to_cpu_by_name(args, kwargs)):
            if self.scan.on_host(_tensors_in(args[:1])):
                self.scan.mark_host(result)
            else:
                self.scan.found.append(f"Tensor.{func.__name__}() of a tensor on the device")
        return result


def _to_cpu_by_name(args: tuple, kwargs: dict) -> bool:
    """Whether `Tensor.to(*args, **kwargs)` names the CPU as its device ("cpu", "cpu:0")."""
    return any(isinstance(a, str) and a.split(":")[0] == "cpu" for a in (*args[1:], kwargs.get("device")))


class _OpScan(TorchDispatchMode):
    """Records the operations of HOST_SYNC_OPS (and boolean-mask indexing) on tensors that are not host tensors;
    marks the outputs of operations on host tensors alone as host tensors."""

    def __init__(self, scan: _Scan) -> None:
        super().__init__()
        self.scan = scan

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        inputs = _tensors_in((args, kwargs))
        on_host = self.scan.on_host(inputs)
        if not on_host and _refused_in_capture(func, args, kwargs):
            self.scan.found.append(str(func))
        result = func(*args, **kwargs)
        if on_host:
            self.scan.mark_host(result)
        return result


def _refused_in_capture(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the dispatched `func(*args, **kwargs)` reads device values on the host (HOST_SYNC_OPS)."""
    name = str(func.overloadpacket)
    if name in HOST_SYNC_OPS:
        return True
    if name == "aten.repeat_interleave" and func._overloadname == "Tensor":
        return kwargs.get("output_size") is None  # the output size is the repeats' sum, read on the host
    if name in _BOOL_INDEXING_OPS:
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ())
    return False


def host_syncs(fn: Callable, *args: Any, **kwargs: Any) -> tuple[Any, list[str]]:
    """(fn(*args, **kwargs), what it ran that a CUDA graph capture refuses, sorted, each once: e.g.
    ["aten.nonzero.default", "torch.tensor(<Python data>, device=...)"]), on any device. The arguments and every
    tensor not built inside `fn` count as GPU tensors; HOST_SYNC_OPS says what is and is not seen."""
    scan = _Scan()
    with _FactoryScan(scan), _OpScan(scan):
        result = fn(*args, **kwargs)
    return result, sorted(set(scan.found))


def _tensors_of(obj: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor held by a decode state (dataclass fields) or a cache (attributes, lists of
    per-layer tensors, HF cache layers)."""
    if dataclasses.is_dataclass(obj):
        items = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    else:
        items = list(vars(obj).items())
    for name, value in items:
        if isinstance(value, torch.Tensor):
            yield name, value
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, torch.Tensor):
                    yield f"{name}[{i}]", item
                elif hasattr(item, "keys") and isinstance(getattr(item, "keys", None), torch.Tensor):
                    yield f"{name}[{i}].keys", item.keys
                    yield f"{name}[{i}].values", item.values


def _addresses(*objects: Any) -> dict[str, int]:
    return {f"{type(o).__name__}.{name}": t.data_ptr() for o in objects for name, t in _tensors_of(o)}


def _model_tensors(model: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the model's parameters and buffers: what its forward reads besides state and cache."""
    return [*model.named_parameters(), *model.named_buffers()]


def _step_name(fn: Callable) -> str:
    """A step's name for messages: its __name__, that of the function a functools.partial wraps, or its type."""
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", None)
    return name or type(fn).__name__


def _differences(before: Any, now: Any) -> str:
    """What differs between two values of a step argument: the changed fields of a dataclass, else both reprs."""
    if dataclasses.is_dataclass(before) and type(before) is type(now):
        changed = [(f.name, getattr(before, f.name), getattr(now, f.name)) for f in dataclasses.fields(before)
                   if getattr(before, f.name) != getattr(now, f.name)]
        return ", ".join(f"{type(now).__name__}.{name} {old!r} -> {new!r}" for name, old, new in changed)
    return f"{before!r} -> {now!r}"


@dataclasses.dataclass
class _Binding:
    """What a layout's first call fixed for every later call (the invariants of the module docstring).

    objects: (model, cache, state). constants: the other arguments but the layout's ints (ops, sp).
    buffers: data pointer of every state and cache tensor. weights: (name, tensor, data pointer) of every
    model parameter and buffer.
    """

    objects: tuple
    constants: tuple
    buffers: dict[str, int]
    weights: list[tuple[str, torch.Tensor, int]]


class _GraphedStep:
    """One step function, captured once per layout key and replayed (see the module docstring)."""

    def __init__(self, fn: Callable, mode: str, pool: Any):
        self.fn, self.mode, self.pool = fn, mode, pool
        self.name = _step_name(fn)
        self.calls: dict[tuple, int] = {}
        self.graphs: dict[tuple, Any] = {}
        self.bound: dict[tuple, _Binding] = {}

    def for_new_batch(self) -> _GraphedStep:
        """A fresh wrapper of the same step for another batch (new state and cache buffers: a new capture);
        `generate` takes one for every batch it decodes."""
        return _GraphedStep(self.fn, self.mode, self.pool)

    def __call__(self, model: Any, cache: Any, state: Any, *rest: Any) -> None:
        key = tuple(a for a in rest if isinstance(a, int))
        constants = tuple(a for a in rest if not isinstance(a, int))
        args = (model, cache, state, *rest)
        calls = self.calls.get(key, 0)
        self.calls[key] = calls + 1
        if calls == 0:
            weights = [(name, t, t.data_ptr()) for name, t in _model_tensors(model)]
            self.bound[key] = _Binding((model, cache, state), constants, _addresses(state, cache), weights)
        else:
            self._check_static(self.bound[key], (model, cache, state), constants)
        if calls == 0:  # the warm-up, eager on a GPU too
            self.fn(*args)
            return
        if self.mode == "check":
            self._run_checked(args)
            return
        if key not in self.graphs:
            self.graphs[key] = self._capture(args)
        self.graphs[key].replay()

    def _check_static(self, bound: _Binding, objects: tuple, constants: tuple) -> None:
        if any(a is not b for a, b in zip(objects, bound.objects)):
            raise RuntimeError(f"{self.name}: a graphed step must be called with the same model, cache and "
                               "state objects every pass (a new batch needs a fresh step, `for_new_batch()`, which "
                               "generate takes for every batch)")
        changed = [_differences(a, b) for a, b in zip(bound.constants, constants) if a != b]
        if changed or len(constants) != len(bound.constants):
            raise RuntimeError(f"{self.name}: called with other arguments than at capture "
                               f"({'; '.join(changed) or 'another number of them'}); a captured graph replays the "
                               "kernels and constants of its capture, so other decode settings or ops need new "
                               "graphed_steps()")
        now = _addresses(objects[2], objects[1])
        moved = [name for name, ptr in bound.buffers.items() if now.get(name) != ptr]
        if moved:
            raise RuntimeError(f"{self.name}: {', '.join(moved)} moved to new memory since the step was "
                               "captured; decode steps must update their state and cache in place")
        moved = [name for name, tensor, ptr in bound.weights if tensor.data_ptr() != ptr]
        if moved:
            raise RuntimeError(f"{self.name}: model tensors {', '.join(moved)} moved to new memory since the step "
                               "was captured (a replay would read the old memory); keep the model in place "
                               "during a decode, or decode with new graphed_steps()")

    def _run_checked(self, args: tuple) -> None:
        """Mode "check": the call a capture or replay would take, run eagerly; RuntimeError when it ran operations a
        capture refuses."""
        _, found = host_syncs(self.fn, *args)
        if found:
            raise RuntimeError(f"{self.name}: the step ran {', '.join(found)}, which a CUDA graph capture refuses (a "
                               "read of device values on the host, an output sized by values, or a tensor built from "
                               "host data, a copy to the GPU); such a model cannot decode with cuda_graph=True")

    def _capture(self, args: tuple) -> Any:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                self.fn(*args)
        except RuntimeError as err:
            first_line = (str(err).strip() or type(err).__name__).splitlines()[0]
            raise RuntimeError(
                f"{self.name}: capturing the decode step in a CUDA graph failed ({first_line}). A graph cannot hold a "
                "host synchronisation (.item(), .nonzero(), .tolist(), a copy to the CPU) or a copy of host data to "
                "the GPU (torch.tensor(x, device=...)), which some models' forwards do: an MoE layer that loops over "
                "the experts its tokens hit, for one (Hugging Face's 'eager' experts implementation, or torch's "
                "grouped GEMM where it cannot run in one kernel); graphed_steps(steps, 'check') names such operations "
                "on any device. Decode with cuda_graph=False; the chained error below shows where the step "
                "failed") from err
        return graph


def graphed_steps(steps: StepFunctions, mode: str = "cuda") -> StepFunctions:
    """`steps` with `ntp_decode_step` and `sbd_block_step` replayed from CUDA graphs (`mode="cuda"`) or run eagerly
    under the same static-buffer checks (`mode="check"`, any device). An instance serves one batch's buffers;
    `generate` takes a fresh one for every batch (`StepFunctions.for_batch`)."""
    if mode not in ("cuda", "check"):
        raise ValueError(f"graphed_steps: mode must be 'cuda' or 'check', got {mode!r}")
    if mode == "cuda" and not torch.cuda.is_available():
        raise ValueError("graphed_steps: mode 'cuda' captures CUDA graphs, and torch sees no CUDA device here "
                         f"(torch {torch.__version__}); mode 'check' runs the same checks eagerly on any device")
    pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
    return dataclasses.replace(steps, ntp_decode_step=_GraphedStep(steps.ntp_decode_step, mode, pool),
                               sbd_block_step=_GraphedStep(steps.sbd_block_step, mode, pool))
