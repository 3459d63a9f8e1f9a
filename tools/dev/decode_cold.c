/* The CPU decode with its K/V in DRAM, as in a model's decode step: one call
 * per layer over L layers' caches (f16, B = 1, H query and K/V heads, one
 * query row, Nk keys, D), L chosen so that the caches together hold at least
 * 256 MiB (eight times a 32 MiB L3), so each call reads its K/V from DRAM
 * however small one layer's is. Beside it, in the same run, the DRAM read
 * rate of one thread and of the given threads (flashattn-bench --peak's sum
 * over a 512 MiB array, best of 5). Prints per round the calls' median and
 * 90th percentile (ms) and the median's K/V GB/s as a share of either rate.
 * The library picks the decode's threads (at most `threads`); run the probe
 * against two builds (LD_LIBRARY_PATH) to compare their choices.
 *   cc -O2 -mavx2 -mf16c -fopenmp -Iinclude tools/dev/decode_cold.c -Lbuild -lflashattn -lm \
 *     -o decode_cold
 *   OMP_WAIT_POLICY=passive ./decode_cold [Nk 1024] [H 8] [D 128] [threads 2] [rounds 3] */
#define _POSIX_C_SOURCE 200809L
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "flashattn.h"
#include "probe.h"

static volatile long long sink;

/* GB/s of a sum over n bytes, each thread its contiguous slice, best of 5. */
static double dram_rate(const char *a, size_t n, int threads) {
  double best = 1e30;
  for (int rep = 0; rep < 6; rep++) { /* the first pass warms the TLB */
    long long total = 0;
    const double t0 = now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
      const size_t t = (size_t)omp_get_thread_num(), nt = (size_t)omp_get_num_threads();
      const size_t lo = n * t / nt / 128 * 128, hi = n * (t + 1) / nt / 128 * 128;
      __m256i s = _mm256_setzero_si256(), s1 = s;
      for (size_t i = lo; i < hi; i += 128) {
        s = _mm256_add_epi64(s, _mm256_load_si256((const __m256i *)(a + i)));
        s1 = _mm256_add_epi64(s1, _mm256_load_si256((const __m256i *)(a + i + 32)));
        s = _mm256_add_epi64(s, _mm256_load_si256((const __m256i *)(a + i + 64)));
        s1 = _mm256_add_epi64(s1, _mm256_load_si256((const __m256i *)(a + i + 96)));
      }
      s = _mm256_add_epi64(s, s1);
      total += _mm256_extract_epi64(s, 0) + _mm256_extract_epi64(s, 3);
    }
    const double dt = now() - t0;
    sink = total;
    if (rep > 0 && dt < best) best = dt;
  }
  return (double)n / best * 1e-9;
}

static void fill_f16(uint16_t *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++) {
    seed = seed * 1664525u + 1013904223u;
    p[i] = _cvtss_sh((float)(seed >> 8) / 16777216.0f - 0.5f, 0);
  }
}

int main(int argc, char **argv) {
  const int64_t nk = argc > 1 ? atol(argv[1]) : 1024, H = argc > 2 ? atol(argv[2]) : 8;
  const int64_t D = argc > 3 ? atol(argv[3]) : 128;
  const int threads = argc > 4 ? atoi(argv[4]) : 2, rounds = argc > 5 ? atoi(argv[5]) : 3;
  const size_t kv = (size_t)(2 * nk * H * D * 2); /* one layer's K and V bytes */
  const int layers = (int)((((size_t)256 << 20) + kv - 1) / kv);
  const int calls = layers < 64 ? 4 * layers : layers; /* per round: whole sweeps */
  uint16_t *q = malloc((size_t)(H * D) * 2), *o = malloc((size_t)(H * D) * 2);
  uint16_t **K = malloc(sizeof *K * (size_t)layers), **V = malloc(sizeof *V * (size_t)layers);
  const size_t nd = 512u << 20;
  char *R = aligned_alloc(4096, nd);
  double *t = malloc(sizeof *t * (size_t)calls);
  if (!q || !o || !K || !V || !R || !t) return 1;
  fill_f16(q, (size_t)(H * D), 1);
  for (int l = 0; l < layers; l++) {
    K[l] = malloc(kv / 2), V[l] = malloc(kv / 2);
    if (!K[l] || !V[l]) return 1;
    fill_f16(K[l], kv / 4, 2 + 2 * (unsigned)l);
    fill_f16(V[l], kv / 4, 3 + 2 * (unsigned)l);
  }
#pragma omp parallel num_threads(threads)
  { /* each thread first touches the slice it reads */
    const size_t i = (size_t)omp_get_thread_num(), nt = (size_t)omp_get_num_threads();
    memset(R + nd * i / nt, 1, nd * (i + 1) / nt - nd * i / nt);
  }
  fa_params p;
  memset(&p, 0, sizeof p);
  p.num_threads = threads;
  fa_tensor tq = fa_tensor_bnhd(q, FA_DTYPE_F16, 1, 1, H, D);
  fa_tensor to = fa_tensor_bnhd(o, FA_DTYPE_F16, 1, 1, H, D);
  printf("Nk %lld, H %lld, D %lld: %.2f MiB of K/V a layer, %d layers, %d calls a round\n",
         (long long)nk, (long long)H, (long long)D, (double)kv / (1 << 20), layers, calls);
  for (int r = 0; r < rounds; r++) {
    const double d1 = dram_rate(R, nd, 1), dn = dram_rate(R, nd, threads);
    for (int i = 0; i < calls; i++) {
      const int l = i % layers;
      fa_tensor tk = fa_tensor_bnhd(K[l], FA_DTYPE_F16, 1, nk, H, D);
      fa_tensor tv = fa_tensor_bnhd(V[l], FA_DTYPE_F16, 1, nk, H, D);
      const double t0 = now();
      if (fa_forward(&p, &tq, &tk, &tv, &to, NULL) != FA_OK) {
        fprintf(stderr, "%s\n", fa_last_error());
        return 1;
      }
      t[i] = now() - t0;
    }
    qsort(t, (size_t)calls, sizeof *t, cmp);
    const double med = t[calls / 2], p90 = t[calls * 9 / 10], gbs = (double)kv / med * 1e-9;
    printf(
        "round %d: DRAM 1 thread %.1f GB/s, %d threads %.1f; call median %.4f ms, p90 %.4f; "
        "%.1f GB/s = %.3f of 1 thread's, %.3f of %d threads'\n",
        r + 1, d1, threads, dn, med * 1e3, p90 * 1e3, gbs, gbs / d1, gbs / dn, threads);
  }
  return 0;
}
