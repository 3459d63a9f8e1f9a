/* The CPU kernels' share of the FMA peak per CPU-second, for hosts that other
 * work keeps busy: wall-clock rates there measure the neighbours, but the
 * process's CPU time counts only the time its threads ran. Times the f32
 * forward and backward (B = 1, H heads, N = Nq = Nk, D) and the 256-bit FMA
 * chains of flashattn-bench --peak on one thread, each as FLOPs per
 * CPU-second (the papers' FLOP counts, as flashattn-bench), rounds
 * interleaved, and prints every round's fractions and their spread.
 * Threads waiting at a barrier spin on the CPU under OpenMP's default wait
 * policy: run it with OMP_WAIT_POLICY=passive. FLASHATTN_CPU_ISA=avx2 times
 * the AVX2 kernels.
 *   cc -O2 -mavx2 -mfma -fopenmp -Iinclude tools/dev/cpu_share.c build/libflashattn.a -lm \
 *     -o cpu_share
 *   OMP_WAIT_POLICY=passive ./cpu_share [D 64] [causal 1] [rounds 3] [H 16] [N 4096] [threads 2] */
#define _POSIX_C_SOURCE 200809L
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "flashattn.h"

static double cpu_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static volatile float sink;

/* GFLOP per CPU-second of 12 independent 256-bit FMA chains (flashattn-bench --peak's). */
static double fma_peak(void) {
  const __m256 a = _mm256_set1_ps(0.9999999f), b = _mm256_set1_ps(1e-7f);
  __m256 c[12];
  for (int j = 0; j < 12; j++) c[j] = _mm256_set1_ps((float)j);
  const long iters = 100000000;
  const double t0 = cpu_seconds();
  for (long i = 0; i < iters; i++)
#pragma GCC unroll 12
    for (int j = 0; j < 12; j++) c[j] = _mm256_fmadd_ps(c[j], a, b);
  const double t = cpu_seconds() - t0;
  float out[8], r = 0;
  for (int j = 1; j < 12; j++) c[0] = _mm256_add_ps(c[0], c[j]);
  _mm256_storeu_ps(out, c[0]);
  for (int l = 0; l < 8; l++) r += out[l];
  sink = r;
  return (double)iters * 12 * 16 / t * 1e-9;
}

static fa_tensor tensor(int64_t h, int64_t n, int64_t d, unsigned seed) {
  fa_tensor t =
      fa_tensor_bnhd(malloc(sizeof(float) * (size_t)(h * n * d)), FA_DTYPE_F32, 1, n, h, d);
  for (int64_t i = 0; i < h * n * d; i++) {
    seed = seed * 1664525u + 1013904223u;
    ((float *)t.data)[i] = (float)(seed >> 8) / 16777216.0f - 0.5f;
  }
  return t;
}

int main(int argc, char **argv) {
  const int64_t D = argc > 1 ? atoi(argv[1]) : 64;
  const int causal = argc > 2 ? atoi(argv[2]) : 1, rounds = argc > 3 ? atoi(argv[3]) : 3;
  const int64_t H = argc > 4 ? atoi(argv[4]) : 16, N = argc > 5 ? atoi(argv[5]) : 4096;
  const int threads = argc > 6 ? atoi(argv[6]) : 2;
  fa_params p;
  memset(&p, 0, sizeof p);
  p.causal = causal;
  p.num_threads = threads;
  fa_tensor q = tensor(H, N, D, 1), k = tensor(H, N, D, 2), v = tensor(H, N, D, 3);
  fa_tensor o = tensor(H, N, D, 4), dO = tensor(H, N, D, 5), dq = tensor(H, N, D, 6);
  fa_tensor dk = tensor(H, N, D, 7), dv = tensor(H, N, D, 8);
  float *lse = malloc(sizeof(float) * (size_t)(H * N));
  const double fwd = 4.0 * H * N * N * D * (causal ? 0.5 : 1.0), bwd = 2.5 * fwd;
  double lo[2] = {1e9, 1e9}, hi[2] = {0, 0};
  if (fa_forward(&p, &q, &k, &v, &o, lse) != FA_OK) { /* warm-up */
    fprintf(stderr, "%s\n", fa_last_error());
    return 1;
  }
  for (int r = 0; r < rounds; r++) {
    const double peak = fma_peak();
    double t0 = cpu_seconds();
    fa_forward(&p, &q, &k, &v, &o, lse);
    const double tf = cpu_seconds() - t0;
    t0 = cpu_seconds();
    fa_backward(&p, &q, &k, &v, &o, &dO, lse, &dq, &dk, &dv);
    const double tb = cpu_seconds() - t0;
    const double f[2] = {fwd / tf * 1e-9 / peak, bwd / tb * 1e-9 / peak};
    for (int i = 0; i < 2; i++) {
      lo[i] = f[i] < lo[i] ? f[i] : lo[i];
      hi[i] = f[i] > hi[i] ? f[i] : hi[i];
    }
    printf("round %d: peak %.1f GFLOP/cpu-s; fwd %.1f (%.3f of peak), bwd %.1f (%.3f)\n", r + 1,
           peak, fwd / tf * 1e-9, f[0], bwd / tb * 1e-9, f[1]);
  }
  printf("D=%lld %s H=%lld N=%lld: fwd %.3f-%.3f, bwd %.3f-%.3f of the peak per CPU-second\n",
         (long long)D, causal ? "causal" : "non-causal", (long long)H, (long long)N, lo[0], hi[0],
         lo[1], hi[1]);
  return 0;
}
