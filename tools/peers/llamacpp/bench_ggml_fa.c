/* bench_ggml_fa: times llama.cpp's CPU attention kernel, ggml_flash_attn_ext, on one
 * shape, the way llama.cpp's graph calls it for prefill and decode, and prints one JSON
 * line in flashattn-bench's --json schema (impl "llamacpp").
 *
 * What llama.cpp does, and so what this does (ggml 0.25.3, src/llama-graph.cpp,
 * src/llama-kv-cache.cpp):
 *  - Q is float32 [D, Hq, Nq] (token-major, heads inside), viewed as [D, Nq, Hq] by
 *    ggml_permute(0, 2, 1, 3); K and V are float16 views of the KV cache, [D, Hk, Nk]
 *    permuted the same way (V not transposed when flash attention is on).
 *  - The mask is float16 [Nk, Nq]: 0 where a key is visible, -inf where not. llama.cpp
 *    always passes one (all zeros for non-causal attention); --no-mask passes NULL.
 *    Causal is bottom-right aligned (query i sees keys j <= i + Nk - Nq), as in
 *    flashattn-bench.
 *  - scale 1/sqrt(D), no ALiBi, no softcap, float32 accumulation (GGML_PREC_F32).
 *  - The graph is computed by the CPU backend on a ggml threadpool of --threads threads.
 * Timing, FLOPs and the median follow flashattn-bench (bench/flashattn-bench.c,
 * bench/report.c): FLOPs 4*D*Hq*Nq*Nk, halved when causal; --warmup untimed runs, then up
 * to --repeat timed runs, cut short once --max-time seconds of runs are spent.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-cpu.h"
#include "ggml.h"

#ifndef PEER_VERSION
#define PEER_VERSION "ggml"
#endif

typedef struct opts {
  int64_t d, hq, hk, nq, nk;
  int causal, mask, threads, repeat, warmup, check, json;
  double max_time;
  uint64_t seed;
} opts;

static void usage(FILE *f) {
  fprintf(f,
          "usage: bench_ggml_fa [options]\n"
          "Times ggml_flash_attn_ext (llama.cpp's CPU kernel, " PEER_VERSION ")\n"
          "on one shape: Q float32, K/V float16, B=1; one JSON line per case.\n"
          "  --headdim N      D (default 64)\n"
          "  --heads N        query heads Hq (default 16)\n"
          "  --kv-heads N     K/V heads Hk, a divisor of Hq (default Hq)\n"
          "  --seqlen N       query rows Nq (default 4096)\n"
          "  --seqlen-k N     keys Nk (default Nq)\n"
          "  --causal         causal mask, bottom-right aligned (default)\n"
          "  --no-causal      an all-zero mask, as llama.cpp passes for non-causal attention\n"
          "  --no-mask        no mask tensor at all (implies --no-causal)\n"
          "  --threads N      threads of the ggml threadpool (default 2)\n"
          "  --repeat N       timed runs, median reported (default 3)\n"
          "  --warmup N       untimed runs first (default 1)\n"
          "  --max-time S     stop a case once its runs took S seconds, after one timed\n"
          "                   run; a warmup longer than S counts as that run (default 2)\n"
          "  --seed N         input seed (default 1)\n"
          "  --check          compare sampled output rows with a float64 reference\n"
          "  --table          a line for people instead of JSON\n");
}

static int parse(int argc, char **argv, opts *o) {
  *o = (opts){.d = 64, .hq = 16, .nq = 4096, .causal = 1, .mask = 1, .threads = 2, .repeat = 3,
              .warmup = 1, .json = 1, .max_time = 2, .seed = 1};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define INT_ARG(name, field)                                                      \
  if (strcmp(a, name) == 0) {                                                     \
    if (!v) return fprintf(stderr, "bench_ggml_fa: %s needs a value\n", a), 2;    \
    char *end;                                                                    \
    long long x = strtoll(v, &end, 10);                                           \
    if (*end || end == v || x < 0)                                                \
      return fprintf(stderr, "bench_ggml_fa: %s: bad value '%s'\n", a, v), 2;     \
    o->field = x;                                                                 \
    i++;                                                                          \
    continue;                                                                     \
  }
    INT_ARG("--headdim", d)
    INT_ARG("--heads", hq)
    INT_ARG("--kv-heads", hk)
    INT_ARG("--seqlen", nq)
    INT_ARG("--seqlen-k", nk)
    INT_ARG("--threads", threads)
    INT_ARG("--repeat", repeat)
    INT_ARG("--warmup", warmup)
    INT_ARG("--seed", seed)
#undef INT_ARG
    if (strcmp(a, "--max-time") == 0 && v) {
      o->max_time = atof(v), i++;
      continue;
    }
    if (strcmp(a, "--causal") == 0) o->causal = 1, o->mask = 1;
    else if (strcmp(a, "--no-causal") == 0) o->causal = 0;
    else if (strcmp(a, "--no-mask") == 0) o->causal = 0, o->mask = 0;
    else if (strcmp(a, "--check") == 0) o->check = 1;
    else if (strcmp(a, "--table") == 0) o->json = 0;
    else if (strcmp(a, "--help") == 0) return usage(stdout), 0;
    else return fprintf(stderr, "bench_ggml_fa: unknown option '%s'\n", a), usage(stderr), 2;
  }
  if (!o->hk) o->hk = o->hq;
  if (!o->nk) o->nk = o->nq;
  if (o->d < 1 || o->hq < 1 || o->nq < 1 || o->nk < 1 || o->threads < 1 || o->repeat < 1 ||
      o->hq % o->hk)
    return fprintf(stderr, "bench_ggml_fa: bad shape or counts (Hk must divide Hq)\n"), 2;
  return -1;
}

/* splitmix64 -> uniform in (-1, 1), never 0 (as flashattn-bench's inputs). */
static float rand_unit(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (float)(((double)(z >> 11) + 0.5) / 9007199254740992.0 * 2.0 - 1.0);
}

static void fill_f16(ggml_fp16_t *dst, int64_t n, uint64_t *s) {
  enum { CHUNK = 4096 };
  float tmp[CHUNK];
  for (int64_t i = 0; i < n; i += CHUNK) {
    const int64_t m = n - i < CHUNK ? n - i : CHUNK;
    for (int64_t j = 0; j < m; j++) tmp[j] = rand_unit(s);
    ggml_fp32_to_fp16_row(tmp, dst + i, m);
  }
}

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Largest |out - reference| over a few query rows of every head, reference in float64
 * from the same float32 Q and float16 K/V values. */
static double check_rows(const opts *o, const float *q, const ggml_fp16_t *k,
                         const ggml_fp16_t *v, const float *out) {
  const int64_t D = o->d, rows[] = {0, o->nq / 3, (2 * o->nq) / 3, o->nq - 1};
  const double scale = 1.0 / sqrt((double)D);
  double *s = malloc((size_t)o->nk * sizeof *s), *acc = malloc((size_t)D * sizeof *acc);
  double err = 0;
  for (int64_t h = 0; h < o->hq; h++) {
    const int64_t hk = h / (o->hq / o->hk);
    for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
      const int64_t i = rows[r];
      const int64_t last = o->causal ? i + o->nk - o->nq : o->nk - 1;
      const float *qi = q + (i * o->hq + h) * D;
      double mx = -INFINITY, l = 0;
      for (int64_t j = 0; j <= last && j < o->nk; j++) {
        const ggml_fp16_t *kj = k + (j * o->hk + hk) * D;
        double dot = 0;
        for (int64_t c = 0; c < D; c++) dot += (double)qi[c] * ggml_fp16_to_fp32(kj[c]);
        s[j] = dot * scale;
        if (s[j] > mx) mx = s[j];
      }
      for (int64_t c = 0; c < D; c++) acc[c] = 0;
      for (int64_t j = 0; j <= last && j < o->nk; j++) {
        const double p = exp(s[j] - mx);
        const ggml_fp16_t *vj = v + (j * o->hk + hk) * D;
        l += p;
        for (int64_t c = 0; c < D; c++) acc[c] += p * ggml_fp16_to_fp32(vj[c]);
      }
      const float *oi = out + (i * o->hq + h) * D;
      for (int64_t c = 0; c < D; c++) {
        const double ref = last >= 0 ? acc[c] / l : 0.0;
        const double e = fabs((double)oi[c] - ref);
        if (!(e <= err)) err = e; /* NaN propagates */
      }
    }
  }
  free(s);
  free(acc);
  return err;
}

int main(int argc, char **argv) {
  opts o;
  const int prc = parse(argc, argv, &o);
  if (prc >= 0) return prc;

  ggml_cpu_init();
  const int64_t D = o.d;
  const size_t q_bytes = (size_t)(D * o.hq * o.nq) * sizeof(float);
  const size_t kv_bytes = (size_t)(D * o.hk * o.nk) * sizeof(ggml_fp16_t);
  const size_t mask_bytes = o.mask ? (size_t)(o.nk * o.nq) * sizeof(ggml_fp16_t) : 0;
  const size_t out_bytes = (size_t)(D * o.hq * o.nq) * sizeof(float);
  const size_t n_tensors = 16;
  struct ggml_init_params ip = {
      .mem_size = q_bytes + 2 * kv_bytes + mask_bytes + out_bytes +
                  n_tensors * (ggml_tensor_overhead() + 64) + ggml_graph_overhead() + (1 << 20),
      .mem_buffer = NULL,
      .no_alloc = false,
  };
  struct ggml_context *ctx = ggml_init(ip);
  if (!ctx) return fprintf(stderr, "bench_ggml_fa: ggml_init failed (%zu bytes)\n", ip.mem_size), 1;

  /* Storage as llama.cpp holds it: the current tokens' Q, and the KV cache's K and V. */
  struct ggml_tensor *q_buf = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, D, o.hq, o.nq);
  struct ggml_tensor *k_buf = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, D, o.hk, o.nk);
  struct ggml_tensor *v_buf = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, D, o.hk, o.nk);
  struct ggml_tensor *mask = o.mask ? ggml_new_tensor_2d(ctx, GGML_TYPE_F16, o.nk, o.nq) : NULL;

  uint64_t seed = o.seed * 0x100000001B3ull;
  float *qd = q_buf->data;
  for (int64_t i = 0; i < D * o.hq * o.nq; i++) qd[i] = rand_unit(&seed);
  fill_f16(k_buf->data, D * o.hk * o.nk, &seed);
  fill_f16(v_buf->data, D * o.hk * o.nk, &seed);
  if (mask) {
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), ninf = ggml_fp32_to_fp16(-INFINITY);
    ggml_fp16_t *m = mask->data;
    for (int64_t i = 0; i < o.nq; i++)
      for (int64_t j = 0; j < o.nk; j++)
        m[i * o.nk + j] = (!o.causal || j <= i + o.nk - o.nq) ? zero : ninf;
  }

  struct ggml_tensor *q = ggml_permute(ctx, q_buf, 0, 2, 1, 3);
  struct ggml_tensor *k = ggml_permute(ctx, k_buf, 0, 2, 1, 3);
  struct ggml_tensor *v = ggml_permute(ctx, v_buf, 0, 2, 1, 3);
  struct ggml_tensor *out =
      ggml_flash_attn_ext(ctx, q, k, v, mask, 1.0f / sqrtf((float)D), 0.0f, 0.0f);
  ggml_prec_set_acc(out, GGML_PREC_F32);

  struct ggml_cgraph *gf = ggml_new_graph(ctx);
  ggml_build_forward_expand(gf, out);

  struct ggml_threadpool_params tpp = ggml_threadpool_params_default(o.threads);
  struct ggml_threadpool *tp = ggml_threadpool_new(&tpp);
  if (!tp) return fprintf(stderr, "bench_ggml_fa: ggml_threadpool_new failed\n"), 1;
  struct ggml_cplan plan = ggml_graph_plan(gf, o.threads, tp);
  uint8_t *work = plan.work_size ? malloc(plan.work_size) : NULL;
  if (plan.work_size && !work) return fprintf(stderr, "bench_ggml_fa: out of memory\n"), 1;
  plan.work_data = work;

  /* flashattn-bench's loop: warmups, then timed runs, cut short by --max-time */
  const double budget_ms = 1e3 * o.max_time;
  double *ms = malloc((size_t)o.repeat * sizeof *ms);
  int runs = 0, warm_left = o.warmup;
  double spent = 0;
  while (runs < o.repeat) {
    const double t0 = now_ms();
    const enum ggml_status st = ggml_graph_compute(gf, &plan);
    const double t = now_ms() - t0;
    if (st != GGML_STATUS_SUCCESS)
      return fprintf(stderr, "bench_ggml_fa: ggml_graph_compute: status %d\n", (int)st), 1;
    spent += t;
    if (warm_left > 0 && !(budget_ms > 0 && t >= budget_ms)) {
      warm_left--;
      continue;
    }
    warm_left = 0;
    ms[runs++] = t;
    if (budget_ms > 0 && spent >= budget_ms) break;
  }
  qsort(ms, (size_t)runs, sizeof *ms, cmp_double);
  const int h = runs / 2;
  const double med = runs % 2 ? ms[h] : 0.5 * (ms[h - 1] + ms[h]);
  const double flops = 4.0 * (double)D * (double)o.hq * (double)o.nq * (double)o.nk *
                       (o.causal ? 0.5 : 1.0);
  const double gflops = flops / (med * 1e-3) * 1e-9;
  const double err = o.check ? check_rows(&o, qd, k_buf->data, v_buf->data, out->data) : NAN;

  if (o.json) {
    printf("{\"record\":\"case\",\"impl\":\"llamacpp\",\"device\":\"cpu\",\"pass\":\"fwd\"");
    printf(",\"B\":1,\"H\":%lld,\"Hk\":%lld,\"Nq\":%lld,\"Nk\":%lld,\"D\":%lld", (long long)o.hq,
           (long long)o.hk, (long long)o.nq, (long long)o.nk, (long long)D);
    printf(",\"dtype\":\"f16\",\"q_dtype\":\"f32\",\"kv_dtype\":\"f16\",\"layout\":\"bnhd\"");
    printf(",\"causal\":%s,\"mask\":\"%s\",\"window_left\":null,\"window_right\":null",
           o.causal ? "true" : "false", !o.mask ? "none" : o.causal ? "causal" : "zeros");
    printf(",\"softcap\":0,\"status\":\"ok\",\"ms\":%.6g,\"ms_min\":%.6g,\"flops\":%.0f", med,
           ms[0], flops);
    printf(",\"gflops\":%.6g,\"extra_bytes\":%zu,\"work_bytes\":%zu,\"mask_bytes\":%zu", gflops,
           plan.work_size + mask_bytes, plan.work_size, mask_bytes);
    printf(",\"threads\":%d,\"runs\":%d,\"repeat\":%d,\"warmup\":%d,\"max_time\":%g", o.threads,
           runs, o.repeat, o.warmup, o.max_time);
    printf(",\"seed\":%llu", (unsigned long long)o.seed);
    if (o.check) printf(",\"max_abs_err\":%.3g", err);
    printf(",\"version\":\"%s\"}\n", PEER_VERSION);
  } else {
    printf("llamacpp cpu fwd H=%lld Hk=%lld Nq=%lld Nk=%lld D=%lld %s %d threads: %.3f ms "
           "(median of %d), %.2f GFLOP/s",
           (long long)o.hq, (long long)o.hk, (long long)o.nq, (long long)o.nk, (long long)D,
           o.causal ? "causal" : "non-causal", o.threads, med, runs, gflops);
    if (o.check) printf(", max abs err %.3g", err);
    printf("\n");
  }
  free(ms);
  free(work);
  ggml_threadpool_free(tp);
  ggml_free(ctx);
  return 0;
}
