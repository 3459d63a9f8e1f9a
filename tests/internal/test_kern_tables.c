/* The CPU kernel tables (src/common/kern.h) share every summation order: the
 * matrix product of each table this CPU can run (AVX-512 with 512-bit tiles,
 * AVX-512VL, AVX2) must give bitwise the AVX2 table's C on random products
 * of every shape the backends make: row counts across the register tiles'
 * heights, one to six panel vectors, panel pairs, strided and transposed A,
 * alpha, beta with and without a row scale, and per-row key ranges (klo,
 * khi) that split rows between a tile and its own tail. Each C is also
 * checked against a float64 product. Internal: it links the tables. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kern.h"

static unsigned g_seed = 12345;
static float rnd(void) {
  g_seed = g_seed * 1664525u + 1013904223u;
  return (float)(g_seed >> 8) / 16777216.0f - 0.5f;
}
static int pick(int n) { return (int)((rnd() + 0.5f) * (float)n) % n; }

int main(void) {
  const fa_kern *tabs[2] = {NULL, NULL};
  int ntab = 0;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (!fa_kern_avx2.gemm || !__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    printf("test_kern_tables: no AVX2 table on this CPU: 0 passed, 0 failed\n");
    return 0;
  }
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")) {
    if (fa_kern_avx512.gemm) tabs[ntab++] = &fa_kern_avx512;
    if (fa_kern_avx512vl.gemm) tabs[ntab++] = &fa_kern_avx512vl;
  }
#endif
  int cases = 0, fail = 0;
  for (int it = 0; it < 3000; it++) {
    const int bwv = 1 + pick(3), bw = bwv * FA_VL; /* panel width: 1-3 vectors */
    const int64_t m = 1 + pick(40), n = FA_VL * (1 + pick(12)), k = pick(70);
    const int trans = pick(2), beta = pick(2), scaled = beta && pick(2), masked = pick(3) == 0;
    const int64_t rsa = trans ? 1 : k + pick(3), csa = trans ? m + pick(3) : 1;
    const int64_t ldb = bw, bps = (k + pick(2)) * bw, ldc = n + FA_VL * pick(2);
    float *a = malloc(sizeof(float) * (size_t)(m * rsa + k * csa + 1));
    float *b = malloc(sizeof(float) * (size_t)(bps * ((n + bw - 1) / bw) + 1));
    float *c0 = malloc(sizeof(float) * (size_t)(m * ldc)),
          *c1 = malloc(sizeof(float) * (size_t)(m * ldc));
    float rs[64];
    int32_t klo[64], khi[64];
    for (int64_t i = 0; i < m * rsa + k * csa + 1; i++) a[i] = rnd();
    for (int64_t i = 0; i < bps * ((n + bw - 1) / bw) + 1; i++) b[i] = rnd();
    for (int64_t i = 0; i < m * ldc; i++) c0[i] = rnd();
    for (int i = 0; i < 64; i++) {
      rs[i] = 1.0f + rnd();
      const int x = k ? pick((int)k + 1) : 0, y = k ? pick((int)k + 1) : 0;
      klo[i] = x < y ? x : y, khi[i] = x < y ? y : x; /* any, empty included */
    }
    fa_gemm g = {m,
                 n,
                 k,
                 a,
                 rsa,
                 csa,
                 b,
                 ldb,
                 bps,
                 bw,
                 c0,
                 ldc,
                 0.5f + rnd(),
                 beta,
                 scaled ? rs : NULL,
                 masked ? klo : NULL,
                 masked ? khi : NULL};
    memcpy(c1, c0, sizeof(float) * (size_t)(m * ldc));
    /* the float64 product, from the C before */
    double *want = malloc(sizeof(double) * (size_t)(m * n));
    for (int64_t i = 0; i < m; i++)
      for (int64_t j = 0; j < n; j++) {
        double acc = 0;
        const int64_t p0 = masked ? klo[i] : 0, p1 = masked ? khi[i] : k;
        for (int64_t p = p0; p < p1; p++)
          acc += (double)a[i * rsa + p * csa] * b[j / bw * bps + p * ldb + j % bw];
        want[i * n + j] =
            g.alpha * acc + (beta ? (double)c0[i * ldc + j] * (scaled ? rs[i] : 1) : 0);
      }
    fa_kern_avx2.gemm(&g);
    for (int64_t i = 0; i < m; i++)
      for (int64_t j = 0; j < n; j++)
        if (fabs(c0[i * ldc + j] - want[i * n + j]) > 1e-5 * (1 + k)) {
          if (fail++ < 10)
            printf("FAIL avx2 vs float64: m %ld n %ld k %ld bw %d (%ld, %ld)\n", (long)m, (long)n,
                   (long)k, bw, (long)i, (long)j);
          i = m;
          break;
        }
    for (int t = 0; t < ntab; t++) {
      float *c = malloc(sizeof(float) * (size_t)(m * ldc));
      memcpy(c, c1, sizeof(float) * (size_t)(m * ldc));
      fa_gemm h = g;
      h.c = c;
      tabs[t]->gemm(&h);
      cases++;
      if (memcmp(c, c0, sizeof(float) * (size_t)(m * ldc)) != 0 && fail++ < 10)
        printf(
            "FAIL %s differs bitwise from avx2: m %ld n %ld k %ld bw %d trans %d beta %d scaled %d "
            "masked %d\n",
            tabs[t]->isa, (long)m, (long)n, (long)k, bw, trans, beta, scaled, masked);
      free(c);
    }
    cases++;
    free(a), free(b), free(c0), free(c1), free(want);
  }
  printf("test_kern_tables (%d tables beside avx2): %d passed, %d failed\n", ntab, cases - fail,
         fail);
  return fail != 0;
}
