/* Run-time choice between the x86 and the portable kernels (kern.h):
 * where the CPU has AVX-512F/VL, the AVX2 kernels in those encodings with
 * their matrix product on 512-bit vectors (ahead of the same kernels on
 * 256-bit vectors on Intel's two 512-bit FMA units and on AMD's Zen 4 alike,
 * though Zen 4 runs a 512-bit FMA at the 256-bit rate: half the instructions
 * and twice the registers; docs/PERF.md), else AVX2/FMA/F16C, else portable
 * C. FLASHATTN_CPU_ISA=avx512, avx512vl (512-bit encodings, 256-bit
 * vectors), avx2 or portable picks that one where the CPU has it (tests run
 * every table the machine can). */
#include "common/kern.h"

#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

static const fa_kern *kern_pick(void) {
  const char *want = getenv("FLASHATTN_CPU_ISA");
  if (want && strcmp(want, "portable") == 0) return &fa_kern_portable;
#if defined(__x86_64__)
  __builtin_cpu_init();
  /* F16C from CPUID leaf 1 (ECX bit 29): clang before 15 has no "f16c" for
   * __builtin_cpu_supports; AVX2's check covers the OS's AVX state */
  unsigned int a, b, c, d;
  const int f16c = __get_cpuid(1, &a, &b, &c, &d) && (c >> 29 & 1);
  const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
  const int avx512 =
      avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
  const int is = want != NULL, lower = is && strcmp(want, "avx2") == 0;
  const int wide = !is || strcmp(want, "avx512") == 0;
  if (fa_kern_avx512.gemm && avx512 && wide) return &fa_kern_avx512;
  if (fa_kern_avx512vl.gemm && avx512 && !lower) return &fa_kern_avx512vl;
  if (fa_kern_avx2.gemm && avx2) return &fa_kern_avx2;
#endif
  return &fa_kern_portable;
}

const fa_kern *fa_kern_get(void) {
  /* Every caller computes the same answer, so a race only repeats the work. */
  static const fa_kern *_Atomic chosen;
  const fa_kern *k = chosen;
  if (!k) chosen = k = kern_pick();
  return k;
}
