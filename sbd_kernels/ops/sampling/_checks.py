"""Argument checks of `sbd.entropy_sample` shared by the oracle and the Triton launcher.

The wording matches the `TORCH_CHECK`s of csrc/cpu/sampling.cpp, so every backend names the same
argument in the same words.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

OP = "sbd.entropy_sample"
LOGITS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLOAT32_MAX = torch.finfo(torch.float32).max


class SampleDims(NamedTuple):
    batch: int
    positions: int
    vocab: int


def _fail(message: str) -> None:
    raise RuntimeError(f"{OP}: {message}")


def _check_per_row_int64(name: str, t: torch.Tensor, batch: int, device: torch.device) -> None:
    """seed / offset: int64, shape [B], or one element ([] or [1]) shared by every row."""
    if t.dtype != torch.int64:
        _fail(f"{name} must be an int64 tensor, got {t.dtype}")
    if t.device != device:
        _fail(f"{name} must be on the device of logits ({device}), got {t.device}")
    if not (tuple(t.shape) == (batch,) or t.dim() == 0 or tuple(t.shape) == (1,)):
        _fail(f"{name} must have shape [B] = [{batch}], [] or [1], got {list(t.shape)}")


def check_entropy_sample_args(logits: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor,
                              temperature: torch.Tensor | None, temperature_val: float,
                              compute_mask: torch.Tensor | None, mask_token_id: int) -> SampleDims:
    """Checks dtypes, shapes, devices and host scalars (no device values); returns (B, K, V)."""
    if logits.dim() != 3:
        _fail(f"logits must be a 3-D tensor [B, K, V], got shape {list(logits.shape)}")
    if logits.dtype not in LOGITS_DTYPES:
        _fail(f"logits must be float32, float16 or bfloat16, got {logits.dtype}")
    batch, positions, vocab = logits.shape
    if vocab < 1:
        _fail("logits must have a vocabulary dimension V >= 1")
    device = logits.device
    _check_per_row_int64("seed", seed, batch, device)
    _check_per_row_int64("offset", offset, batch, device)
    if temperature is not None:
        if temperature.dtype != torch.float32:
            _fail(f"temperature must be a float32 tensor, got {temperature.dtype}")
        if temperature.device != device:
            _fail(f"temperature must be on the device of logits ({device}), got {temperature.device}")
        if tuple(temperature.shape) != (batch,):
            _fail(f"temperature must have shape [B] = [{batch}], got {list(temperature.shape)}")
    elif not 0.0 <= temperature_val <= FLOAT32_MAX:  # the kernels run at fp32(temperature_val)
        _fail(f"temperature_val must be finite and >= 0 as a float32 (at most 3.4028235e+38), "
              f"got {temperature_val:g}")  # :g prints a double as C++ streams do
    if compute_mask is not None:
        if compute_mask.dtype != torch.bool:
            _fail(f"compute_mask must be a bool tensor, got {compute_mask.dtype}")
        if compute_mask.device != device:
            _fail(f"compute_mask must be on the device of logits ({device}), got {compute_mask.device}")
        if tuple(compute_mask.shape) != (batch, positions):
            _fail(f"compute_mask must have shape [B, K] = [{batch}, {positions}], "
                  f"got {list(compute_mask.shape)}")
    if not (mask_token_id == -1 or 0 <= mask_token_id < vocab):
        _fail(f"mask_token_id must be -1 (none) or in [0, V) = [0, {vocab}), got {mask_token_id}")
    return SampleDims(batch, positions, vocab)


TEMPERATURE_VALUE_MESSAGE = f"{OP}: temperature must be finite and >= 0"


def temperature_is_valid(temperature: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor on temperature's device: every entry finite and >= 0 (no host sync)."""
    return (torch.isfinite(temperature) & (temperature >= 0)).all()
