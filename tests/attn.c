/* The numerical attention test (see attn.h). */
#include "attn.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- tolerances -------------------------------------------------------------
 * err(impl) <= 2 * err(naive) + floor. err(naive) already holds the storage
 * rounding; the floor only absorbs the noise of small cases (a 2x2 problem has
 * few elements to average over): about half a unit roundoff of the dtype
 * (f16 u = 4.9e-4, bf16 u = 3.9e-3), 16 units for f32. */
double attn_floor(fa_dtype dt, int backward) {
  switch (dt) {
    case FA_DTYPE_F32:
      return backward ? 2e-6 : 1e-6;
    case FA_DTYPE_F16:
      return backward ? 5e-4 : 2.5e-4;
    case FA_DTYPE_BF16:
      return backward ? 4e-3 : 2e-3;
    case FA_DTYPE_F64:
      return 1e-12;
  }
  return 0;
}

/* The yardstick itself must be sane: the naive storage-precision run may not
 * be worse than this (else a broken standard algorithm would loosen every test). */
static double naive_cap(fa_dtype dt, int backward) {
  switch (dt) {
    case FA_DTYPE_F32:
      return backward ? 1e-5 : 5e-6;
    case FA_DTYPE_F16:
      return backward ? 1e-2 : 5e-3;
    case FA_DTYPE_BF16:
      return backward ? 8e-2 : 4e-2;
    case FA_DTYPE_F64:
      return 1e-12;
  }
  return 0;
}

/* lse: |x - ref| / max(1, |ref|) <= 2 * (same for naive) + floor. The scores
 * come from exactly representable inputs with float32 accumulation in every
 * dtype, so the floor does not depend much on the dtype. */
static double lse_floor(fa_dtype dt) {
  switch (dt) {
    case FA_DTYPE_F32:
      return 1e-5;
    case FA_DTYPE_F16:
      return 2e-5;
    case FA_DTYPE_BF16:
      return 2e-5;
    case FA_DTYPE_F64:
      return 1e-12;
  }
  return 0;
}

double attn_naive_cap(fa_dtype dt, int backward) { return naive_cap(dt, backward); }
double attn_lse_floor(fa_dtype dt) { return lse_floor(dt); }

/* ---- configurations ------------------------------------------------------------ */

acfg acfg_default(void) {
  acfg c;
  memset(&c, 0, sizeof c);
  c.algo = FA_ALGO_FLASH2;
  c.dtype = FA_DTYPE_F32;
  c.batch = 1;
  c.hq = c.hk = 2;
  c.nq = c.nk = 64;
  c.d = 64;
  c.wl = c.wr = -1;
  c.layout = TU_BNHD;
  return c;
}

void acfg_name(const acfg *c, const char *group, char *buf, size_t n) {
  size_t u = 0;
#define APP(...)                                                \
  do {                                                          \
    int k_ = snprintf(buf + u, u < n ? n - u : 0, __VA_ARGS__); \
    if (k_ > 0) u += (size_t)k_;                                \
  } while (0)
  APP("%s/%s/%s/%s", c->backward ? "bwd" : "fwd", group, tu_algo_name(c->algo),
      tu_dtype_name(c->dtype));
  if (c->nseq > 0) {
    APP("/varlen");
    for (int s = 0; s < c->nseq; s++) APP("%s%d:%d", s ? "," : "", c->lens_q[s], c->lens_k[s]);
  } else {
    APP("/n%dx%d", c->nq, c->nk);
    if (c->batch != 1) APP("/b%d", c->batch);
  }
  APP("/d%d/h%d:%d", c->d, c->hq, c->hk);
  if (c->causal) APP("/causal");
  if (c->window) APP("/win%lld,%lld", (long long)c->wl, (long long)c->wr);
  if (c->softcap > 0) APP("/cap%g", c->softcap);
  if (c->alibi) APP("/alibi-%s", c->alibi == 1 ? "head" : "batch");
  if (c->scale != 0) APP("/scale%g", c->scale);
  if (c->qk_std != 0) APP("/std%g", c->qk_std);
  if (c->layout != TU_BNHD) APP("/%s", tu_layout_name(c->layout));
  if (c->threads) APP("/t%d", c->threads);
#undef APP
}

static void case_fn(const void *arg) { attn_check((const acfg *)arg); }

void attn_register_fn(const char *group, tr_fn fn, const acfg *c, int slow) {
  char name[256];
  acfg x = *c;
  acfg_name(&x, group, name, sizeof name);
  x.seed = tu_hash_str(name);
  tr_add(name, fn, &x, sizeof x, slow);
}

void attn_register(const char *group, const acfg *c, int slow) {
  attn_register_fn(group, case_fn, c, slow);
}

/* ---- the problem: shapes, inputs, params ------------------------------------------ */

typedef struct prob {
  acfg c;
  int64_t B, NQ, NK, HQ, HK, D; /* tensor shapes (varlen: B = 1, N = total) */
  int64_t nseqs;
  int varlen;
  int32_t cu_q[ACFG_MAX_SEQS + 1], cu_k[ACFG_MAX_SEQS + 1];
  float *slopes;
  int64_t slope_stride;
  double *q, *k, *v, *dout; /* canonical (b, n, h, d) order, exactly representable */
  size_t nq_el, nk_el, lse_n;
} prob;

static double gen_value(tu_rng *r, double std, fa_dtype dt) {
  double x;
  do x = tu_round(std * tu_rng_normal(r), dt);
  while (x == 0 || !isfinite(x));
  return x;
}

static double *gen_array(tu_rng *r, size_t n, double std, fa_dtype dt) {
  double *a = (double *)malloc((n ? n : 1) * sizeof(double));
  for (size_t i = 0; i < n; i++) a[i] = gen_value(r, std, dt);
  return a;
}

static void prob_init(prob *p, const acfg *c) {
  tu_rng r;
  memset(p, 0, sizeof *p);
  p->c = *c;
  tu_rng_seed(&r, c->seed);
  p->HQ = c->hq;
  p->HK = c->hk;
  p->D = c->d;
  if (c->nseq > 0) {
    p->varlen = 1;
    p->B = 1;
    p->nseqs = c->nseq;
    for (int s = 0; s < c->nseq; s++) {
      p->cu_q[s + 1] = p->cu_q[s] + c->lens_q[s];
      p->cu_k[s + 1] = p->cu_k[s] + c->lens_k[s];
    }
    p->NQ = p->cu_q[c->nseq];
    p->NK = p->cu_k[c->nseq];
  } else {
    p->B = c->batch;
    p->nseqs = c->batch;
    p->NQ = c->nq;
    p->NK = c->nk;
  }
  p->nq_el = (size_t)(p->B * p->NQ * p->HQ * p->D);
  p->nk_el = (size_t)(p->B * p->NK * p->HK * p->D);
  p->lse_n = (size_t)(p->B * p->HQ * p->NQ);
  double std = c->qk_std > 0 ? c->qk_std : 1.0;
  p->q = gen_array(&r, p->nq_el, std, c->dtype);
  p->k = gen_array(&r, p->nk_el, std, c->dtype);
  p->v = gen_array(&r, p->nk_el, 1.0, c->dtype);
  p->dout = gen_array(&r, p->nq_el, 1.0, c->dtype);
  if (c->alibi) {
    int64_t nb = c->alibi == 2 ? p->nseqs : 1;
    p->slopes = (float *)malloc((size_t)(nb * p->HQ) * sizeof(float));
    for (int64_t b = 0; b < nb; b++)
      for (int64_t h = 0; h < p->HQ; h++)
        p->slopes[b * p->HQ + h] =
            (float)(pow(2.0, -8.0 * (double)(h + 1) / (double)p->HQ) * (1.0 + 0.75 * (double)b));
    p->slope_stride = c->alibi == 2 ? p->HQ : 0;
  }
}

static void prob_free(prob *p) {
  free(p->q);
  free(p->k);
  free(p->v);
  free(p->dout);
  free(p->slopes);
}

static void prob_seq(const prob *p, int64_t s, int64_t *qb, int64_t *q0, int64_t *nq, int64_t *kb,
                     int64_t *k0, int64_t *nk) {
  if (p->varlen) {
    *qb = *kb = 0;
    *q0 = p->cu_q[s];
    *nq = p->cu_q[s + 1] - p->cu_q[s];
    *k0 = p->cu_k[s];
    *nk = p->cu_k[s + 1] - p->cu_k[s];
  } else {
    *qb = *kb = s;
    *q0 = *k0 = 0;
    *nq = p->NQ;
    *nk = p->NK;
  }
}

static size_t prob_lse_index(const prob *p, int64_t s, int64_t h, int64_t i) {
  if (p->varlen) return (size_t)(h * p->NQ + p->cu_q[s] + i);
  return (size_t)((s * p->HQ + h) * p->NQ + i);
}

static size_t qidx(const prob *p, int64_t b, int64_t n, int64_t h, int64_t d) {
  return (size_t)(((b * p->NQ + n) * p->HQ + h) * p->D + d);
}
static size_t kidx(const prob *p, int64_t b, int64_t n, int64_t h, int64_t d) {
  return (size_t)(((b * p->NK + n) * p->HK + h) * p->D + d);
}

/* The mask as the header documents it, written here independently. */
static int visible(const acfg *c, int64_t nq, int64_t nk, int64_t i, int64_t j) {
  int64_t diag = i + nk - nq;
  if (c->causal && j > diag) return 0;
  if (c->window) {
    if (c->wl >= 0 && j < diag - c->wl) return 0;
    if (c->wr >= 0 && j > diag + c->wr) return 0;
  }
  return 1;
}

static int row_masked(const acfg *c, int64_t nq, int64_t nk, int64_t i) {
  for (int64_t j = 0; j < nk; j++)
    if (visible(c, nq, nk, i, j)) return 0;
  return 1;
}

static int col_unseen(const acfg *c, int64_t nq, int64_t nk, int64_t j) {
  for (int64_t i = 0; i < nq; i++)
    if (visible(c, nq, nk, i, j)) return 0;
  return 1;
}

static fa_params prob_params(const prob *p, fa_algorithm algo, int threads) {
  fa_params pr;
  memset(&pr, 0, sizeof pr);
  pr.device = FA_DEVICE_CPU;
  pr.algorithm = algo;
  pr.softmax_scale = p->c.scale;
  pr.causal = p->c.causal;
  pr.window_enabled = p->c.window;
  pr.window_left = p->c.wl;
  pr.window_right = p->c.wr;
  pr.softcap = p->c.softcap;
  pr.alibi_slopes = p->slopes;
  pr.alibi_stride_batch = p->slope_stride;
  if (p->varlen) {
    pr.cu_seqlens_q = p->cu_q;
    pr.cu_seqlens_k = p->cu_k;
    pr.num_seqs = p->nseqs;
  }
  pr.num_threads = threads;
  return pr;
}

/* ---- one run: forward (and backward) with every memory check ---------------------- */

typedef struct run {
  tu_tensor q, k, v, o, dout, dq, dk, dv;
  tu_buf lse;
  int fwd_ok, bwd_ok, have_bwd;
  double *o_vals, *dq_vals, *dk_vals, *dv_vals;
} run;

typedef struct runopt {
  fa_algorithm algo;
  fa_dtype dtype;
  tu_layout layout;
  int threads, deterministic, backward;
  double scale_mul; /* 0 or 1: none */
  int mut_window;
  double dout_mul; /* 0 or 1: none */
  int workspace;   /* pass caller memory of the queried size */
  const char *label;
} runopt;

/* The options a check starts from: the case's algorithm, dtype, layout,
 * threads and pass; the rest zero. */
static runopt runopt_of(const acfg *c) {
  runopt ro;
  memset(&ro, 0, sizeof ro);
  ro.algo = c->algo;
  ro.dtype = c->dtype;
  ro.layout = c->layout;
  ro.threads = c->threads;
  ro.backward = c->backward;
  return ro;
}

static const char *st_name(fa_status st) {
  const char *s = fa_status_string(st);
  return s ? s : "(null)";
}

static void check_written(const char *label, const char *call, const char *what,
                          const tu_tensor *x) {
  if (!tu_buf_guards_ok(&x->buf))
    tr_fail("%s %s wrote into the guard zone around %s", label, call, what);
  else if (!tu_tensor_untouched_outside(x))
    tr_fail("%s %s wrote into a stride gap of %s", label, call, what);
}

static void check_snap(const char *label, const char *call, const char *what, const tu_snap *s,
                       const tu_buf *b) {
  if (!tu_snap_same(s, b)) tr_fail("%s %s modified its input %s", label, call, what);
}

static void run_free(run *r) {
  tu_tensor_free(&r->q);
  tu_tensor_free(&r->k);
  tu_tensor_free(&r->v);
  tu_tensor_free(&r->o);
  if (r->have_bwd) {
    tu_tensor_free(&r->dout);
    tu_tensor_free(&r->dq);
    tu_tensor_free(&r->dk);
    tu_tensor_free(&r->dv);
  }
  tu_buf_free(&r->lse);
  free(r->o_vals);
  free(r->dq_vals);
  free(r->dk_vals);
  free(r->dv_vals);
  memset(r, 0, sizeof *r);
}

static void *alloc_ws(const char *label, fa_pass pass, fa_params *pr, const run *r, tu_buf *wsb) {
  size_t bytes = (size_t)-1;
  fa_status st = fa_workspace_size(pass, pr, &r->q.t, &r->k.t, &r->v.t, &bytes);
  if (st != FA_OK) {
    tr_fail("%s fa_workspace_size(%s): %s: %s", label, pass ? "backward" : "forward", st_name(st),
            fa_last_error());
    return NULL;
  }
  if (bytes > ((size_t)1 << 34)) {
    tr_fail("%s fa_workspace_size(%s) = %zu bytes: absurd", label, pass ? "backward" : "forward",
            bytes);
    return NULL;
  }
  tu_buf_alloc(wsb, bytes, 1);
  pr->workspace = wsb->data;
  pr->workspace_bytes = bytes;
  return wsb->data;
}

/* The layout of tensor number i (q k v o dout dq dk dv) of a run. */
static tu_layout layout_of(const runopt *ro, int i) {
  static const tu_layout mixed[8] = {TU_BHND, TU_PADDED, TU_PACKED, TU_BNHD,
                                     TU_HUGE, TU_PACKED, TU_BHND,   TU_PADDED};
  return ro->layout == TU_MIXED ? mixed[i] : ro->layout;
}

/* Fills the inputs from p, poisons the outputs, calls the library and checks
 * status, guards, stride gaps and inputs. Leaves the outputs in r. */
static void run_exec(run *r, const prob *p, const runopt *ro) {
  memset(r, 0, sizeof *r);
  const char *lb = ro->label;
  fa_params pr = prob_params(p, ro->algo, ro->threads);
  pr.deterministic = ro->deterministic;
  if (ro->scale_mul != 0 && ro->scale_mul != 1) {
    float base = p->c.scale != 0 ? p->c.scale : (float)(1.0 / sqrt((double)p->D));
    pr.softmax_scale = (float)(base * ro->scale_mul);
  }
  if (ro->mut_window) {
    pr.causal = 0;
    pr.window_enabled = 1;
    pr.window_left = p->c.window ? p->c.wl : -1;
    pr.window_right = 1;
  }
  tu_tensor_make(&r->q, ro->dtype, layout_of(ro, 0), p->B, p->NQ, p->HQ, p->D);
  tu_tensor_make(&r->k, ro->dtype, layout_of(ro, 1), p->B, p->NK, p->HK, p->D);
  tu_tensor_make(&r->v, ro->dtype, layout_of(ro, 2), p->B, p->NK, p->HK, p->D);
  tu_tensor_make(&r->o, ro->dtype, layout_of(ro, 3), p->B, p->NQ, p->HQ, p->D);
  tu_tensor_fill(&r->q, p->q);
  tu_tensor_fill(&r->k, p->k);
  tu_tensor_fill(&r->v, p->v);
  tu_buf_alloc(&r->lse, p->lse_n, sizeof(float));

  tu_snap sq, sk, sv;
  tu_snap_take(&sq, &r->q.buf);
  tu_snap_take(&sk, &r->k.buf);
  tu_snap_take(&sv, &r->v.buf);
  tu_buf ws;
  memset(&ws, 0, sizeof ws);
  fa_params prf = pr;
  if (ro->workspace) alloc_ws(lb, FA_PASS_FORWARD, &prf, r, &ws);
  fa_status st = fa_forward(&prf, &r->q.t, &r->k.t, &r->v.t, &r->o.t, (float *)r->lse.data);
  if (st != FA_OK) {
    tr_fail("%s fa_forward returned %s: %s", lb, st_name(st), fa_last_error());
  } else {
    r->fwd_ok = 1;
    check_written(lb, "fa_forward", "o", &r->o);
    if (!tu_buf_guards_ok(&r->lse)) tr_fail("%s fa_forward wrote into the guard zone of lse", lb);
    check_snap(lb, "fa_forward", "q", &sq, &r->q.buf);
    check_snap(lb, "fa_forward", "k", &sk, &r->k.buf);
    check_snap(lb, "fa_forward", "v", &sv, &r->v.buf);
    if (ro->workspace && ws.raw && !tu_buf_guards_ok(&ws))
      tr_fail("%s fa_forward wrote beyond its workspace (%zu bytes)", lb, ws.bytes);
  }
  if (ws.raw) tu_buf_free(&ws);
  r->o_vals = (double *)malloc((p->nq_el ? p->nq_el : 1) * sizeof(double));
  tu_tensor_read(&r->o, r->o_vals);

  if (ro->backward && r->fwd_ok) {
    r->have_bwd = 1;
    tu_tensor_make(&r->dout, ro->dtype, layout_of(ro, 4), p->B, p->NQ, p->HQ, p->D);
    if (ro->dout_mul != 0 && ro->dout_mul != 1) {
      double *tmp = (double *)malloc((p->nq_el ? p->nq_el : 1) * sizeof(double));
      for (size_t i = 0; i < p->nq_el; i++) tmp[i] = p->dout[i] * ro->dout_mul;
      tu_tensor_fill(&r->dout, tmp);
      free(tmp);
    } else {
      tu_tensor_fill(&r->dout, p->dout);
    }
    tu_tensor_make(&r->dq, ro->dtype, layout_of(ro, 5), p->B, p->NQ, p->HQ, p->D);
    tu_tensor_make(&r->dk, ro->dtype, layout_of(ro, 6), p->B, p->NK, p->HK, p->D);
    tu_tensor_make(&r->dv, ro->dtype, layout_of(ro, 7), p->B, p->NK, p->HK, p->D);
    tu_snap so, sd, sl;
    tu_snap_take(&so, &r->o.buf);
    tu_snap_take(&sd, &r->dout.buf);
    tu_snap_take(&sl, &r->lse);
    fa_params prb = pr;
    if (ro->workspace) alloc_ws(lb, FA_PASS_BACKWARD, &prb, r, &ws);
    st = fa_backward(&prb, &r->q.t, &r->k.t, &r->v.t, &r->o.t, &r->dout.t,
                     (const float *)r->lse.data, &r->dq.t, &r->dk.t, &r->dv.t);
    if (st != FA_OK) {
      tr_fail("%s fa_backward returned %s: %s", lb, st_name(st), fa_last_error());
    } else {
      r->bwd_ok = 1;
      check_written(lb, "fa_backward", "dq", &r->dq);
      check_written(lb, "fa_backward", "dk", &r->dk);
      check_written(lb, "fa_backward", "dv", &r->dv);
      check_snap(lb, "fa_backward", "q", &sq, &r->q.buf);
      check_snap(lb, "fa_backward", "k", &sk, &r->k.buf);
      check_snap(lb, "fa_backward", "v", &sv, &r->v.buf);
      check_snap(lb, "fa_backward", "o", &so, &r->o.buf);
      check_snap(lb, "fa_backward", "dout", &sd, &r->dout.buf);
      check_snap(lb, "fa_backward", "lse", &sl, &r->lse);
      if (ro->workspace && ws.raw && !tu_buf_guards_ok(&ws))
        tr_fail("%s fa_backward wrote beyond its workspace (%zu bytes)", lb, ws.bytes);
    }
    if (ws.raw) tu_buf_free(&ws);
    tu_snap_free(&so);
    tu_snap_free(&sd);
    tu_snap_free(&sl);
    r->dq_vals = (double *)malloc((p->nq_el ? p->nq_el : 1) * sizeof(double));
    r->dk_vals = (double *)malloc((p->nk_el ? p->nk_el : 1) * sizeof(double));
    r->dv_vals = (double *)malloc((p->nk_el ? p->nk_el : 1) * sizeof(double));
    tu_tensor_read(&r->dq, r->dq_vals);
    tu_tensor_read(&r->dk, r->dk_vals);
    tu_tensor_read(&r->dv, r->dv_vals);
  }
  tu_snap_free(&sq);
  tu_snap_free(&sk);
  tu_snap_free(&sv);
}

/* ---- comparisons ------------------------------------------------------------------ */

static attn_stats g_stats;
attn_stats attn_last_stats(void) { return g_stats; }

static void decode(size_t idx, int64_t N, int64_t H, int64_t D, char *buf, size_t n) {
  int64_t d = (int64_t)idx % D, h = ((int64_t)idx / D) % H, i = ((int64_t)idx / D / H) % N,
          b = (int64_t)idx / D / H / N;
  snprintf(buf, n, "(b%lld,n%lld,h%lld,d%lld)", (long long)b, (long long)i, (long long)h,
           (long long)d);
}

/* Returns err(x); fails when it exceeds 2 err(naive) + floor or has NaN/inf.
 * *ratio_out = err / tol. */
static double check_tensor(const char *what, const double *x, const double *naive,
                           const double *ref, size_t n, int64_t N, int64_t H, int64_t D,
                           fa_dtype dt, int backward, double *ratio_out) {
  tu_err ei = tu_compare(x, ref, n), en = tu_compare(naive, ref, n);
  double fl = attn_floor(dt, backward), tol = 2 * en.rel_fro + fl;
  char where[96];
  if (ei.nan_count) {
    decode((size_t)ei.first_bad, N, H, D, where, sizeof where);
    tr_fail("%s: %lld NaN/inf elements, first at %s = %g", what, (long long)ei.nan_count, where,
            x[ei.first_bad]);
  } else if (!(ei.rel_fro <= tol)) {
    tr_fail(
        "%s: rel err %.3g > tol %.3g (= 2 x naive %.3g + floor %.3g; max abs err %.3g, "
        "|ref| %.3g)",
        what, ei.rel_fro, tol, en.rel_fro, fl, ei.max_abs, ei.ref_norm);
  }
  if (en.nan_count || !(en.rel_fro <= naive_cap(dt, backward)))
    tr_fail("%s: the naive standard run's rel err %.3g exceeds the sanity cap %.3g", what,
            en.rel_fro, naive_cap(dt, backward));
  double ratio = ei.rel_fro / tol;
  *ratio_out = ratio;
  if (ratio > g_stats.worst_ratio) g_stats.worst_ratio = ratio;
  if (tr_verbose())
    printf("  stat %s %s impl %.3g naive %.3g ratio %.3f %s\n", what, tu_dtype_name(dt), ei.rel_fro,
           en.rel_fro, ratio, tr_name());
  return ei.rel_fro;
}

static int row_is_zero(const double *vals, size_t base, int64_t D) {
  for (int64_t d = 0; d < D; d++)
    if (vals[base + (size_t)d] != 0) return 0;
  return 1;
}

/* lse and every mask consequence: fully masked rows (O = 0, lse = -inf, dQ = 0)
 * and keys nobody sees (dK = dV = 0), in the oracle as in the tested run. */
static void check_rows(const prob *p, const run *orc, const run *nv, const run *im) {
  const acfg *c = &p->c;
  const float *lo = (const float *)orc->lse.data, *ln = (const float *)nv->lse.data,
              *li = (const float *)im->lse.data;
  double worst = 0, worst_naive = 0;
  int64_t worst_at = -1;
  int reported = 0;
  for (int64_t s = 0; s < p->nseqs; s++) {
    int64_t qb, q0, nq, kb, k0, nk;
    prob_seq(p, s, &qb, &q0, &nq, &kb, &k0, &nk);
    for (int64_t h = 0; h < p->HQ; h++)
      for (int64_t i = 0; i < nq; i++) {
        size_t li_ = prob_lse_index(p, s, h, i);
        double r = lo[li_], x = li[li_], y = ln[li_];
        int masked = row_masked(c, nq, nk, i);
        size_t ob = qidx(p, qb, q0 + i, h, 0);
        if (masked) {
          if (!(isinf(r) && r < 0) && reported++ < 1)
            tr_fail(
                "oracle: lse of fully masked row (seq %lld, head %lld, row %lld) is %g, "
                "expected -inf",
                (long long)s, (long long)h, (long long)i, r);
          if (!(isinf(x) && x < 0))
            tr_fail("lse of fully masked row (seq %lld, head %lld, row %lld) is %g, expected -inf",
                    (long long)s, (long long)h, (long long)i, x);
          if (!row_is_zero(orc->o_vals, ob, p->D) && reported++ < 1)
            tr_fail("oracle: O of fully masked row (seq %lld, head %lld, row %lld) is not 0",
                    (long long)s, (long long)h, (long long)i);
          if (!row_is_zero(im->o_vals, ob, p->D))
            tr_fail(
                "O of fully masked row (seq %lld, head %lld, row %lld) is not exactly 0 "
                "(first element %g)",
                (long long)s, (long long)h, (long long)i, im->o_vals[ob]);
          if (im->dq_vals && im->bwd_ok && !row_is_zero(im->dq_vals, ob, p->D))
            tr_fail(
                "dQ of fully masked row (seq %lld, head %lld, row %lld) is not exactly 0 "
                "(first element %g)",
                (long long)s, (long long)h, (long long)i, im->dq_vals[ob]);
          continue;
        }
        if (!isfinite(r)) {
          if (reported++ < 1)
            tr_fail("oracle: lse of visible row (seq %lld, head %lld, row %lld) is %g",
                    (long long)s, (long long)h, (long long)i, r);
          continue;
        }
        if (!isfinite(x)) {
          tr_fail("lse (seq %lld, head %lld, row %lld) is %g, expected %.7g", (long long)s,
                  (long long)h, (long long)i, x, r);
          continue;
        }
        double sc = fabs(r) > 1 ? fabs(r) : 1;
        double e = fabs(x - r) / sc, en = isfinite(y) ? fabs(y - r) / sc : INFINITY;
        if (e > worst) {
          worst = e;
          worst_at = (int64_t)li_;
        }
        if (en > worst_naive) worst_naive = en;
      }
    if (im->dk_vals && im->bwd_ok)
      for (int64_t j = 0; j < nk; j++) {
        if (!col_unseen(c, nq, nk, j)) continue;
        for (int64_t h = 0; h < p->HK; h++) {
          size_t kbase = kidx(p, kb, k0 + j, h, 0);
          if (!row_is_zero(im->dk_vals, kbase, p->D) || !row_is_zero(im->dv_vals, kbase, p->D))
            tr_fail(
                "dK/dV of key (seq %lld, kv head %lld, key %lld) seen by no query is not "
                "exactly 0 (dK %g, dV %g)",
                (long long)s, (long long)h, (long long)j, im->dk_vals[kbase], im->dv_vals[kbase]);
        }
      }
  }
  double tol = 2 * worst_naive + lse_floor(c->dtype);
  if (worst > tol)
    tr_fail("lse: max rel err %.3g at index %lld (got %.8g, oracle %.8g) > tol %.3g (naive %.3g)",
            worst, (long long)worst_at, li[worst_at], lo[worst_at], tol, worst_naive);
  if (worst_naive > 1e-4) tr_fail("lse: the naive standard run's rel err %.3g > 1e-4", worst_naive);
  g_stats.err_lse = worst;
  if (tr_verbose())
    printf("  stat lse %s impl %.3g naive %.3g ratio %.3f %s\n", tu_dtype_name(c->dtype), worst,
           worst_naive, worst / tol, tr_name());
  if (worst / tol > g_stats.worst_ratio) g_stats.worst_ratio = worst / tol;
}

void attn_check(const acfg *c) {
  prob p;
  prob_init(&p, c);
  tr_context("seed %#llx", (unsigned long long)c->seed);
  memset(&g_stats, 0, sizeof g_stats);
  run orc, nv, im;
  runopt ro;
  memset(&ro, 0, sizeof ro);
  ro.algo = FA_ALGO_STANDARD;
  ro.dtype = FA_DTYPE_F64;
  ro.layout = TU_BNHD;
  ro.backward = c->backward;
  ro.label = "oracle (standard f64):";
  run_exec(&orc, &p, &ro);
  ro.dtype = c->dtype;
  ro.label = "naive (standard in storage dtype):";
  run_exec(&nv, &p, &ro);
  ro.algo = c->algo;
  ro.layout = c->layout;
  ro.threads = c->threads;
  ro.scale_mul = c->mut_scale != 0 ? c->mut_scale : tr_mutate_scale();
  ro.mut_window = c->mut_window;
  ro.dout_mul = c->mut_dout != 0 ? 1 + c->mut_dout : 1;
  ro.label = "tested:";
  run_exec(&im, &p, &ro);

  if (orc.fwd_ok && nv.fwd_ok && im.fwd_ok) {
    g_stats.err_o = check_tensor("O", im.o_vals, nv.o_vals, orc.o_vals, p.nq_el, p.NQ, p.HQ, p.D,
                                 c->dtype, 0, &g_stats.ratio_o);
    g_stats.err_naive_o = tu_compare(nv.o_vals, orc.o_vals, p.nq_el).rel_fro;
    check_rows(&p, &orc, &nv, &im);
  }
  if (c->backward && orc.bwd_ok && nv.bwd_ok && im.bwd_ok) {
    g_stats.err_dq = check_tensor("dQ", im.dq_vals, nv.dq_vals, orc.dq_vals, p.nq_el, p.NQ, p.HQ,
                                  p.D, c->dtype, 1, &g_stats.ratio_dq);
    g_stats.err_dk = check_tensor("dK", im.dk_vals, nv.dk_vals, orc.dk_vals, p.nk_el, p.NK, p.HK,
                                  p.D, c->dtype, 1, &g_stats.ratio_dk);
    g_stats.err_dv = check_tensor("dV", im.dv_vals, nv.dv_vals, orc.dv_vals, p.nk_el, p.NK, p.HK,
                                  p.D, c->dtype, 1, &g_stats.ratio_dv);
  }
  if (tr_verbose())
    printf("  stats: O %.3g (naive %.3g) lse %.3g dQ %.3g dK %.3g dV %.3g worst/tol %.3f\n",
           g_stats.err_o, g_stats.err_naive_o, g_stats.err_lse, g_stats.err_dq, g_stats.err_dk,
           g_stats.err_dv, g_stats.worst_ratio);
  run_free(&orc);
  run_free(&nv);
  run_free(&im);
  prob_free(&p);
}

/* ---- determinism and thread counts -------------------------------------------------- */

static int same_bytes(const tu_buf *a, const tu_buf *b) {
  return a->bytes == b->bytes && memcmp(a->data, b->data, a->bytes) == 0;
}

static void compare_runs(const char *what, const run *a, const run *b, int backward) {
  if (!a->fwd_ok || !b->fwd_ok) return;
  if (!same_bytes(&a->o.buf, &b->o.buf)) tr_fail("%s: O differs bitwise", what);
  if (!same_bytes(&a->lse, &b->lse)) tr_fail("%s: lse differs bitwise", what);
  if (!backward || !a->bwd_ok || !b->bwd_ok) return;
  if (!same_bytes(&a->dq.buf, &b->dq.buf)) tr_fail("%s: dQ differs bitwise", what);
  if (!same_bytes(&a->dk.buf, &b->dk.buf)) tr_fail("%s: dK differs bitwise", what);
  if (!same_bytes(&a->dv.buf, &b->dv.buf)) tr_fail("%s: dV differs bitwise", what);
}

void attn_check_threads(const acfg *c) {
  prob p;
  prob_init(&p, c);
  tr_context("seed %#llx", (unsigned long long)c->seed);
  runopt ro = runopt_of(c);
  ro.deterministic = 1;
  run r1, r2, r2b, r0, rnd;
  ro.threads = 1;
  ro.label = "threads=1:";
  run_exec(&r1, &p, &ro);
  ro.threads = 2;
  ro.label = "threads=2:";
  run_exec(&r2, &p, &ro);
  ro.label = "threads=2 (again):";
  run_exec(&r2b, &p, &ro);
  ro.threads = 0;
  ro.label = "threads=0:";
  run_exec(&r0, &p, &ro);
  /* Without the deterministic flag the forward pass must still be reproducible. */
  ro.threads = 2;
  ro.deterministic = 0;
  ro.backward = 0;
  ro.label = "threads=2, deterministic=0:";
  run_exec(&rnd, &p, &ro);
  compare_runs("threads 1 vs 2 (deterministic=1)", &r1, &r2, c->backward);
  compare_runs("threads 2, repeated (deterministic=1)", &r2, &r2b, c->backward);
  compare_runs("threads 1 vs 0 (all cores, deterministic=1)", &r1, &r0, c->backward);
  compare_runs("forward with deterministic=0 vs 1", &r2, &rnd, 0);
  run_free(&r1);
  run_free(&r2);
  run_free(&r2b);
  run_free(&r0);
  run_free(&rnd);
  prob_free(&p);
}

/* Two runs of one problem that must give the same bits: the second after
 * flip(&ro, 1), and flip(&ro, 0) restores what it changed outside ro. */
static void check_same_bits(const acfg *c, int deterministic, const char *what, const char *la,
                            const char *lb, void (*flip)(runopt *, int)) {
  prob p;
  prob_init(&p, c);
  tr_context("seed %#llx", (unsigned long long)c->seed);
  runopt ro = runopt_of(c);
  ro.threads = c->threads ? c->threads : 2;
  ro.deterministic = deterministic;
  run a, b;
  ro.label = la;
  run_exec(&a, &p, &ro);
  flip(&ro, 1);
  ro.label = lb;
  run_exec(&b, &p, &ro);
  flip(&ro, 0);
  compare_runs(what, &a, &b, c->backward);
  run_free(&a);
  run_free(&b);
  prob_free(&p);
}

static void flip_pack(runopt *ro, int off) {
  (void)ro;
  if (off)
    setenv("FLASHATTN_CPU_PACK", "0", 1);
  else
    unsetenv("FLASHATTN_CPU_PACK");
}

/* With and without the CPU backend's packed copies (FLASHATTN_CPU_PACK=0):
 * the same bits. */
void attn_check_pack(const acfg *c) {
  check_same_bits(c, 0, "packed vs FLASHATTN_CPU_PACK=0",
                  "packed:", "FLASHATTN_CPU_PACK=0:", flip_pack);
}

static void flip_workspace(runopt *ro, int caller) { ro->workspace = caller; }

void attn_check_workspace(const acfg *c) {
  check_same_bits(c, 1, "caller workspace vs library-allocated",
                  "library-allocated workspace:", "caller workspace:", flip_workspace);
}

/* ---- the oracle against an independent reference --------------------------------------- */

/* Straight from the header's definitions, in double: masks, softcap, ALiBi,
 * GQA, varlen; and the backward pass by the chain rule. */
static void indep_reference(const prob *p, double *o, double *lse, double *dq, double *dk,
                            double *dv) {
  const acfg *c = &p->c;
  const int64_t D = p->D, group = p->HQ / p->HK;
  const double scale = c->scale != 0 ? (double)c->scale : 1.0 / sqrt((double)D);
  memset(o, 0, p->nq_el * sizeof(double));
  memset(dq, 0, p->nq_el * sizeof(double));
  memset(dk, 0, p->nk_el * sizeof(double));
  memset(dv, 0, p->nk_el * sizeof(double));
  int64_t maxk = p->NK > 0 ? p->NK : 1;
  double *sc = (double *)malloc((size_t)maxk * sizeof(double));
  double *th = (double *)malloc((size_t)maxk * sizeof(double));
  double *pp = (double *)malloc((size_t)maxk * sizeof(double));
  for (int64_t s = 0; s < p->nseqs; s++) {
    int64_t qb, q0, nq, kb, k0, nk;
    prob_seq(p, s, &qb, &q0, &nq, &kb, &k0, &nk);
    for (int64_t h = 0; h < p->HQ; h++) {
      int64_t hk = h / group;
      double slope = p->slopes ? p->slopes[s * p->slope_stride + h] : 0;
      for (int64_t i = 0; i < nq; i++) {
        const double *qi = p->q + qidx(p, qb, q0 + i, h, 0);
        double m = -INFINITY;
        for (int64_t j = 0; j < nk; j++) {
          if (!visible(c, nq, nk, i, j)) continue;
          const double *kj = p->k + kidx(p, kb, k0 + j, hk, 0);
          double x = 0;
          for (int64_t d = 0; d < D; d++) x += qi[d] * kj[d];
          x *= scale;
          th[j] = 0;
          if (c->softcap > 0) {
            th[j] = tanh(x / c->softcap);
            x = c->softcap * th[j];
          }
          x -= slope * fabs((double)(i + nk - nq - j));
          sc[j] = x;
          if (x > m) m = x;
        }
        double l = 0;
        for (int64_t j = 0; j < nk; j++) {
          pp[j] = visible(c, nq, nk, i, j) ? exp(sc[j] - m) : 0;
          l += pp[j];
        }
        lse[prob_lse_index(p, s, h, i)] = l > 0 ? m + log(l) : -INFINITY;
        if (l == 0) continue;
        double *oi = o + qidx(p, qb, q0 + i, h, 0);
        for (int64_t j = 0; j < nk; j++) {
          pp[j] /= l;
          for (int64_t d = 0; d < D; d++) oi[d] += pp[j] * p->v[kidx(p, kb, k0 + j, hk, d)];
        }
        const double *doi = p->dout + qidx(p, qb, q0 + i, h, 0);
        double di = 0;
        for (int64_t d = 0; d < D; d++) di += doi[d] * oi[d]; /* rowsum(dO o O) */
        for (int64_t j = 0; j < nk; j++) {
          if (pp[j] == 0) continue;
          double dpj = 0;
          for (int64_t d = 0; d < D; d++) dpj += doi[d] * p->v[kidx(p, kb, k0 + j, hk, d)];
          double ds = pp[j] * (dpj - di);
          if (c->softcap > 0) ds *= 1 - th[j] * th[j];
          for (int64_t d = 0; d < D; d++) {
            dq[qidx(p, qb, q0 + i, h, d)] += scale * ds * p->k[kidx(p, kb, k0 + j, hk, d)];
            dk[kidx(p, kb, k0 + j, hk, d)] += scale * ds * qi[d];
            dv[kidx(p, kb, k0 + j, hk, d)] += pp[j] * doi[d];
          }
        }
      }
    }
  }
  free(sc);
  free(th);
  free(pp);
}

void attn_check_oracle(const acfg *c) {
  prob p;
  acfg x = *c;
  x.dtype = FA_DTYPE_F64;
  x.backward = 1;
  prob_init(&p, &x);
  tr_context("seed %#llx", (unsigned long long)c->seed);
  runopt ro;
  memset(&ro, 0, sizeof ro);
  ro.algo = FA_ALGO_STANDARD;
  ro.dtype = FA_DTYPE_F64;
  ro.layout = c->layout;
  ro.backward = 1;
  ro.label = "oracle:";
  run orc;
  run_exec(&orc, &p, &ro);
  double *o = (double *)malloc((p.nq_el + 1) * sizeof(double));
  double *dq = (double *)malloc((p.nq_el + 1) * sizeof(double));
  double *dk = (double *)malloc((p.nk_el + 1) * sizeof(double));
  double *dv = (double *)malloc((p.nk_el + 1) * sizeof(double));
  double *lse = (double *)malloc((p.lse_n + 1) * sizeof(double));
  indep_reference(&p, o, lse, dq, dk, dv);
  /* The api resolves the default scale in float32; an explicit scale is exact. */
  double tol = c->scale != 0 ? 1e-12 : 1e-6;
  if (orc.fwd_ok) {
    tu_err e = tu_compare(orc.o_vals, o, p.nq_el);
    if (!(e.rel_fro <= tol)) tr_fail("oracle O vs independent reference: rel err %.3g", e.rel_fro);
    const float *ol = (const float *)orc.lse.data;
    for (size_t i = 0; i < p.lse_n; i++) {
      double a = ol[i], b = lse[i];
      if (isinf(b) ? a != b : !(fabs(a - b) <= 1e-6 * (fabs(b) > 1 ? fabs(b) : 1))) {
        tr_fail("oracle lse[%zu] = %.9g, independent reference %.9g", i, a, b);
        break;
      }
    }
  }
  if (orc.bwd_ok) {
    tu_err e;
    e = tu_compare(orc.dq_vals, dq, p.nq_el);
    if (!(e.rel_fro <= tol)) tr_fail("oracle dQ vs independent reference: rel err %.3g", e.rel_fro);
    e = tu_compare(orc.dk_vals, dk, p.nk_el);
    if (!(e.rel_fro <= tol)) tr_fail("oracle dK vs independent reference: rel err %.3g", e.rel_fro);
    e = tu_compare(orc.dv_vals, dv, p.nk_el);
    if (!(e.rel_fro <= tol)) tr_fail("oracle dV vs independent reference: rel err %.3g", e.rel_fro);
  }
  free(o);
  free(dq);
  free(dk);
  free(dv);
  free(lse);
  run_free(&orc);
  prob_free(&p);
}

/* ---- NaN and -inf in the inputs ------------------------------------------------------------
 * What we require: the call succeeds and touches only its outputs; rows whose
 * attention cannot involve the bad element are bitwise what they are without
 * it; a NaN that a row does see shows up as NaN in that row (it is not
 * silently turned into a finite wrong answer). For -inf in K the rows that see
 * it are not checked (their scores are +-inf: NaN or a one-hot row are both
 * defensible). A NaN in V must not leak into rows whose mask hides that key
 * (a tile computing P V must skip, not multiply by, the zero P of a masked key). */

static int row_same(const run *a, const run *b, const prob *p, int64_t n, int64_t h) {
  for (int64_t d = 0; d < p->D; d++)
    if (tu_tensor_get(&a->o, 0, n, h, d) != tu_tensor_get(&b->o, 0, n, h, d)) return 0;
  float la = ((const float *)a->lse.data)[h * p->NQ + n];
  float lb = ((const float *)b->lse.data)[h * p->NQ + n];
  return la == lb || (isinf(la) && la == lb);
}

static int row_has_nan(const run *a, const prob *p, int64_t n, int64_t h) {
  for (int64_t d = 0; d < p->D; d++)
    if (isnan(tu_tensor_get(&a->o, 0, n, h, d))) return 1;
  return 0;
}

void attn_check_nan_q(const acfg *c) {
  prob p;
  prob_init(&p, c); /* batch 1 */
  tr_context("seed %#llx", (unsigned long long)c->seed);
  runopt ro = runopt_of(c);
  run clean, bad;
  ro.label = "clean:";
  run_exec(&clean, &p, &ro);
  const int64_t n0 = p.NQ / 2, h0 = p.HQ - 1;
  p.q[qidx(&p, 0, n0, h0, p.D / 3)] = NAN;
  ro.label = "NaN in Q:";
  run_exec(&bad, &p, &ro);
  if (clean.fwd_ok && bad.fwd_ok) {
    int64_t nbad = 0;
    for (int64_t h = 0; h < p.HQ; h++)
      for (int64_t n = 0; n < p.NQ; n++) {
        if (n == n0 && h == h0) continue;
        if (!row_same(&clean, &bad, &p, n, h) && nbad++ == 0)
          tr_fail("NaN in Q row %lld head %lld changed row %lld head %lld", (long long)n0,
                  (long long)h0, (long long)n, (long long)h);
      }
    if (!row_has_nan(&bad, &p, n0, h0) && !row_masked(c, p.NQ, p.NK, n0))
      tr_fail("NaN in Q row %lld head %lld: that row's O has no NaN (first element %g)",
              (long long)n0, (long long)h0, tu_tensor_get(&bad.o, 0, n0, h0, 0));
  }
  run_free(&clean);
  run_free(&bad);
  prob_free(&p);
}

/* NaN/-inf in one K element or NaN in one V element (c->inject 1, 2, 3). */
void attn_check_nan_k(const acfg *c) {
  prob p;
  prob_init(&p, c); /* batch 1 */
  tr_context("seed %#llx", (unsigned long long)c->seed);
  runopt ro = runopt_of(c);
  run clean, bad;
  ro.label = "clean:";
  run_exec(&clean, &p, &ro);
  const int64_t j0 = p.NK / 2 + 1, hk0 = 0, group = p.HQ / p.HK;
  static const char *what[4] = {"", "NaN in K", "-inf in K", "NaN in V"};
  if (c->inject == 3)
    p.v[kidx(&p, 0, j0, hk0, 1)] = NAN;
  else
    p.k[kidx(&p, 0, j0, hk0, 1)] = c->inject == 2 ? -INFINITY : NAN;
  ro.label = what[c->inject];
  run_exec(&bad, &p, &ro);
  if (clean.fwd_ok && bad.fwd_ok) {
    int64_t nbad = 0, nmissing = 0;
    for (int64_t h = 0; h < p.HQ; h++)
      for (int64_t n = 0; n < p.NQ; n++) {
        int sees = h / group == hk0 && visible(c, p.NQ, p.NK, n, j0);
        if (!sees) {
          if (!row_same(&clean, &bad, &p, n, h) && nbad++ == 0)
            tr_fail("%s at key %lld (kv head %lld) changed row %lld head %lld, which cannot see it",
                    what[c->inject], (long long)j0, (long long)hk0, (long long)n, (long long)h);
        } else if (c->inject != 2 && !row_has_nan(&bad, &p, n, h) && nmissing++ == 0) {
          tr_fail("%s at key %lld: row %lld head %lld sees it but its O has no NaN",
                  what[c->inject], (long long)j0, (long long)n, (long long)h);
        }
      }
  }
  run_free(&clean);
  run_free(&bad);
  prob_free(&p);
}

/* ---- varlen: sequences isolated from each other ------------------------------------------
 * Every element of sequence c->nan_seq's Q, K, V and dO is NaN. The other
 * sequences are separate problems and the CPU backend is deterministic, so
 * their O, lse, dQ, dK and dV are bitwise what a clean run on the same inputs
 * gives. Inside the NaN sequence (not compared) every row that sees a key has
 * NaN in O and dQ, and every key some row sees has NaN in dK and dV. */

static int vals_same(const double *a, const double *b, size_t base, int64_t D) {
  return memcmp(a + base, b + base, (size_t)D * sizeof(double)) == 0;
}

static int vals_have_nan(const double *a, size_t base, int64_t D) {
  for (int64_t d = 0; d < D; d++)
    if (isnan(a[base + (size_t)d])) return 1;
  return 0;
}

/* "head h, row i" for dQ-shaped tensors, "kv head h, key i" for dK and dV. */
static const char *iso_where(const char *what, int head) {
  if (what[0] == 'd' && (what[1] == 'K' || what[1] == 'V')) return head ? "kv head" : "key";
  return head ? "head" : "row";
}

/* One row (D values at base) of a sequence other than the NaN one. */
static void iso_row(const char *what, const double *bad, const double *clean, size_t base,
                    int64_t D, int64_t s0, int64_t s, int64_t h, int64_t i, int64_t *nbad) {
  if (vals_same(bad, clean, base, D) || (*nbad)++ > 0) return;
  size_t d = 0;
  while (d + 1 < (size_t)D && memcmp(bad + base + d, clean + base + d, sizeof(double)) == 0) d++;
  tr_fail(
      "NaN in sequence %lld changed %s of sequence %lld (%s %lld, %s %lld, d %zu): %.9g, "
      "clean run %.9g",
      (long long)s0, what, (long long)s, iso_where(what, 1), (long long)h, iso_where(what, 0),
      (long long)i, d, bad[base + d], clean[base + d]);
}

/* One row of the NaN sequence that sees a key (or one key that a row sees). */
static void nan_row(const char *what, const double *bad, size_t base, int64_t D, int64_t s0,
                    int64_t h, int64_t i, int64_t *nmissing) {
  if (vals_have_nan(bad, base, D) || (*nmissing)++ > 0) return;
  tr_fail("NaN sequence %lld: %s of %s %lld, %s %lld has no NaN (first element %g)", (long long)s0,
          what, iso_where(what, 1), (long long)h, iso_where(what, 0), (long long)i, bad[base]);
}

void attn_check_varlen_nan(const acfg *c) {
  prob p;
  prob_init(&p, c);
  tr_context("seed %#llx", (unsigned long long)c->seed);
  const int64_t s0 = c->nan_seq;
  if (!p.varlen || s0 < 0 || s0 >= p.nseqs) {
    tr_fail("test defect: nan_seq %lld is not a sequence of a varlen batch", (long long)s0);
    prob_free(&p);
    return;
  }
  runopt ro = runopt_of(c);
  ro.deterministic = 1;
  run clean, bad;
  ro.label = "clean:";
  run_exec(&clean, &p, &ro);
  int64_t qb, q0, nq, kb, k0, nk;
  prob_seq(&p, s0, &qb, &q0, &nq, &kb, &k0, &nk);
  for (int64_t i = 0; i < nq; i++)
    for (int64_t h = 0; h < p.HQ; h++)
      for (int64_t d = 0; d < p.D; d++) {
        p.q[qidx(&p, qb, q0 + i, h, d)] = NAN;
        p.dout[qidx(&p, qb, q0 + i, h, d)] = NAN;
      }
  for (int64_t j = 0; j < nk; j++)
    for (int64_t h = 0; h < p.HK; h++)
      for (int64_t d = 0; d < p.D; d++) {
        p.k[kidx(&p, kb, k0 + j, h, d)] = NAN;
        p.v[kidx(&p, kb, k0 + j, h, d)] = NAN;
      }
  ro.label = "NaN sequence:";
  run_exec(&bad, &p, &ro);
  const int bwd = c->backward && clean.bwd_ok && bad.bwd_ok;
  if (clean.fwd_ok && bad.fwd_ok) {
    const float *lc = (const float *)clean.lse.data, *lb = (const float *)bad.lse.data;
    int64_t n_o = 0, n_lse = 0, n_dq = 0, n_dk = 0, n_dv = 0, miss_o = 0, miss_dq = 0, miss_dk = 0,
            miss_dv = 0, seen_rows = 0;
    for (int64_t s = 0; s < p.nseqs; s++) {
      prob_seq(&p, s, &qb, &q0, &nq, &kb, &k0, &nk);
      for (int64_t h = 0; h < p.HQ; h++)
        for (int64_t i = 0; i < nq; i++) {
          const size_t ob = qidx(&p, qb, q0 + i, h, 0), li = prob_lse_index(&p, s, h, i);
          if (s == s0) {
            if (row_masked(c, nq, nk, i)) continue;
            seen_rows++;
            nan_row("O", bad.o_vals, ob, p.D, s0, h, i, &miss_o);
            if (bwd) nan_row("dQ", bad.dq_vals, ob, p.D, s0, h, i, &miss_dq);
            continue;
          }
          iso_row("O", bad.o_vals, clean.o_vals, ob, p.D, s0, s, h, i, &n_o);
          if (memcmp(&lb[li], &lc[li], sizeof(float)) != 0 && n_lse++ == 0)
            tr_fail(
                "NaN in sequence %lld changed lse of sequence %lld (head %lld, row %lld): "
                "%.9g, clean run %.9g",
                (long long)s0, (long long)s, (long long)h, (long long)i, lb[li], lc[li]);
          if (bwd) iso_row("dQ", bad.dq_vals, clean.dq_vals, ob, p.D, s0, s, h, i, &n_dq);
        }
      if (!bwd) continue;
      for (int64_t h = 0; h < p.HK; h++)
        for (int64_t j = 0; j < nk; j++) {
          const size_t kbase = kidx(&p, kb, k0 + j, h, 0);
          if (s == s0) {
            if (col_unseen(c, nq, nk, j)) continue;
            nan_row("dK", bad.dk_vals, kbase, p.D, s0, h, j, &miss_dk);
            nan_row("dV", bad.dv_vals, kbase, p.D, s0, h, j, &miss_dv);
            continue;
          }
          iso_row("dK", bad.dk_vals, clean.dk_vals, kbase, p.D, s0, s, h, j, &n_dk);
          iso_row("dV", bad.dv_vals, clean.dv_vals, kbase, p.D, s0, s, h, j, &n_dv);
        }
    }
    if (n_o + n_lse + n_dq + n_dk + n_dv > 1)
      tr_fail("rows changed outside the NaN sequence: O %lld, lse %lld, dQ %lld, dK %lld, dV %lld",
              (long long)n_o, (long long)n_lse, (long long)n_dq, (long long)n_dk, (long long)n_dv);
    if (seen_rows == 0)
      tr_fail("test defect: no row of NaN sequence %lld sees a key", (long long)s0);
  }
  run_free(&clean);
  run_free(&bad);
  prob_free(&p);
}

/* ---- storage rounding ------------------------------------------------------------------------
 * Two identical keys give P = 1/2 exactly, so O = (V0 + V1) / 2 exactly in
 * float32 (V entries in [0.5, 4) keep the sum exact) and the stored O must be
 * that value rounded to nearest even, bit for bit, in every algorithm and dtype.
 * This is what catches a wrong float16/bfloat16 conversion, which the error
 * yardstick cannot (the naive run would share it). */
void attn_check_rounding(const acfg *c) {
  prob p;
  acfg x = *c;
  x.nk = 2;
  x.causal = 0;
  x.window = 0;
  x.softcap = 0;
  x.alibi = 0;
  prob_init(&p, &x);
  tr_context("seed %#llx", (unsigned long long)c->seed);
  tu_rng r;
  tu_rng_seed(&r, c->seed ^ 0x5bd1e995u);
  for (int64_t h = 0; h < p.HK; h++)
    for (int64_t d = 0; d < p.D; d++) {
      p.k[kidx(&p, 0, 1, h, d)] = p.k[kidx(&p, 0, 0, h, d)];
      for (int64_t j = 0; j < 2; j++) {
        double m = tu_round(0.5 + 3.5 * tu_rng_uniform(&r), x.dtype);
        if (m >= 4) m = 0.5;
        p.v[kidx(&p, 0, j, h, d)] = (tu_rng_next(&r) & 1) ? -m : m;
      }
    }
  runopt ro;
  memset(&ro, 0, sizeof ro);
  ro.algo = x.algo;
  ro.dtype = x.dtype;
  ro.layout = x.layout;
  ro.threads = x.threads;
  ro.label = "two identical keys:";
  run im;
  run_exec(&im, &p, &ro);
  if (im.fwd_ok) {
    int64_t bad = 0, ties = 0;
    for (int64_t n = 0; n < p.NQ; n++)
      for (int64_t h = 0; h < p.HQ; h++)
        for (int64_t d = 0; d < p.D; d++) {
          const int64_t hk = h / (p.HQ / p.HK);
          const double exact = 0.5 * (p.v[kidx(&p, 0, 0, hk, d)] + p.v[kidx(&p, 0, 1, hk, d)]);
          const double want = tu_round(exact, x.dtype);
          const double got = im.o_vals[qidx(&p, 0, n, h, d)];
          if (want != exact) ties++;
          if (got != want && bad++ == 0)
            tr_fail("O(n%lld,h%lld,d%lld) = %.9g, expected (V0+V1)/2 = %.9g rounded to %.9g",
                    (long long)n, (long long)h, (long long)d, got, exact, want);
        }
    if (bad > 1) tr_fail("%lld elements of O are not correctly rounded", (long long)bad);
    if (x.dtype != FA_DTYPE_F32 && ties == 0) tr_fail("test defect: no element needed rounding");
  }
  run_free(&im);
  prob_free(&p);
}
