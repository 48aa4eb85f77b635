"""Host scalars as the kernels take them: a double rounded to the float32 nearest to it, and its text in
error messages, digit for digit as the C++ checks print it (csrc/cpu/float32_text.h)."""
from __future__ import annotations

import math
import struct

FLOAT32_MAX = (2 - 2.0**-23) * 2.0**127  # the largest finite float32, 3.4028234663852886e38


def as_float32(value: float) -> float:
    """The float32 nearest to `value` (ties to even), as the kernels take a host scalar: inf from the
    midpoint 2^128 - 2^103 up (3.4028235e38 rounds to the largest float32, 1e39 to inf), 0 up to the
    midpoint 2^-150 (1e-50)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # struct refuses a finite double whose float32 is inf
        return math.inf if value > 0 else -math.inf


def exact_g(value: float) -> str:
    """`value` as "%g" with the fewest significant digits (at most 17) that read back as `value`: the C++
    checks' exact_g, digit for digit. f"{value:g}" printed 0.999999999999 as 1."""
    if math.isnan(value):
        return "nan"
    for digits in range(1, 18):
        text = f"{value:.{digits}g}"
        if float(text) == value:
            break
    return text
