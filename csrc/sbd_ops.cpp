// Every schema of the `sbd` operator library, in one place. Kernels register elsewhere:
// csrc/cpu/<family>.cpp for CPU (C++), sbd_kernels/ops/<family>/triton.py for CUDA (Triton), and
// sbd_kernels/ops/<family>/__init__.py for the fake (meta) kernels.
#include <torch/library.h>

#include "cpu/isa.h"
#include "cpu/overlap.h"

#ifdef SBD_PYTHON_MODULE
#include <Python.h>
// `import sbd_kernels._C` loads this shared library, which runs the registrations below.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
#endif

TORCH_LIBRARY(sbd, m) {
  m.def(
      "block_attention_with_kvcache(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor cache_seqlens, Tensor num_causal, int block_size, "
      "Tensor? block_table=None, float? softmax_scale=None) -> (Tensor out, Tensor lse)");
  m.def(
      "entropy_sample(Tensor logits, Tensor seed, Tensor offset, Tensor? temperature=None, "
      "float temperature_val=0.0, Tensor? compute_mask=None, int mask_token_id=-1, Tensor? top_k=None, "
      "int top_k_val=0, Tensor? top_p=None, float top_p_val=1.0, Tensor? min_p=None, float min_p_val=0.0) "
      "-> (Tensor tokens, Tensor entropy, Tensor logprob, Tensor valid)");
  m.def(
      "mask_scatter_(Tensor(a!) block_tokens, Tensor(b!) is_masked, Tensor sampled, Tensor entropy, "
      "Tensor? gamma=None, float gamma_val=0.1, str rule=\"eb\", Tensor? valid=None) "
      "-> (Tensor accepted, Tensor num_accepted, Tensor block_done)");
  // Private: which instruction-set variant of the CPU kernels runs ("default", "avx2", "avx512"),
  // and a switch for tests and benchmarks. Also settable with the SBD_CPU_ISA environment variable.
  m.def("_cpu_isa() -> str", [] { return std::string(sbd::cpu::isa_name(sbd::cpu::active_isa())); });
  m.def("_set_cpu_isa(str isa) -> ()", [](const std::string& isa) { sbd::cpu::set_active_isa(isa); });
  // Private: the memory-overlap answers of csrc/cpu/overlap.h (0 no, 1 yes, 2 may share memory), for
  // tests that hold them against sbd_kernels/ops/_overlap.py and a brute-force enumeration.
  m.def("_internal_overlap(Tensor t) -> int",
        [](const at::Tensor& t) { return static_cast<int64_t>(sbd::cpu::internal_overlap(t)); });
  m.def("_views_overlap(Tensor a, Tensor b) -> int", [](const at::Tensor& a, const at::Tensor& b) {
    return static_cast<int64_t>(sbd::cpu::views_overlap(a, b));
  });
}
