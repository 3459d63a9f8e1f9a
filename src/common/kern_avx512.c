/* kern_avx512vl.c's kernels with the matrix product's register tiles on
 * 512-bit vectors (KB_WIDE: kern_body.h's SFX(ukrw)), the same bits. Where
 * 512-bit FMAs run at twice the 256-bit rate (Intel's server cores have two
 * 512-bit FMA units) 256-bit code reaches half the FMA peak; where they run
 * at the same rate (AMD's Zen 4) the wide tiles still issue half the
 * instructions from twice the registers. CMake compiles it with the flags
 * of kern_avx512vl.c; fa_kern_get() prefers it wherever AVX-512F and VL are. */
#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && \
    defined(__AVX512F__) && defined(__AVX512VL__)
#define SFX(name) name##_avx512
#define KB_ISA "avx512"
#define KB_REGS 32
#define KB_WIDE 1
#include "common/kern_x86.h"
#else
#include <stddef.h>

#include "common/kern.h"

const fa_kern fa_kern_avx512 = {.isa = "avx512"};
#endif
