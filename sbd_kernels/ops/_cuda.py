"""Registers each family's Triton launcher as the CUDA kernel of its `sbd` op, imported on first use."""
from __future__ import annotations

import importlib

import torch


def register_triton_kernel(op: str, family: str) -> None:
    """Makes `sbd_kernels.ops.<family>.triton.<op>` the CUDA kernel of `sbd::<op>`.

    The Triton module is imported on the first CUDA call, not at package import: triton is optional (CPU-only
    installs never need it) and importing it costs about a second.
    """

    def cuda_kernel(*args):
        try:
            module = importlib.import_module(f"sbd_kernels.ops.{family}.triton")
        except ImportError as err:
            raise RuntimeError(
                f"sbd.{op} on CUDA tensors needs Triton, which could not be imported ({err}); "
                "install it with `pip install triton`"
            ) from err
        return getattr(module, op)(*args)

    cuda_kernel.__name__ = f"_{op}_cuda"
    torch.library.register_kernel(f"sbd::{op}", "cuda", cuda_kernel)
