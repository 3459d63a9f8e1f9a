/* kern_body.h on AVX2 + FMA + F16C intrinsics (kern_x86.h). CMake compiles
 * this file alone with -mavx2 -mfma -mf16c (x86-64 only); fa_kern_get() uses
 * it only where the CPU has all three, so the rest of the library stays
 * baseline x86-64. */
#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SFX(name) name##_avx2
#define KB_ISA "avx2"
#include "common/kern_x86.h"
#else
#include <stddef.h>

#include "common/kern.h"

const fa_kern fa_kern_avx2 = {.isa = "avx2"};
#endif
