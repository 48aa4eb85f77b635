"""Registers each family's Triton launcher as the CUDA kernel of its `sbd` op, imported on first use."""
from __future__ import annotations

import importlib
from collections.abc import Callable

import torch


def device_to_enter(args: tuple) -> int | None:
    """Index of the CUDA device a launch on `args` must run on, when it is not the current device (None: stay).

    Triton launches on torch's current device and its current stream, whatever device the tensors are on,
    and a kernel registered from Python gets no device guard from the dispatcher. The launch follows the
    first CUDA tensor argument (the op checks that every tensor is on its device): with tensors on cuda:1 and
    cuda:0 current (a model spread over GPUs, `--device cuda:1`), it would otherwise run on cuda:0 and its
    stream, and fail or read another GPU's memory. Reads device metadata only (no host sync).
    """
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.device.type == "cuda":
            index = arg.device.index
            return None if index == torch.cuda.current_device() else index
    return None


def cuda_kernel_of(op: str, family: str) -> Callable:
    """The CUDA kernel of `sbd::<op>`: `sbd_kernels.ops.<family>.triton.<op>`, run on the device of its tensors.

    The Triton module is imported on the first CUDA call, not at package import: triton is optional (CPU-only
    installs never need it) and importing it costs about a second. The device is switched only when the
    tensors are not on the current device (`device_to_enter`), so the usual call enters no context.
    """

    def cuda_kernel(*args):
        try:
            module = importlib.import_module(f"sbd_kernels.ops.{family}.triton")
        except ImportError as err:
            raise RuntimeError(
                f"sbd.{op} on CUDA tensors needs Triton, which could not be imported ({err}); "
                "install it with `pip install triton`"
            ) from err
        launcher = getattr(module, op)
        index = device_to_enter(args)
        if index is None:
            return launcher(*args)
        with torch.cuda.device(index):
            return launcher(*args)

    cuda_kernel.__name__ = f"_{op}_cuda"
    return cuda_kernel


def register_triton_kernel(op: str, family: str) -> None:
    """Makes `cuda_kernel_of(op, family)` the CUDA kernel of `sbd::<op>`."""
    torch.library.register_kernel(f"sbd::{op}", "cuda", cuda_kernel_of(op, family))
