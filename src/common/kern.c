/* Run-time choice between the AVX2 and the portable kernels (kern.h). */
#include "common/kern.h"

#include <stdlib.h>
#include <string.h>

static const fa_kern *kern_pick(void) {
  const char *want = getenv("FLASHATTN_CPU_ISA");
  if (want && strcmp(want, "portable") == 0) return &fa_kern_portable;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (fa_kern_avx2.gemm && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    return &fa_kern_avx2;
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
