// Declarations shared by the dispatch file csrc/cpu/attention.cpp and the per-ISA kernel copies of
// csrc/cpu/attention_kernel.h (one in each of the namespaces DEFAULT, AVX2, AVX512).
#pragma once
#include <cstdint>

#include <ATen/core/Tensor.h>

#include "cpu/isa.h"

namespace sbd::cpu {

// Validated arguments of sbd::block_attention_with_kvcache.
// q [B, S, Hq, D], k / v [B, S, Hkv, D]: contiguous. Caches: [B, S_max, Hkv, D] (block_table == nullptr)
// or [num_pages, page_size, Hkv, D], any strides but a contiguous last dimension. out [B, S, Hq, D] and
// lse [B, Hq, S] are contiguous and pre-filled with 0 / -inf, so padding rows need no write.
struct BlockAttentionArgs {
  at::Tensor q, k, v, k_cache, v_cache, out, lse;
  const int32_t* cache_seqlens;  // [B], validated: >= 0, L + c <= capacity
  const int32_t* num_causal;     // [B], validated: in [0, C]
  const int32_t* block_table;    // [B, table_stride] page ids (validated for the pages in use), or nullptr
  int64_t table_stride;
  int64_t num_causal_slots;  // C
  int64_t block_size;        // K
  float scale;
};

SBD_ISA_DECLARE(void block_attention_kernel(const BlockAttentionArgs& args))

}  // namespace sbd::cpu
