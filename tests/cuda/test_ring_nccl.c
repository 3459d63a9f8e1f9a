/* fa_ring_forward / fa_ring_backward on every visible GPU, one thread a rank,
 * over NCCL (include/flashattn_nccl.h), against the whole sequence: each
 * rank's O, dQ, dK, dV put back at their positions must match the float64
 * CPU oracle within twice the error of one GPU's whole-sequence call plus a
 * floor (bf16). Exits 77 (skipped) with fewer than two GPUs. */
#include <cuda_runtime.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../ring_rows.h"
#include "flashattn.h"
#include "flashattn_nccl.h"

#define MAXW 8

typedef struct cfg {
  const char *name;
  fa_ring_layout layout;
  int B, H, Hk, n, D; /* n: rows a rank on 2 GPUs (on W GPUs, 2n / W: the same sequence) */
  int causal, window;
  int64_t wl, wr;
  float p;
} cfg;

static uint16_t to_bf16(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  x += 0x7fffu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}
static float from_bf16(uint16_t h) {
  uint32_t x = (uint32_t)h << 16;
  float f;
  memcpy(&f, &x, 4);
  return f;
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static double normal(void) {
  rng = rng * 6364136223846793005ull + 1442695040888963407ull;
  double u1 = ((rng >> 11) + 1.0) / 9007199254740993.0;
  rng = rng * 6364136223846793005ull + 1442695040888963407ull;
  double u2 = (rng >> 11) / 9007199254740992.0;
  return sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2);
}

static fa_params params_of(const cfg *c) {
  fa_params p = {0};
  p.causal = c->causal;
  p.window_enabled = c->window;
  p.window_left = c->wl;
  p.window_right = c->wr;
  p.dropout_p = c->p;
  p.dropout_seed = 4242;
  return p;
}

typedef struct job {
  const cfg *c;
  int W, rank;
  ncclComm_t comm;
  const uint16_t *q, *k, *v, *dout; /* whole sequence, bf16, host */
  uint16_t *o, *dq, *dk, *dv;       /* whole-sequence results, host: this rank's rows */
  fa_status st;
  char err[256];
} job;

#define CK(x)                                                               \
  do {                                                                      \
    if ((x) != cudaSuccess) {                                               \
      snprintf(j->err, sizeof j->err, "%s: %s", #x, cudaGetErrorString(x)); \
      j->st = FA_ERR_DEVICE;                                                \
      return NULL;                                                          \
    }                                                                       \
  } while (0)

static void *rank_main(void *arg) {
  job *j = arg;
  const cfg *c = j->c;
  const int B = c->B, H = c->H, Hk = c->Hk, D = c->D, n = c->n, N = n * j->W;
  const size_t nq = (size_t)B * n * H * D, nk = (size_t)B * n * Hk * D;
  int64_t pos[4096];
  ring_positions(c->layout, j->W, n, j->rank, pos);
  cudaError_t e = cudaSetDevice(j->rank);
  CK(e);
  uint16_t *h = malloc(2 * (4 * nq + 4 * nk));
  uint16_t *hq = h, *hdo = hq + nq, *ho = hdo + nq, *hdq = ho + nq, *hk = hdq + nq, *hv = hk + nk,
           *hdk = hv + nk, *hdv = hdk + nk;
  ring_rows(hq, (void *)j->q, pos, B, n, N, 2 * (size_t)H * D, 1);
  ring_rows(hdo, (void *)j->dout, pos, B, n, N, 2 * (size_t)H * D, 1);
  ring_rows(hk, (void *)j->k, pos, B, n, N, 2 * (size_t)Hk * D, 1);
  ring_rows(hv, (void *)j->v, pos, B, n, N, 2 * (size_t)Hk * D, 1);
  void *d;
  float *lse;
  e = cudaMalloc(&d, 2 * (4 * nq + 4 * nk));
  CK(e);
  e = cudaMalloc((void **)&lse, sizeof(float) * (size_t)B * H * n);
  CK(e);
  uint16_t *dq_ = d, *ddo = dq_ + nq, *dout_o = ddo + nq, *ddq = dout_o + nq, *dk_ = ddq + nq,
           *dv_ = dk_ + nk, *ddk = dv_ + nk, *ddv = ddk + nk;
  e = cudaMemcpy(d, h, 2 * (4 * nq + 4 * nk), cudaMemcpyHostToDevice);
  CK(e);
  e = cudaMemset(dout_o, 0xFF, 2 * nq); /* outputs poisoned */
  CK(e);
  cudaStream_t s;
  e = cudaStreamCreate(&s);
  CK(e);
  fa_ring_nccl net;
  fa_ring ring;
  j->st = fa_ring_nccl_init(&net, &ring, j->comm, c->layout);
  fa_params p = params_of(c);
  p.device = FA_DEVICE_CUDA;
  p.stream = s;
  void *const ptr[8] = {dq_, dk_, dv_, dout_o, ddo, ddq, ddk, ddv};
  if (j->st == FA_OK) j->st = ring_run(&p, &ring, ptr, lse, FA_DTYPE_BF16, B, n, H, Hk, D);
  if (j->st != FA_OK) snprintf(j->err, sizeof j->err, "%s", fa_last_error());
  e = cudaStreamSynchronize(s);
  CK(e);
  e = cudaMemcpy(h, d, 2 * (4 * nq + 4 * nk), cudaMemcpyDeviceToHost);
  CK(e);
  ring_rows(ho, j->o, pos, B, n, N, 2 * (size_t)H * D, 0);
  ring_rows(hdq, j->dq, pos, B, n, N, 2 * (size_t)H * D, 0);
  ring_rows(hdk, j->dk, pos, B, n, N, 2 * (size_t)Hk * D, 0);
  ring_rows(hdv, j->dv, pos, B, n, N, 2 * (size_t)Hk * D, 0);
  fa_ring_nccl_destroy(&net);
  cudaStreamDestroy(s);
  cudaFree(d);
  cudaFree(lse);
  free(h);
  return NULL;
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static double rel(const uint16_t *x, const double *r, size_t n, int *nan) {
  double a = 0, b = 0;
  for (size_t i = 0; i < n; i++) {
    const double v = from_bf16(x[i]);
    if (isnan(v)) *nan = 1;
    a += (v - r[i]) * (v - r[i]), b += r[i] * r[i];
  }
  return sqrt(a / b);
}

/* The whole sequence in one call: f64 on the CPU (out: double) or bf16 on GPU 0 (out: bf16). */
static int whole(const cfg *c, int W, int gpu, const uint16_t *const in[4], double *r64[4],
                 uint16_t *r16[4]) {
  const int B = c->B, H = c->H, Hk = c->Hk, D = c->D, N = c->n * W;
  const size_t nq = (size_t)B * N * H * D, nk = (size_t)B * N * Hk * D;
  const size_t sz[8] = {nq, nk, nk, nq, nq, nq, nk, nk};
  const int heads[8] = {H, Hk, Hk, H, H, H, Hk, Hk};
  const size_t es = gpu ? 2 : 8;
  char *buf[8];
  float *lse;
  fa_params p = params_of(c);
  if (gpu) {
    p.device = FA_DEVICE_CUDA;
    if (cudaSetDevice(0) != cudaSuccess) return 0;
    for (int i = 0; i < 8; i++)
      if (cudaMalloc((void **)&buf[i], sz[i] * es) != cudaSuccess) return 0;
    if (cudaMalloc((void **)&lse, 4 * (size_t)B * H * N) != cudaSuccess) return 0;
    for (int i = 0; i < 4; i++)
      if (cudaMemcpy(buf[i], in[i], sz[i] * 2, cudaMemcpyHostToDevice) != cudaSuccess) return 0;
  } else {
    p.algorithm = FA_ALGO_STANDARD;
    for (int i = 0; i < 8; i++) buf[i] = malloc(sz[i] * es);
    lse = malloc(4 * (size_t)B * H * N);
    for (int i = 0; i < 4; i++)
      for (size_t x = 0; x < sz[i]; x++) ((double *)buf[i])[x] = from_bf16(in[i][x]);
  }
  fa_tensor t[8];
  for (int i = 0; i < 8; i++)
    t[i] = fa_tensor_bnhd(buf[i], gpu ? FA_DTYPE_BF16 : FA_DTYPE_F64, B, N, heads[i], D);
  int ok = fa_forward(&p, &t[0], &t[1], &t[2], &t[4], lse) == FA_OK &&
           fa_backward(&p, &t[0], &t[1], &t[2], &t[4], &t[3], lse, &t[5], &t[6], &t[7]) == FA_OK;
  if (!ok) fprintf(stderr, "whole-sequence run: %s\n", fa_last_error());
  for (int i = 0; ok && i < 4; i++) {
    if (gpu)
      ok = cudaMemcpy(r16[i], buf[4 + i], sz[4 + i] * 2, cudaMemcpyDeviceToHost) == cudaSuccess;
    else
      memcpy(r64[i], buf[4 + i], sz[4 + i] * 8);
  }
  for (int i = 0; i < 8; i++) gpu ? (void)cudaFree(buf[i]) : free(buf[i]);
  gpu ? (void)cudaFree(lse) : free(lse);
  return ok;
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0); /* each line out before a crash or a kill */
  int W = 0;
  if (cudaGetDeviceCount(&W) != cudaSuccess || W < 2) {
    printf("test_ring_nccl: skipped (fewer than two GPUs)\n");
    return 77;
  }
  if (W > MAXW) W = MAXW;
  const cfg cases[] = {
      {"zigzag/causal", FA_RING_ZIGZAG, 1, 4, 4, 512, 128, 1, 0, 0, 0, 0},
      {"zigzag/causal/gqa", FA_RING_ZIGZAG, 2, 4, 1, 256, 64, 1, 0, 0, 0, 0},
      {"contiguous/window/dropout", FA_RING_CONTIGUOUS, 1, 2, 2, 512, 128, 0, 1, 300, 100, 0.2f},
      {"zigzag/causal-window/dropout", FA_RING_ZIGZAG, 1, 2, 1, 512, 64, 1, 1, 400, -1, 0.1f},
  };
  int devs[MAXW];
  for (int i = 0; i < W; i++) devs[i] = i;
  ncclComm_t comms[MAXW];
  const double t_init = now();
  if (ncclCommInitAll(comms, W, devs) != ncclSuccess) {
    printf("FAIL ncclCommInitAll\n");
    return 1;
  }
  printf("ncclCommInitAll over %d GPUs: %.1f s\n", W, now() - t_init);
  int fails = 0;
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    cfg cw = cases[ci];
    cw.n = (cw.n * 2 / W) & ~1; /* the float64 reference's time does not grow with W */
    const cfg *c = &cw;
    const int N = c->n * W;
    const size_t nq = (size_t)c->B * N * c->H * c->D, nk = (size_t)c->B * N * c->Hk * c->D;
    const size_t sz[4] = {nq, nq, nk, nk};
    uint16_t *in[4], *got[4], *one[4];
    double *ref[4];
    const size_t insz[4] = {nq, nk, nk, nq}; /* q, k, v, dout */
    for (int i = 0; i < 4; i++) {
      in[i] = malloc(2 * insz[i]);
      for (size_t x = 0; x < insz[i]; x++) in[i][x] = to_bf16((float)normal());
    }
    for (int i = 0; i < 4; i++) {
      got[i] = malloc(2 * sz[i]), one[i] = malloc(2 * sz[i]);
      ref[i] = malloc(8 * sz[i]);
    }
    const double t0 = now();
    job jobs[MAXW];
    pthread_t th[MAXW];
    for (int r = 0; r < W; r++) {
      jobs[r] = (job){c,     W,      r,      comms[r], in[0],  in[1], in[2],
                      in[3], got[0], got[1], got[2],   got[3], FA_OK, ""};
      pthread_create(&th[r], NULL, rank_main, &jobs[r]);
    }
    for (int r = 0; r < W; r++) pthread_join(th[r], NULL);
    int ok = 1;
    for (int r = 0; r < W; r++)
      if (jobs[r].st != FA_OK) {
        printf("FAIL %s: rank %d: %s: %s\n", c->name, r, fa_status_string(jobs[r].st), jobs[r].err);
        ok = 0;
      }
    const uint16_t *const ins[4] = {in[0], in[1], in[2], in[3]};
    const double t1 = now();
    if (ok && !whole(c, W, 0, ins, ref, NULL)) ok = 0;
    const double t2 = now();
    if (ok && !whole(c, W, 1, ins, NULL, one)) ok = 0;
    const double t3 = now();
    if (ok) {
      const char *names[4] = {"O", "dQ", "dK", "dV"};
      char line[512];
      int at = 0;
      for (int i = 0; i < 4; i++) {
        int nan = 0, nan1 = 0;
        const double e = rel(got[i], ref[i], sz[i], &nan), e1 = rel(one[i], ref[i], sz[i], &nan1);
        const double tol = 2 * e1 + (i ? 4e-3 : 2e-3);
        const int good = !nan && e <= tol;
        ok &= good;
        at += snprintf(line + at, sizeof line - (size_t)at, " %s %.2e/%.2e%s", names[i], e, tol,
                       good ? "" : " FAIL");
      }
      printf("%s %s:%s (%d GPUs; ring %.1f s, float64 reference %.1f s, one GPU %.1f s)\n",
             ok ? "ok  " : "FAIL", c->name, line, W, t1 - t0, t2 - t1, t3 - t2);
    }
    fails += !ok;
    for (int i = 0; i < 4; i++) free(in[i]), free(got[i]), free(one[i]), free(ref[i]);
  }
  for (int i = 0; i < W; i++) ncclCommDestroy(comms[i]);
  printf("%d passed, %d failed\n", (int)(sizeof cases / sizeof cases[0]) - fails, fails);
  return fails ? 1 : 0;
}
