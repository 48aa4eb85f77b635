// CPU kernel of sbd::block_attention_with_kvcache: argument checks, output allocation and the ISA dispatch
// into csrc/cpu/attention_kernel.h. The math is defined in sbd_kernels/ops/attention/naive.py; the checks
// word for word match sbd_kernels/ops/attention/_checks.py. Value checks (lengths, page ids) are free on
// the CPU, so they run here before the kernel touches memory.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include "cpu/attention.h"
#include "cpu/float32_text.h"
#include "cpu/isa.h"
#include "cpu/overlap.h"

namespace sbd::cpu {
namespace {

constexpr const char* kOp = "sbd.block_attention_with_kvcache";
constexpr int64_t kMaxHeadDim = 256;

// Python's names ("torch.float32"), so that messages read as those of _checks.py.
std::string dtype_name(at::ScalarType type) { return "torch." + std::string(c10::getDtypeNames(type).first); }

// Layout reminders appended to shape errors (as _checks.QKV_LAYOUT / CACHE_LAYOUT): the usual cause is a tensor
// in Hugging Face's head-major layout.
constexpr const char* kQkvLayout =
    "q, k and v are [B, S, H, D] (Hugging Face attention passes [B, H, S, D]: call .transpose(1, 2) on q, k and v)";
constexpr const char* kCacheLayout =
    "caches are [B, S_max, Hkv, D] or paged [num_pages, page_size, Hkv, D] (a Hugging Face StaticCache layer is "
    "[B, Hkv, S_max, D]: call .transpose(1, 2))";

// "<name> dimension <dim> (<label>) is <got>, <other>'s is <expected>; <layout>" unless got == expected.
void check_dim(const char* name, int64_t dim, const char* label, int64_t got, const char* other, int64_t expected,
               const char* layout) {
  TORCH_CHECK(got == expected, kOp, ": ", name, " dimension ", dim, " (", label, ") is ", got, ", ", other, "'s is ",
              expected, "; ", layout);
}

void check_cache(const char* name, const at::Tensor& cache, const at::Tensor& q, int64_t kv_heads) {
  TORCH_CHECK(cache.dim() == 4, kOp, ": ", name, " must be 4-D, got shape ", cache.sizes(), "; ", kCacheLayout);
  TORCH_CHECK(cache.scalar_type() == q.scalar_type(), kOp, ": ", name, " must have the dtype of q (",
              dtype_name(q.scalar_type()), "), got ", dtype_name(cache.scalar_type()));
  TORCH_CHECK(cache.device() == q.device(), kOp, ": ", name, " must be on the device of q (", q.device(),
              "), got ", cache.device());
  check_dim(name, 2, "Hkv", cache.size(2), "k", kv_heads, kCacheLayout);
  check_dim(name, 3, "D", cache.size(3), "q", q.size(3), kCacheLayout);
  TORCH_CHECK(cache.stride(3) == 1, kOp, ": ", name, " must have a contiguous last dimension (stride 1)");
}

void check_int32_vector(const char* name, const at::Tensor& t, int64_t batch, const at::Tensor& q) {
  TORCH_CHECK(t.scalar_type() == at::kInt, kOp, ": ", name, " must be int32, got ", dtype_name(t.scalar_type()));
  TORCH_CHECK(t.dim() == 1 && t.size(0) == batch, kOp, ": ", name, " must have shape [", batch, "], got ",
              t.sizes());
  TORCH_CHECK(t.device() == q.device(), kOp, ": ", name, " must be on the device of q (", q.device(),
              "), got ", t.device());
}

void check_block_table(const at::Tensor& table, int64_t batch, const at::Tensor& q, const at::Tensor& k_cache) {
  TORCH_CHECK(table.scalar_type() == at::kInt, kOp, ": block_table must be int32, got ",
              dtype_name(table.scalar_type()));
  TORCH_CHECK(table.dim() == 2 && table.size(0) == batch, kOp, ": block_table must have shape [", batch,
              ", max_pages], got ", table.sizes());
  TORCH_CHECK(table.device() == q.device(), kOp, ": block_table must be on the device of q (", q.device(),
              "), got ", table.device());
  TORCH_CHECK(k_cache.size(1) > 0, kOp, ": k_cache page size must be positive");
}

// Do the storages of a and b share a byte? A view never reaches outside its storage, so when they do not,
// neither do the views (separate allocations, the usual case).
bool storages_meet(const at::Tensor& a, const at::Tensor& b) {
  const auto* first_a = static_cast<const char*>(a.storage().data());
  const auto* first_b = static_cast<const char*>(b.storage().data());
  return first_a < first_b + b.storage().nbytes() && first_b < first_a + a.storage().nbytes();
}

// The caches are written in place: no internal overlap, no memory shared with each other or with any
// argument read (as _checks._check_no_aliasing; exact for strided views, see cpu/overlap.h). Metadata only.
void check_no_aliasing(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& cache_seqlens, const at::Tensor& num_causal,
                       const c10::optional<at::Tensor>& block_table) {
  using Named = std::pair<const char*, const at::Tensor*>;
  const Named caches[] = {{"k_cache", &k_cache}, {"v_cache", &v_cache}};
  for (const auto& [name, cache] : caches) {
    if (!cache->is_contiguous()) check_writable(kOp, name, *cache);
  }
  std::vector<std::pair<Named, Named>> pairs = {{caches[0], caches[1]}};
  for (const auto& cache : caches) {
    for (const Named& read : {Named{"q", &q}, {"k", &k}, {"v", &v}, {"cache_seqlens", &cache_seqlens},
                              {"num_causal", &num_causal}}) {
      pairs.push_back({cache, read});
    }
    if (block_table.has_value()) pairs.push_back({cache, {"block_table", &*block_table}});
  }
  for (const auto& [written, other] : pairs) {
    if (storages_meet(*written.second, *other.second)) {
      check_disjoint(kOp, written.first, *written.second, other.first, *other.second);
    }
  }
}

// Shapes, dtypes, devices, softmax_scale, aliasing (same order and wording as
// _checks.check_block_attention_args).
void check_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                const at::Tensor& v_cache, const at::Tensor& cache_seqlens, const at::Tensor& num_causal,
                int64_t block_size, const c10::optional<at::Tensor>& block_table,
                c10::optional<double> softmax_scale) {
  TORCH_CHECK(q.dim() == 4, kOp, ": q must be 4-D [B, S, Hq, D], got shape ", q.sizes(), "; ", kQkvLayout);
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              kOp, ": q must be float32, float16 or bfloat16, got ", dtype_name(q.scalar_type()));
  const int64_t batch = q.size(0), seq = q.size(1), q_heads = q.size(2), dim = q.size(3);
  TORCH_CHECK(dim > 0 && dim <= kMaxHeadDim, kOp, ": q head dim must be in [1, ", kMaxHeadDim, "], got ", dim);
  TORCH_CHECK(k.dim() == 4, kOp, ": k must be 4-D [B, S, Hkv, D], got shape ", k.sizes(), "; ", kQkvLayout);
  check_dim("k", 0, "B", k.size(0), "q", batch, kQkvLayout);
  check_dim("k", 1, "S", k.size(1), "q", seq, kQkvLayout);
  check_dim("k", 3, "D", k.size(3), "q", dim, kQkvLayout);
  const int64_t kv_heads = k.size(2);
  TORCH_CHECK(kv_heads > 0 && q_heads % kv_heads == 0, kOp, ": q heads (", q_heads,
              ") must be a multiple of k heads (", kv_heads, ")");
  TORCH_CHECK(v.sizes() == k.sizes(), kOp, ": v shape ", v.sizes(), " must equal k shape ", k.sizes());
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"k", k}, {"v", v}}) {
    TORCH_CHECK(t.scalar_type() == q.scalar_type(), kOp, ": ", name, " must have the dtype of q (",
                dtype_name(q.scalar_type()), "), got ", dtype_name(t.scalar_type()));
    TORCH_CHECK(t.device() == q.device(), kOp, ": ", name, " must be on the device of q (", q.device(),
                "), got ", t.device());
  }
  TORCH_CHECK(block_size >= 0 && block_size <= seq, kOp, ": block_size must be in [0, S=", seq, "], got ",
              block_size);
  if (softmax_scale.has_value()) {
    // The kernel uses fp32(softmax_scale): the doubles strictly between 2^-150 and 2^128 - 2^103 (the
    // midpoints that round to 0 and to inf) become finite and > 0; 1e39 would become inf, 1e-50 zero.
    // Compared as doubles: converting an out-of-range double to float is undefined behaviour.
    // The message names the float32 when only the rounding puts the value out of range (1e-50 is 0).
    const double scale = *softmax_scale;
    const bool finite_positive = scale > 0 && std::isfinite(scale);
    TORCH_CHECK(scale > 0x1p-150 && scale < 0x1p128 - 0x1p103, kOp,
                ": softmax_scale must be finite and > 0 as a float32, got ", exact_g(scale),
                finite_positive ? " (" + exact_g(as_float32(scale)) + " as a float32)" : std::string());
  }
  check_cache("k_cache", k_cache, q, kv_heads);
  check_cache("v_cache", v_cache, q, kv_heads);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), kOp, ": v_cache shape ", v_cache.sizes(),
              " must equal k_cache shape ", k_cache.sizes());
  check_int32_vector("cache_seqlens", cache_seqlens, batch, q);
  check_int32_vector("num_causal", num_causal, batch, q);
  if (block_table.has_value()) {
    check_block_table(*block_table, batch, q, k_cache);
  } else {
    TORCH_CHECK(k_cache.size(0) == batch, kOp, ": k_cache must have batch size ", batch,
                " (contiguous cache), got ", k_cache.size(0));
  }
  check_no_aliasing(q, k, v, k_cache, v_cache, cache_seqlens, num_causal, block_table);
}

// Values (same order and wording as _checks.assert_block_attention_values): L >= 0, 0 <= c <= C,
// L + c <= capacity, page ids of the pages holding slots [0, L + c) in [0, num_pages), pages written used once. Each condition is
// checked over the whole batch before the next, as the Python checks do (one torch._assert_async per
// condition, which keeps them free of host syncs on CUDA), so that a call with two bad values in different
// sequences raises the same error in both.
void check_values(const int32_t* lengths, const int32_t* causal, const int32_t* table, int64_t table_stride,
                  int64_t batch, int64_t causal_slots, int64_t page_size, int64_t capacity, int64_t num_pages) {
  for (int64_t b = 0; b < batch; ++b) TORCH_CHECK(lengths[b] >= 0, kOp, ": cache_seqlens must be >= 0");
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(causal[b] >= 0 && causal[b] <= causal_slots, kOp, ": num_causal must be in [0, C=",
                causal_slots, "]");
  }
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(static_cast<int64_t>(lengths[b]) + causal[b] <= capacity, kOp,
                ": cache_seqlens + num_causal exceeds the cache capacity (", capacity, " slots)");
  }
  if (table == nullptr) return;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t end = static_cast<int64_t>(lengths[b]) + causal[b];
    for (int64_t p = 0; p < (end + page_size - 1) / page_size; ++p) {
      const int32_t page = table[b * table_stride + p];
      TORCH_CHECK(page >= 0 && page < num_pages, kOp, ": block_table holds a page id outside [0, ", num_pages,
                  ") for a used page");
    }
  }
  // A page written by the call (holding slots [L_b, L_b + c_b)) must be used once in the whole table: shared
  // pages are read-only, since the write of one sequence would race with another's reads (the sequences run
  // in parallel) or with its own second mapping of the page. One byte per page, counting to 2.
  std::vector<uint8_t> uses(num_pages, 0);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t end = static_cast<int64_t>(lengths[b]) + causal[b];
    for (int64_t p = 0; p < (end + page_size - 1) / page_size; ++p) {
      uint8_t& count = uses[table[b * table_stride + p]];
      count = std::min<uint8_t>(count + 1, 2);
    }
  }
  for (int64_t b = 0; b < batch; ++b) {
    if (causal[b] == 0) continue;
    const int64_t end = static_cast<int64_t>(lengths[b]) + causal[b];
    for (int64_t p = lengths[b] / page_size; p < (end + page_size - 1) / page_size; ++p) {
      TORCH_CHECK(uses[table[b * table_stride + p]] == 1, kOp, ": block_table maps a page the call writes (slots "
                  "[L_b, L_b + c_b)) to more than one used entry; pages shared between sequences must be read-only");
    }
  }
}

std::tuple<at::Tensor, at::Tensor> block_attention_with_kvcache_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
    const at::Tensor& cache_seqlens, const at::Tensor& num_causal, int64_t block_size,
    const c10::optional<at::Tensor>& block_table, c10::optional<double> softmax_scale) {
  check_args(q, k, v, k_cache, v_cache, cache_seqlens, num_causal, block_size, block_table, softmax_scale);
  const int64_t batch = q.size(0), seq = q.size(1), q_heads = q.size(2), dim = q.size(3);
  const at::Tensor lengths = cache_seqlens.contiguous();
  const at::Tensor causal = num_causal.contiguous();
  const at::Tensor table = block_table.has_value() ? block_table->contiguous() : at::Tensor();
  const bool paged = table.defined();
  const int64_t page_size = k_cache.size(1);
  const int64_t capacity = paged ? table.size(1) * page_size : page_size;
  check_values(lengths.data_ptr<int32_t>(), causal.data_ptr<int32_t>(), paged ? table.data_ptr<int32_t>() : nullptr,
               paged ? table.size(1) : 0, batch, seq - block_size, paged ? page_size : capacity, capacity,
               k_cache.size(0));

  BlockAttentionArgs args;
  args.q = q.contiguous();
  args.k = k.contiguous();
  args.v = v.contiguous();
  args.k_cache = k_cache;
  args.v_cache = v_cache;
  // Padding rows keep these values (out = 0, lse = -inf); the kernel writes every other row.
  args.out = at::zeros({batch, seq, q_heads, dim}, q.options());
  args.lse = at::full({batch, q_heads, seq}, -std::numeric_limits<float>::infinity(), q.options().dtype(at::kFloat));
  args.cache_seqlens = lengths.data_ptr<int32_t>();
  args.num_causal = causal.data_ptr<int32_t>();
  args.block_table = paged ? table.data_ptr<int32_t>() : nullptr;
  args.table_stride = paged ? table.size(1) : 0;
  args.num_causal_slots = seq - block_size;
  args.block_size = block_size;
  args.scale = static_cast<float>(softmax_scale.has_value() ? *softmax_scale : 1.0 / std::sqrt(double(dim)));
  if (batch > 0 && seq > 0) SBD_ISA_DISPATCH(block_attention_kernel, args);
  return {args.out, args.lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(sbd, CPU, m) {
  m.impl("block_attention_with_kvcache", &block_attention_with_kvcache_cpu);
}

}  // namespace sbd::cpu
