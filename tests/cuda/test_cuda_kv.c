/* GPU tests of paged KV caches and the KV-cache call (fa_forward_kvcache):
 * kvtest.h's checks with the device's memory, against the float64 CPU
 * oracle on each sequence's gathered keys. Decode and prefill shapes on the
 * Hopper kernels (page sizes that are multiples of 8) and the sm_80 kernels
 * (other page sizes, softcap, ALiBi, left padding, batch indices), rotary
 * both ways, appends that cross pages, split keys.
 *   test_cuda_kv [--quick] [-v] [FILTER]   (--quick: what the sanitizers run)
 * Exits 77 with no device. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kvtest.h"

static void ck(cudaError_t e, const char *what) {
  if (e != cudaSuccess) {
    fprintf(stderr, "test_cuda_kv: %s: %s\n", what, cudaGetErrorString(e));
    exit(2);
  }
}
static void *d_alloc(size_t bytes) {
  void *p = NULL;
  ck(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc");
  return p;
}
static void d_up(void *dst, const void *src, size_t bytes) {
  ck(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to the device");
}
static void d_down(void *dst, const void *src, size_t bytes) {
  ck(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy from the device");
}
static void d_free(void *p) { cudaFree(p); }
static void d_sync(void *stream) {
  ck(cudaStreamSynchronize((cudaStream_t)stream), "cudaStreamSynchronize");
  ck(cudaGetLastError(), "a kernel");
}

static kvdev g_dev = {FA_DEVICE_CUDA, NULL, d_alloc, d_up, d_down, d_free,
                      d_sync,         1e-3, 8e-3,    1e-6, 1e-3};

static kvcfg base(fa_dtype dt, int d) {
  kvcfg c = kvcfg_default();
  c.dt = dt, c.d = d, c.dev = &g_dev;
  return c;
}

static void paged_cases(void) {
  static const fa_dtype dts[2] = {FA_DTYPE_F16, FA_DTYPE_BF16};
  static const int dims[4] = {64, 128, 256, 96};
  for (int t = 0; t < 2; t++)
    for (int di = 0; di < 4; di++) {
      const int D = dims[di];
      /* decode, GQA 32:8: split keys, packed heads; pages of 16 and 256 */
      kvcfg c = base(dts[t], D);
      c.hq = 32, c.hk = 8, c.nq = 1, c.page = 16, c.cap = 3072, c.seqused = 1, c.share = 1;
      const int u[4] = {3000, 1, 0, 2049};
      kv_seqs(&c, 4, NULL, u);
      kv_register("paged", c, di > 1);
      c.page = 256;
      kv_register("paged", c, 1);
      /* prefill rows against the cache, causal: pages of 64, 48 (boxes of
       * 16), 24 (boxes of 8) and 20 (the sm_80 kernels) */
      static const int pg[4] = {64, 48, 24, 20};
      for (int i = 0; i < 4; i++) {
        c = base(dts[t], D);
        c.hq = 4, c.hk = 2, c.nq = 300, c.page = pg[i], c.cap = 960, c.seqused = 1, c.causal = 1;
        const int u2[2] = {960, 517};
        kv_seqs(&c, 2, NULL, u2);
        kv_register("paged", c, i > 0 && di != 1);
      }
    }
  /* varlen, sm_80 and Hopper head dims; every key of the pages */
  static const int vd[2] = {32, 128};
  for (int i = 0; i < 2; i++) {
    kvcfg c = base(FA_DTYPE_BF16, vd[i]);
    c.varlen = 1, c.hq = 4, c.hk = 2, c.page = 32, c.cap = 1536, c.causal = 1;
    const int lq[4] = {1, 200, 0, 37}, lk[4] = {1500, 300, 9, 0};
    kv_seqs(&c, 4, lq, lk);
    kv_register("paged", c, 0);
  }
  kvcfg c = base(FA_DTYPE_F16, 128);
  c.page = 128, c.cap = 512, c.nq = 130;
  kv_register("paged", c, 0);
  /* the transforming sm_80 kernel: softcap, ALiBi, windows */
  c = base(FA_DTYPE_F16, 64);
  c.hq = 8, c.hk = 2, c.nq = 5, c.page = 16, c.cap = 2048, c.seqused = 1, c.softcap = 20;
  c.alibi = 2, c.causal = 1;
  const int u3[3] = {2040, 33, 1000};
  kv_seqs(&c, 3, NULL, u3);
  kv_register("paged", c, 0);
  c.softcap = 0, c.alibi = 0, c.window = 1, c.wl = 300, c.wr = 0, c.nq = 64, c.d = 128;
  kv_register("paged", c, 0);
  /* pools in (pages, heads, rows, D) with padded rows; forced splits */
  c = base(FA_DTYPE_BF16, 128);
  c.hq = 8, c.hk = 8, c.nq = 1, c.page = 64, c.cap = 1024, c.seqused = 1, c.bhnd = 1, c.pad = 8;
  c.num_splits = 7;
  const int u4[2] = {1000, 64};
  kv_seqs(&c, 2, NULL, u4);
  kv_register("paged", c, 0);
  /* the suite catches the last two pages swapped */
  c = base(FA_DTYPE_F16, 128);
  c.nq = 16, c.page = 64, c.cap = 512, c.seqused = 1, c.causal = 1, c.sabotage = 1;
  const int u5[2] = {500, 300};
  kv_seqs(&c, 2, NULL, u5);
  kv_register("meta", c, 0);
}

static void call_cases(void) {
  static const fa_dtype dts[2] = {FA_DTYPE_F16, FA_DTYPE_BF16};
  for (int t = 0; t < 2; t++) {
    /* a decode step: append one row, rotate, GQA 32:8, paged and not */
    for (int paged = 0; paged < 2; paged++)
      for (int inter = 0; inter < 2; inter++) {
        kvcfg c = base(dts[t], 128);
        c.api = KV_CALL, c.hq = 32, c.hk = 8, c.nq = 1, c.nnew = 1, c.cap = 2048;
        c.rotary = 128, c.interleaved = inter, c.causal = 1, c.page = paged ? 16 : 0;
        const int sl[4] = {2000, 0, 15, 1024};
        kv_seqs(&c, 4, NULL, sl);
        kv_register("call", c, t == 1 && inter);
      }
    /* a prefill chunk: 128 new rows, causal, rotary on half the head */
    kvcfg c = base(dts[t], 128);
    c.api = KV_CALL, c.hq = 8, c.hk = 2, c.nq = 128, c.nnew = 128, c.cap = 1024, c.rotary = 64;
    c.causal = 1, c.page = 64;
    const int sl[2] = {700, 5};
    kv_seqs(&c, 2, NULL, sl);
    kv_register("call", c, t == 1);
  }
  /* head dims 64 and 256; no mask (q rows at one position); local */
  kvcfg c = base(FA_DTYPE_F16, 64);
  c.api = KV_CALL, c.hq = 4, c.hk = 4, c.nq = 4, c.nnew = 4, c.cap = 512, c.rotary = 64;
  const int sl2[3] = {300, 508, 0};
  kv_seqs(&c, 3, NULL, sl2);
  kv_register("call", c, 0);
  c.d = 256, c.rotary = 32, c.window = 1, c.wl = 50, c.wr = 0, c.page = 32;
  kv_register("call", c, 0);
  /* left padding and batch indices (the sm_80 kernels) */
  c = base(FA_DTYPE_BF16, 128);
  c.api = KV_CALL, c.nq = 2, c.nnew = 2, c.cap = 600, c.rotary = 128, c.causal = 1, c.hq = 8;
  c.hk = 2, c.leftpad = 1, c.lp[0] = 100, c.lp[1] = 0, c.lp[2] = 7;
  const int sl3[3] = {500, 3, 7};
  kv_seqs(&c, 3, NULL, sl3);
  kv_register("call", c, 0);
  c.leftpad = 0, c.bidx = 1, c.cache_batch = 5, c.bi[0] = 4, c.bi[1] = 0, c.bi[2] = 2;
  kv_register("call", c, 0);
  /* softcap and ALiBi (the sm_80 kernels), splits forced; nothing appended */
  c = base(FA_DTYPE_F16, 128);
  c.api = KV_CALL, c.nq = 1, c.nnew = 1, c.cap = 4096, c.rotary = 64, c.softcap = 30;
  c.alibi = 1, c.num_splits = 16, c.page = 256;
  const int sl4[2] = {4095, 2000};
  kv_seqs(&c, 2, NULL, sl4);
  kv_register("call", c, 0);
  c.softcap = 0, c.alibi = 0, c.nnew = 0, c.rotary = 0, c.num_splits = 1;
  kv_register("call", c, 0);
  /* the last two pages swapped under the call */
  c = base(FA_DTYPE_BF16, 128);
  c.api = KV_CALL, c.nq = 8, c.nnew = 8, c.cap = 512, c.page = 64, c.rotary = 128, c.causal = 1;
  c.sabotage = 1;
  const int sl5[2] = {300, 200};
  kv_seqs(&c, 2, NULL, sl5);
  kv_register("meta", c, 0);
}

int main(int argc, char **argv) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0 || !fa_device_available(FA_DEVICE_CUDA)) {
    printf("test_cuda_kv: no CUDA device: skipped\n");
    return 77;
  }
  cudaStream_t s;
  ck(cudaStreamCreate(&s), "cudaStreamCreate");
  g_dev.stream = s;
  paged_cases();
  call_cases();
  kv_register_drawn(300, 40, &g_dev); /* 40 under the sanitizers */
  const int rc = tr_main(argc, argv);
  cudaStreamDestroy(s);
  return rc;
}
