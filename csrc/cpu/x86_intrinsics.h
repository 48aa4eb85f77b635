// The x86 intrinsic headers, included before any other header of a kernel build (the ATen vector headers
// include them too; their include guards then make that a no-op).
//
// GCC 12.0-12.2 warns "'__Y' may be used uninitialized" inside avx512fintrin.h wherever an AVX-512 intrinsic
// that takes an undefined merge source is inlined (GCC bug 105593, fixed in 12.3): about 300 false warnings
// per build with -Wall, which hid any real one. GCC reads the diagnostic state at the warning's location, a
// line of these system headers, so the pragmas silence exactly them; the kernels' own code keeps -Wall.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif
#endif
