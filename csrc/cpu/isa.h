// Run-time choice among the instruction-set variants of the CPU kernels.
//
// Each kernel file `<family>_kernel.h` is compiled three times (`<family>_kernel_{default,avx2,avx512}.cpp`,
// flags in setup.py and CMakeLists.txt), each copy inside namespace `sbd::cpu::<CPU_CAPABILITY>` as ATen's
// own vectorised kernels are. `SBD_ISA_DISPATCH` calls the copy for the active variant: the best one
// this CPU supports, or the one named by SBD_CPU_ISA / `torch.ops.sbd._set_cpu_isa`.
#pragma once
#include <string>

namespace sbd::cpu {

enum class Isa { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };

Isa active_isa();
const char* isa_name(Isa isa);
// Selects a variant by name; TORCH_CHECK-fails if the name is unknown or this CPU lacks it.
void set_active_isa(const std::string& name);

}  // namespace sbd::cpu

// Calls `sbd::cpu::<ISA>::fn(args...)` for the active instruction set.
#define SBD_ISA_DISPATCH(fn, ...)                                \
  do {                                                           \
    switch (::sbd::cpu::active_isa()) {                          \
      case ::sbd::cpu::Isa::kAvx512:                             \
        ::sbd::cpu::AVX512::fn(__VA_ARGS__);                     \
        break;                                                   \
      case ::sbd::cpu::Isa::kAvx2:                               \
        ::sbd::cpu::AVX2::fn(__VA_ARGS__);                       \
        break;                                                   \
      default:                                                   \
        ::sbd::cpu::DEFAULT::fn(__VA_ARGS__);                    \
    }                                                            \
  } while (0)

// Declares `declaration` in each variant's namespace (sbd::cpu::DEFAULT, ::AVX2, ::AVX512); use inside
// namespace sbd::cpu, beside the kernel's argument struct.
#define SBD_ISA_DECLARE(...)      \
  namespace DEFAULT {             \
  __VA_ARGS__;                    \
  }                               \
  namespace AVX2 {                \
  __VA_ARGS__;                    \
  }                               \
  namespace AVX512 {              \
  __VA_ARGS__;                    \
  }
