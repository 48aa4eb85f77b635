// Instruction-set variant of attention_kernel.h (flags by file suffix in setup.py / CMakeLists.txt).
#include "cpu/attention_kernel.h"
