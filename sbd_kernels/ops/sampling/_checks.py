"""Argument checks of `sbd.entropy_sample` shared by the oracle, the Triton launcher and the fake kernel.

The wording matches the `TORCH_CHECK`s of csrc/cpu/sampling.cpp word for word (dtypes are printed with
ATen's names, e.g. "Double", and floats by `exact_g`), so every backend names the same argument in the
same words.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from sbd_kernels.ops._float32 import as_float32, exact_g
from sbd_kernels.ops._trusted import values_trusted

OP = "sbd.entropy_sample"
LOGITS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class SampleDims(NamedTuple):
    batch: int
    positions: int
    vocab: int


def _fail(message: str) -> None:
    raise RuntimeError(f"{OP}: {message}")


def _check_float32_scalar(name: str, value: float, in_range: Callable[[float], bool], rule: str) -> None:
    """temperature_val, top_p_val, min_p_val: checked as the float32 the kernels run at, like an entry of
    the [B] tensor. The message names the float32 when only the rounding puts the value out of range
    (top_p_val 1e-50 is 0 as a float32)."""
    value32 = as_float32(value)
    if in_range(value32):
        return
    rounded = f" ({exact_g(value32)} as a float32)" if in_range(value) else ""
    _fail(f"{name} must be {rule}, got {exact_g(value)}{rounded}")


# c10's names of the ScalarTypes whose name is not the Python one with its prefix capitalised.
_ATEN_NAMES = {"float64": "Double", "float32": "Float", "float16": "Half", "bfloat16": "BFloat16", "int64": "Long",
               "int32": "Int", "int16": "Short", "int8": "Char", "uint8": "Byte", "bool": "Bool",
               "complex128": "ComplexDouble", "complex64": "ComplexFloat", "complex32": "ComplexHalf"}
# Prefixes of the other dtypes and c10's spelling of them ("uint16" -> "UInt16", "float8_e4m3fn" ->
# "Float8_e4m3fn", "quint4x2" -> "QUInt4x2"); none is the start of another.
_ATEN_PREFIXES = (("quint", "QUInt"), ("qint", "QInt"), ("uint", "UInt"), ("int", "Int"), ("bits", "Bits"),
                  ("float", "Float"))


def _dtype_name(dtype: torch.dtype) -> str:
    """ATen's name of `dtype` ("Double", "Long", "Float8_e4m3fn"), as `TORCH_CHECK(..., t.scalar_type())`
    prints it (c10::toString), with no tensor made (the fake kernel calls this too). Derived by rule rather
    than read from a private torch API; a dtype the rule does not know is named as Python names it."""
    name = str(dtype).removeprefix("torch.")
    if name in _ATEN_NAMES:
        return _ATEN_NAMES[name]
    for prefix, aten in _ATEN_PREFIXES:
        if name.startswith(prefix):
            return aten + name[len(prefix):]
    return name


def _check_per_row_int64(name: str, t: torch.Tensor, batch: int, device: torch.device) -> None:
    """seed / offset: int64, shape [B], or one element ([] or [1]) shared by every row."""
    if t.dtype != torch.int64:
        _fail(f"{name} must be an int64 tensor, got {_dtype_name(t.dtype)}")
    if t.device != device:
        _fail(f"{name} must be on the device of logits ({device}), got {t.device}")
    if not (tuple(t.shape) == (batch,) or t.dim() == 0 or tuple(t.shape) == (1,)):
        _fail(f"{name} must have shape [B] = [{batch}], [] or [1], got {list(t.shape)}")


def _check_per_row_tensor(name: str, t: torch.Tensor, dtype: torch.dtype, kind: str, batch: int,
                          device: torch.device) -> None:
    """temperature / top_k / top_p / min_p: a [B] tensor of `dtype` ("a float32", "an int64")."""
    if t.dtype != dtype:
        _fail(f"{name} must be {kind} tensor, got {_dtype_name(t.dtype)}")
    if t.device != device:
        _fail(f"{name} must be on the device of logits ({device}), got {t.device}")
    if tuple(t.shape) != (batch,):
        _fail(f"{name} must have shape [B] = [{batch}], got {list(t.shape)}")


def check_entropy_sample_args(logits: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor,
                              temperature: torch.Tensor | None, temperature_val: float,
                              compute_mask: torch.Tensor | None, mask_token_id: int,
                              top_k: torch.Tensor | None = None, top_k_val: int = 0,
                              top_p: torch.Tensor | None = None, top_p_val: float = 1.0,
                              min_p: torch.Tensor | None = None, min_p_val: float = 0.0) -> SampleDims:
    """Checks dtypes, shapes, devices and host scalars (no device values); returns (B, K, V)."""
    if logits.dim() != 3:
        _fail(f"logits must be a 3-D tensor [B, K, V], got shape {list(logits.shape)}")
    if logits.dtype not in LOGITS_DTYPES:
        _fail(f"logits must be float32, float16 or bfloat16, got {_dtype_name(logits.dtype)}")
    batch, positions, vocab = logits.shape
    if vocab < 1:
        _fail("logits must have a vocabulary dimension V >= 1")
    device = logits.device
    _check_per_row_int64("seed", seed, batch, device)
    _check_per_row_int64("offset", offset, batch, device)
    if temperature is not None:
        _check_per_row_tensor("temperature", temperature, torch.float32, "a float32", batch, device)
    else:
        _check_float32_scalar("temperature_val", temperature_val, lambda t: t >= 0 and math.isfinite(t),
                              "finite and >= 0 as a float32 (at most 3.4028235e+38)")
    if compute_mask is not None:
        if compute_mask.dtype != torch.bool:
            _fail(f"compute_mask must be a bool tensor, got {_dtype_name(compute_mask.dtype)}")
        if compute_mask.device != device:
            _fail(f"compute_mask must be on the device of logits ({device}), got {compute_mask.device}")
        if tuple(compute_mask.shape) != (batch, positions):
            _fail(f"compute_mask must have shape [B, K] = [{batch}, {positions}], "
                  f"got {list(compute_mask.shape)}")
    if not (mask_token_id == -1 or 0 <= mask_token_id < vocab):
        _fail(f"mask_token_id must be -1 (none) or in [0, V) = [0, {vocab}), got {mask_token_id}")
    _check_filters(top_k, top_k_val, top_p, top_p_val, min_p, min_p_val, batch, device)
    return SampleDims(batch, positions, vocab)


def _check_filters(top_k, top_k_val, top_p, top_p_val, min_p, min_p_val, batch, device) -> None:
    if top_k is not None:
        _check_per_row_tensor("top_k", top_k, torch.int64, "an int64", batch, device)
    elif not top_k_val >= 0:
        _fail(f"top_k_val must be >= 0 (0: off), got {top_k_val}")
    if top_p is not None:
        _check_per_row_tensor("top_p", top_p, torch.float32, "a float32", batch, device)
    else:
        _check_float32_scalar("top_p_val", top_p_val, lambda p: 0 < p <= 1, "in (0, 1] as a float32 (1: off)")
    if min_p is not None:
        _check_per_row_tensor("min_p", min_p, torch.float32, "a float32", batch, device)
    else:
        _check_float32_scalar("min_p_val", min_p_val, lambda p: 0 <= p < 1, "in [0, 1) as a float32 (0: off)")


# Value checks of the per-row tensors: the oracle raises them, the Triton launcher asserts them on the
# device without a host sync (torch._assert_async), the C++ kernel checks them on the host. Both Python
# backends skip them inside `sbd_kernels.ops.trusted_values()`.
TEMPERATURE_VALUE_MESSAGE = f"{OP}: temperature must be finite and >= 0"
TOP_K_VALUE_MESSAGE = f"{OP}: top_k must be >= 0 (0: off)"
TOP_P_VALUE_MESSAGE = f"{OP}: top_p must be in (0, 1] (1: off)"
MIN_P_VALUE_MESSAGE = f"{OP}: min_p must be in [0, 1) (0: off)"


def temperature_is_valid(temperature: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor on temperature's device: every entry finite and >= 0 (no host sync)."""
    return (torch.isfinite(temperature) & (temperature >= 0)).all()


def per_row_value_checks(temperature, top_k, top_p, min_p) -> list[tuple[torch.Tensor, str]]:
    """(0-d bool tensor, message) of every per-row tensor given: its values are in range (NaN is not).
    Empty inside `trusted_values()`: these values only enter comparisons in the kernels, never an address."""
    if values_trusted():
        return []
    checks = []
    if temperature is not None:
        checks.append((temperature_is_valid(temperature), TEMPERATURE_VALUE_MESSAGE))
    if top_k is not None:
        checks.append(((top_k >= 0).all(), TOP_K_VALUE_MESSAGE))
    if top_p is not None:
        checks.append((((top_p > 0) & (top_p <= 1)).all(), TOP_P_VALUE_MESSAGE))
    if min_p is not None:
        checks.append((((min_p >= 0) & (min_p < 1)).all(), MIN_P_VALUE_MESSAGE))
    return checks


def filters_requested(top_k, top_k_val, top_p, top_p_val, min_p, min_p_val) -> bool:
    """Whether any filter may be on for some row (a tensor given, or a scalar that is not off)."""
    return (top_k is not None or top_p is not None or min_p is not None or top_k_val > 0
            or top_p_val < 1.0 or min_p_val > 0.0)
