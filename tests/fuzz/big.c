/* More than 2^31 elements in one tensor: offsets past what an int32 holds.
 * Computation is kept cheap (one row over every key, windowed rows, or few
 * keys), the inputs come from a hash of the element index, and the result is
 * checked against a float64 reference on the rows it looks at:
 *   K/V big: bf16, D = 128, 2^24 + 5 keys (2^31 + 640 elements; K and V one
 *     buffer, which inputs may share), one decode row seeing every key (the
 *     keys that decide it lie past element 2^31, before it and at the end),
 *     and 40 rows under a causal 3000-key window across the 2^31 boundary
 *     (flash2 and flash1 tiles);
 *   Q/O big: f16, D = 128, 2^24 + 64 query rows against 16 keys, rows sampled
 *     (and, where memory allows, the backward: dQ sampled, dK and dV whole).
 *     The 64 rows past element 2^31 decide dK and dV: they share one query and
 *     carry an output gradient 2048x the others', so a wrong offset there shows.
 *     The other 2^24 rows' part of dK and dV is one sum of 2^24 products in
 *     float32; on tensor cores, whose accumulator truncates, its error grows
 *     linearly with the rows (measured on an H100: 6e-3 relative at 2^22 rows,
 *     about 2^-29.3 a row), so that part is allowed 2^-28 a row of its size.
 * Each runs only where half the free memory holds it (a shared machine).
 * Tolerance: 2x the error of the reference rounded to the dtype plus
 * attn_floor(); lse within 1e-4 relative (2^24 keys are summed in float32). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "run.h"

#define BIG_D 128
#define BIG_N (((int64_t)1 << 24) + 5)
#define BIG_NQ (((int64_t)1 << 24) + 64)

static float hval(uint64_t i, uint64_t salt) {
  uint64_t z = (i + salt) * 0x9e3779b97f4a7c15ull;
  z ^= z >> 29;
  z *= 0xbf58476d1ce4e5b9ull;
  return (float)((int)(z >> 56) - 128) / 192.0f;
}

/* A host buffer and its device copy (the same memory on the CPU). */
typedef struct big_buf {
  unsigned char *h, *d;
  size_t bytes;
} big_buf;

static int big_alloc(big_buf *b, const fz_dev *dev, size_t bytes) {
  b->bytes = bytes;
  b->h = (unsigned char *)malloc(bytes);
  if (!b->h) return 0;
  b->d = dev->device == FA_DEVICE_CPU ? b->h : (unsigned char *)dev->alloc(bytes);
  return b->d != NULL;
}
static void big_up(big_buf *b, const fz_dev *dev) {
  if (dev->device != FA_DEVICE_CPU) dev->upload(b->d, b->h, b->bytes);
}
static void big_down(big_buf *b, const fz_dev *dev) {
  if (dev->device != FA_DEVICE_CPU) {
    dev->sync(dev->stream);
    dev->download(b->h, b->d, b->bytes);
  }
}
static void big_free(big_buf *b, const fz_dev *dev) {
  if (b->d && b->d != b->h) dev->release(b->d);
  free(b->h);
  memset(b, 0, sizeof *b);
}

static void fill(big_buf *b, fa_dtype dt, size_t n, uint64_t salt, float scale) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < (int64_t)n; i++)
    tu_store(b->h, dt, (size_t)i, scale * hval((uint64_t)i, salt));
}

/* Element i of x: float64 tables (K and V converted once) inline, the rest through
 * tu_load. */
static inline double kv_at(const void *x, fa_dtype dt, size_t i) {
  return dt == FA_DTYPE_F64 ? ((const double *)x)[i] : tu_load(x, dt, i);
}

/* One attention row in float64: keys [lo, hi) of K, V (row j at j * ldk),
 * o (D), lse; and, with dout, dq (D) and the row's dS and P (for dK, dV). */
static double ref_row(const double *q, const void *k, const void *v, fa_dtype dt, int64_t ldk,
                      int64_t lo, int64_t hi, double scale, double *o, double *p) {
  double m = -INFINITY, l = 0;
  for (int64_t j = lo; j < hi; j++) {
    double s = 0;
    for (int d = 0; d < BIG_D; d++) s += q[d] * kv_at(k, dt, (size_t)(j * ldk + d));
    p[j - lo] = s * scale;
    if (p[j - lo] > m) m = p[j - lo];
  }
  for (int64_t j = lo; j < hi; j++) l += (p[j - lo] = exp(p[j - lo] - m));
  for (int d = 0; d < BIG_D; d++) o[d] = 0;
  for (int64_t j = lo; j < hi; j++) {
    p[j - lo] /= l;
    for (int d = 0; d < BIG_D; d++) o[d] += p[j - lo] * kv_at(v, dt, (size_t)(j * ldk + d));
  }
  return m + log(l);
}

/* err(x) <= 2 err(ref rounded to dt) + floor + extra, over D values */
static int row_within(const double *ref, const void *x, fa_dtype dt, size_t at, int backward,
                      double extra) {
  double num = 0, den = 0, rnd = 0;
  for (int d = 0; d < BIG_D; d++) {
    const double g = tu_load(x, dt, at + (size_t)d), r = ref[d], e = tu_round(r, dt) - r;
    if (!isfinite(g)) return 0;
    num += (g - r) * (g - r), den += r * r, rnd += e * e;
  }
  den = den > 0 ? den : 1;
  return sqrt(num / den) <= 2 * sqrt(rnd / den) + attn_floor(dt, backward) + extra;
}
static int row_ok(const double *ref, const void *x, fa_dtype dt, size_t at, int backward) {
  return row_within(ref, x, dt, at, backward, 0);
}

static double norm(const double *x) {
  double s = 0;
  for (int d = 0; d < BIG_D; d++) s += x[d] * x[d];
  return sqrt(s);
}

static int lse_ok(double ref, float got) {
  return fabs((double)got - ref) <= 1e-4 * (fabs(ref) > 1 ? fabs(ref) : 1);
}

static int big_fail(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;
static int big_fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("FAIL big ");
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
  fflush(stdout);
  return 1;
}

/* ---- K and V of more than 2^31 elements ------------------------------------------------ */

static int big_kv(const fz_dev *dev, int verbose) {
  const fa_dtype dt = FA_DTYPE_BF16;
  const int64_t NK = BIG_N, NQ = 40, D = BIG_D;
  const size_t nk = (size_t)(NK * D), es = 2;
  big_buf k, q, o, lse;
  memset(&k, 0, sizeof k), memset(&q, 0, sizeof q);
  memset(&o, 0, sizeof o), memset(&lse, 0, sizeof lse);
  big_buf v = k; /* V is K's buffer */
  int failures = 0;
  if (!big_alloc(&k, dev, nk * es) || !big_alloc(&q, dev, (size_t)(NQ * D) * es) ||
      !big_alloc(&o, dev, (size_t)(NQ * D) * es) || !big_alloc(&lse, dev, (size_t)NQ * 4)) {
    printf("big K/V: skipped (cannot allocate %zu GiB)\n", nk * es >> 30);
    goto done;
  }
  fill(&k, dt, nk, 1, 1);
  fill(&q, dt, (size_t)(NQ * D), 3, 1);
  /* keys whose scores dominate row NQ - 1's softmax: before element 2^31, past
   * it, and the last one; each a multiple of that row's query */
  const int64_t spikes[4] = {((int64_t)1 << 24) - 2, ((int64_t)1 << 24) + 1, ((int64_t)1 << 24) + 3,
                             NK - 1};
  for (int s = 0; s < 4; s++)
    for (int64_t d = 0; d < D; d++)
      tu_store(k.h, dt, (size_t)(spikes[s] * D + d),
               (6.0 + 0.25 * s) * tu_load(q.h, dt, (size_t)((NQ - 1) * D + d)));
  big_up(&k, dev), big_up(&q, dev);
  v = k;
  fa_tensor tq = fa_tensor_bnhd(q.d, dt, 1, 1, 1, D), tk = fa_tensor_bnhd(k.d, dt, 1, NK, 1, D);
  fa_tensor tv = fa_tensor_bnhd(v.d, dt, 1, NK, 1, D), to = fa_tensor_bnhd(o.d, dt, 1, 1, 1, D);
  tq.data = q.d + (size_t)((NQ - 1) * D) * es; /* the row the spikes are for */
  const double scale = (float)(1.0 / sqrt((double)D));
  double ref[BIG_D], *p = (double *)malloc((size_t)NK * sizeof(double));
  double qr[BIG_D];
  for (int64_t d = 0; d < D; d++) qr[d] = tu_load(q.h, dt, (size_t)((NQ - 1) * D + d));
  const double rl = ref_row(qr, k.h, v.h, dt, D, 0, NK, scale, ref, p);
  /* 1. one row over every key (the decode path) */
  fa_params pr;
  memset(&pr, 0, sizeof pr);
  pr.device = dev->device;
  pr.stream = dev->stream;
  memset(o.h, 0xFF, o.bytes), memset(lse.h, 0xFF, lse.bytes);
  big_up(&o, dev), big_up(&lse, dev);
  fa_status st = fa_forward(&pr, &tq, &tk, &tv, &to, (float *)lse.d);
  big_down(&o, dev), big_down(&lse, dev);
  if (st != FA_OK) {
    failures +=
        big_fail("K/V one row: fa_forward returned %s: %s", fa_status_string(st), fa_last_error());
  } else {
    if (!row_ok(ref, o.h, dt, 0, 0))
      failures += big_fail("K/V one row: O off (first element %g, reference %g)",
                           tu_load(o.h, dt, 0), ref[0]);
    if (!lse_ok(rl, ((float *)lse.h)[0]))
      failures += big_fail("K/V one row: lse %g, reference %g", (double)((float *)lse.h)[0], rl);
  }
  if (verbose) printf("big K/V: one row over %lld keys done\n", (long long)NK);
  /* 2. NQ rows, causal with a 3000-key window: tiles across element 2^31 */
  tq = fa_tensor_bnhd(q.d, dt, 1, NQ, 1, D);
  to = fa_tensor_bnhd(o.d, dt, 1, NQ, 1, D);
  pr.causal = 1;
  pr.window_enabled = 1;
  pr.window_left = 3000;
  pr.window_right = 0;
  static const fa_algorithm algos[2] = {FA_ALGO_FLASH2, FA_ALGO_FLASH1};
  for (int a = 0; a < 2; a++) {
    if (dev->device != FA_DEVICE_CPU && a == 1) break; /* one kernel on a GPU */
    pr.algorithm = algos[a];
    memset(o.h, 0xFF, o.bytes), memset(lse.h, 0xFF, lse.bytes);
    big_up(&o, dev), big_up(&lse, dev);
    st = fa_forward(&pr, &tq, &tk, &tv, &to, (float *)lse.d);
    big_down(&o, dev), big_down(&lse, dev);
    if (st != FA_OK) {
      failures += big_fail("K/V windowed %s: fa_forward returned %s: %s", tu_algo_name(algos[a]),
                           fa_status_string(st), fa_last_error());
      continue;
    }
    for (int64_t i = 0; i < NQ; i++) {
      for (int64_t d = 0; d < D; d++) qr[d] = tu_load(q.h, dt, (size_t)(i * D + d));
      const int64_t diag = i + NK - NQ;
      const double l = ref_row(qr, k.h, v.h, dt, D, diag - 3000, diag + 1, scale, ref, p);
      if (!row_ok(ref, o.h, dt, (size_t)(i * D), 0)) {
        failures += big_fail("K/V windowed %s: O of row %lld off (first element %g, reference %g)",
                             tu_algo_name(algos[a]), (long long)i,
                             tu_load(o.h, dt, (size_t)(i * D)), ref[0]);
        break;
      }
      if (!lse_ok(l, ((float *)lse.h)[i])) {
        failures += big_fail("K/V windowed %s: lse of row %lld is %g, reference %g",
                             tu_algo_name(algos[a]), (long long)i, (double)((float *)lse.h)[i], l);
        break;
      }
    }
  }
  free(p);
  printf("big K/V (%lld elements, bf16): %s\n", (long long)(NK * D),
         failures ? "FAILED" : "passed");
  fflush(stdout);
done:
  big_free(&k, dev), big_free(&q, dev), big_free(&o, dev);
  big_free(&lse, dev);
  return failures;
}

/* ---- Q and O of more than 2^31 elements ------------------------------------------------- */

static int big_q(const fz_dev *dev, int backward, int verbose) {
  const fa_dtype dt = FA_DTYPE_F16;
  const int64_t NQ = BIG_NQ, NK = 16, D = BIG_D, edge = ((int64_t)1 << 31) / D;
  const size_t nq = (size_t)(NQ * D), es = 2, nkv = (size_t)(NK * D);
  big_buf q, k, v, o, lse, dout, dq, dk, dv;
  big_buf *all[9] = {&q, &k, &v, &o, &lse, &dout, &dq, &dk, &dv};
  for (int b = 0; b < 9; b++) memset(all[b], 0, sizeof *all[b]);
  int failures = 0;
  if (!big_alloc(&q, dev, nq * es) || !big_alloc(&o, dev, nq * es) ||
      !big_alloc(&k, dev, nkv * es) || !big_alloc(&v, dev, nkv * es) ||
      !big_alloc(&lse, dev, (size_t)NQ * 4) ||
      (backward && (!big_alloc(&dout, dev, nq * es) || !big_alloc(&dq, dev, nq * es) ||
                    !big_alloc(&dk, dev, nkv * es) || !big_alloc(&dv, dev, nkv * es)))) {
    printf("big Q/O: skipped (cannot allocate)\n");
    goto done;
  }
  fill(&q, dt, nq, 4, 1);
  fill(&k, dt, nkv, 5, 1);
  fill(&v, dt, nkv, 6, 1);
  if (backward) fill(&dout, dt, nq, 7, 1.0f / 16);
  for (int64_t i = edge + 1; i < NQ; i++) /* the rows past element 2^31: one query */
    memcpy(q.h + (size_t)(i * D) * es, q.h + (size_t)(edge * D) * es, (size_t)D * es);
  if (backward)
    for (int64_t i = edge; i < NQ; i++)
      for (int64_t d = 0; d < D; d++) tu_store(dout.h, dt, (size_t)(i * D + d), 128 * hval(d, 8));
  memset(o.h, 0xFF, o.bytes), memset(lse.h, 0xFF, lse.bytes);
  for (int b = 0; b < 9; b++)
    if (all[b]->h && b != 6 && b != 7 && b != 8) big_up(all[b], dev);
  fa_tensor tq = fa_tensor_bnhd(q.d, dt, 1, NQ, 1, D), tk = fa_tensor_bnhd(k.d, dt, 1, NK, 1, D);
  fa_tensor tv = fa_tensor_bnhd(v.d, dt, 1, NK, 1, D), to = fa_tensor_bnhd(o.d, dt, 1, NQ, 1, D);
  fa_params pr;
  memset(&pr, 0, sizeof pr);
  pr.device = dev->device;
  pr.stream = dev->stream;
  fa_status st = fa_forward(&pr, &tq, &tk, &tv, &to, (float *)lse.d);
  big_down(&o, dev), big_down(&lse, dev);
  if (st != FA_OK) {
    failures += big_fail("Q/O: fa_forward returned %s: %s", fa_status_string(st), fa_last_error());
    goto done;
  }
  /* rows sampled: both ends, around element 2^31, and spread between */
  int64_t rows[64];
  int nr = 0;
  const int64_t fixed[8] = {0, 1, edge - 2, edge - 1, edge, edge + 1, NQ - 2, NQ - 1};
  for (int i = 0; i < 8; i++) rows[nr++] = fixed[i];
  for (; nr < 64; nr++) rows[nr] = (int64_t)(fz_mix(99, (uint64_t)nr) % (uint64_t)NQ);
  const double scale = (float)(1.0 / sqrt((double)D));
  /* the reference reads K and V (16 keys) as float64, converted once: the backward's
   * reference visits every one of the 2^24 rows */
  double kd[16 * BIG_D], vd[16 * BIG_D];
  for (size_t e = 0; e < nkv; e++) kd[e] = tu_load(k.h, dt, e), vd[e] = tu_load(v.h, dt, e);
  double ref[BIG_D], qr[BIG_D], p[16];
  for (int r = 0; r < nr && !failures; r++) {
    const int64_t i = rows[r];
    for (int64_t d = 0; d < D; d++) qr[d] = tu_load(q.h, dt, (size_t)(i * D + d));
    const double l = ref_row(qr, kd, vd, FA_DTYPE_F64, D, 0, NK, scale, ref, p);
    if (!row_ok(ref, o.h, dt, (size_t)(i * D), 0))
      failures += big_fail("Q/O: O of row %lld off (first element %g, reference %g)", (long long)i,
                           tu_load(o.h, dt, (size_t)(i * D)), ref[0]);
    else if (!lse_ok(l, ((float *)lse.h)[i]))
      failures += big_fail("Q/O: lse of row %lld is %g, reference %g", (long long)i,
                           (double)((float *)lse.h)[i], l);
  }
  if (verbose) printf("big Q/O: forward checked on %d rows\n", nr);
  if (backward && !failures) {
    memset(dq.h, 0xFF, dq.bytes), memset(dk.h, 0xFF, dk.bytes), memset(dv.h, 0xFF, dv.bytes);
    big_up(&dq, dev), big_up(&dk, dev), big_up(&dv, dev);
    fa_tensor tdo = fa_tensor_bnhd(dout.d, dt, 1, NQ, 1, D),
              tdq = fa_tensor_bnhd(dq.d, dt, 1, NQ, 1, D);
    fa_tensor tdk = fa_tensor_bnhd(dk.d, dt, 1, NK, 1, D),
              tdv = fa_tensor_bnhd(dv.d, dt, 1, NK, 1, D);
    st = fa_backward(&pr, &tq, &tk, &tv, &to, &tdo, (const float *)lse.d, &tdq, &tdk, &tdv);
    big_down(&dq, dev), big_down(&dk, dev), big_down(&dv, dev);
    if (st != FA_OK) {
      failures +=
          big_fail("Q/O: fa_backward returned %s: %s", fa_status_string(st), fa_last_error());
      goto done;
    }
    /* dK, dV over every row (float64, in parallel over rows): acc the rows before
     * element 2^31, acc + 2 nkv all; dQ on the sampled rows */
    double *acc = (double *)calloc(4 * nkv, sizeof(double));
#pragma omp parallel
    {
      double *mine = (double *)calloc(4 * nkv, sizeof(double)), o_[BIG_D], q_[BIG_D], pp[16];
#pragma omp for schedule(static)
      for (int64_t i = 0; i < NQ; i++) {
        double di = 0, dp[16], do_[BIG_D];
        for (int64_t d = 0; d < D; d++) {
          q_[d] = tu_load(q.h, dt, (size_t)(i * D + d));
          do_[d] = tu_load(dout.h, dt, (size_t)(i * D + d));
        }
        ref_row(q_, kd, vd, FA_DTYPE_F64, D, 0, NK, scale, o_, pp);
        for (int64_t d = 0; d < D; d++) di += do_[d] * o_[d];
        for (int64_t j = 0; j < NK; j++) {
          dp[j] = 0;
          for (int64_t d = 0; d < D; d++) dp[j] += do_[d] * vd[j * D + d];
          const double ds = pp[j] * (dp[j] - di) * scale;
          double *sum = mine + (i < edge ? 0 : 2 * nkv);
          for (int64_t d = 0; d < D; d++) {
            sum[j * D + d] += ds * q_[d];
            sum[nkv + (size_t)(j * D + d)] += pp[j] * do_[d];
          }
        }
      }
#pragma omp critical
      for (size_t e = 0; e < 2 * nkv; e++) acc[e] += mine[e], acc[2 * nkv + e] += mine[2 * nkv + e];
      free(mine);
    }
    for (size_t e = 0; e < 2 * nkv; e++) acc[2 * nkv + e] += acc[e];
    const double per_row = ldexp((double)edge, -28);
    for (int64_t j = 0; j < NK && !failures; j++) {
      const double *rk = acc + 2 * nkv + j * D, *rv = rk + nkv;
      if (!row_within(rk, dk.h, dt, (size_t)(j * D), 1, per_row * norm(acc + j * D) / norm(rk)))
        failures += big_fail("Q/O: dK of key %lld off (first element %g, reference %g)",
                             (long long)j, tu_load(dk.h, dt, (size_t)(j * D)), rk[0]);
      else if (!row_within(rv, dv.h, dt, (size_t)(j * D), 1,
                           per_row * norm(acc + nkv + j * D) / norm(rv)))
        failures += big_fail("Q/O: dV of key %lld off (first element %g, reference %g)",
                             (long long)j, tu_load(dv.h, dt, (size_t)(j * D)), rv[0]);
    }
    free(acc);
    for (int r = 0; r < nr && !failures; r++) {
      const int64_t i = rows[r];
      double di = 0, dqr[BIG_D], do_[BIG_D];
      for (int64_t d = 0; d < D; d++) {
        qr[d] = tu_load(q.h, dt, (size_t)(i * D + d));
        do_[d] = tu_load(dout.h, dt, (size_t)(i * D + d));
        dqr[d] = 0;
      }
      ref_row(qr, kd, vd, FA_DTYPE_F64, D, 0, NK, scale, ref, p);
      for (int64_t d = 0; d < D; d++) di += do_[d] * ref[d];
      for (int64_t j = 0; j < NK; j++) {
        double dp = 0;
        for (int64_t d = 0; d < D; d++) dp += do_[d] * vd[j * D + d];
        const double ds = p[j] * (dp - di) * scale;
        for (int64_t d = 0; d < D; d++) dqr[d] += ds * kd[j * D + d];
      }
      if (!row_ok(dqr, dq.h, dt, (size_t)(i * D), 1))
        failures += big_fail("Q/O: dQ of row %lld off (first element %g, reference %g)",
                             (long long)i, tu_load(dq.h, dt, (size_t)(i * D)), dqr[0]);
    }
  }
  printf("big Q/O (%lld elements, f16, %s): %s\n", (long long)(NQ * D),
         backward ? "forward and backward" : "forward", failures ? "FAILED" : "passed");
  fflush(stdout);
done:
  for (int b = 0; b < 9; b++) big_free(all[b], dev);
  return failures;
}

/* Whether n big tensors (and a margin) fit in half the free memory of the host
 * and of the device. */
static int fits(const fz_dev *dev, int n, const char *what) {
  const size_t gib = (size_t)1 << 30, need = n * (size_t)(BIG_NQ * BIG_D) * 2 + gib;
  const size_t host = fz_cpu.mem_available();
  const size_t avail = dev->device == FA_DEVICE_CPU ? host : dev->mem_available();
  const size_t have = host < avail ? host : avail;
  if (have / 2 >= need) return 1;
  printf("big %s: skipped (needs %zu GiB, half of the %zu GiB free)\n", what, need / gib,
         have / gib);
  fflush(stdout);
  return 0;
}

int fz_big(const fz_dev *dev, int verbose) {
  int failures = 0;
  if (fits(dev, 1, "K/V")) failures += big_kv(dev, verbose);
  if (fits(dev, 4, "Q/O backward"))
    failures += big_q(dev, 1, verbose);
  else if (fits(dev, 2, "Q/O"))
    failures += big_q(dev, 0, verbose);
  return failures;
}
