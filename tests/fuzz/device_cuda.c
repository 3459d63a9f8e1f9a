/* The fuzz checks on the CUDA backend: every tested run's buffers mirrored to
 * the GPU (stream-ordered copies and allocations on the host thread's stream,
 * so host threads with streams of their own overlap), and the properties of
 * --cuda-properties:
 *   streams      T host threads, each with its own stream, run valid cases at
 *                once, each checking its results and its own fa_last_error();
 *   determinism  a deterministic backward of 2 x 8 heads x 1024 keys, three
 *                runs, the same bits;
 *   allocation   a call whose workspace is past the free memory returns
 *                FA_ERR_OUT_OF_MEMORY with a message, writes nothing, leaks
 *                nothing (free memory as before, within 1 MiB, with the pool
 *                trimmed), and the next call works;
 *   size         fz_big: tensors of more than 2^31 elements. */
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "run.h"

int fz_cuda_init(fz_dev *dev);
int fz_cuda_properties(const fz_dev *dev, uint64_t seed, int verbose);

static _Thread_local cudaStream_t tl_stream; /* the calling host thread's stream */

static void ck(cudaError_t e, const char *what) {
  if (e != cudaSuccess) {
    fprintf(stderr, "fa_fuzz: %s: %s\n", what, cudaGetErrorString(e));
    exit(2);
  }
}

static void *dev_alloc(size_t n) {
  void *p = NULL;
  ck(cudaMallocAsync(&p, n ? n : 1, tl_stream), "cudaMallocAsync");
  return p;
}
static void dev_release(void *p) { ck(cudaFreeAsync(p, tl_stream), "cudaFreeAsync"); }
static void dev_upload(void *dst, const void *src, size_t n) {
  ck(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, tl_stream), "cudaMemcpyAsync");
  ck(cudaStreamSynchronize(tl_stream), "cudaStreamSynchronize"); /* src may change next */
}
static void dev_download(void *dst, const void *src, size_t n) {
  ck(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, tl_stream), "cudaMemcpyAsync");
  ck(cudaStreamSynchronize(tl_stream), "cudaStreamSynchronize");
}
static void dev_sync(void *stream) {
  ck(cudaStreamSynchronize((cudaStream_t)stream), "cudaStreamSynchronize");
}
static size_t dev_mem_available(void) {
  size_t free_b = 0, total = 0;
  ck(cudaMemGetInfo(&free_b, &total), "cudaMemGetInfo");
  return free_b;
}
static void *dev_thread_stream(void) {
  ck(cudaStreamCreateWithFlags(&tl_stream, cudaStreamNonBlocking), "cudaStreamCreate");
  return tl_stream;
}

int fz_cuda_init(fz_dev *dev) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0 || !fa_device_available(FA_DEVICE_CUDA)) {
    printf("fa_fuzz: no CUDA device (skipped)\n");
    return 0;
  }
  memset(dev, 0, sizeof *dev);
  dev->device = FA_DEVICE_CUDA;
  dev->alloc = dev_alloc;
  dev->release = dev_release;
  dev->upload = dev_upload;
  dev->download = dev_download;
  dev->sync = dev_sync;
  dev->mem_available = dev_mem_available;
  dev->thread_stream = dev_thread_stream;
  dev->stream = dev_thread_stream(); /* the main thread's */
  return 1;
}

/* ---- several streams at once ------------------------------------------------------ */

typedef struct stream_worker {
  const fz_dev *dev;
  uint64_t seed;
  int id, cases, failures;
} stream_worker;

static void *stream_body(void *arg) {
  stream_worker *w = (stream_worker *)arg;
  fz_dev dev = *w->dev;
  dev.stream = dev.thread_stream();
  for (int i = 0; i < w->cases; i++) {
    const uint64_t seed = fz_mix(w->seed, (uint64_t)(w->id * 100000 + i));
    fz_case c;
    fz_draw(&c, seed, 1);
    fz_ctx x = {0, "", 0};
    fz_stats st = {0, 0, 0};
    fz_check_valid(&c, &dev, 0, &x, &st);
    /* a refusal of this thread's own: its message, whatever the others do */
    char want[64];
    snprintf(want, sizeof want, "pass: unknown pass %d", 5000 + w->id);
    size_t b;
    fa_tensor q = fa_tensor_bnhd(NULL, FA_DTYPE_F16, 1, 1, 1, 8);
    fa_params p;
    memset(&p, 0, sizeof p);
    (void)fa_workspace_size((fa_pass)(5000 + w->id), &p, &q, &q, &q, &b);
    if (x.failures || strcmp(fa_last_error(), want) != 0) {
      printf("FAIL streams: thread %d case %#llx: %s\n  repro: fa_fuzz --case %#llx --cuda\n",
             w->id, (unsigned long long)seed,
             x.failures ? x.first : "fa_last_error() is another thread's",
             (unsigned long long)seed);
      w->failures++;
    }
  }
  ck(cudaStreamDestroy(tl_stream), "cudaStreamDestroy");
  return NULL;
}

static int prop_streams(const fz_dev *dev, uint64_t seed) {
  enum { T = 4, CASES = 50 };
  stream_worker w[T];
  pthread_t th[T];
  int failures = 0;
  for (int i = 0; i < T; i++) {
    w[i].dev = dev, w[i].seed = seed, w[i].id = i, w[i].cases = CASES, w[i].failures = 0;
    if (pthread_create(&th[i], NULL, stream_body, &w[i]) != 0) return 1;
  }
  for (int i = 0; i < T; i++) pthread_join(th[i], NULL), failures += w[i].failures;
  printf("streams: %d host threads with a stream each, %d cases each: %s\n", T, CASES,
         failures ? "FAILED" : "passed");
  return failures;
}

/* ---- a deterministic backward of some size, three runs ------------------------------- */

static int prop_deterministic(const fz_dev *dev) {
  fz_case c;
  fz_draw(&c, 1, 1);
  c.algo = FA_ALGO_FLASH2;
  c.dtype = FA_DTYPE_BF16;
  c.varlen = 0, c.used = 0, c.block = 0, c.alibi = 0, c.window = 0, c.softcap = 0;
  c.dropout = 0, c.scale = 0, c.lse_null = 0, c.workspace = 0;
  c.B = c.nseq = 2, c.HQ = 8, c.HK = 2, c.D = 128, c.NQ = c.NK = 1024, c.causal = 1;
  c.backward = 1, c.qk_std = 1;
  for (int t = 0; t < FZ_NT; t++)
    memset(&c.lay[t], 0, sizeof c.lay[t]), c.lay[t].order[1] = 1, c.lay[t].order[2] = 2;
  int failures = 0;
  for (int r = 0; r < 2; r++) { /* three runs: 1 vs 2, then 1 vs 3 */
    fz_ctx x = {0, "", 0};
    fz_check_repeat(&c, dev, &x);
    if (x.failures) printf("FAIL deterministic: %s\n", x.first), failures++;
  }
  printf("deterministic backward (2 x 8 heads x 1024, bf16, causal), repeated: %s\n",
         failures ? "FAILED" : "passed");
  return failures;
}

/* ---- allocation failure ------------------------------------------------------------------ */

static size_t trimmed_free(void) {
  int d = 0;
  cudaMemPool_t pool;
  ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  ck(cudaGetDevice(&d), "cudaGetDevice");
  ck(cudaDeviceGetDefaultMemPool(&pool, d), "cudaDeviceGetDefaultMemPool");
  ck(cudaMemPoolTrimTo(pool, 0), "cudaMemPoolTrimTo");
  return dev_mem_available();
}

static int prop_out_of_memory(const fz_dev *dev) {
  /* the standard algorithm's workspace: heads * Nq * Nk floats, 1 TiB here */
  const int64_t N = (int64_t)1 << 16, H = 64, D = 8;
  const size_t bytes = (size_t)(N * H * D) * 2;
  void *q = NULL, *o = NULL, *lse = NULL;
  ck(cudaMalloc(&q, bytes), "cudaMalloc");
  ck(cudaMalloc(&o, bytes), "cudaMalloc");
  ck(cudaMalloc(&lse, (size_t)(N * H) * 4), "cudaMalloc");
  ck(cudaMemset(q, 0, bytes), "cudaMemset");
  ck(cudaMemset(o, 0xFF, bytes), "cudaMemset");
  fa_tensor tq = fa_tensor_bnhd(q, FA_DTYPE_F16, 1, N, H, D);
  fa_tensor to = fa_tensor_bnhd(o, FA_DTYPE_F16, 1, N, H, D);
  fa_params p;
  memset(&p, 0, sizeof p);
  p.device = FA_DEVICE_CUDA;
  p.algorithm = FA_ALGO_STANDARD;
  p.stream = dev->stream;
  int failures = 0;
  size_t need = 0;
  if (fa_workspace_size(FA_PASS_FORWARD, &p, &tq, &tq, &tq, &need) != FA_OK) {
    printf("FAIL out of memory: fa_workspace_size: %s\n", fa_last_error());
    failures++;
  }
  const size_t before = trimmed_free();
  fa_status st = fa_forward(&p, &tq, &tq, &tq, &to, (float *)lse);
  const size_t after = trimmed_free();
  if (st != FA_ERR_OUT_OF_MEMORY || !fa_last_error()[0]) {
    printf("FAIL out of memory: a %zu-byte workspace gave %s: \"%s\"\n", need, fa_status_string(st),
           fa_last_error());
    failures++;
  }
  /* the driver's own bookkeeping may move free memory by a page or two: 1 MiB */
  if (after + ((size_t)1 << 20) < before) {
    printf("FAIL out of memory: free memory %zu bytes before the call, %zu after\n", before, after);
    failures++;
  }
  unsigned char *h = (unsigned char *)malloc(bytes);
  ck(cudaMemcpy(h, o, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
  for (size_t i = 0; i < bytes; i++)
    if (h[i] != 0xFF) {
      printf("FAIL out of memory: the refused call wrote o\n");
      failures++;
      break;
    }
  free(h);
  /* nothing sticky: the next call works */
  fa_tensor small = fa_tensor_bnhd(q, FA_DTYPE_F16, 1, 64, 8, D);
  fa_tensor osmall = fa_tensor_bnhd(o, FA_DTYPE_F16, 1, 64, 8, D);
  p.algorithm = FA_ALGO_FLASH2;
  st = fa_forward(&p, &small, &small, &small, &osmall, (float *)lse);
  if (st != FA_OK || cudaStreamSynchronize((cudaStream_t)dev->stream) != cudaSuccess) {
    printf("FAIL out of memory: the next call returned %s: %s\n", fa_status_string(st),
           fa_last_error());
    failures++;
  }
  ck(cudaFree(q), "cudaFree");
  ck(cudaFree(o), "cudaFree");
  ck(cudaFree(lse), "cudaFree");
  printf("allocation failure (a %zu GiB workspace): %s\n", need >> 30,
         failures ? "FAILED" : "FA_ERR_OUT_OF_MEMORY, nothing written or leaked");
  return failures;
}

int fz_cuda_properties(const fz_dev *dev, uint64_t seed, int verbose) {
  int failures = 0;
  failures += prop_streams(dev, seed);
  failures += prop_deterministic(dev);
  failures += prop_out_of_memory(dev);
  failures += fz_big(dev, verbose);
  return failures;
}
