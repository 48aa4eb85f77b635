// CPU kernel of sbd::entropy_sample: argument checks, output allocation and the ISA dispatch into
// csrc/cpu/sampling_kernel.h. The math and the random generator are defined in
// sbd_kernels/ops/sampling/naive.py; the checks word for word match sbd_kernels/ops/sampling/_checks.py.
#include <cmath>
#include <limits>
#include <string>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include "cpu/float32_text.h"
#include "cpu/isa.h"
#include "cpu/sampling.h"

namespace sbd::cpu {
namespace {

constexpr const char* kOp = "sbd.entropy_sample";

// seed / offset: int64, shape [B], or one element ([] or [1]) shared by every row. Returns the row stride.
int64_t check_per_row_int64(const char* name, const at::Tensor& t, int64_t batch, const at::Device& device) {
  TORCH_CHECK(t.scalar_type() == at::kLong, kOp, ": ", name, " must be an int64 tensor, got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == device, kOp, ": ", name, " must be on the device of logits (", device,
              "), got ", t.device());
  const bool per_row = t.dim() == 1 && t.size(0) == batch;
  const bool shared = t.dim() == 0 || (t.dim() == 1 && t.size(0) == 1);
  TORCH_CHECK(per_row || shared, kOp, ": ", name, " must have shape [B] = [", batch, "], [] or [1], got ",
              t.sizes());
  return (per_row && batch > 1) ? t.stride(0) : 0;
}

// temperature_val, top_p_val, min_p_val: checked as the float32 the kernels run at, like an entry of the
// [B] tensor. `in_range` takes a float or a double: the message names the float32 when only the rounding
// puts the value out of range (top_p_val 1e-50 is 0 as a float32).
template <typename InRange>
void check_float32_scalar(const char* name, double value, InRange in_range, const char* rule) {
  const float value32 = as_float32(value);
  TORCH_CHECK(in_range(value32), kOp, ": ", name, " must be ", rule, ", got ", exact_g(value),
              in_range(value) ? " (" + exact_g(value32) + " as a float32)" : std::string());
}

void check_temperature(const c10::optional<at::Tensor>& temperature, double temperature_val, int64_t batch,
                       const at::Device& device) {
  if (!temperature.has_value()) {
    check_float32_scalar("temperature_val", temperature_val,
                         [](auto t) { return t >= 0 && std::isfinite(t); },
                         "finite and >= 0 as a float32 (at most 3.4028235e+38)");
    return;
  }
  const at::Tensor& t = *temperature;
  TORCH_CHECK(t.scalar_type() == at::kFloat, kOp, ": temperature must be a float32 tensor, got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == device, kOp, ": temperature must be on the device of logits (", device,
              "), got ", t.device());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == batch, kOp, ": temperature must have shape [B] = [", batch,
              "], got ", t.sizes());
  TORCH_CHECK(t.isfinite().logical_and(t.ge(0)).all().item<bool>(), kOp,
              ": temperature must be finite and >= 0");
}

// top_k / top_p / min_p: a [B] tensor of `dtype` on the device of logits (values checked by the caller).
// `kind` names the dtype with its article: "an int64", "a float32".
void check_filter_tensor(const char* name, const at::Tensor& t, at::ScalarType dtype, const char* kind,
                         int64_t batch, const at::Device& device) {
  TORCH_CHECK(t.scalar_type() == dtype, kOp, ": ", name, " must be ", kind, " tensor, got ", t.scalar_type());
  TORCH_CHECK(t.device() == device, kOp, ": ", name, " must be on the device of logits (", device,
              "), got ", t.device());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == batch, kOp, ": ", name, " must have shape [B] = [", batch,
              "], got ", t.sizes());
}

void check_filters(const c10::optional<at::Tensor>& top_k, int64_t top_k_val,
                   const c10::optional<at::Tensor>& top_p, double top_p_val,
                   const c10::optional<at::Tensor>& min_p, double min_p_val, int64_t batch,
                   const at::Device& device) {
  if (top_k.has_value()) {
    check_filter_tensor("top_k", *top_k, at::kLong, "an int64", batch, device);
    TORCH_CHECK(top_k->ge(0).all().item<bool>(), kOp, ": top_k must be >= 0 (0: off)");
  } else {
    TORCH_CHECK(top_k_val >= 0, kOp, ": top_k_val must be >= 0 (0: off), got ", top_k_val);
  }
  if (top_p.has_value()) {
    check_filter_tensor("top_p", *top_p, at::kFloat, "a float32", batch, device);
    TORCH_CHECK(top_p->gt(0).logical_and(top_p->le(1)).all().item<bool>(), kOp,
                ": top_p must be in (0, 1] (1: off)");
  } else {
    check_float32_scalar("top_p_val", top_p_val, [](auto p) { return p > 0 && p <= 1; },
                         "in (0, 1] as a float32 (1: off)");
  }
  if (min_p.has_value()) {
    check_filter_tensor("min_p", *min_p, at::kFloat, "a float32", batch, device);
    TORCH_CHECK(min_p->ge(0).logical_and(min_p->lt(1)).all().item<bool>(), kOp,
                ": min_p must be in [0, 1) (0: off)");
  } else {
    check_float32_scalar("min_p_val", min_p_val, [](auto p) { return p >= 0 && p < 1; },
                         "in [0, 1) as a float32 (0: off)");
  }
}

void check_compute_mask(const c10::optional<at::Tensor>& compute_mask, int64_t batch, int64_t positions,
                        const at::Device& device) {
  if (!compute_mask.has_value()) return;
  const at::Tensor& m = *compute_mask;
  TORCH_CHECK(m.scalar_type() == at::kBool, kOp, ": compute_mask must be a bool tensor, got ",
              m.scalar_type());
  TORCH_CHECK(m.device() == device, kOp, ": compute_mask must be on the device of logits (", device,
              "), got ", m.device());
  TORCH_CHECK(m.dim() == 2 && m.size(0) == batch && m.size(1) == positions, kOp,
              ": compute_mask must have shape [B, K] = [", batch, ", ", positions, "], got ", m.sizes());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> entropy_sample_cpu(
    const at::Tensor& logits, const at::Tensor& seed, const at::Tensor& offset,
    const c10::optional<at::Tensor>& temperature, double temperature_val,
    const c10::optional<at::Tensor>& compute_mask, int64_t mask_token_id, const c10::optional<at::Tensor>& top_k,
    int64_t top_k_val, const c10::optional<at::Tensor>& top_p, double top_p_val,
    const c10::optional<at::Tensor>& min_p, double min_p_val) {
  TORCH_CHECK(logits.dim() == 3, kOp, ": logits must be a 3-D tensor [B, K, V], got shape ", logits.sizes());
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, kOp,
              ": logits must be float32, float16 or bfloat16, got ", dtype);
  const int64_t batch = logits.size(0), positions = logits.size(1), vocab = logits.size(2);
  TORCH_CHECK(vocab >= 1, kOp, ": logits must have a vocabulary dimension V >= 1");
  const at::Device device = logits.device();
  const int64_t seed_stride = check_per_row_int64("seed", seed, batch, device);
  const int64_t offset_stride = check_per_row_int64("offset", offset, batch, device);
  check_temperature(temperature, temperature_val, batch, device);
  check_compute_mask(compute_mask, batch, positions, device);
  TORCH_CHECK(mask_token_id == -1 || (mask_token_id >= 0 && mask_token_id < vocab), kOp,
              ": mask_token_id must be -1 (none) or in [0, V) = [0, ", vocab, "), got ", mask_token_id);
  check_filters(top_k, top_k_val, top_p, top_p_val, min_p, min_p_val, batch, device);

  const auto out_opts = logits.options();
  at::Tensor tokens = at::empty({batch, positions}, out_opts.dtype(at::kLong));
  at::Tensor entropy = at::empty({batch, positions}, out_opts.dtype(at::kFloat));
  at::Tensor logprob = at::empty({batch, positions}, out_opts.dtype(at::kFloat));
  at::Tensor valid = at::empty({batch, positions}, out_opts.dtype(at::kBool));
  if (batch * positions == 0) return {tokens, entropy, logprob, valid};

  // The kernel reads rows in place when the vocabulary is contiguous; any other layout is copied once.
  at::Tensor rows = logits.stride(2) == 1 ? logits : logits.contiguous();
  at::Tensor mask = compute_mask.has_value() ? compute_mask->contiguous() : at::Tensor();
  at::Tensor seed_flat = seed.reshape({-1});
  at::Tensor offset_flat = offset.reshape({-1});

  EntropySampleArgs args;
  args.logits = rows;
  args.seed = seed_flat.data_ptr<int64_t>();
  args.seed_stride = seed_stride;
  args.offset = offset_flat.data_ptr<int64_t>();
  args.offset_stride = offset_stride;
  args.temperature = temperature.has_value() ? temperature->data_ptr<float>() : nullptr;
  args.temperature_stride = temperature.has_value() ? temperature->stride(0) : 0;
  args.temperature_val = as_float32(temperature_val);
  args.compute_mask = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  args.mask_token_id = mask_token_id;
  args.top_k = top_k.has_value() ? top_k->data_ptr<int64_t>() : nullptr;
  args.top_k_stride = top_k.has_value() ? top_k->stride(0) : 0;
  args.top_k_val = top_k_val;
  args.top_p = top_p.has_value() ? top_p->data_ptr<float>() : nullptr;
  args.top_p_stride = top_p.has_value() ? top_p->stride(0) : 0;
  args.top_p_val = as_float32(top_p_val);
  args.min_p = min_p.has_value() ? min_p->data_ptr<float>() : nullptr;
  args.min_p_stride = min_p.has_value() ? min_p->stride(0) : 0;
  args.min_p_val = as_float32(min_p_val);
  args.filters = top_k.has_value() || top_p.has_value() || min_p.has_value() || top_k_val > 0 ||
                 args.top_p_val < 1.f || args.min_p_val > 0.f;
  args.tokens = tokens.data_ptr<int64_t>();
  args.entropy = entropy.data_ptr<float>();
  args.logprob = logprob.data_ptr<float>();
  args.valid = valid.data_ptr<bool>();
  SBD_ISA_DISPATCH(entropy_sample_kernel, args);
  return {tokens, entropy, logprob, valid};
}

}  // namespace
}  // namespace sbd::cpu

TORCH_LIBRARY_IMPL(sbd, CPU, m) { m.impl("entropy_sample", &sbd::cpu::entropy_sample_cpu); }
