"""Argument checks of `sbd::mask_scatter_` shared by the Triton launcher and the oracle.

Same wording as the C++ checks in csrc/cpu/scatter.cpp, so that a bad call fails with the same message
(a RuntimeError naming the argument) on every backend.
"""
from __future__ import annotations

import torch

OP = "sbd.mask_scatter_"
RULES = ("eb", "threshold")


def _fail(message: str) -> None:
    raise RuntimeError(f"{OP}: {message}")


def _check_tensor(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...],
                  device: torch.device) -> None:
    """`t` has `dtype`, `shape` and lives on `device`."""
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        _fail(f"{name} must be {str(dtype).removeprefix('torch.')}, got {str(t.dtype).removeprefix('torch.')}")
    if tuple(t.shape) != shape:
        dims = "[B, K]" if len(shape) == 2 else "[B]"
        _fail(f"{name} must have shape {dims} = {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        _fail(f"{name} must be on the device of block_tokens ({device}), got {t.device}")


def check_mask_scatter_args(block_tokens: torch.Tensor, is_masked: torch.Tensor, sampled: torch.Tensor,
                            entropy: torch.Tensor, gamma: torch.Tensor | None, gamma_val: float,
                            rule: str, valid: torch.Tensor | None) -> tuple[int, int]:
    """Checks dtypes, shapes, devices, `rule` and gamma >= 0; returns (B, K).

    The gamma tensor's values are checked with `torch._assert_async`: no host sync on CUDA (the error
    surfaces at the next sync), an immediate RuntimeError on CPU tensors.
    """
    if not isinstance(block_tokens, torch.Tensor):
        _fail(f"block_tokens must be a tensor, got {type(block_tokens).__name__}")
    if block_tokens.dim() != 2:
        _fail(f"block_tokens must be a 2-D [B, K] tensor, got shape {list(block_tokens.shape)}")
    batch, k = block_tokens.shape
    device = block_tokens.device
    _check_tensor(block_tokens, "block_tokens", torch.int64, (batch, k), device)
    _check_tensor(is_masked, "is_masked", torch.bool, (batch, k), device)
    _check_tensor(sampled, "sampled", torch.int64, (batch, k), device)
    _check_tensor(entropy, "entropy", torch.float32, (batch, k), device)
    for name, t in (("block_tokens", block_tokens), ("is_masked", is_masked)):
        if torch._debug_has_internal_overlap(t) == 1:  # 1: MemOverlap::Yes, e.g. an expanded view
            _fail(f"{name} is written in place and must not have elements sharing memory (expanded view?)")
    if valid is not None:
        _check_tensor(valid, "valid", torch.bool, (batch, k), device)
    if rule not in RULES:
        _fail(f"rule must be 'eb' or 'threshold', got '{rule}'")
    if gamma is None:
        if not gamma_val >= 0:  # also rejects NaN
            _fail(f"gamma must be >= 0, got gamma_val={gamma_val}")
    else:
        _check_tensor(gamma, "gamma", torch.float32, (batch,), device)
        torch._assert_async(torch.all(gamma >= 0), f"{OP}: gamma must be >= 0 (and not NaN) in every row")
    return batch, k
