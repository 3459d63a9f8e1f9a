/* The valid-case check: oracle, yardstick and tested run (fuzz.h), with
 * tests/attn.c's tolerance rule, the masks' exact consequences and the
 * memory the library may not touch. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "run.h"

/* The device's floor: tests/cuda/test_cuda.c's (its tensor-core products
 * round differently from the CPU's), never below the CPU's. */
static double floor_of(const fz_case *c, int backward) {
  double f = attn_floor(c->dtype, backward);
  if (c->cuda) {
    double g = c->dtype == FA_DTYPE_F16 ? 1e-3 : c->dtype == FA_DTYPE_BF16 ? 8e-3 : 0;
    if (g > f) f = g;
  }
  return f;
}

/* Which rows and keys the library writes, and which the masks hide. */
typedef struct fz_live {
  unsigned char *qrow;   /* (b, n): an O/dQ row the call writes */
  unsigned char *krow;   /* (b, n): a dK/dV row the call writes */
  unsigned char *masked; /* (s, h, i) by lse index: the row sees no key */
  unsigned char *unseen; /* (b, n, hk): a written key no query row sees */
} fz_live;

static void live_make(fz_live *l, const fz_case *c, const fz_data *d) {
  const size_t nq = (size_t)(c->B * c->NQ), nk = (size_t)(c->B * c->NK);
  l->qrow = (unsigned char *)calloc(nq, 1);
  l->krow = (unsigned char *)calloc(nk, 1);
  l->masked = (unsigned char *)calloc(d->lse_n ? d->lse_n : 1, 1);
  l->unseen = (unsigned char *)calloc(nk * (size_t)c->HK, 1);
  const int64_t G = c->HQ / c->HK;
  for (int64_t s = 0; s < c->nseq; s++) {
    const fz_seq q = fz_seq_of(c, s);
    for (int64_t i = 0; i < q.nq; i++) l->qrow[q.qb * c->NQ + q.q0 + i] = 1;
    for (int64_t j = 0; j < q.nk; j++) {
      int64_t b, n;
      fz_key_row(c, s, j, &b, &n);
      l->krow[b * c->NK + n] = 1;
      for (int64_t hk = 0; hk < c->HK; hk++) l->unseen[(b * c->NK + n) * c->HK + hk] = 1;
    }
    for (int64_t h = 0; h < c->HQ; h++)
      for (int64_t i = 0; i < q.nq; i++) {
        int any = 0;
        for (int64_t j = 0; j < q.nk; j++)
          if (fz_visible(c, d, s, h, i, j)) {
            any = 1;
            int64_t b, n;
            fz_key_row(c, s, j, &b, &n);
            l->unseen[(b * c->NK + n) * c->HK + h / G] = 0;
          }
        l->masked[fz_lse_index(c, s, h, i)] = !any;
      }
  }
}

static void live_free(fz_live *l) {
  free(l->qrow);
  free(l->krow);
  free(l->masked);
  free(l->unseen);
}

/* The live elements of canonical array a (rows marked in rows) into out. */
static size_t gather(const double *a, const unsigned char *rows, size_t nrows, int64_t HD,
                     double *out) {
  size_t m = 0;
  for (size_t r = 0; r < nrows; r++)
    if (rows[r])
      for (int64_t e = 0; e < HD; e++) out[m++] = a[r * (size_t)HD + (size_t)e];
  return m;
}

static int elems_poisoned(const tu_tensor *t, int64_t b, int64_t n, int64_t h) {
  const size_t es = t->buf.esize;
  return tu_bytes_poisoned(
      (const unsigned char *)t->buf.data + tu_tensor_index(&t->t, b, n, h, 0) * es,
      (size_t)t->D * es);
}

static int row_zero(const double *a, size_t base, int64_t D) {
  for (int64_t d = 0; d < D; d++)
    if (a[base + (size_t)d] != 0) return 0;
  return 1;
}

/* The backward recomputes P = exp(S - lse) from the forward's float32 lse (the
 * API's), which the naive run, normalising its own P, does not: S - lse then
 * carries the rounding of S, of lse and of their log2 forms, a relative error
 * in P of up to about 6 |lse| 2^-24 (seen: 5.5 with one key per row, where
 * P = 1 exactly), beyond the float32 floor once |lse| reaches tens (ALiBi over
 * long distances, scales far above 1/sqrt(D)). */
static double lse_term(const fz_case *c, const fz_run *orc) {
  const float *lo = (const float *)orc->lse.data;
  double mx = 0;
  for (size_t e = 0; e < (size_t)(c->B * c->HQ * c->NQ); e++)
    if (isfinite(lo[e]) && fabs(lo[e]) > mx) mx = fabs(lo[e]);
  return 8 * mx * 0x1p-24;
}

/* err(tested) <= 2 err(naive) + floor over the live elements of one tensor. */
static void compare(fz_ctx *x, fz_stats *st, const fz_case *c, const char *what, const fz_run *im,
                    const fz_run *nv, const fz_run *orc, int t, const unsigned char *rows,
                    size_t nrows, int64_t H, int backward) {
  const int64_t HD = H * c->D;
  double *buf = (double *)malloc((nrows * (size_t)HD + 1) * 3 * sizeof(double));
  double *xi = buf, *xn = buf + nrows * (size_t)HD + 1, *xr = xn + nrows * (size_t)HD + 1;
  const size_t m = gather(im->vals[t], rows, nrows, HD, xi);
  gather(nv->vals[t], rows, nrows, HD, xn);
  gather(orc->vals[t], rows, nrows, HD, xr);
  const tu_err ei = tu_compare(xi, xr, m), en = tu_compare(xn, xr, m);
  const double fl = floor_of(c, backward) + (backward ? lse_term(c, orc) : 0);
  const double tol = 2 * en.rel_fro + fl;
  if (ei.nan_count)
    fz_fail(x, "%s: %lld NaN/inf elements among those written", what, (long long)ei.nan_count);
  if (ei.nan_count && x->verbose) { /* where: the first few (row = b * N + n) */
    int shown = 0;
    for (size_t r = 0; r < nrows && shown < 8; r++)
      for (int64_t e = 0; rows[r] && e < HD && shown < 8; e++)
        if (!isfinite(im->vals[t][r * (size_t)HD + (size_t)e]))
          printf("  %s row %zu head %lld col %lld: %g (oracle %g)\n", what, r,
                 (long long)(e / c->D), (long long)(e % c->D),
                 im->vals[t][r * (size_t)HD + (size_t)e], orc->vals[t][r * (size_t)HD + (size_t)e]),
              shown++;
  } else if (!(ei.rel_fro <= tol))
    fz_fail(x, "%s: rel err %.3g > tol %.3g (= 2 x naive %.3g + floor %.3g; max abs err %.3g)",
            what, ei.rel_fro, tol, en.rel_fro, fl, ei.max_abs);
  /* The yardstick's sanity cap (20x the suite's) is a property of the population:
   * random draws reach worse-conditioned problems than the suite's tables (a few
   * keys per row with peaked scores leave gradients far below the rounding of
   * dO V^T, noise in every implementation), so a case over it is counted, and
   * main() fails the run when more than 1% are (a broken yardstick is over it
   * everywhere). Where the exact result is 0 (every row sees one key: no softmax
   * gradient) the errors are absolute noise and no cap applies. */
  const double cap = 20 * attn_naive_cap(c->dtype, backward);
  if (en.nan_count)
    fz_fail(x, "%s: the naive standard run has %lld NaN/inf elements", what,
            (long long)en.nan_count);
  else if (en.ref_norm > 0 && !(en.rel_fro <= cap) && !st->naive_over_cap++ && x->verbose)
    printf("  %s: the naive standard run's rel err %.3g exceeds the sanity cap %.3g\n", what,
           en.rel_fro, cap);
  const double ratio = ei.rel_fro / tol;
  if (ratio > st->worst_ratio) st->worst_ratio = ratio;
  free(buf);
}

/* lse (attn.c's rule), -inf and O = dQ = 0 on rows that see no key, nothing
 * written to rows the call does not own. */
static void check_rows(fz_ctx *x, fz_stats *st, const fz_case *c, const fz_live *l,
                       const fz_run *im, const fz_run *nv, const fz_run *orc) {
  const float *li = (const float *)im->lse.data, *ln = (const float *)nv->lse.data,
              *lo = (const float *)orc->lse.data;
  double worst = 0, worst_naive = 0;
  int reported = 0;
  for (int64_t s = 0; s < c->nseq; s++) {
    const fz_seq q = fz_seq_of(c, s);
    for (int64_t h = 0; h < c->HQ; h++)
      for (int64_t i = 0; i < q.nq; i++) {
        const size_t e = fz_lse_index(c, s, h, i);
        const double r = lo[e], v = li[e], y = ln[e];
        const size_t ob = (size_t)(((q.qb * c->NQ + q.q0 + i) * c->HQ + h) * c->D);
        if (l->masked[e]) {
          if (!(isinf(r) && r < 0) && reported++ == 0)
            fz_fail(x,
                    "oracle: lse of a row that sees no key (seq %lld, head %lld, row %lld) is %g",
                    (long long)s, (long long)h, (long long)i, r);
          if (!(isinf(v) && v < 0) && reported++ == 0)
            fz_fail(x, "lse of a row that sees no key (seq %lld, head %lld, row %lld) is %g",
                    (long long)s, (long long)h, (long long)i, v);
          if (!row_zero(im->vals[FZ_O], ob, c->D) && reported++ == 0)
            fz_fail(x, "O of a row that sees no key (seq %lld, head %lld, row %lld) is not 0",
                    (long long)s, (long long)h, (long long)i);
          if (im->bwd_ok && !row_zero(im->vals[FZ_DQ], ob, c->D) && reported++ == 0)
            fz_fail(x, "dQ of a row that sees no key (seq %lld, head %lld, row %lld) is not 0",
                    (long long)s, (long long)h, (long long)i);
          continue;
        }
        if (!isfinite(r)) {
          if (reported++ == 0)
            fz_fail(x, "oracle: lse of a row that sees keys (seq %lld, head %lld, row %lld) is %g",
                    (long long)s, (long long)h, (long long)i, r);
          continue;
        }
        if (!isfinite(v)) {
          if (reported++ == 0)
            fz_fail(x, "lse (seq %lld, head %lld, row %lld) is %g, oracle %.7g", (long long)s,
                    (long long)h, (long long)i, v, r);
          continue;
        }
        const double sc = fabs(r) > 1 ? fabs(r) : 1;
        const double ev = fabs(v - r) / sc, en = isfinite(y) ? fabs(y - r) / sc : INFINITY;
        if (ev > worst) worst = ev;
        if (en > worst_naive) worst_naive = en;
      }
  }
  /* CUDA's softcap takes the hardware tanh (tanhf under --use_fast_math is
   * tanh.approx.f32, relative error <= 2^-10.987, as flash-attn's kernels use):
   * each capped score may move by less than cap x 2^-10, and lse by as much */
  const double cap_term = c->cuda && c->softcap > 0 ? (double)c->softcap * 0x1p-10 : 0;
  const double tol = 2 * worst_naive + attn_lse_floor(c->dtype) + cap_term;
  if (worst > tol)
    fz_fail(x, "lse: max rel err %.3g > tol %.3g (naive %.3g)", worst, tol, worst_naive);
  if (worst_naive > 1e-4)
    fz_fail(x, "lse: the naive standard run's rel err %.3g > 1e-4", worst_naive);
  if (worst / tol > st->worst_ratio) st->worst_ratio = worst / tol;

  /* rows of no sequence (a padded varlen buffer, keys past seqused_k) stay as they were */
  int64_t stray = 0;
  for (int64_t b = 0; b < c->B; b++)
    for (int64_t n = 0; n < c->NQ; n++) {
      if (l->qrow[b * c->NQ + n]) continue;
      for (int64_t h = 0; h < c->HQ; h++) {
        if (!elems_poisoned(&im->t[FZ_O], b, n, h) && stray++ == 0)
          fz_fail(x, "O row %lld (batch %lld, head %lld) of no sequence was written", (long long)n,
                  (long long)b, (long long)h);
        if (im->bwd_ok && !elems_poisoned(&im->t[FZ_DQ], b, n, h) && stray++ == 0)
          fz_fail(x, "dQ row %lld (batch %lld, head %lld) of no sequence was written", (long long)n,
                  (long long)b, (long long)h);
        if (c->varlen && !tu_bytes_poisoned(li + h * c->NQ + n, sizeof(float)) && stray++ == 0)
          fz_fail(x, "lse of row %lld (head %lld), of no sequence, was written", (long long)n,
                  (long long)h);
      }
    }
  if (!im->bwd_ok) return;
  for (int64_t b = 0; b < c->B; b++)
    for (int64_t n = 0; n < c->NK; n++)
      for (int64_t h = 0; h < c->HK; h++) {
        const size_t kb = (size_t)(((b * c->NK + n) * c->HK + h) * c->D);
        if (!l->krow[b * c->NK + n]) {
          if ((!elems_poisoned(&im->t[FZ_DK], b, n, h) ||
               !elems_poisoned(&im->t[FZ_DV], b, n, h)) &&
              stray++ == 0)
            fz_fail(x,
                    "dK/dV of key row %lld (batch %lld, kv head %lld), past seqused_k or of no "
                    "sequence, was written",
                    (long long)n, (long long)b, (long long)h);
        } else if (l->unseen[(b * c->NK + n) * c->HK + h] &&
                   (!row_zero(im->vals[FZ_DK], kb, c->D) || !row_zero(im->vals[FZ_DV], kb, c->D)) &&
                   stray++ == 0) {
          fz_fail(x,
                  "dK/dV of key row %lld (batch %lld, kv head %lld), which no query sees, is not 0",
                  (long long)n, (long long)b, (long long)h);
        }
      }
}

static int same_bytes(const tu_buf *a, const tu_buf *b) {
  return a->bytes == b->bytes && memcmp(a->data, b->data, a->bytes) == 0;
}

/* The tested run again with another thread count and the other workspace
 * mode: the same bits (the CPU backend promises it; a device's deterministic
 * backward too). */
static void check_bitwise(fz_ctx *x, const fz_case *c, const fz_data *d, const fz_dev *dev,
                          const fz_run *im) {
  fz_opt o = fz_opt_tested(c, dev);
  o.o_in = im->o.o_in;
  o.threads = c->threads == 1 ? 2 : 1;
  o.workspace = c->workspace ? 0 : 1;
  o.lse_null = 0;
  o.label = "tested (other threads and workspace)";
  fz_run b;
  fz_run_setup(&b, c, d, &o);
  fz_ctx bx = {0, "", x->verbose};
  fz_run_exec(&b, &bx);
  if (bx.failures) fz_fail(x, "%s", bx.first);
  if (b.fwd_ok) {
    if (memcmp(im->o_fwd, b.o_fwd, im->t[FZ_O].buf.bytes + 2 * im->t[FZ_O].buf.guard_bytes))
      fz_fail(x, "O differs bitwise with %d threads instead of %d", o.threads, c->threads);
    if (!same_bytes(&im->lse, &b.lse))
      fz_fail(x, "lse differs bitwise with %d threads instead of %d", o.threads, c->threads);
  }
  const int bwd_same = dev->device == FA_DEVICE_CPU || c->deterministic;
  if (b.bwd_ok && bwd_same)
    for (int t = FZ_DQ; t <= FZ_DV; t++)
      if (!same_bytes(&im->t[t].buf, &b.t[t].buf))
        fz_fail(x, "%s differs bitwise with %d threads instead of %d",
                t == FZ_DQ   ? "dQ"
                : t == FZ_DK ? "dK"
                             : "dV",
                o.threads, c->threads);
  fz_run_free(&b);
}

/* A refusal the CUDA backend documents (forward.cu's fa_cuda_check): 16-bit
 * storage only, no standard backward. */
static int cuda_refuses(const fz_case *c) {
  if (c->dtype != FA_DTYPE_F16 && c->dtype != FA_DTYPE_BF16) return 1;
  return c->algo == FA_ALGO_STANDARD && c->backward;
}

void fz_check_valid(const fz_case *c, const fz_dev *dev, int bitwise_threads, fz_ctx *x,
                    fz_stats *st) {
  fz_data d;
  fz_data_make(&d, c);
  fz_run orc, nv, im;
  fz_opt o = fz_opt_reference(c, FA_DTYPE_F64);
  fz_run_setup(&orc, c, &d, &o);
  fz_run_exec(&orc, x);
  o = fz_opt_reference(c, c->dtype);
  o.o_in = orc.vals[FZ_O];
  fz_run_setup(&nv, c, &d, &o);
  fz_run_exec(&nv, x);
  o = fz_opt_tested(c, dev);
  o.o_in = orc.vals[FZ_O];
  fz_run_setup(&im, c, &d, &o);
  fz_ctx ix = {0, "", x->verbose};
  fz_run_exec(&im, &ix);
  if (ix.failures && dev->device != FA_DEVICE_CPU && cuda_refuses(c) &&
      (im.st_wsf == FA_ERR_UNSUPPORTED || im.st_wsb == FA_ERR_UNSUPPORTED ||
       im.st_fwd == FA_ERR_UNSUPPORTED || im.st_bwd == FA_ERR_UNSUPPORTED)) {
    st->unsupported++;
  } else if (ix.failures) {
    x->failures += ix.failures;
    if (x->failures == ix.failures) snprintf(x->first, sizeof x->first, "%s", ix.first);
  }
  if (orc.fwd_ok && nv.fwd_ok && im.fwd_ok) {
    fz_live l;
    live_make(&l, c, &d);
    const size_t nq = (size_t)(c->B * c->NQ), nk = (size_t)(c->B * c->NK);
    compare(x, st, c, "O", &im, &nv, &orc, FZ_O, l.qrow, nq, c->HQ, 0);
    if (orc.bwd_ok && nv.bwd_ok && im.bwd_ok) {
      compare(x, st, c, "dQ", &im, &nv, &orc, FZ_DQ, l.qrow, nq, c->HQ, 1);
      compare(x, st, c, "dK", &im, &nv, &orc, FZ_DK, l.krow, nk, c->HK, 1);
      compare(x, st, c, "dV", &im, &nv, &orc, FZ_DV, l.krow, nk, c->HK, 1);
    }
    check_rows(x, st, c, &l, &im, &nv, &orc);
    live_free(&l);
    if (bitwise_threads) check_bitwise(x, c, &d, dev, &im);
  }
  fz_run_free(&orc);
  fz_run_free(&nv);
  fz_run_free(&im);
  fz_data_free(&d);
}

void fz_check_repeat(const fz_case *c, const fz_dev *dev, fz_ctx *x) {
  if (!c->backward) return;
  fz_data d;
  fz_data_make(&d, c);
  fz_opt o = fz_opt_tested(c, dev);
  o.deterministic = 1;
  o.lse_null = 0;
  fz_run a, b;
  o.label = "deterministic run 1";
  fz_run_setup(&a, c, &d, &o);
  fz_run_exec(&a, x);
  o.label = "deterministic run 2";
  fz_run_setup(&b, c, &d, &o);
  fz_run_exec(&b, x);
  if (a.bwd_ok && b.bwd_ok)
    for (int t = FZ_DQ; t <= FZ_DV; t++)
      if (!same_bytes(&a.t[t].buf, &b.t[t].buf))
        fz_fail(x, "deterministic backward: %s differs bitwise between two runs",
                t == FZ_DQ   ? "dQ"
                : t == FZ_DK ? "dK"
                             : "dV");
  fz_run_free(&a);
  fz_run_free(&b);
  fz_data_free(&d);
}
