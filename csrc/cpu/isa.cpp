#include "cpu/isa.h"

#include <atomic>
#include <cstdlib>

#include <c10/util/Exception.h>

namespace sbd::cpu {
namespace {

bool supported(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("fma");
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    default:
      return true;
  }
}

Isa parse(const std::string& name) {
  if (name == "default") return Isa::kDefault;
  if (name == "avx2") return Isa::kAvx2;
  if (name == "avx512") return Isa::kAvx512;
  TORCH_CHECK(false, "sbd: unknown CPU instruction set '", name,
              "'; expected one of 'default', 'avx2', 'avx512'");
}

Isa best_supported() {
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2}) {
    if (supported(isa)) return isa;
  }
  return Isa::kDefault;
}

Isa initial_isa() {
  const char* env = std::getenv("SBD_CPU_ISA");
  if (env == nullptr || *env == '\0') return best_supported();
  Isa isa = parse(env);
  TORCH_CHECK(supported(isa), "sbd: SBD_CPU_ISA=", env, " but this CPU does not support it");
  return isa;
}

std::atomic<int>& active() {
  static std::atomic<int> isa{static_cast<int>(initial_isa())};
  return isa;
}

}  // namespace

Isa active_isa() { return static_cast<Isa>(active().load(std::memory_order_relaxed)); }

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "default";
  }
}

void set_active_isa(const std::string& name) {
  Isa isa = parse(name);
  TORCH_CHECK(supported(isa), "sbd: this CPU does not support the '", name, "' kernels");
  active().store(static_cast<int>(isa), std::memory_order_relaxed);
}

}  // namespace sbd::cpu
