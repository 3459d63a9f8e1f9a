/* KV-cache tests on any device (see kvtest.h). */
#include "kvtest.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- configurations ---------------------------------------------------------- */

kvcfg kvcfg_default(void) {
  kvcfg c;
  memset(&c, 0, sizeof c);
  c.api = KV_FORWARD;
  c.dt = FA_DTYPE_F32;
  c.algo = FA_ALGO_FLASH2;
  c.B = 2;
  c.hq = c.hk = 2;
  c.d = 32;
  c.nq = 1;
  c.cap = 64;
  c.wl = c.wr = -1;
  c.dev = &kv_host;
  return c;
}

void kvcfg_name(const kvcfg *c, const char *group, char *buf, size_t n) {
  size_t u = 0;
#define APP(...) tu_appendf(buf, n, &u, __VA_ARGS__)
  APP("kv/%s/%s/%s/%s", group, c->api == KV_CALL ? "call" : "fwd", tu_algo_name(c->algo),
      tu_dtype_name(c->dt));
  APP("/b%d/h%d:%d/d%d", c->B, c->hq, c->hk, c->d);
  if (c->varlen) {
    APP("/varlen");
    for (int s = 0; s < c->B; s++) APP("%s%d:%d", s ? "," : "", c->lq[s], c->used[s]);
  } else {
    APP("/nq%d", c->nq);
    if (c->api == KV_CALL || c->seqused) {
      APP("/%s", c->api == KV_CALL ? "seqlens" : "used");
      for (int s = 0; s < c->B; s++) APP("%s%d", s ? "," : "", c->used[s]);
    }
  }
  APP(c->page ? "/page%d" : "/contig", c->page);
  APP("/cap%d", c->cap);
  if (c->nnew) APP("/new%d", c->nnew);
  if (c->leftpad) {
    APP("/leftpad");
    for (int s = 0; s < c->B; s++) APP("%s%d", s ? "," : "", c->lp[s]);
  }
  if (c->bidx) {
    APP("/bidx");
    for (int s = 0; s < c->B; s++) APP("%s%d", s ? "," : "", c->bi[s]);
    APP("of%d", c->cache_batch);
  }
  if (c->rotary) APP("/rot%d%s", c->rotary, c->interleaved ? "i" : "");
  if (c->causal) APP("/causal");
  if (c->window) APP("/win%d,%d", c->wl, c->wr);
  if (c->softcap > 0) APP("/cap%g", c->softcap);
  if (c->alibi) APP("/alibi%d", c->alibi);
  if (c->num_splits) APP("/splits%d", c->num_splits);
  if (c->share) APP("/shared");
  if (c->bhnd) APP("/bhnd");
  if (c->pad) APP("/pad%d", c->pad);
  if (c->threads) APP("/t%d", c->threads);
  if (c->ws) APP("/ws");
  if (c->sabotage) APP("/sabotaged");
#undef APP
}

/* ---- the problem --------------------------------------------------------------- */

typedef struct kvprob {
  kvcfg c;
  int S;                                       /* sequences (the batch) */
  int qb, qrows;                               /* q's batch and seqlen (varlen: 1, total) */
  int nq[KV_MAX_SEQS], q0[KV_MAX_SEQS];        /* query rows of sequence s, first row */
  int nk[KV_MAX_SEQS], k0[KV_MAX_SEQS];        /* keys it attends to; first in the gathered K */
  int kstart[KV_MAX_SEQS], entry[KV_MAX_SEQS]; /* contiguous cache: first row, batch entry */
  int maxk, totk;
  int32_t cu_q[KV_MAX_SEQS + 1], cu_k[KV_MAX_SEQS + 1];
  /* the cache as the call sees it: a (cbatch, crows, hk, d) tensor */
  fa_tensor cd; /* strides; data NULL */
  size_t celems;
  int ppseq, npages;
  int32_t *table, *table_lib;    /* S x ppseq: the true table, and the one the call gets */
  double *kc0, *vc0, *kc1, *vc1; /* every element of the cache before and after */
  double *q, *knew, *vnew, *cs, *sn;
  double *qo, *qn;      /* q as the oracle and the naive run see it */
  double *ko, *kn, *vg; /* gathered keys (oracle, naive) and values */
  float *slopes;
  int64_t slope_stride;
} kvprob;

static double kv_value(tu_rng *r, fa_dtype dt) {
  double x;
  do x = tu_round(tu_rng_normal(r), dt);
  while (x == 0 || !isfinite(x));
  return x;
}

static size_t cidx(const kvprob *p, int64_t b, int64_t n, int64_t h, int64_t d) {
  return (size_t)(b * p->cd.stride_batch + n * p->cd.stride_seq + h * p->cd.stride_head + d);
}

/* Batch entry and row of the cache holding row r (from the start of sequence
 * s's cache) through the table tab. */
static void crow(const kvprob *p, const int32_t *tab, int s, int r, int64_t *b, int64_t *n) {
  if (p->c.page) {
    *b = tab[s * p->ppseq + r / p->c.page];
    *n = r % p->c.page;
  } else {
    *b = p->entry[s];
    *n = r;
  }
}

/* Rotary position of query row i and of new key i of sequence s. */
static int qpos(const kvprob *p, int s, int i) {
  const kvcfg *c = &p->c;
  const int all = c->causal || (c->window && (c->wl >= 0 || c->wr >= 0));
  return c->used[s] + (all ? i : 0);
}

/* out = in with its first rotary_dim columns rotated to position pos, in
 * float64 or (f32) float32 arithmetic. */
static void rot_row(const kvprob *p, double *out, const double *in, int pos, int f32) {
  const int rd = p->c.rotary, half = rd / 2, D = p->c.d;
  for (int e = 0; e < D; e++) out[e] = in[e];
  for (int c = 0; c < half; c++) {
    const int i1 = p->c.interleaved ? 2 * c : c, i2 = p->c.interleaved ? 2 * c + 1 : c + half;
    const double C = p->cs[pos * half + c], S = p->sn[pos * half + c];
    if (f32) {
      const float a = (float)in[i1], b = (float)in[i2], fc = (float)C, fs = (float)S;
      out[i1] = (double)(a * fc - b * fs);
      out[i2] = (double)(a * fs + b * fc);
    } else {
      out[i1] = in[i1] * C - in[i2] * S;
      out[i2] = in[i1] * S + in[i2] * C;
    }
  }
}

static void prob_free(kvprob *p) {
  free(p->table), free(p->table_lib);
  free(p->kc0), free(p->vc0), free(p->kc1), free(p->vc1);
  free(p->q), free(p->knew), free(p->vnew), free(p->cs), free(p->sn);
  free(p->qo), free(p->qn), free(p->ko), free(p->kn), free(p->vg), free(p->slopes);
}

static double *dalloc(size_t n) { return (double *)calloc(n ? n : 1, sizeof(double)); }

/* 0 when the configuration itself is inconsistent (a test defect). */
static int prob_make(kvprob *p, const kvcfg *c) {
  memset(p, 0, sizeof *p);
  p->c = *c;
  tu_rng r;
  tu_rng_seed(&r, c->seed);
  const int S = p->S = c->B, D = c->d, Hk = c->hk, Hq = c->hq;
  if (S < 1 || S > KV_MAX_SEQS || (c->page && c->cap % c->page)) return 0;
  /* sequences: query rows, keys, the cache rows they read and write */
  int stable[KV_MAX_SEQS], rows[KV_MAX_SEQS]; /* rows read before the call; rows touched */
  p->qb = c->varlen ? 1 : S;
  for (int s = 0; s < S; s++) {
    p->nq[s] = c->varlen ? c->lq[s] : c->nq;
    p->q0[s] = c->varlen ? p->cu_q[s] : 0;
    p->cu_q[s + 1] = p->cu_q[s] + p->nq[s];
    const int lp = c->leftpad ? c->lp[s] : 0;
    if (c->api == KV_CALL) {
      p->nk[s] = c->used[s] + c->nnew - lp;
      stable[s] = c->used[s];
      rows[s] = c->used[s] + c->nnew;
    } else {
      p->nk[s] = c->varlen || c->seqused ? c->used[s] : c->cap;
      stable[s] = rows[s] = p->nk[s];
    }
    p->kstart[s] = lp;
    p->entry[s] = c->bidx ? c->bi[s] : s;
    if (p->nk[s] < 0 || rows[s] > c->cap || lp > stable[s]) return 0;
    p->cu_k[s + 1] = p->cu_k[s] + p->nk[s];
    p->k0[s] = c->varlen ? p->cu_k[s] : 0;
    if (p->nk[s] > p->maxk) p->maxk = p->nk[s];
  }
  p->totk = p->cu_k[S];
  p->qrows = c->varlen ? p->cu_q[S] : c->nq;
  /* the cache tensor */
  int64_t cb, cr;
  if (c->page) {
    p->ppseq = c->cap / c->page;
    p->npages = S * p->ppseq + 3;
    cb = p->npages, cr = c->page;
  } else {
    cb = c->bidx ? c->cache_batch : S, cr = c->cap;
  }
  const int64_t row = D + c->pad;
  p->cd.dtype = c->dt, p->cd.batch = cb, p->cd.seqlen = cr, p->cd.heads = Hk, p->cd.headdim = D;
  if (c->bhnd) {
    p->cd.stride_seq = row, p->cd.stride_head = cr * row, p->cd.stride_batch = Hk * cr * row;
  } else {
    p->cd.stride_head = row, p->cd.stride_seq = Hk * row, p->cd.stride_batch = cr * Hk * row;
  }
  p->celems = (size_t)(cb * p->cd.stride_batch);
  /* the page table: shuffled pages, shared prefixes, invalid unused entries */
  if (c->page) {
    int *perm = (int *)malloc(sizeof(int) * (size_t)p->npages), next = 0;
    for (int i = 0; i < p->npages; i++) perm[i] = i;
    for (int i = p->npages - 1; i > 0; i--) {
      const int j = (int)(tu_rng_next(&r) % (uint64_t)(i + 1)), t = perm[i];
      perm[i] = perm[j], perm[j] = t;
    }
    p->table = (int32_t *)malloc(sizeof(int32_t) * (size_t)(S * p->ppseq));
    for (int s = 0; s < S; s++) {
      const int need = (rows[s] + c->page - 1) / c->page;
      const int shared =
          c->share && s > 0 ? (stable[0] < stable[s] ? stable[0] : stable[s]) / c->page : 0;
      for (int i = 0; i < p->ppseq; i++)
        p->table[s * p->ppseq + i] = i < shared ? p->table[i] : i < need ? perm[next++] : -1000 - i;
    }
    free(perm);
    p->table_lib = (int32_t *)malloc(sizeof(int32_t) * (size_t)(S * p->ppseq));
    memcpy(p->table_lib, p->table, sizeof(int32_t) * (size_t)(S * p->ppseq));
    if (c->sabotage) { /* sequence 0's last two pages swapped */
      const int last = (rows[0] + c->page - 1) / c->page - 1;
      if (last < 1) return 0;
      p->table_lib[last - 1] = p->table[last], p->table_lib[last] = p->table[last - 1];
    }
  }
  /* the cache: NaN everywhere, random in the rows read before the call */
  p->kc0 = dalloc(p->celems), p->vc0 = dalloc(p->celems);
  for (size_t e = 0; e < p->celems; e++) p->kc0[e] = p->vc0[e] = NAN;
  for (int s = 0; s < S; s++)
    for (int rr = p->kstart[s]; rr < stable[s]; rr++) {
      int64_t b, n;
      crow(p, p->table, s, rr, &b, &n);
      if (!isnan(p->kc0[cidx(p, b, n, 0, 0)])) continue; /* a shared page, filled already */
      for (int h = 0; h < Hk; h++)
        for (int e = 0; e < D; e++) {
          p->kc0[cidx(p, b, n, h, e)] = kv_value(&r, c->dt);
          p->vc0[cidx(p, b, n, h, e)] = kv_value(&r, c->dt);
        }
    }
  /* q, the new rows, the rotary tables (angles pos * 10000^(-2c/rd), rounded) */
  const size_t nqe = (size_t)p->qb * (size_t)p->qrows * (size_t)Hq * (size_t)D;
  const size_t nne = (size_t)S * (size_t)c->nnew * (size_t)Hk * (size_t)D;
  p->q = dalloc(nqe), p->knew = dalloc(nne), p->vnew = dalloc(nne);
  for (size_t e = 0; e < nqe; e++) p->q[e] = kv_value(&r, c->dt);
  for (size_t e = 0; e < nne; e++)
    p->knew[e] = kv_value(&r, c->dt), p->vnew[e] = kv_value(&r, c->dt);
  const int half = c->rotary / 2;
  p->cs = dalloc((size_t)(c->cap * half)), p->sn = dalloc((size_t)(c->cap * half));
  for (int pos = 0; pos < c->cap; pos++)
    for (int k = 0; k < half; k++) {
      const double ang = pos * pow(10000.0, -2.0 * k / c->rotary) + 0.1 * k;
      p->cs[pos * half + k] = tu_round(cos(ang), c->dt);
      p->sn[pos * half + k] = tu_round(sin(ang), c->dt);
    }
  /* q as the oracle (float64 rotation) and the naive run (float32, rounded) see it */
  p->qo = dalloc(nqe), p->qn = dalloc(nqe);
  memcpy(p->qo, p->q, nqe * sizeof(double));
  memcpy(p->qn, p->q, nqe * sizeof(double));
  if (c->rotary)
    for (int s = 0; s < S; s++)
      for (int i = 0; i < p->nq[s]; i++)
        for (int h = 0; h < Hq; h++) {
          const size_t o =
              (((size_t)s * (size_t)p->qrows + (size_t)i) * (size_t)Hq + (size_t)h) * (size_t)D;
          rot_row(p, p->qo + o, p->q + o, qpos(p, s, i), 0);
          rot_row(p, p->qn + o, p->q + o, qpos(p, s, i), c->dt != FA_DTYPE_F64);
          for (int e = 0; e < D; e++) p->qn[o + (size_t)e] = tu_round(p->qn[o + (size_t)e], c->dt);
        }
  /* the cache after the call: the new rows rotated (float32) and rounded */
  p->kc1 = dalloc(p->celems), p->vc1 = dalloc(p->celems);
  memcpy(p->kc1, p->kc0, p->celems * sizeof(double));
  memcpy(p->vc1, p->vc0, p->celems * sizeof(double));
  double *tmp = dalloc((size_t)D);
  for (int s = 0; s < S && c->api == KV_CALL; s++)
    for (int i = 0; i < c->nnew; i++) {
      int64_t b, n;
      crow(p, p->table, s, c->used[s] + i, &b, &n);
      for (int h = 0; h < Hk; h++) {
        const size_t o =
            (((size_t)s * (size_t)c->nnew + (size_t)i) * (size_t)Hk + (size_t)h) * (size_t)D;
        if (c->rotary)
          rot_row(p, tmp, p->knew + o, c->used[s] + i, c->dt != FA_DTYPE_F64);
        else
          memcpy(tmp, p->knew + o, sizeof(double) * (size_t)D);
        for (int e = 0; e < D; e++) {
          p->kc1[cidx(p, b, n, h, e)] = tu_round(tmp[e], c->dt);
          p->vc1[cidx(p, b, n, h, e)] = p->vnew[o + (size_t)e];
        }
      }
    }
  /* each sequence's keys and values gathered: (S, maxk) or varlen (1, totk) */
  const int gb = c->varlen ? 1 : S, gr = c->varlen ? p->totk : p->maxk;
  const size_t nge = (size_t)gb * (size_t)(gr ? gr : 1) * (size_t)Hk * (size_t)D;
  p->ko = dalloc(nge), p->kn = dalloc(nge), p->vg = dalloc(nge);
  for (int s = 0; s < S; s++) {
    const int old = c->api == KV_CALL ? c->used[s] - p->kstart[s] : p->nk[s];
    for (int j = 0; j < p->nk[s]; j++)
      for (int h = 0; h < Hk; h++) {
        const size_t g =
            ((c->varlen ? (size_t)(p->k0[s] + j) : (size_t)s * (size_t)gr + (size_t)j) *
                 (size_t)Hk +
             (size_t)h) *
            (size_t)D;
        if (j < old) {
          int64_t b, n;
          crow(p, p->table, s, p->kstart[s] + j, &b, &n);
          for (int e = 0; e < D; e++) {
            p->ko[g + (size_t)e] = p->kn[g + (size_t)e] = p->kc0[cidx(p, b, n, h, e)];
            p->vg[g + (size_t)e] = p->vc0[cidx(p, b, n, h, e)];
          }
        } else {
          const int i = j - old;
          const size_t o =
              (((size_t)s * (size_t)c->nnew + (size_t)i) * (size_t)Hk + (size_t)h) * (size_t)D;
          if (c->rotary) {
            rot_row(p, p->ko + g, p->knew + o, c->used[s] + i, 0);
            rot_row(p, p->kn + g, p->knew + o, c->used[s] + i, c->dt != FA_DTYPE_F64);
          } else {
            memcpy(p->ko + g, p->knew + o, sizeof(double) * (size_t)D);
            memcpy(p->kn + g, p->knew + o, sizeof(double) * (size_t)D);
          }
          for (int e = 0; e < D; e++) {
            p->kn[g + (size_t)e] = tu_round(p->kn[g + (size_t)e], c->dt);
            p->vg[g + (size_t)e] = p->vnew[o + (size_t)e];
          }
        }
      }
  }
  free(tmp);
  if (c->alibi) {
    const int nb = c->alibi == 2 ? S : 1;
    p->slopes = (float *)malloc(sizeof(float) * (size_t)(nb * Hq));
    for (int b = 0; b < nb; b++)
      for (int h = 0; h < Hq; h++)
        p->slopes[b * Hq + h] = (float)(pow(2.0, -8.0 * (h + 1) / Hq) * (1 + 0.5 * b));
    p->slope_stride = c->alibi == 2 ? Hq : 0;
  }
  return 1;
}

/* ---- the reference runs (CPU, FA_ALGO_STANDARD, gathered keys) -------------------------- */

static fa_params base_params(const kvprob *p) {
  fa_params pr;
  memset(&pr, 0, sizeof pr);
  pr.causal = p->c.causal;
  pr.window_enabled = p->c.window;
  pr.window_left = p->c.wl;
  pr.window_right = p->c.wr;
  pr.softcap = p->c.softcap;
  pr.alibi_stride_batch = p->slope_stride;
  return pr;
}

static void *to_bytes(const double *x, size_t n, fa_dtype dt) {
  void *m = malloc(n * tu_esize(dt) + 16);
  for (size_t e = 0; e < n; e++) tu_store(m, dt, e, x[e]);
  return m;
}

/* O (canonical q layout) and lse of the standard algorithm in dtype dt on q
 * and the gathered k, v. */
static int ref_run(const kvprob *p, fa_dtype dt, const double *q, const double *k, const double *v,
                   double *o, float *lse) {
  const kvcfg *c = &p->c;
  const int gb = c->varlen ? 1 : p->S, gr = c->varlen ? p->totk : p->maxk;
  const size_t nqe = (size_t)p->qb * (size_t)p->qrows * (size_t)c->hq * (size_t)c->d;
  const size_t nge = (size_t)gb * (size_t)(gr ? gr : 1) * (size_t)c->hk * (size_t)c->d;
  void *qm = to_bytes(q, nqe, dt), *km = to_bytes(k, nge, dt), *vm = to_bytes(v, nge, dt);
  void *om = malloc(nqe * tu_esize(dt) + 16);
  fa_tensor tq = fa_tensor_bnhd(qm, dt, p->qb, p->qrows, c->hq, c->d);
  fa_tensor tk = fa_tensor_bnhd(km, dt, gb, gr ? gr : 1, c->hk, c->d);
  fa_tensor tv = fa_tensor_bnhd(vm, dt, gb, gr ? gr : 1, c->hk, c->d);
  fa_tensor to = fa_tensor_bnhd(om, dt, p->qb, p->qrows, c->hq, c->d);
  fa_params pr = base_params(p);
  pr.algorithm = FA_ALGO_STANDARD;
  pr.alibi_slopes = p->slopes;
  int32_t used[KV_MAX_SEQS];
  for (int s = 0; s < p->S; s++) used[s] = p->nk[s];
  if (c->varlen) {
    pr.cu_seqlens_q = p->cu_q, pr.cu_seqlens_k = p->cu_k, pr.num_seqs = p->S;
  } else {
    pr.seqused_k = used;
  }
  const fa_status st = fa_forward(&pr, &tq, &tk, &tv, &to, lse);
  if (st != FA_OK)
    tr_fail("reference (%s) fa_forward: %s: %s", tu_dtype_name(dt), fa_status_string(st),
            fa_last_error());
  else
    for (size_t e = 0; e < nqe; e++) o[e] = tu_load(om, dt, e);
  free(qm), free(km), free(vm), free(om);
  return st == FA_OK;
}

/* ---- device buffers between guard zones ------------------------------------------------ */

#define KV_GUARD 256
typedef struct dbuf {
  unsigned char *raw; /* device: guard | data | guard */
  void *data;
  size_t bytes;
  const char *name;
} dbuf;

static dbuf dbuf_make(const kvdev *dev, const char *name, const void *host, size_t bytes) {
  dbuf b;
  b.name = name;
  b.bytes = bytes;
  b.raw = (unsigned char *)dev->alloc(bytes + 2 * KV_GUARD);
  b.data = b.raw + KV_GUARD;
  unsigned char *g = (unsigned char *)malloc(bytes + 2 * KV_GUARD);
  memset(g, 0xA5, KV_GUARD);
  memset(g + KV_GUARD + bytes, 0xA5, KV_GUARD);
  if (host)
    memcpy(g + KV_GUARD, host, bytes);
  else
    memset(g + KV_GUARD, 0xFF, bytes); /* an output: poisoned (NaN) */
  dev->upload(b.raw, g, bytes + 2 * KV_GUARD);
  free(g);
  return b;
}

/* Downloads the data (when out) and checks the guards; frees the buffer. */
static void dbuf_done(const kvdev *dev, dbuf *b, void *out) {
  if (!b->raw) return;
  unsigned char *g = (unsigned char *)malloc(b->bytes + 2 * KV_GUARD);
  dev->download(g, b->raw, b->bytes + 2 * KV_GUARD);
  for (size_t i = 0; i < KV_GUARD; i++)
    if (g[i] != 0xA5 || g[KV_GUARD + b->bytes + i] != 0xA5) {
      tr_fail("the call wrote into the guard zone around %s", b->name);
      break;
    }
  if (out) memcpy(out, g + KV_GUARD, b->bytes);
  free(g);
  dev->release(b->raw);
  b->raw = NULL;
}

/* ---- the check ------------------------------------------------------------------------ */

/* relative Frobenius error over n values (NaN counted in *nan) */
static double rel_err(const double *x, const double *ref, size_t n, long *nan) {
  double e2 = 0, r2 = 0;
  for (size_t i = 0; i < n; i++) {
    if (isnan(x[i]) || isinf(x[i])) {
      if (nan) (*nan)++;
      continue;
    }
    e2 += (x[i] - ref[i]) * (x[i] - ref[i]);
    r2 += ref[i] * ref[i];
  }
  return r2 > 0 ? sqrt(e2 / r2) : sqrt(e2);
}

static double o_floor(const kvdev *dev, fa_dtype dt) {
  return dt == FA_DTYPE_F16    ? dev->floor_f16
         : dt == FA_DTYPE_BF16 ? dev->floor_bf16
                               : dev->floor_f32;
}

static size_t lse_index(const kvprob *p, int s, int h, int i) {
  if (p->c.varlen) return (size_t)h * (size_t)p->qrows + (size_t)(p->q0[s] + i);
  return ((size_t)s * (size_t)p->c.hq + (size_t)h) * (size_t)p->qrows + (size_t)i;
}

/* One unit in the last place of x in dt (f32: 2^-23 relative). */
static double ulp_of(double x, fa_dtype dt) {
  const int mant = dt == FA_DTYPE_F16 ? 10 : dt == FA_DTYPE_BF16 ? 7 : dt == FA_DTYPE_F32 ? 23 : 52;
  int ex;
  frexp(x == 0 ? 1e-30 : x, &ex);
  return ldexp(1.0, ex - 1 - mant);
}

/* The cache after the call against what it must hold. */
static void check_cache(const kvprob *p, const char *what, const void *got, const double *want0,
                        const double *want1) {
  const fa_dtype dt = p->c.dt;
  long changed = 0, wrong = 0;
  size_t first = 0;
  for (size_t e = 0; e < p->celems; e++) {
    const double g = tu_load(got, dt, e), w = want1[e];
    if (isnan(w)) { /* never written: the same NaN bytes as before */
      const unsigned char *gb = (const unsigned char *)got + e * tu_esize(dt);
      unsigned char wb[8];
      tu_store(wb, dt, 0, NAN);
      if (memcmp(gb, wb, tu_esize(dt)) != 0 && changed++ == 0) first = e;
    } else if (!isnan(want0[e])) { /* a row read, not written: unchanged */
      if (!(g == w) && changed++ == 0) first = e;
    } else if (!(fabs(g - w) <= ulp_of(w, dt)) && wrong++ == 0) { /* appended */
      first = e;
    }
  }
  if (changed)
    tr_fail(
        "%s: %ld elements changed that the call must not write (first at element %zu: %g, "
        "was %g)",
        what, changed, first, tu_load(got, dt, first), want1[first]);
  if (wrong)
    tr_fail(
        "%s: %ld appended elements differ from the rotated new rows (first at element %zu: "
        "%.9g, want %.9g)",
        what, wrong, first, tu_load(got, dt, first), want1[first]);
}

void kv_check(const kvcfg *cfg, const kvdev *dev) {
  kvprob p;
  tr_context("seed %#llx", (unsigned long long)cfg->seed);
  if (!prob_make(&p, cfg)) {
    tr_fail("test defect: inconsistent configuration");
    prob_free(&p);
    return;
  }
  const kvcfg *c = &p.c;
  const fa_dtype dt = c->dt;
  const size_t es = tu_esize(dt);
  const int S = p.S, D = c->d;
  const size_t nqe = (size_t)p.qb * (size_t)p.qrows * (size_t)c->hq * (size_t)D;
  const size_t nlse = (size_t)p.qb * (size_t)c->hq * (size_t)p.qrows;
  double *oo = dalloc(nqe), *on = dalloc(nqe), *oi = dalloc(nqe);
  float *lo = (float *)calloc(nlse + 1, 4), *ln = (float *)calloc(nlse + 1, 4);
  float *li = (float *)calloc(nlse + 1, 4);
  if (!ref_run(&p, FA_DTYPE_F64, p.qo, p.ko, p.vg, oo, lo) ||
      !ref_run(&p, dt, p.qn, p.kn, p.vg, on, ln))
    goto out;

  /* the run under test */
  {
    void *qh = to_bytes(p.q, nqe, dt), *kch = to_bytes(p.kc0, p.celems, dt);
    void *vch = to_bytes(p.vc0, p.celems, dt);
    const size_t nne = (size_t)S * (size_t)c->nnew * (size_t)c->hk * (size_t)D;
    void *knh = to_bytes(p.knew, nne, dt), *vnh = to_bytes(p.vnew, nne, dt);
    const size_t ntab = (size_t)(c->cap * (c->rotary / 2));
    void *csh = to_bytes(p.cs, ntab, dt), *snh = to_bytes(p.sn, ntab, dt);
    int32_t used[KV_MAX_SEQS], lp[KV_MAX_SEQS], bi[KV_MAX_SEQS];
    for (int s = 0; s < S; s++) used[s] = c->used[s], lp[s] = c->lp[s], bi[s] = c->bi[s];
    dbuf q = dbuf_make(dev, "q", qh, nqe * es), kc = dbuf_make(dev, "k cache", kch, p.celems * es);
    dbuf vc = dbuf_make(dev, "v cache", vch, p.celems * es),
         o = dbuf_make(dev, "o", NULL, nqe * es);
    dbuf lse = dbuf_make(dev, "lse", NULL, nlse * 4);
    dbuf kn = {0}, vn = {0}, cs = {0}, sn = {0}, tab = {0}, us = {0}, cq = {0}, ck = {0};
    dbuf lpd = {0}, bid = {0}, sl = {0}, ws = {0};
    fa_params pr = base_params(&p);
    pr.device = dev->device;
    pr.algorithm = c->algo;
    pr.stream = dev->stream;
    pr.num_threads = c->threads;
    pr.num_splits = c->num_splits;
    if (c->alibi) {
      sl = dbuf_make(dev, "alibi slopes", p.slopes,
                     sizeof(float) * (size_t)((c->alibi == 2 ? S : 1) * c->hq));
      pr.alibi_slopes = (const float *)sl.data;
    }
    if (c->page) {
      tab = dbuf_make(dev, "block table", p.table_lib, sizeof(int32_t) * (size_t)(S * p.ppseq));
      pr.block_table = (const int32_t *)tab.data;
      pr.max_pages_per_seq = p.ppseq;
      pr.block_table_stride = p.ppseq;
    }
    fa_tensor tq = fa_tensor_bnhd(q.data, dt, p.qb, p.qrows, c->hq, D);
    fa_tensor to = fa_tensor_bnhd(o.data, dt, p.qb, p.qrows, c->hq, D);
    fa_tensor tk = p.cd, tv = p.cd, tkn, tvn;
    tk.data = kc.data, tv.data = vc.data;
    fa_kvcache kv;
    memset(&kv, 0, sizeof kv);
    size_t wsz = 0;
    fa_status st;
    if (c->api == KV_CALL) {
      us = dbuf_make(dev, "cache_seqlens", used, sizeof(int32_t) * (size_t)S);
      kv.cache_seqlens = (const int32_t *)us.data;
      if (c->nnew) {
        kn = dbuf_make(dev, "k_new", knh, nne * es), vn = dbuf_make(dev, "v_new", vnh, nne * es);
        tkn = fa_tensor_bnhd(kn.data, dt, S, c->nnew, c->hk, D);
        tvn = fa_tensor_bnhd(vn.data, dt, S, c->nnew, c->hk, D);
        kv.k_new = &tkn, kv.v_new = &tvn;
      }
      if (c->leftpad) {
        lpd = dbuf_make(dev, "cache_leftpad", lp, sizeof(int32_t) * (size_t)S);
        kv.cache_leftpad = (const int32_t *)lpd.data;
      }
      if (c->bidx) {
        bid = dbuf_make(dev, "cache_batch_idx", bi, sizeof(int32_t) * (size_t)S);
        kv.cache_batch_idx = (const int32_t *)bid.data;
      }
      if (c->rotary) {
        cs = dbuf_make(dev, "rotary_cos", csh, ntab * es),
        sn = dbuf_make(dev, "rotary_sin", snh, ntab * es);
        kv.rotary_cos = cs.data, kv.rotary_sin = sn.data;
        kv.rotary_seqlen = c->cap, kv.rotary_dim = c->rotary,
        kv.rotary_interleaved = c->interleaved;
      }
      st = c->ws ? fa_kvcache_workspace_size(&pr, &kv, &tq, &tk, &tv, &wsz) : FA_OK;
      if (st == FA_OK && c->ws) {
        ws = dbuf_make(dev, "workspace", NULL, wsz);
        pr.workspace = ws.data, pr.workspace_bytes = wsz;
      }
      if (st == FA_OK) st = fa_forward_kvcache(&pr, &kv, &tq, &tk, &tv, &to, (float *)lse.data);
    } else {
      if (c->varlen) {
        cq = dbuf_make(dev, "cu_seqlens_q", p.cu_q, sizeof(int32_t) * (size_t)(S + 1));
        ck = dbuf_make(dev, "cu_seqlens_k", p.cu_k, sizeof(int32_t) * (size_t)(S + 1));
        pr.cu_seqlens_q = (const int32_t *)cq.data, pr.cu_seqlens_k = (const int32_t *)ck.data;
        pr.num_seqs = S;
      } else if (c->seqused) {
        us = dbuf_make(dev, "seqused_k", used, sizeof(int32_t) * (size_t)S);
        pr.seqused_k = (const int32_t *)us.data;
      }
      st = c->ws ? fa_workspace_size(FA_PASS_FORWARD, &pr, &tq, &tk, &tv, &wsz) : FA_OK;
      if (st == FA_OK && c->ws) {
        ws = dbuf_make(dev, "workspace", NULL, wsz);
        pr.workspace = ws.data, pr.workspace_bytes = wsz;
      }
      if (st == FA_OK) st = fa_forward(&pr, &tq, &tk, &tv, &to, (float *)lse.data);
    }
    dev->sync(dev->stream);
    if (st != FA_OK) tr_fail("the call returned %s: %s", fa_status_string(st), fa_last_error());
    void *oh = malloc(nqe * es + 1), *kgot = malloc(p.celems * es + 1),
         *vgot = malloc(p.celems * es + 1);
    dbuf_done(dev, &o, oh);
    dbuf_done(dev, &lse, li);
    dbuf_done(dev, &kc, kgot);
    dbuf_done(dev, &vc, vgot);
    dbuf *rest[] = {&q, &kn, &vn, &cs, &sn, &tab, &us, &cq, &ck, &lpd, &bid, &sl, &ws};
    for (size_t i = 0; i < sizeof rest / sizeof rest[0]; i++) dbuf_done(dev, rest[i], NULL);
    if (st == FA_OK) {
      for (size_t e = 0; e < nqe; e++) oi[e] = tu_load(oh, dt, e);
      check_cache(&p, "k cache", kgot, p.kc0, p.kc1);
      check_cache(&p, "v cache", vgot, p.vc0, p.vc1);
      /* O against the oracle, beside the naive run */
      long nan = 0;
      const double ei = rel_err(oi, oo, nqe, &nan), en = rel_err(on, oo, nqe, NULL);
      const double tol = 2 * en + o_floor(dev, dt);
      if (nan)
        tr_fail("O: %ld NaN/inf elements", nan);
      else if (!(ei <= tol))
        tr_fail("O: rel err %.3g > tol %.3g (= 2 x naive %.3g + floor %.3g)", ei, tol, en,
                o_floor(dev, dt));
      if (tr_verbose())
        printf("  stat O %s impl %.3g naive %.3g ratio %.3f %s\n", tu_dtype_name(dt), ei, en,
               ei / tol, tr_name());
      /* lse, and rows that see no key: O = 0 exactly, lse = -inf */
      double lw = 0, lwn = 0;
      long bad_masked = 0;
      for (int s = 0; s < S; s++)
        for (int h = 0; h < c->hq; h++)
          for (int i = 0; i < p.nq[s]; i++) {
            const size_t x = lse_index(&p, s, h, i);
            const double r = lo[x];
            const size_t ob =
                (((size_t)(c->varlen ? 0 : s) * (size_t)p.qrows + (size_t)(p.q0[s] + i)) *
                     (size_t)c->hq +
                 (size_t)h) *
                (size_t)D;
            if (isinf(r) && r < 0) {
              int zero = isinf(li[x]) && li[x] < 0;
              for (int e = 0; e < D; e++) zero &= oi[ob + (size_t)e] == 0;
              bad_masked += !zero;
              continue;
            }
            const double sc = fabs(r) > 1 ? fabs(r) : 1;
            const double e1 = isfinite(li[x]) ? fabs(li[x] - r) / sc : INFINITY;
            const double e2 = fabs(ln[x] - r) / sc;
            if (e1 > lw) lw = e1;
            if (e2 > lwn) lwn = e2;
          }
      if (bad_masked) tr_fail("%ld rows that see no key are not O = 0, lse = -inf", bad_masked);
      if (!(lw <= 2 * lwn + dev->lse_floor))
        tr_fail("lse: worst rel err %.3g > 2 x naive %.3g + %.3g", lw, lwn, dev->lse_floor);
    }
    free(oh), free(kgot), free(vgot);
    free(qh), free(kch), free(vch), free(knh), free(vnh), free(csh), free(snh);
  }
out:
  free(oo), free(on), free(oi), free(lo), free(ln), free(li);
  prob_free(&p);
}

/* ---- registration ---------------------------------------------------------------- */

static void kv_case_fn(const void *arg) {
  const kvcfg *c = (const kvcfg *)arg;
  kv_check(c, c->dev);
}

/* A deliberately broken table (the last two pages swapped) must be caught. */
static void kv_sabotage_fn(const void *arg) {
  const kvcfg *c = (const kvcfg *)arg;
  const int before = tr_failures(), was = tr_silent(1);
  kv_check(c, c->dev);
  const int caught = tr_failures() > before;
  tr_silent(was);
  tr_reset_failures(before);
  if (!caught) tr_fail("a page table with two pages swapped was not caught");
}

void kv_register(const char *group, kvcfg c, int slow) {
  char name[320];
  kvcfg_name(&c, group, name, sizeof name);
  c.seed = tu_hash_str(name);
  tr_add(name, c.sabotage ? kv_sabotage_fn : kv_case_fn, &c, sizeof c, slow);
}

kvcfg kv_draw(tu_rng *r, const kvdev *dev) {
#define PICK(k) ((int)(tu_rng_next(r) % (uint64_t)(k)))
  static const fa_dtype dts[3] = {FA_DTYPE_F16, FA_DTYPE_BF16, FA_DTYPE_F32};
  static const fa_algorithm algos[3] = {FA_ALGO_FLASH2, FA_ALGO_FLASH1, FA_ALGO_STANDARD};
  static const int dims[10] = {8, 16, 24, 32, 40, 64, 72, 96, 128, 256};
  static const int pages[7] = {8, 16, 24, 32, 48, 64, 256};
  const int cuda = dev->device != FA_DEVICE_CPU;
  kvcfg c = kvcfg_default();
  c.dev = dev;
  c.api = PICK(2) ? KV_CALL : KV_FORWARD;
  c.dt = dts[PICK(cuda ? 2 : 3)];
  c.algo = cuda ? FA_ALGO_FLASH2 : algos[PICK(3)];
  c.hk = 1 + PICK(3);
  c.hq = c.hk << PICK(3);
  c.d = dims[PICK(10)];
  c.page = PICK(3) ? 0 : pages[PICK(7)];
  c.cap = c.page ? c.page * (1 + PICK(cuda ? 16 : 6)) : 1 + PICK(cuda ? 700 : 200);
  c.B = 1 + PICK(4);
  c.causal = PICK(2);
  if (PICK(4) == 0) {
    c.window = 1;
    c.wl = PICK(2) ? -1 : PICK(c.cap + 1);
    c.wr = c.causal || PICK(2) ? -1 : PICK(16);
  }
  const int all_rows = c.causal || (c.window && (c.wl >= 0 || c.wr >= 0));
  if (c.api == KV_CALL) {
    c.nq = 1 + PICK(8);
    c.nnew = PICK((c.cap < 8 ? c.cap : 8) + 1);
    if (c.nnew && PICK(2)) {
      c.rotary = 2 * (1 + PICK(c.d / 2));
      c.interleaved = PICK(2);
    }
    /* rotary tables of cap rows: query rows must not pass them */
    int room = c.rotary && all_rows && c.nq > c.nnew ? c.nq : c.nnew; /* rows past used */
    if (room > c.cap) c.nq = room = c.nnew;
    for (int s = 0; s < c.B; s++) c.used[s] = PICK(c.cap - room + 1);
    if (!c.page && PICK(4) == 0) {
      c.leftpad = 1;
      for (int s = 0; s < c.B; s++) c.lp[s] = PICK(c.used[s] + 1);
    }
    if (!c.page && PICK(4) == 0) { /* rows of a larger cache; distinct when appending */
      c.bidx = 1, c.cache_batch = c.B + PICK(3);
      int perm[KV_MAX_SEQS + 2];
      for (int i = 0; i < c.cache_batch; i++) perm[i] = i;
      for (int i = c.cache_batch - 1; i > 0; i--) {
        const int j = PICK(i + 1), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
      }
      for (int s = 0; s < c.B; s++) c.bi[s] = c.nnew ? perm[s] : PICK(c.cache_batch);
    }
  } else {
    c.varlen = c.page && PICK(2); /* packed queries over a paged cache */
    c.nq = 1 + PICK(8);
    c.seqused = !c.varlen && PICK(2);
    for (int s = 0; s < c.B; s++) c.lq[s] = PICK(9), c.used[s] = PICK(c.cap + 1);
    if (c.varlen && c.lq[0] + c.lq[c.B - 1] == 0) c.lq[0] = 1; /* the oracle needs a row */
  }
  c.share = c.page && c.B > 1 && PICK(3) == 0;
  if (PICK(5) == 0) c.softcap = 1.0f + 5.0f * (float)tu_rng_uniform(r);
  c.alibi = PICK(5) == 0;
  if (PICK(4) == 0) c.num_splits = 1 + PICK(5);
  c.bhnd = PICK(4) == 0;
  if (PICK(4) == 0) c.pad = cuda ? 8 * (1 + PICK(2)) : 1 + PICK(8);
  if (!cuda && PICK(3) == 0) c.threads = 1 + PICK(2);
  c.ws = PICK(2);
#undef PICK
  return c;
}

void kv_register_drawn(int n, int quick, const kvdev *dev) {
  for (int i = 0; i < n; i++) {
    char group[32];
    snprintf(group, sizeof group, "drawn/%03d", i);
    tu_rng r;
    tu_rng_seed(&r, tu_hash_str(group) ^ (dev->device == FA_DEVICE_CPU ? 0 : 0x5bd1e995u));
    kv_register(group, kv_draw(&r, dev), i >= quick);
  }
}

void kv_seqs(kvcfg *c, int n, const int *lq, const int *used) {
  c->B = n;
  for (int s = 0; s < n; s++) {
    if (lq) c->lq[s] = lq[s];
    c->used[s] = used[s];
  }
}

/* ---- the host device ----------------------------------------------------------------- */

static void *host_alloc(size_t bytes) { /* 64-byte aligned, as a workspace must be */
  return aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
}
static void host_copy(void *dst, const void *src, size_t bytes) { memcpy(dst, src, bytes); }
static void host_sync(void *stream) { (void)stream; }

const kvdev kv_host = {FA_DEVICE_CPU, NULL,   host_alloc, host_copy, host_copy, free,
                       host_sync,     2.5e-4, 2e-3,       1e-6,      1e-5};
