// Instruction-set variant of sampling_kernel.h (flags by file suffix in setup.py / CMakeLists.txt).
#include "cpu/sampling_kernel.h"
