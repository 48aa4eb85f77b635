"""Argument checks of `sbd::mask_scatter_` shared by the Triton launcher, the oracle and the fake kernel.

Same wording and order as the C++ checks in csrc/cpu/scatter.cpp, so that a bad call fails with the same
message (a RuntimeError naming the argument) on every backend and at `torch.compile` trace time.
"""
from __future__ import annotations

import torch

from sbd_kernels.ops._overlap import check_not_sharing, check_writable
from sbd_kernels.ops._trusted import values_trusted

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


# Aliases that cannot change the result: each element of `sampled` (`valid`) is then read only for the
# position of `block_tokens` (`is_masked`) it is, before that position is written.
IDENTICAL_OK = frozenset({("block_tokens", "sampled"), ("is_masked", "valid")})


def check_mask_scatter_args(block_tokens: torch.Tensor, is_masked: torch.Tensor, sampled: torch.Tensor,
                            entropy: torch.Tensor, gamma: torch.Tensor | None, gamma_val: float,
                            rule: str, valid: torch.Tensor | None) -> tuple[int, int]:
    """Checks dtypes, shapes, devices, memory overlap, `rule` and gamma_val >= 0; returns (B, K).

    Metadata only (no device value is read, nothing synchronises), so the fake kernel runs it too; on fake
    and meta tensors the aliasing between arguments is not checked (no data pointers). The gamma tensor's
    values are checked by `assert_gamma_values`.
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
    check_writable(OP, "block_tokens", block_tokens)
    check_writable(OP, "is_masked", is_masked)
    if valid is not None:
        _check_tensor(valid, "valid", torch.bool, (batch, k), device)
    if rule not in RULES:
        _fail(f"rule must be 'eb' or 'threshold', got '{rule}'")
    if gamma is None:
        if not gamma_val >= 0:  # also rejects NaN
            _fail(f"gamma must be >= 0, got gamma_val={gamma_val}")
    else:
        _check_tensor(gamma, "gamma", torch.float32, (batch,), device)
    check_not_sharing(OP, [("block_tokens", block_tokens), ("is_masked", is_masked)],
                      [("sampled", sampled), ("entropy", entropy), ("valid", valid), ("gamma", gamma)],
                      IDENTICAL_OK)
    return batch, k


def assert_gamma_values(gamma: torch.Tensor | None) -> None:
    """gamma >= 0 (and not NaN) in every row, with `torch._assert_async`: no host sync on CUDA (the error
    surfaces at the next sync), an immediate RuntimeError on CPU tensors. Skipped inside `trusted_values()`:
    gamma only enters comparisons, never an address."""
    if gamma is not None and not values_trusted():
        torch._assert_async(torch.all(gamma >= 0), f"{OP}: gamma must be >= 0 (and not NaN) in every row")


def gamma_fp32(gamma_val: float) -> float:
    """`gamma_val` rounded to fp32 (to nearest, so anything beyond the fp32 range becomes +inf), as the
    C++ kernel's cast does; every backend compares against this value."""
    return float(torch.tensor(gamma_val, dtype=torch.float64).to(torch.float32))
