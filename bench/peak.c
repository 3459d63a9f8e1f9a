/* The machine's measured ceilings, the yardstick for the CPU kernels: float32
 * FMA throughput (independent FMA chains on 8-wide vectors, and on 16-wide
 * ones where the CPU has AVX-512, all threads; only the 8-wide ones under
 * FLASHATTN_CPU_ISA=avx2, the portable C's under =portable) and
 * DRAM read bandwidth (a sum over an array far larger than any cache). */
#define _POSIX_C_SOURCE 200809L
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define BENCH_X86 1
#endif

/* Enough independent chains to cover FMA latency x issue width (4-5 cycles x 2). */
#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
enum { N_CHAINS = 12, LANES = 8 };

typedef float (*fma_kernel)(int64_t iters, float seed);

#ifdef BENCH_X86
/* The chains on one vector type: VT, with its intrinsics V(op) (_mm256_op,
 * _mm512_op), defined around each use. */
#define FMA_BODY                                                       \
  const VT a = V(set1_ps)(0.9999999f), b = V(set1_ps)(1e-7f);          \
  CHAINS(DECL)                                                         \
  for (int64_t i = 0; i < iters; i++) {                                \
    CHAINS(STEP)                                                       \
  }                                                                    \
  VT s = V(setzero_ps)();                                              \
  CHAINS(SUM)                                                          \
  float out[sizeof(VT) / sizeof(float)], r = 0;                        \
  V(storeu_ps)(out, s);                                                \
  for (size_t l = 0; l < sizeof(VT) / sizeof(float); l++) r += out[l]; \
  return r;
#define DECL(j) VT acc##j = V(set1_ps)(seed + (float)(j));
#define STEP(j) acc##j = V(fmadd_ps)(acc##j, a, b);
#define SUM(j) s = V(add_ps)(s, acc##j);

#define VT __m256
#define V(op) _mm256_##op
__attribute__((target("avx2,fma"))) static float fma_avx2(int64_t iters, float seed) { FMA_BODY }
#undef VT
#undef V

/* 16-lane AVX-512 vectors: the peak counts whichever of the two is faster
 * (equal where AVX-512 runs on 256-bit units, double where it has 512-bit
 * ones). */
#define VT __m512
#define V(op) _mm512_##op
__attribute__((target("avx512f"))) static float fma_avx512(int64_t iters, float seed) { FMA_BODY }
#undef VT
#undef V
#undef DECL
#undef STEP
#undef SUM
#undef FMA_BODY
#endif

/* Portable fallback: the same chains with GCC vector extensions. */
typedef float v8f __attribute__((vector_size(LANES * sizeof(float))));

static float fma_generic(int64_t iters, float seed) {
  const v8f a = {0.9999999f, 0.9999999f, 0.9999999f, 0.9999999f,
                 0.9999999f, 0.9999999f, 0.9999999f, 0.9999999f};
  const v8f b = a * 0 + 1e-7f;
#define DECL(j) v8f acc##j = a * 0 + (seed + (float)(j));
#define STEP(j) acc##j = acc##j * a + b;
#define SUM(j) s += acc##j;
  CHAINS(DECL)
  for (int64_t i = 0; i < iters; i++) {
    CHAINS(STEP)
  }
  v8f s = a * 0;
  CHAINS(SUM)
  float r = 0;
  for (int l = 0; l < LANES; l++) r += s[l];
  return r;
#undef DECL
#undef STEP
#undef SUM
}

static volatile double peak_sink; /* keeps the kernels' results alive */

/* Seconds for every thread to run iters iterations of the kernel. */
static double time_fma(fma_kernel k, int threads, int64_t iters) {
  double sum = 0, t0 = bench_now_seconds();
#pragma omp parallel num_threads(threads) reduction(+ : sum)
  sum += k(iters, (float)omp_get_thread_num());
  double dt = bench_now_seconds() - t0;
  peak_sink = sum;
  return dt;
}

static double measure_fma(fma_kernel k, int threads, int lanes) {
  int64_t iters = 1 << 16;
  while (time_fma(k, threads, iters) < 0.2 && iters < ((int64_t)1 << 40)) iters *= 2;
  double best = 1e30;
  for (int rep = 0; rep < 3; rep++) {
    double t = time_fma(k, threads, iters);
    if (t < best) best = t;
  }
  return (double)iters * N_CHAINS * lanes * 2 * threads / best * 1e-9;
}

/* ---- DRAM read bandwidth ---------------------------------------------------- */

typedef uint64_t u64x4 __attribute__((vector_size(32)));

static uint64_t sum_vectors(const u64x4 *p, size_t n) {
  u64x4 s0 = {0, 0, 0, 0}, s1 = s0, s2 = s0, s3 = s0;
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += p[i], s1 += p[i + 1];
    s2 += p[i + 2], s3 += p[i + 3];
  }
  for (; i < n; i++) s0 += p[i];
  u64x4 s = s0 + s1 + s2 + s3;
  return s[0] + s[1] + s[2] + s[3];
}

/* Each thread owns one contiguous slice: it first touches and later reads it. */
static void thread_slice(size_t n, size_t *lo, size_t *hi) {
  size_t t = (size_t)omp_get_thread_num(), nt = (size_t)omp_get_num_threads();
  *lo = n * t / nt, *hi = n * (t + 1) / nt;
}

static double measure_dram(int threads, size_t *bytes_out) {
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  size_t bytes = (size_t)1 << 30;
  if (pages > 0 && page > 0 && (size_t)pages * (size_t)page / 8 < bytes)
    bytes = (size_t)pages * (size_t)page / 8;
  const size_t n = bytes / sizeof(u64x4);
  u64x4 *a = aligned_alloc(64, n * sizeof(u64x4));
  *bytes_out = 0;
  if (!a) return 0;
#pragma omp parallel num_threads(threads)
  {
    size_t lo, hi;
    thread_slice(n, &lo, &hi);
    for (size_t i = lo; i < hi; i++) {
      u64x4 v = {i, i + 1, i + 2, i + 3};
      a[i] = v;
    }
  }
  double best = 1e30;
  for (int rep = 0; rep < 6; rep++) { /* the first pass warms the TLB */
    uint64_t sum = 0;
    double t0 = bench_now_seconds();
#pragma omp parallel num_threads(threads) reduction(+ : sum)
    {
      size_t lo, hi;
      thread_slice(n, &lo, &hi);
      sum += sum_vectors(a + lo, hi - lo);
    }
    double t = bench_now_seconds() - t0;
    peak_sink = (double)sum;
    if (rep > 0 && t < best) best = t;
  }
  free(a);
  *bytes_out = n * sizeof(u64x4);
  return (double)*bytes_out / best * 1e-9;
}

void bench_measure_peak(int threads, bench_peak *p) {
  fma_kernel k = fma_generic;
  p->isa = "generic";
  /* the peak of the instructions the kernels run: FLASHATTN_CPU_ISA=avx2
   * forces the library's AVX2 kernels (16 vector registers, no AVX-512
   * encodings), so the peak is AVX2's; =portable, the portable C's */
  const char *want = getenv("FLASHATTN_CPU_ISA");
  const int portable = want && strcmp(want, "portable") == 0;
  const int avx2_only = want && strcmp(want, "avx2") == 0;
#ifdef BENCH_X86
  __builtin_cpu_init();
  if (!portable && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    k = fma_avx2;
    p->isa = "avx2+fma";
  }
#endif
  p->fma_gflops = measure_fma(k, threads, LANES);
#ifdef BENCH_X86
  if (k == fma_avx2 && !avx2_only && __builtin_cpu_supports("avx512f")) {
    const double g = measure_fma(fma_avx512, threads, 2 * LANES);
    if (g > p->fma_gflops) {
      p->fma_gflops = g;
      p->isa = "avx512f";
    }
  }
#endif
  p->dram_gbps = measure_dram(threads, &p->dram_bytes);
  p->measured = 1;
}
