/* Memory, random inputs, streams and timers for either device, so the rest of
 * the bench never branches on CPU vs CUDA. Every CUDA return code is checked;
 * a failure leaves its message in bench_device_error(). */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"

#ifdef FLASHATTN_CUDA
#include <cuda_runtime.h>
#endif

static char device_error[256];

const char *bench_device_error(void) { return device_error; }

#ifdef FLASHATTN_CUDA
/* 1 when the call succeeded; else records what failed and returns 0. */
static int cuda_ok(cudaError_t e, const char *what) {
  if (e == cudaSuccess) return 1;
  snprintf(device_error, sizeof device_error, "%s: %s", what, cudaGetErrorString(e));
  return 0;
}
#define CUDA_OK(call) cuda_ok((call), #call)
#endif

int bench_device_ready(fa_device d, const char **why) {
  *why = "";
  if (d == FA_DEVICE_CPU) return 1;
#ifdef FLASHATTN_CUDA
  int n = 0;
  if (!CUDA_OK(cudaGetDeviceCount(&n)) || n == 0) {
    *why = n == 0 && !device_error[0] ? "no CUDA device found" : device_error;
    return 0;
  }
  if (!fa_device_available(FA_DEVICE_CUDA)) {
    *why = "the library reports no usable CUDA device";
    return 0;
  }
  return 1;
#else
  *why =
      "this build has no CUDA backend (configure with -DFLASHATTN_CUDA=ON on a machine with nvcc)";
  return 0;
#endif
}

int bench_stream_create(fa_device d, void **stream) {
  *stream = NULL;
#ifdef FLASHATTN_CUDA
  if (d == FA_DEVICE_CUDA) {
    cudaStream_t s;
    if (!CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking))) return -1;
    *stream = s;
  }
#else
  (void)d;
#endif
  return 0;
}

void bench_stream_destroy(fa_device d, void *stream) {
#ifdef FLASHATTN_CUDA
  if (d == FA_DEVICE_CUDA && stream) CUDA_OK(cudaStreamDestroy((cudaStream_t)stream));
#else
  (void)d, (void)stream;
#endif
}

size_t bench_memory_limit(fa_device d) {
#ifdef FLASHATTN_CUDA
  if (d == FA_DEVICE_CUDA) {
    size_t free_b = 0, total_b = 0;
    /* unknown: let cudaMalloc decide */
    return CUDA_OK(cudaMemGetInfo(&free_b, &total_b)) ? free_b : SIZE_MAX;
  }
#else
  (void)d;
#endif
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return SIZE_MAX;
  return (size_t)((double)pages * (double)page * 0.75);
}

void *bench_alloc(fa_device d, size_t bytes) {
  if (bytes == 0) bytes = 1;
#ifdef FLASHATTN_CUDA
  if (d == FA_DEVICE_CUDA) {
    void *p = NULL;
    if (!CUDA_OK(cudaMalloc(&p, bytes))) {
      (void)cudaGetLastError(); /* an out-of-memory error is not sticky: clear it */
      return NULL;
    }
    return p;
  }
#else
  (void)d;
#endif
  return aligned_alloc(64, (bytes + 63) & ~(size_t)63);
}

int bench_copy_to_device(fa_device d, void *dst, const void *src, size_t bytes) {
#ifdef FLASHATTN_CUDA
  if (d == FA_DEVICE_CUDA)
    return CUDA_OK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice)) ? 0 : -1;
#else
  (void)d;
#endif
  memcpy(dst, src, bytes);
  return 0;
}

void bench_free(fa_device d, void *p) {
  if (!p) return;
#ifdef FLASHATTN_CUDA
  if (d == FA_DEVICE_CUDA) {
    CUDA_OK(cudaFree(p));
    return;
  }
#else
  (void)d;
#endif
  free(p);
}

int bench_touch(fa_device d, void *stream, void *p, size_t bytes) {
#ifdef FLASHATTN_CUDA
  if (d == FA_DEVICE_CUDA)
    return CUDA_OK(cudaMemsetAsync(p, 0, bytes, (cudaStream_t)stream)) &&
                   CUDA_OK(cudaStreamSynchronize((cudaStream_t)stream))
               ? 0
               : -1;
#else
  (void)d, (void)stream;
#endif
  memset(p, 0, bytes);
  return 0;
}

/* ---- random inputs ------------------------------------------------------- */

/* Element i of stream seed: a counter-based hash, so any chunk can be made alone. */
static float random_value(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0xD1B54A32D192ED03ull + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  /* odd numerator over 2^24: uniform in (-1, 1), exact in float, never 0 */
  int32_t n = (int32_t)(2 * (z >> 40) + 1) - (1 << 24);
  return (float)n * (1.0f / 16777216.0f);
}

static uint16_t f32_to_f16(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
  if (a >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0));
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past 65504 */
  uint32_t h, rem, halfway;
  if (a < 0x38800000u) { /* half subnormal: units of 2^-24 */
    if (a < 0x33000000u) return (uint16_t)sign;
    int shift = 126 - (int)(a >> 23);
    uint32_t m = (a & 0x7fffffu) | 0x800000u;
    h = m >> shift, rem = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
  } else {
    h = (a - 0x38000000u) >> 13, rem = a & 0x1fffu, halfway = 0x1000u;
  }
  if (rem > halfway || (rem == halfway && (h & 1))) h++; /* to nearest even */
  return (uint16_t)(sign | h);
}

static uint16_t f32_to_bf16(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
  return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* Elements [first, first + count) of the stream, written to host memory. */
static void fill_host(void *dst, fa_dtype dtype, size_t first, size_t count, uint64_t seed) {
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < (int64_t)count; j++) {
    float x = random_value(seed, first + (uint64_t)j);
    switch (dtype) {
      case FA_DTYPE_F16:
        ((uint16_t *)dst)[j] = f32_to_f16(x);
        break;
      case FA_DTYPE_BF16:
        ((uint16_t *)dst)[j] = f32_to_bf16(x);
        break;
      case FA_DTYPE_F64:
        ((double *)dst)[j] = x;
        break;
      case FA_DTYPE_F32:
        ((float *)dst)[j] = x;
        break;
    }
  }
}

int bench_fill_random(fa_device d, void *stream, void *p, fa_dtype dtype, size_t count,
                      uint64_t seed) {
  if (d == FA_DEVICE_CPU) {
    fill_host(p, dtype, 0, count, seed);
    return 0;
  }
#ifdef FLASHATTN_CUDA
  /* staged through a host buffer, one chunk at a time */
  const size_t es = fa_dtype_size(dtype), chunk = ((size_t)16 << 20) / es;
  void *host = malloc(chunk * es);
  if (!host) {
    snprintf(device_error, sizeof device_error, "cannot allocate a host staging buffer");
    return -1;
  }
  int ok = 1;
  for (size_t first = 0; ok && first < count; first += chunk) {
    size_t n = count - first < chunk ? count - first : chunk;
    fill_host(host, dtype, first, n, seed);
    ok = CUDA_OK(cudaMemcpyAsync((char *)p + first * es, host, n * es, cudaMemcpyHostToDevice,
                                 (cudaStream_t)stream)) &&
         CUDA_OK(cudaStreamSynchronize((cudaStream_t)stream));
  }
  free(host);
  return ok ? 0 : -1;
#else
  (void)stream;
  return -1;
#endif
}

/* ---- timing -------------------------------------------------------------- */

double bench_now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int bench_timer_init(bench_timer *t, fa_device d, void *stream) {
  memset(t, 0, sizeof *t);
  t->device = d;
  t->stream = stream;
#ifdef FLASHATTN_CUDA
  if (d == FA_DEVICE_CUDA) {
    cudaEvent_t a, b;
    if (!CUDA_OK(cudaEventCreate(&a))) return -1;
    if (!CUDA_OK(cudaEventCreate(&b))) {
      (void)cudaEventDestroy(a); /* keep the create error as the message */
      return -1;
    }
    t->start = a, t->stop = b;
  }
#endif
  return 0;
}

int bench_timer_start(bench_timer *t) {
#ifdef FLASHATTN_CUDA
  if (t->device == FA_DEVICE_CUDA)
    return CUDA_OK(cudaEventRecord((cudaEvent_t)t->start, (cudaStream_t)t->stream)) ? 0 : -1;
#endif
  t->t0 = bench_now_seconds();
  return 0;
}

double bench_timer_stop(bench_timer *t) {
#ifdef FLASHATTN_CUDA
  if (t->device == FA_DEVICE_CUDA) {
    float ms = 0;
    if (!CUDA_OK(cudaEventRecord((cudaEvent_t)t->stop, (cudaStream_t)t->stream)) ||
        !CUDA_OK(cudaEventSynchronize((cudaEvent_t)t->stop)) ||
        !CUDA_OK(cudaEventElapsedTime(&ms, (cudaEvent_t)t->start, (cudaEvent_t)t->stop)))
      return -1;
    return ms;
  }
#endif
  return 1e3 * (bench_now_seconds() - t->t0);
}

void bench_timer_destroy(bench_timer *t) {
#ifdef FLASHATTN_CUDA
  if (t->start) CUDA_OK(cudaEventDestroy((cudaEvent_t)t->start));
  if (t->stop) CUDA_OK(cudaEventDestroy((cudaEvent_t)t->stop));
#endif
  t->start = t->stop = NULL;
}
