// Memory overlap of strided tensors, decided from sizes, strides and data pointers only (header-only).
//
// The C++ twin of sbd_kernels/ops/_overlap.py, step for step (same search, same step budget, same
// answers; tests/test_overlap.py holds both against a brute-force enumeration):
//   internal_overlap(t)   do two different indices of t address the same element?
//   views_overlap(a, b)   do a and b share any byte of memory?
// Exact for strided views, not conservative on byte ranges: kv[:, 0] and kv[:, 1] of a combined paged KV
// allocation, column slices of a fused qkv output, big[:, ::2] beside big[:, 1::2] are disjoint.
//
// Method (the Python module's docstring has the long form): size-1 dims dropped, dims sorted by stride,
// contiguous neighbours merged. Internal overlap: a stride-0 dim overlaps; dim d adds no collision when
// its stride exceeds the extent sum_{d' < d} (size - 1) * stride of the dims below; otherwise the lower
// dims shifted by m * stride_d are intersected with themselves. Two views: disjoint address ranges share
// nothing; else peel the top dims (equal top strides S: only the shifts m * S that bring the lower
// ranges together; else split the view with the larger top stride into the slices that meet the other).
// Each step past the range test spends one of kSearchSteps; past them the answer is kMaybe.
//
// Arithmetic is int64: a tensor's extent in bytes is below 2^63 (PyTorch checks storage sizes for
// overflow), and so is the distance between two data pointers.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace sbd::cpu {

// Values returned by the private ops sbd::_internal_overlap / sbd::_views_overlap (sbd_ops.cpp).
enum class Overlap : int64_t { kNo = 0, kYes = 1, kMaybe = 2 };

// Steps of the exact search before it answers kMaybe; the same number as SEARCH_STEPS in _overlap.py.
constexpr int64_t kSearchSteps = int64_t{1} << 16;

namespace overlap_detail {

struct Dim {
  int64_t size;
  int64_t stride;
};
using Dims = std::vector<Dim>;  // size >= 2, ascending by (stride, size)

// Size-1 dims dropped (stride-0 dims too unless keep_zero_strides), sorted by (stride, size), contiguous
// neighbours merged. The set of addresses is unchanged.
inline Dims normal_dims(at::IntArrayRef sizes, at::IntArrayRef strides, bool keep_zero_strides) {
  std::vector<std::pair<int64_t, int64_t>> sorted;  // (stride, size)
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] > 1 && (strides[d] != 0 || keep_zero_strides)) sorted.emplace_back(strides[d], sizes[d]);
  }
  std::sort(sorted.begin(), sorted.end());
  Dims merged;
  for (const auto& [stride, size] : sorted) {
    if (!merged.empty() && merged.back().stride != 0 && stride == merged.back().size * merged.back().stride) {
      merged.back().size *= size;
    } else {
      merged.push_back({size, stride});
    }
  }
  return merged;
}

// Extent of the first n dims: sum of (size - 1) * stride.
inline int64_t extent(const Dims& dims, size_t n) {
  int64_t total = 0;
  for (size_t d = 0; d < n; ++d) total += (dims[d].size - 1) * dims[d].stride;
  return total;
}

inline int64_t floor_div(int64_t a, int64_t b) {  // b > 0
  const int64_t q = a / b;
  return (a % b != 0 && a < 0) ? q - 1 : q;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return -floor_div(-a, b); }  // b > 0

struct Budget {
  int64_t steps = kSearchSteps;
  bool spend() {
    if (steps == 0) return false;
    --steps;
    return true;
  }
};

// Do off_a + L(first na dims of a) and off_b + L(first nb dims of b) intersect?
inline Overlap intersect(int64_t off_a, const Dims& a, size_t na, int64_t off_b, const Dims& b, size_t nb,
                         Budget& budget) {
  const int64_t ext_a = extent(a, na);
  const int64_t ext_b = extent(b, nb);
  if (off_a + ext_a < off_b || off_b + ext_b < off_a) return Overlap::kNo;
  if (na == 0 && nb == 0) return Overlap::kYes;  // two single addresses whose ranges meet: equal
  if (!budget.spend()) return Overlap::kMaybe;
  const int64_t top_a = na > 0 ? a[na - 1].stride : 0;
  const int64_t top_b = nb > 0 ? b[nb - 1].stride : 0;
  if (top_a == top_b) {
    // off_a + i S + x == off_b + j S + y  <=>  off_a + x == off_b - m S + y with m = i - j.
    const int64_t step = top_a;
    const int64_t gap = off_b - off_a;
    const int64_t first = std::max(-(b[nb - 1].size - 1), ceil_div(gap - extent(a, na - 1), step));
    const int64_t last = std::min(a[na - 1].size - 1, floor_div(gap + extent(b, nb - 1), step));
    for (int64_t m = first; m <= last; ++m) {
      const Overlap answer = intersect(off_a, a, na - 1, off_b - m * step, b, nb - 1, budget);
      if (answer != Overlap::kNo) return answer;
    }
    return Overlap::kNo;
  }
  // Split the view with the larger top stride (`split`) into the slices that meet the other (`whole`).
  const bool split_a = top_a > top_b;
  const int64_t off_split = split_a ? off_a : off_b;
  const Dims& split = split_a ? a : b;
  const size_t n_split = split_a ? na : nb;
  const int64_t off_whole = split_a ? off_b : off_a;
  const Dims& whole = split_a ? b : a;
  const size_t n_whole = split_a ? nb : na;
  const int64_t ext_whole = split_a ? ext_b : ext_a;
  const int64_t step = split[n_split - 1].stride;
  const int64_t first = std::max<int64_t>(0, ceil_div(off_whole - off_split - extent(split, n_split - 1), step));
  const int64_t last = std::min(split[n_split - 1].size - 1, floor_div(off_whole + ext_whole - off_split, step));
  for (int64_t i = first; i <= last; ++i) {
    const Overlap answer = intersect(off_split + i * step, split, n_split - 1, off_whole, whole, n_whole, budget);
    if (answer != Overlap::kNo) return answer;  // kYes, or kMaybe: the budget is spent
  }
  return Overlap::kNo;
}

inline bool has_zero_size(at::IntArrayRef sizes) {
  return std::any_of(sizes.begin(), sizes.end(), [](int64_t n) { return n == 0; });
}

inline Overlap views_overlap_of(int64_t offset_a, at::IntArrayRef sizes_a, at::IntArrayRef strides_a,
                                int64_t offset_b, at::IntArrayRef sizes_b, at::IntArrayRef strides_b) {
  if (has_zero_size(sizes_a) || has_zero_size(sizes_b)) return Overlap::kNo;
  const Dims a = normal_dims(sizes_a, strides_a, false);
  const Dims b = normal_dims(sizes_b, strides_b, false);
  Budget budget;
  return intersect(offset_a, a, a.size(), offset_b, b, b.size(), budget);
}

// Sizes and strides in bytes, with each element as an innermost dim of its byte size and stride 1.
inline std::pair<std::vector<int64_t>, std::vector<int64_t>> byte_layout(const at::Tensor& t) {
  const int64_t item = static_cast<int64_t>(t.element_size());
  std::vector<int64_t> sizes(t.sizes().begin(), t.sizes().end());
  std::vector<int64_t> strides;
  for (int64_t s : t.strides()) strides.push_back(s * item);
  sizes.push_back(item);
  strides.push_back(1);
  return {sizes, strides};
}

// [first byte, last byte + 1) spanned by the elements of t, which has some.
inline std::pair<uintptr_t, uintptr_t> byte_span(const at::Tensor& t) {
  int64_t extent = 0;
  for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
  const auto first = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  return {first, first + static_cast<uintptr_t>((extent + 1) * static_cast<int64_t>(t.element_size()))};
}

inline std::string layout_text(const at::Tensor& t) {
  std::ostringstream out;
  out << "sizes " << t.sizes() << ", strides " << t.strides();
  return out.str();
}

}  // namespace overlap_detail

// Do two different indices of t address the same element? From sizes and strides only (meta tensors too).
inline Overlap internal_overlap(const at::Tensor& t) {
  using namespace overlap_detail;
  if (has_zero_size(t.sizes())) return Overlap::kNo;
  const Dims dims = normal_dims(t.sizes(), t.strides(), true);
  if (!dims.empty() && dims[0].stride == 0) return Overlap::kYes;
  Budget budget;
  for (size_t d = 0; d < dims.size(); ++d) {
    const int64_t low_extent = extent(dims, d);
    const int64_t shifts = std::min(dims[d].size - 1, low_extent / dims[d].stride);
    for (int64_t m = 1; m <= shifts; ++m) {
      const Overlap answer = intersect(0, dims, d, m * dims[d].stride, dims, d, budget);
      if (answer != Overlap::kNo) return answer;
    }
  }
  return Overlap::kNo;
}

// Do a and b share any byte of memory? From data pointers, sizes and strides (never reads data). Tensors
// on different devices share nothing. Meta tensors have no data pointer: an error.
inline Overlap views_overlap(const at::Tensor& a, const at::Tensor& b) {
  using namespace overlap_detail;
  TORCH_CHECK(!a.is_meta() && !b.is_meta(), "views_overlap: meta tensors have no data pointer to compare");
  if (a.numel() == 0 || b.numel() == 0) return Overlap::kNo;
  const auto [first_a, end_a] = byte_span(a);
  const auto [first_b, end_b] = byte_span(b);
  // The search's first test, in bytes (it would answer the same): separate allocations end here.
  if (end_a <= first_b || end_b <= first_a || a.device() != b.device()) return Overlap::kNo;
  const int64_t item_a = static_cast<int64_t>(a.element_size());
  const int64_t item_b = static_cast<int64_t>(b.element_size());
  const int64_t gap = static_cast<int64_t>(first_b - first_a);  // bytes
  if (item_a == item_b && gap % item_a == 0) {
    return views_overlap_of(0, a.sizes(), a.strides(), gap / item_a, b.sizes(), b.strides());
  }
  const auto [sizes_a, strides_a] = byte_layout(a);
  const auto [sizes_b, strides_b] = byte_layout(b);
  return views_overlap_of(0, sizes_a, strides_a, gap, sizes_b, strides_b);
}

// a and b address the same bytes index for index: same data pointer, element size, shape and strides
// (strides of size-1 dims ignored). A kernel that reads b[i] only to write a[i] is then safe.
inline bool same_elements(const at::Tensor& a, const at::Tensor& b) {
  if (a.device() != b.device() || a.const_data_ptr() != b.const_data_ptr() ||
      a.element_size() != b.element_size() || a.sizes() != b.sizes()) {
    return false;
  }
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

// Error naming `name` unless no two elements of t (written in place by `op`) share memory.
inline void check_writable(const char* op, const char* name, const at::Tensor& t) {
  if (t.is_contiguous()) return;
  const Overlap answer = internal_overlap(t);
  TORCH_CHECK(answer != Overlap::kYes, op, ": ", name,
              " is written in place and must not have elements sharing memory (an expanded or overlapping "
              "view: ", overlap_detail::layout_text(t), ")");
  TORCH_CHECK(answer != Overlap::kMaybe, op, ": ", name,
              " is written in place and may have elements sharing memory (could not decide for ",
              overlap_detail::layout_text(t), "); pass a view with non-overlapping strides");
}

// Error naming both arguments if `written` (written in place by `op`) shares memory with `other`.
// identical_ok: allow `other` to be the same elements as `written` index for index (for an argument read
// only at the position it is written to).
inline void check_disjoint(const char* op, const char* written_name, const at::Tensor& written,
                           const char* other_name, const at::Tensor& other, bool identical_ok = false) {
  if (identical_ok && same_elements(written, other)) return;
  const Overlap answer = views_overlap(written, other);
  TORCH_CHECK(answer != Overlap::kYes, op, ": ", written_name,
              " is written in place and must not share memory with ", other_name);
  TORCH_CHECK(answer != Overlap::kMaybe, op, ": ", written_name, " is written in place and may share memory with ",
              other_name, " (could not decide for ", written_name, " ", overlap_detail::layout_text(written),
              " and ", other_name, " ", overlap_detail::layout_text(other), ")");
}

// A named argument for check_not_sharing; tensor == nullptr: an absent optional argument, skipped.
struct NamedTensor {
  const char* name;
  const at::Tensor* tensor;
};

// check_disjoint for every written argument against each later written one and every read one, in that
// order (the order of the Python check_not_sharing, so both name the same pair first). identical_ok
// lists the (written, read) name pairs that may be the same elements. Tensors with data (not meta).
inline void check_not_sharing(const char* op, std::initializer_list<NamedTensor> written,
                              std::initializer_list<NamedTensor> read,
                              std::initializer_list<std::pair<std::string_view, std::string_view>> identical_ok = {}) {
  std::vector<NamedTensor> all(written);
  all.insert(all.end(), read.begin(), read.end());
  for (size_t i = 0; i < written.size(); ++i) {
    if (all[i].tensor == nullptr) continue;
    for (size_t j = i + 1; j < all.size(); ++j) {
      if (all[j].tensor == nullptr) continue;
      const bool allowed = std::any_of(identical_ok.begin(), identical_ok.end(), [&](const auto& pair) {
        return pair.first == all[i].name && pair.second == all[j].name;
      });
      check_disjoint(op, all[i].name, *all[i].tensor, all[j].name, *all[j].tensor, allowed);
    }
  }
}

}  // namespace sbd::cpu
