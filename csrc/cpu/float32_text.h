// Host scalars as the kernels take them, and their text in error messages: the C++ twin of
// sbd_kernels/ops/_float32.py, digit for digit (header-only).
#pragma once

#include <charconv>
#include <cmath>
#include <limits>
#include <string>

namespace sbd::cpu {

// The float32 nearest to x (ties to even). The doubles from the midpoint 2^128 - 2^103 up become inf, tested
// first: converting a double beyond the float range is undefined behaviour in C++.
inline float as_float32(double x) {
  if (std::isnan(x)) return std::numeric_limits<float>::quiet_NaN();
  if (std::abs(x) >= 0x1p128 - 0x1p103) return std::copysign(std::numeric_limits<float>::infinity(), x);
  return static_cast<float>(x);
}

// %g with the fewest significant digits (at most 17) that read back as x, so that 0.999999999999 does not
// print as 1 (a stream's 6 digits); a NaN is "nan" whatever its sign bit (a stream prints "-nan", Python
// "nan").
inline std::string exact_g(double x) {
  if (std::isnan(x)) return "nan";
  char text[32];
  for (int digits = 1;; ++digits) {
    char* end = std::to_chars(text, text + sizeof(text), x, std::chars_format::general, digits).ptr;
    double back = 0;
    std::from_chars(text, end, back);
    if (back == x || digits == 17) return std::string(text, end);
  }
}

}  // namespace sbd::cpu
