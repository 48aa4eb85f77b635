"""Decode steps replayed from CUDA graphs: `generate(..., cuda_graph=True)`.

Called eagerly, a decode pass of a small model is host-bound: Python, the model's modules and each kernel launch
cost more than the GPU work (a forward of the small reference model took 4.0-6.4 ms eagerly and 0.35-1.7 ms
replayed on an H200: docs/performance.md §6.2). A CUDA graph records every kernel of one step once and
replays them with one launch. That is only correct when a replay touches the same memory the capture saw, so the
decode loop keeps every tensor a step reads or writes in static buffers: the per-sequence state (`NtpState`,
`SbdState`), the KV cache and its lengths are allocated once per batch and only ever updated in place, and a step
has no host sync inside.

`GraphedSteps` wraps the two repeated steps (`ntp_decode_step`, and `sbd_block_step` once per row layout:
2K rows or K rows); the prefills run eagerly. Per layout, the first call runs eagerly (the warm-up CUDA graphs
need), the second captures, and every call from then on replays. Every call checks the invariant replays rely on:
the same state / cache / model objects, and the same data pointers of every state and cache tensor as at capture.
A step that rebinds a buffer (e.g. `state.block = ...`) is an error here, not a silently stale replay.

On CPU tensors (`mode="check"`), nothing is captured: every call runs eagerly with the same checks, so the
static-buffer discipline is tested without a GPU.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from sbd_kernels.generate import StepFunctions


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


class _GraphedStep:
    """One step function, captured once per layout key and replayed (see the module docstring)."""

    def __init__(self, fn: Callable, mode: str, pool: Any):
        self.fn, self.mode, self.pool = fn, mode, pool
        self.calls: dict[tuple, int] = {}
        self.graphs: dict[tuple, Any] = {}
        self.bound: dict[tuple, tuple[tuple, dict[str, int]]] = {}

    def __call__(self, model: Any, cache: Any, state: Any, *rest: Any) -> None:
        key = tuple(a for a in rest if isinstance(a, int))
        args = (model, cache, state, *rest)
        calls = self.calls.get(key, 0)
        self.calls[key] = calls + 1
        if calls == 0:
            self.bound[key] = (args, _addresses(state, cache))
        else:
            self._check_static(key, args, state, cache)
        if self.mode == "check" or calls == 0:
            self.fn(*args)
            return
        if key not in self.graphs:
            self.graphs[key] = self._capture(args)
        self.graphs[key].replay()

    def _check_static(self, key: tuple, args: tuple, state: Any, cache: Any) -> None:
        bound_args, bound_addresses = self.bound[key]
        if any(a is not b for a, b in zip(args[:3], bound_args[:3])):
            raise RuntimeError(f"{self.fn.__name__}: a graphed step must be called with the same model, cache and "
                               "state objects every pass (a new batch needs new GraphedSteps)")
        now = _addresses(state, cache)
        moved = [name for name, ptr in bound_addresses.items() if now.get(name) != ptr]
        if moved:
            raise RuntimeError(f"{self.fn.__name__}: {', '.join(moved)} moved to new memory since the step was "
                               "captured; decode steps must update their state and cache in place")

    def _capture(self, args: tuple) -> Any:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.fn(*args)
        return graph


def graphed_steps(steps: StepFunctions, mode: str = "cuda") -> StepFunctions:
    """`steps` with `ntp_decode_step` and `sbd_block_step` replayed from CUDA graphs (`mode="cuda"`) or run eagerly
    under the same static-buffer checks (`mode="check"`, any device). One instance per decoded batch."""
    if mode not in ("cuda", "check"):
        raise ValueError(f"graphed_steps: mode must be 'cuda' or 'check', got {mode!r}")
    pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
    return dataclasses.replace(steps, ntp_decode_step=_GraphedStep(steps.ntp_decode_step, mode, pool),
                               sbd_block_step=_GraphedStep(steps.sbd_block_step, mode, pool))
