// CPU kernel of sbd::mask_scatter_: EB / threshold acceptance of block positions, in place.
//
// Per row: collect the candidates (masked and valid), sort them by (entropy, position) with NaN as +inf,
// walk them in rank order summing entropies in fp32 one term at a time (the order the oracle and the
// Triton kernel use, so all three agree exactly at the gamma boundary), write accepted positions.
// A row is a few dozen scalars, so the kernel is scalar; rows run in parallel when there are many.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "overlap.h"

namespace sbd::cpu {
namespace {

constexpr const char* kOp = "sbd.mask_scatter_";
// Rows per parallel chunk: about 16K positions, so that small batches (128 x 32 = 4K positions, a few
// microseconds of work) stay on one thread instead of paying the thread-pool wake-up (~10-20 us).
constexpr int64_t kPositionsPerTask = 16384;

enum class Rule { kEb, kThreshold };

Rule parse_rule(const std::string& rule) {
  if (rule == "eb") return Rule::kEb;
  if (rule == "threshold") return Rule::kThreshold;
  TORCH_CHECK(false, kOp, ": rule must be 'eb' or 'threshold', got '", rule, "'");
}

// "int64", "bool", "float32": the names Python users see, same wording as the Triton / oracle checks.
std::string dtype_name(at::ScalarType dtype) { return std::string(c10::getDtypeNames(dtype).first); }

void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef shape,
                  const at::Device& device) {
  TORCH_CHECK(t.scalar_type() == dtype, kOp, ": ", name, " must be ", dtype_name(dtype), ", got ",
              dtype_name(t.scalar_type()));
  TORCH_CHECK(t.sizes() == shape, kOp, ": ", name, " must have shape ", shape.size() == 2 ? "[B, K]" : "[B]",
              " = ", shape, ", got ", t.sizes());
  TORCH_CHECK(t.device() == device, kOp, ": ", name, " must be on the device of block_tokens (", device,
              "), got ", t.device());
}

// Reads one [B, K] (or [B]) tensor through its strides.
template <typename T>
struct Strided2d {
  T* data;
  int64_t stride_b;
  int64_t stride_k;
  T& at(int64_t b, int64_t k) const { return data[b * stride_b + k * stride_k]; }
};

template <typename T>
Strided2d<T> view2d(const at::Tensor& t) {
  return {t.data_ptr<T>(), t.stride(0), t.stride(1)};
}

struct Row {
  Strided2d<int64_t> tokens;
  Strided2d<bool> masked;
  Strided2d<const int64_t> sampled;
  Strided2d<const float> entropy;
  const bool* valid_data;  // nullptr: every position valid
  int64_t valid_stride_b;
  int64_t valid_stride_k;
  bool valid(int64_t b, int64_t k) const {
    return valid_data == nullptr || valid_data[b * valid_stride_b + k * valid_stride_k];
  }
};

// Marks in `accepted` (row of K bools) the candidates accepted by `rule`. `ranked` holds
// (entropy, position) of the candidates sorted ascending.
void accept_ranked(const std::vector<std::pair<float, int64_t>>& ranked, float gamma, Rule rule,
                   bool* accepted) {
  float before = 0.0f;  // fp32 sum of the entropies ranked before the current candidate
  for (size_t r = 0; r < ranked.size(); ++r) {
    const float h = ranked[r].first;
    const bool take = r == 0 || (rule == Rule::kEb ? before <= gamma : h < gamma);
    if (take) accepted[ranked[r].second] = true;
    before += h;
  }
}

// One row: rank the candidates, accept, write in place; returns (number accepted, row done).
std::pair<int32_t, bool> scatter_row(const Row& row, int64_t b, int64_t k, float gamma, Rule rule,
                                     bool* accepted, std::vector<std::pair<float, int64_t>>& ranked) {
  ranked.clear();
  for (int64_t j = 0; j < k; ++j) {
    accepted[j] = false;
    if (row.masked.at(b, j) && row.valid(b, j)) {
      const float h = row.entropy.at(b, j);
      ranked.emplace_back(std::isnan(h) ? std::numeric_limits<float>::infinity() : h, j);
    }
  }
  // Positions are distinct, so the pair order is a strict total order: the same ranking as a stable
  // sort on the entropy alone.
  std::sort(ranked.begin(), ranked.end());
  accept_ranked(ranked, gamma, rule, accepted);

  int32_t count = 0;
  bool done = true;
  for (int64_t j = 0; j < k; ++j) {
    if (accepted[j]) {
      row.tokens.at(b, j) = row.sampled.at(b, j);
      row.masked.at(b, j) = false;
      ++count;
    }
    done = done && !row.masked.at(b, j);
  }
  return {count, done};
}

// gamma of every row as fp32, checked >= 0 before anything is written. gamma_val is rounded to nearest
// (IEEE conversion: beyond the fp32 range it becomes +inf), as the Python backends do.
std::vector<float> row_gammas(const std::optional<at::Tensor>& gamma, double gamma_val, int64_t batch) {
  std::vector<float> out(batch, static_cast<float>(gamma_val));
  if (!gamma.has_value()) {
    TORCH_CHECK(gamma_val >= 0, kOp, ": gamma must be >= 0, got gamma_val=", gamma_val);
    return out;
  }
  const float* data = gamma->data_ptr<float>();
  for (int64_t b = 0; b < batch; ++b) {
    out[b] = data[b * gamma->stride(0)];
    TORCH_CHECK(out[b] >= 0, kOp, ": gamma must be >= 0 (and not NaN) in every row, got gamma[", b,
                "]=", out[b]);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mask_scatter_cpu(
    at::Tensor& block_tokens, at::Tensor& is_masked, const at::Tensor& sampled, const at::Tensor& entropy,
    const std::optional<at::Tensor>& gamma, double gamma_val, c10::string_view rule_name,
    const std::optional<at::Tensor>& valid) {
  TORCH_CHECK(block_tokens.dim() == 2, kOp, ": block_tokens must be a 2-D [B, K] tensor, got shape ",
              block_tokens.sizes());
  const int64_t batch = block_tokens.size(0);
  const int64_t k = block_tokens.size(1);
  const at::Device device = block_tokens.device();
  check_tensor(block_tokens, "block_tokens", at::kLong, {batch, k}, device);
  check_tensor(is_masked, "is_masked", at::kBool, {batch, k}, device);
  check_tensor(sampled, "sampled", at::kLong, {batch, k}, device);
  check_tensor(entropy, "entropy", at::kFloat, {batch, k}, device);
  // Rows run in parallel: two positions sharing memory would race.
  check_writable(kOp, "block_tokens", block_tokens);
  check_writable(kOp, "is_masked", is_masked);
  if (valid.has_value()) check_tensor(*valid, "valid", at::kBool, {batch, k}, device);
  const Rule rule = parse_rule(std::string(rule_name));
  if (gamma.has_value()) check_tensor(*gamma, "gamma", at::kFloat, {batch}, device);
  // The in-place arguments share no memory with each other or with a read-only argument, except sampled
  // identical to block_tokens and valid identical to is_masked: each element is then read only for its
  // own position, before that position is written, so the result cannot change.
  check_not_sharing(kOp, {{"block_tokens", &block_tokens}, {"is_masked", &is_masked}},
                    {{"sampled", &sampled},
                     {"entropy", &entropy},
                     {"valid", valid.has_value() ? &*valid : nullptr},
                     {"gamma", gamma.has_value() ? &*gamma : nullptr}},
                    {{"block_tokens", "sampled"}, {"is_masked", "valid"}});
  const std::vector<float> gammas = row_gammas(gamma, gamma_val, batch);

  at::Tensor accepted = at::empty({batch, k}, block_tokens.options().dtype(at::kBool));
  at::Tensor num_accepted = at::empty({batch}, block_tokens.options().dtype(at::kInt));
  at::Tensor block_done = at::empty({batch}, block_tokens.options().dtype(at::kBool));
  if (batch == 0) return {accepted, num_accepted, block_done};

  const Row row{view2d<int64_t>(block_tokens),
                view2d<bool>(is_masked),
                {sampled.data_ptr<int64_t>(), sampled.stride(0), sampled.stride(1)},
                {entropy.data_ptr<float>(), entropy.stride(0), entropy.stride(1)},
                valid.has_value() ? valid->data_ptr<bool>() : nullptr,
                valid.has_value() ? valid->stride(0) : 0,
                valid.has_value() ? valid->stride(1) : 0};
  bool* accepted_data = accepted.data_ptr<bool>();
  int32_t* count_data = num_accepted.data_ptr<int32_t>();
  bool* done_data = block_done.data_ptr<bool>();
  const int64_t grain = std::max<int64_t>(1, kPositionsPerTask / std::max<int64_t>(k, 1));
  at::parallel_for(0, batch, grain, [&](int64_t begin, int64_t end) {
    std::vector<std::pair<float, int64_t>> ranked;
    ranked.reserve(k);
    for (int64_t b = begin; b < end; ++b) {
      auto [count, done] = scatter_row(row, b, k, gammas[b], rule, accepted_data + b * k, ranked);
      count_data[b] = count;
      done_data[b] = done;
    }
  });
  return {accepted, num_accepted, block_done};
}

}  // namespace
}  // namespace sbd::cpu

TORCH_LIBRARY_IMPL(sbd, CPU, m) { m.impl("mask_scatter_", &sbd::cpu::mask_scatter_cpu); }
