/* Reads two arrays (K, V) the way the CPU decode does, with no arithmetic:
 * each thread takes its slice of both and reads a block of K, then the same
 * block of V, and so on (whole blocks of its slice); beside it the one
 * contiguous stream per thread that flashattn-bench --peak measures. Tells
 * what the decode's access pattern can reach from DRAM on this host
 * (docs/PERF.md, "CPU: decode and KV cache").
 *   cc -O2 -mavx2 -fopenmp tools/dev/kv_stream.c -o kv_stream
 *   ./kv_stream [MiB of each array, 64] [KiB per block, 64] */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static __m256i sum_bytes(const char *p, size_t n, __m256i s) {
  for (size_t i = 0; i < n; i += 128) {
    s = _mm256_add_epi64(s, _mm256_load_si256((const __m256i *)(p + i)));
    s = _mm256_add_epi64(s, _mm256_load_si256((const __m256i *)(p + i + 32)));
    s = _mm256_add_epi64(s, _mm256_load_si256((const __m256i *)(p + i + 64)));
    s = _mm256_add_epi64(s, _mm256_load_si256((const __m256i *)(p + i + 96)));
  }
  return s;
}

static volatile long long sink;

int main(int argc, char **argv) {
  const size_t n = (size_t)(argc > 1 ? atol(argv[1]) : 64) << 20;
  const size_t blk = (size_t)(argc > 2 ? atol(argv[2]) : 64) << 10;
  if (n == 0 || blk == 0 || blk % 128 || n % blk) {
    fprintf(stderr, "kv_stream: the array must be whole blocks of a multiple of 128 bytes\n");
    return 2;
  }
  char *K = aligned_alloc(4096, n), *V = aligned_alloc(4096, n), *R = aligned_alloc(4096, 2 * n);
  if (!K || !V || !R) return 1;
#pragma omp parallel
  { /* each thread first touches what it reads */
    const size_t t = (size_t)omp_get_thread_num(), nt = (size_t)omp_get_num_threads();
    memset(K + n * t / nt, 1, n / nt);
    memset(V + n * t / nt, 2, n / nt);
    memset(R + 2 * n * t / nt, 3, 2 * n / nt);
  }
  for (int rep = 0; rep < 8; rep++) {
    const double t0 = omp_get_wtime();
#pragma omp parallel
    {
      const size_t t = (size_t)omp_get_thread_num(), nt = (size_t)omp_get_num_threads();
      const __m256i s = sum_bytes(R + 2 * n * t / nt, 2 * n / nt, _mm256_setzero_si256());
      sink += _mm256_extract_epi64(s, 0);
    }
    const double t1 = omp_get_wtime();
#pragma omp parallel
    {
      const size_t t = (size_t)omp_get_thread_num(), nt = (size_t)omp_get_num_threads();
      __m256i s = _mm256_setzero_si256();
      for (size_t o = n * t / nt; o + blk <= n * (t + 1) / nt; o += blk) {
        s = sum_bytes(K + o, blk, s);
        s = sum_bytes(V + o, blk, s);
      }
      sink += _mm256_extract_epi64(s, 0);
    }
    const double t2 = omp_get_wtime();
    printf("one stream %.1f GB/s   K, V in %zu KiB blocks %.1f GB/s   ratio %.2f\n",
           2 * n / (t1 - t0) * 1e-9, blk >> 10, 2 * n / (t2 - t1) * 1e-9, (t1 - t0) / (t2 - t1));
  }
  free(K);
  free(V);
  free(R);
  return 0;
}
