/* kern_x86.h's AVX2 kernels compiled with AVX-512F/VL as well (CMake adds
 * -mavx512f -mavx512vl for this file alone): the same 256-bit vectors, with
 * 32 registers for the register tiles and broadcast operands folded into the
 * FMAs. fa_kern_get() prefers it where the CPU has AVX-512F and VL. */
#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && \
    defined(__AVX512F__) && defined(__AVX512VL__)
#define SFX(name) name##_avx512vl
#define KB_ISA "avx512vl"
#define KB_REGS 32
#include "common/kern_x86.h"
#else
#include <stddef.h>

#include "common/kern.h"

const fa_kern fa_kern_avx512vl = {.isa = "avx512vl"};
#endif
