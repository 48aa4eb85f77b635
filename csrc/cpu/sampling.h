// Declarations shared by the dispatch file csrc/cpu/sampling.cpp and the per-ISA kernel copies of
// csrc/cpu/sampling_kernel.h (one in each of the namespaces DEFAULT, AVX2, AVX512).
#pragma once
#include <cstdint>

#include <ATen/core/Tensor.h>

#include "cpu/isa.h"

namespace sbd::cpu {

// Validated arguments of sbd::entropy_sample. `logits` is [B, K, V] with stride(2) == 1; per-row inputs
// are read as ptr[b * stride] (stride 0 broadcasts one element); outputs are contiguous [B, K].
struct EntropySampleArgs {
  at::Tensor logits;
  const int64_t* seed;
  int64_t seed_stride;
  const int64_t* offset;
  int64_t offset_stride;
  const float* temperature;  // [B] with temperature_stride, or nullptr: temperature_val for every row
  int64_t temperature_stride;
  float temperature_val;
  const bool* compute_mask;  // contiguous [B, K], or nullptr: every position
  int64_t mask_token_id;     // -1: none
  // Filters, per row b like the temperature: ptr[b * stride], or the scalar when ptr is nullptr.
  const int64_t* top_k;  // 0: off
  int64_t top_k_stride;
  int64_t top_k_val;
  const float* top_p;  // 1: off
  int64_t top_p_stride;
  float top_p_val;
  const float* min_p;  // 0: off
  int64_t min_p_stride;
  float min_p_val;
  bool filters;  // false when every filter is off for every row: the kernel then skips them entirely
  int64_t* tokens;
  float* entropy;
  float* logprob;
  bool* valid;
};

SBD_ISA_DECLARE(void entropy_sample_kernel(const EntropySampleArgs& args))

}  // namespace sbd::cpu
