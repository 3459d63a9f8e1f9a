/* Dropout and block-sparse attention: the RNG against an independent
 * implementation of docs/DROPOUT.md, keep rates, and forward and backward
 * against a float64 reference written here (not the library's oracle, which
 * is the implementation under test for these features so far). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

/* Algorithms that implement dropout and block masks on the CPU (all of them);
 * extensions/validation checks that the others would refuse them. */
static const fa_algorithm ext_algos[] = {FA_ALGO_STANDARD, FA_ALGO_FLASH2, FA_ALGO_FLASH1};
#define EXT_NALGOS (int)(sizeof ext_algos / sizeof ext_algos[0])

/* ---- Philox4x32-10 and the mask index, written from the spec ------------- */

static void ref_philox(uint32_t c[4], uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; r++) {
    uint64_t a = (uint64_t)0xD2511F53u * c[0], b = (uint64_t)0xCD9E8D57u * c[2];
    uint32_t n0 = (uint32_t)(b >> 32) ^ c[1] ^ k0, n2 = (uint32_t)(a >> 32) ^ c[3] ^ k1;
    c[0] = n0, c[1] = (uint32_t)b, c[2] = n2, c[3] = (uint32_t)a;
    k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
  }
}

static int ref_keep(float p, uint64_t seed, uint64_t offset, uint64_t bh, int64_t i, int64_t j) {
  uint32_t c[4] = {(uint32_t)(j / 4), (uint32_t)i, (uint32_t)bh, (uint32_t)offset};
  ref_philox(c, (uint32_t)seed, (uint32_t)(seed >> 32) ^ (uint32_t)(offset >> 32));
  double t = (double)p * 4294967296.0;
  uint32_t thr = t >= 4294967295.0 ? 0xFFFFFFFFu : (uint32_t)t;
  return c[j % 4] >= thr;
}

static void t_philox_kat(const void *arg) {
  (void)arg;
  /* Random123's known-answer vectors for philox4x32_10 */
  static const uint32_t kat[3][7] = {
      {0, 0, 0, 0, 0, 0, 0},
      {~0u, ~0u, ~0u, ~0u, ~0u, ~0u, 0},
      {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u, 0}};
  static const uint32_t want[3][4] = {{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u},
                                      {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu},
                                      {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}};
  for (int t = 0; t < 3; t++) {
    uint32_t c[4] = {kat[t][0], kat[t][1], kat[t][2], kat[t][3]};
    ref_philox(c, kat[t][4], kat[t][5]);
    for (int w = 0; w < 4; w++)
      if (c[w] != want[t][w]) tr_fail("KAT %d word %d: %08x, want %08x", t, w, c[w], want[t][w]);
  }
}

/* fa_dropout_mask is the spec, bit for bit, including high offset and seed bits. */
static void t_mask_spec(const void *arg) {
  (void)arg;
  const uint64_t seeds[3] = {0, 0x123456789abcdef0ull, ~0ull};
  const uint64_t offs[3] = {0, 7, 0x100000003ull};
  const float ps[3] = {0.1f, 0.5f, 0.875f};
  const int64_t nq = 5, nk = 23, H = 3;
  uint8_t m[5 * 23];
  for (int a = 0; a < 3; a++) {
    fa_params p = {0};
    p.dropout_p = ps[a];
    p.dropout_seed = seeds[a];
    p.dropout_offset = offs[a];
    for (int64_t s = 0; s < 2; s++)
      for (int64_t h = 0; h < H; h++) {
        memset(m, 0xAA, sizeof m);
        fa_status st = fa_dropout_mask(&p, H, s, h, nq, nk, m);
        if (st != FA_OK) return tr_fail("fa_dropout_mask: %s", fa_last_error());
        for (int64_t i = 0; i < nq; i++)
          for (int64_t j = 0; j < nk; j++)
            if (m[i * nk + j] != ref_keep(ps[a], seeds[a], offs[a], (uint64_t)(s * H + h), i, j))
              return tr_fail("mask differs from the spec at p=%g s=%lld h=%lld (%lld, %lld)",
                             (double)ps[a], (long long)s, (long long)h, (long long)i, (long long)j);
      }
  }
}

/* Keep rate within 5 sigma of 1 - p; another offset gives another mask. */
static void t_keep_rate(const void *arg) {
  (void)arg;
  const int64_t nq = 64, nk = 4096;
  uint8_t *m = malloc((size_t)(nq * nk)), *m2 = malloc((size_t)(nq * nk));
  const float ps[4] = {0.0f, 0.1f, 0.5f, 0.9f};
  for (int a = 0; a < 4; a++) {
    fa_params p = {0};
    p.dropout_p = ps[a];
    p.dropout_seed = 42;
    if (fa_dropout_mask(&p, 4, 1, 2, nq, nk, m) != FA_OK) tr_fail("%s", fa_last_error());
    p.dropout_offset = 1;
    if (fa_dropout_mask(&p, 4, 1, 2, nq, nk, m2) != FA_OK) tr_fail("%s", fa_last_error());
    double kept = 0, same = 0, n = (double)(nq * nk);
    for (int64_t e = 0; e < nq * nk; e++) kept += m[e], same += m[e] == m2[e];
    double q = 1.0 - ps[a], sd = sqrt(q * (1 - q) / n);
    if (fabs(kept / n - q) > 5 * sd + 1e-12)
      tr_fail("p=%g: kept %.5f, want %.5f +- %.5f", (double)ps[a], kept / n, q, 5 * sd);
    double agree = q * q + (1 - q) * (1 - q); /* two independent masks */
    if (ps[a] > 0 && fabs(same / n - agree) > 0.01)
      tr_fail("p=%g: offsets 0 and 1 agree on %.4f of elements, independent would be %.4f",
              (double)ps[a], same / n, agree);
  }
  free(m);
  free(m2);
}

/* ---- forward and backward against a float64 reference written here -------- */

typedef struct ecfg {
  fa_dtype dt;
  int B, H, Hk, nq, nk, D; /* varlen when nseq > 0: lens below, B = 1 */
  int causal;
  float p;    /* dropout */
  int block;  /* 0: none; 1: random per head; 2: random broadcast; 3: with empty rows */
  int bq, bk; /* block sizes */
  int nseq;
  int lq[3], lk[3];
  int kv, used[3]; /* kv: a KV cache, sequence s using used[s] of its keys (seqused_k) */
} ecfg;

typedef struct ebufs {
  double *q, *k, *v, *o, *lse, *dout, *dq, *dk, *dv; /* (B, N, H, D) contiguous */
  uint8_t *bm;
  int64_t nbq, nbk;
} ebufs;

static double urand(uint64_t *s) {
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  return (double)(*s >> 11) / 9007199254740992.0;
}

/* Sequence s of the config: batch index, first rows, lengths. */
static void eseq(const ecfg *c, int s, int *b, int *q0, int *nq, int *k0, int *nk) {
  if (c->nseq) {
    *b = 0, *q0 = 0, *k0 = 0;
    for (int t = 0; t < s; t++) *q0 += c->lq[t], *k0 += c->lk[t];
    *nq = c->lq[s], *nk = c->lk[s];
  } else {
    *b = s, *q0 = 0, *k0 = 0, *nq = c->nq, *nk = c->nk;
  }
  if (c->kv) *nk = c->used[s];
}

/* Sequence s's key rows in the tensors (its KV cache's capacity). */
static int ecap(const ecfg *c, int s) { return c->nseq ? c->lk[s] : c->nk; }

static int ext_visible(const ecfg *c, const ebufs *e, int s, int h, int nq, int nk, int i, int j) {
  if (c->causal && j > i + nk - nq) return 0;
  if (!c->block) return 1;
  size_t hs = c->block == 2 ? 0 : (size_t)(e->nbq * e->nbk);
  size_t bs = c->block == 2 ? 0 : (size_t)c->H * hs;
  return e->bm[(size_t)s * bs + (size_t)h * hs + (size_t)(i / c->bq) * (size_t)e->nbk +
               (size_t)(j / c->bk)] != 0;
}

/* O, lse, dQ, dK, dV of the config in float64, the dropout mask from the
 * spec; and P of every (sequence, head) into probs (rows x cols each, zeros
 * around; dropped elements negated, sign bit and all, as fa_attention_probs
 * encodes them). */
static void ext_reference(const ecfg *c, const ebufs *e, uint64_t seed, double *o, double *lse,
                          double *dq, double *dk, double *dv, double *probs, int rows, int cols) {
  const int B = c->nseq ? 1 : c->B, H = c->H, Hk = c->Hk, D = c->D, S = c->nseq ? c->nseq : c->B;
  const int Nq = c->nseq ? c->lq[0] + c->lq[1] + c->lq[2] : c->nq;
  const int Nk = c->nseq ? c->lk[0] + c->lk[1] + c->lk[2] : c->nk;
  const double scale = (double)(float)(1.0 / sqrt((double)D)); /* the library keeps it as float */
  memset(dq, 0, sizeof(double) * (size_t)(B * Nq * H * D));
  memset(dk, 0, sizeof(double) * (size_t)(B * Nk * Hk * D));
  memset(dv, 0, sizeof(double) * (size_t)(B * Nk * Hk * D));
  double *P = malloc(sizeof(double) * (size_t)Nk), *Z = malloc(sizeof(double) * (size_t)Nk);
  memset(probs, 0, sizeof(double) * (size_t)(S * H) * (size_t)rows * (size_t)cols);
  for (int s = 0; s < S; s++) {
    int b, q0, nq, k0, nk;
    eseq(c, s, &b, &q0, &nq, &k0, &nk);
    for (int h = 0; h < H; h++) {
      const int hk = h / (H / Hk);
      for (int i = 0; i < nq; i++) {
        const double *qi = e->q + (((size_t)b * Nq + q0 + i) * H + h) * D;
        const double *doi = e->dout + (((size_t)b * Nq + q0 + i) * H + h) * D;
        double *oi = o + (((size_t)b * Nq + q0 + i) * H + h) * D;
        double *dqi = dq + (((size_t)b * Nq + q0 + i) * H + h) * D;
        double mx = -INFINITY, l = 0;
        for (int j = 0; j < nk; j++) {
          P[j] = -INFINITY;
          if (!ext_visible(c, e, s, h, nq, nk, i, j)) continue;
          const double *kj = e->k + (((size_t)b * Nk + k0 + j) * Hk + hk) * D;
          double x = 0;
          for (int d = 0; d < D; d++) x += qi[d] * kj[d];
          P[j] = x * scale;
          if (P[j] > mx) mx = P[j];
        }
        for (int j = 0; j < nk; j++) l += P[j] == -INFINITY ? 0 : exp(P[j] - mx);
        size_t lix = c->nseq ? (size_t)h * (size_t)Nq + (size_t)(q0 + i)
                             : ((size_t)b * H + h) * (size_t)Nq + (size_t)i;
        lse[lix] = l > 0 ? mx + log(l) : -INFINITY;
        double di = 0;
        for (int d = 0; d < D; d++) oi[d] = 0;
        for (int j = 0; j < nk; j++) {
          P[j] = P[j] == -INFINITY ? 0 : exp(P[j] - mx) / l;
          Z[j] = c->p > 0 ? (ref_keep(c->p, seed, seed * 3, (uint64_t)(s * H + h), i, j)
                                 ? 1.0 / (1.0 - (double)c->p)
                                 : 0)
                          : 1;
          probs[(((size_t)s * H + h) * rows + i) * cols + j] = Z[j] == 0 ? -P[j] : P[j];
          const double *vj = e->v + (((size_t)b * Nk + k0 + j) * Hk + hk) * D;
          double *dvj = dv + (((size_t)b * Nk + k0 + j) * Hk + hk) * D;
          double dp = 0;
          for (int d = 0; d < D; d++) {
            oi[d] += Z[j] * P[j] * vj[d];
            dvj[d] += Z[j] * P[j] * doi[d];
            dp += doi[d] * vj[d];
          }
          Z[j] *= dp; /* from here Z holds dP~ = Z * dP */
          di += P[j] * Z[j];
        }
        for (int j = 0; j < nk; j++) {
          double ds = P[j] * (Z[j] - di) * scale;
          const double *kj = e->k + (((size_t)b * Nk + k0 + j) * Hk + hk) * D;
          double *dkj = dk + (((size_t)b * Nk + k0 + j) * Hk + hk) * D;
          for (int d = 0; d < D; d++) dqi[d] += ds * kj[d], dkj[d] += ds * qi[d];
        }
      }
    }
  }
  free(P);
  free(Z);
}

static double rel_err(const double *a, const double *b, size_t n) {
  double num = 0, den = 0;
  for (size_t x = 0; x < n; x++) {
    if (isnan(a[x]) || isnan(b[x])) return INFINITY;
    num += (a[x] - b[x]) * (a[x] - b[x]);
    den += b[x] * b[x];
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void *to_dtype(const double *x, size_t n, fa_dtype dt) {
  void *m = malloc(n * tu_esize(dt) + 1);
  for (size_t e = 0; e < n; e++) tu_store(m, dt, e, x[e]);
  return m;
}

static void from_dtype(double *x, const void *m, size_t n, fa_dtype dt) {
  for (size_t e = 0; e < n; e++) x[e] = tu_load(m, dt, e);
}

/* fa_attention_probs (CPU) against the reference's P: values to float32
 * rounding, every sign bit (the dropout pattern) exact, zeros around. */
static void ext_check_probs(const ecfg *c, const fa_params *pp, const ebufs *e, int B, int Nq,
                            int Nk, const double *ref, int rows, int cols) {
  const int H = c->H, Hk = c->Hk, D = c->D, S = c->nseq ? c->nseq : c->B;
  fa_params p = *pp;
  p.algorithm = FA_ALGO_STANDARD; /* any: the probabilities have one implementation */
  void *q = to_dtype(e->q, (size_t)(B * Nq * H * D), c->dt);
  void *k = to_dtype(e->k, (size_t)(B * Nk * Hk * D), c->dt);
  for (int s = 0; c->kv && s < S; s++) { /* NaN past the used keys: never read */
    int b, q0, nq, k0, nk;
    eseq(c, s, &b, &q0, &nq, &k0, &nk);
    for (size_t x = (((size_t)b * Nk + k0 + nk) * Hk) * D;
         x < (((size_t)b * Nk + k0 + ecap(c, s)) * Hk) * D; x++)
      tu_store(k, c->dt, x, NAN);
  }
  fa_tensor tq = fa_tensor_bnhd(q, c->dt, B, Nq, H, D), tk = fa_tensor_bnhd(k, c->dt, B, Nk, Hk, D);
  const size_t n = (size_t)(S * H) * (size_t)rows * (size_t)cols;
  float *got = malloc(sizeof(float) * n);
  memset(got, 0xFF, sizeof(float) * n);
  size_t ws = 0;
  if (fa_workspace_size(FA_PASS_PROBS, &p, &tq, &tk, &tk, &ws) != FA_OK || ws == 0)
    tr_fail("fa_workspace_size(FA_PASS_PROBS): %zu bytes, %s", ws, fa_last_error());
  if (fa_attention_probs(&p, &tq, &tk, rows, cols, got) != FA_OK) {
    tr_fail("fa_attention_probs: %s", fa_last_error());
  } else {
    long bad = 0, neg = 0;
    for (size_t x = 0; x < n; x++) {
      bad += !(fabs((double)got[x] - ref[x]) <= 1e-6) || !signbit(got[x]) != !signbit(ref[x]);
      neg += signbit(got[x]) != 0;
    }
    if (bad) tr_fail("fa_attention_probs: %ld of %zu elements differ from the reference", bad, n);
    if (c->p > 0 && neg == 0) tr_fail("fa_attention_probs: dropout but no element dropped");
  }
  free(got), free(q), free(k);
}

static void t_ext_case(const void *arg) {
  const ecfg *c = arg;
  const uint64_t seed = tu_hash_str(tr_name());
  uint64_t rs = seed;
  const int B = c->nseq ? 1 : c->B, H = c->H, Hk = c->Hk, D = c->D, S = c->nseq ? c->nseq : c->B;
  const int Nq = c->nseq ? c->lq[0] + c->lq[1] + c->lq[2] : c->nq;
  const int Nk = c->nseq ? c->lk[0] + c->lk[1] + c->lk[2] : c->nk;
  const size_t nq_el = (size_t)(B * Nq * H * D), nk_el = (size_t)(B * Nk * Hk * D);
  const size_t nlse = (size_t)(B * H * Nq);
  ebufs e = {0};
  double *all = malloc(sizeof(double) * (3 * nq_el + 3 * nk_el + nlse));
  e.q = all, e.dout = e.q + nq_el, e.o = e.dout + nq_el, e.k = e.o + nq_el, e.v = e.k + nk_el;
  e.dk = e.v + nk_el, e.lse = e.dk + nk_el;
  for (size_t x = 0; x < nq_el; x++) e.q[x] = tu_round(2 * urand(&rs) - 1, c->dt);
  for (size_t x = 0; x < nq_el; x++) e.dout[x] = tu_round(2 * urand(&rs) - 1, c->dt);
  for (size_t x = 0; x < nk_el; x++) e.k[x] = tu_round(2 * urand(&rs) - 1, c->dt);
  for (size_t x = 0; x < nk_el; x++) e.v[x] = tu_round(2 * urand(&rs) - 1, c->dt);
  int maxq = c->nseq ? 0 : c->nq, maxk = c->nseq ? 0 : c->nk;
  for (int s = 0; s < c->nseq; s++) {
    if (c->lq[s] > maxq) maxq = c->lq[s];
    if (c->lk[s] > maxk) maxk = c->lk[s];
  }
  e.nbq = (maxq + c->bq - 1) / (c->bq ? c->bq : 1);
  e.nbk = (Nk + c->bk - 1) / (c->bk ? c->bk : 1); /* default row stride: k's seqlen */
  int32_t cuq[4] = {0}, cuk[4] = {0};
  for (int s = 0; s < c->nseq; s++) cuq[s + 1] = cuq[s] + c->lq[s], cuk[s + 1] = cuk[s] + c->lk[s];
  fa_params p = {0};
  p.causal = c->causal;
  p.dropout_p = c->p;
  p.dropout_seed = seed;
  p.dropout_offset = seed * 3;
  if (c->nseq) p.cu_seqlens_q = cuq, p.cu_seqlens_k = cuk, p.num_seqs = c->nseq;
  int32_t used[3] = {c->used[0], c->used[1], c->used[2]};
  if (c->kv) p.seqused_k = used;
  if (c->block) {
    size_t nbm = (size_t)((c->block == 2 ? 1 : S * H) * e.nbq * e.nbk);
    e.bm = malloc(nbm);
    for (size_t x = 0; x < nbm; x++) e.bm[x] = urand(&rs) < 0.5;
    if (c->block == 3) memset(e.bm, 0, (size_t)e.nbk); /* query block 0 of (0, 0) sees nothing */
    p.block_mask = e.bm;
    p.block_size_q = c->bq;
    p.block_size_k = c->bk;
    p.block_mask_stride_head = c->block == 2 ? 0 : e.nbq * e.nbk;
    p.block_mask_stride_batch = c->block == 2 ? 0 : H * e.nbq * e.nbk;
  }
  double *ro = malloc(sizeof(double) * (3 * nq_el + 3 * nk_el + nlse)), *rlse = ro + nq_el;
  double *rdq = rlse + nlse, *rdk = rdq + nq_el, *rdv = rdk + nk_el, *got = rdv + nk_el;
  /* the probabilities: room around every sequence's matrix, which must be 0 */
  const int prow = maxq + 3, pcol = maxk + 5;
  const size_t npr = (size_t)(S * H) * (size_t)prow * (size_t)pcol;
  double *rprobs = malloc(sizeof(double) * npr);
  ext_reference(c, &e, seed, ro, rlse, rdq, rdk, rdv, rprobs, prow, pcol);
  const double tol = c->dt == FA_DTYPE_F64 ? 1e-12 : c->dt == FA_DTYPE_F32 ? 1e-5 : 2e-2;

  for (int a = 0; a < EXT_NALGOS; a++) {
    p.algorithm = ext_algos[a];
    if (c->dt == FA_DTYPE_F64 && p.algorithm != FA_ALGO_STANDARD) continue; /* oracle-only dtype */
    void *q = to_dtype(e.q, nq_el, c->dt), *k = to_dtype(e.k, nk_el, c->dt);
    void *v = to_dtype(e.v, nk_el, c->dt), *dout = to_dtype(e.dout, nq_el, c->dt);
    void *o = to_dtype(e.q, nq_el, c->dt), *dq = to_dtype(e.q, nq_el, c->dt);
    void *dk = to_dtype(e.k, nk_el, c->dt), *dv = to_dtype(e.k, nk_el, c->dt);
    float *lse = malloc(sizeof(float) * nlse);
    memset(o, 0xFF, nq_el * tu_esize(c->dt)); /* poison: NaN in every float type */
    memset(dq, 0xFF, nq_el * tu_esize(c->dt));
    memset(dk, 0xFF, nk_el * tu_esize(c->dt));
    memset(dv, 0xFF, nk_el * tu_esize(c->dt));
    memset(lse, 0xFF, sizeof(float) * nlse);
    /* KV cache: the keys past each sequence's used ones hold NaN (never read) */
    for (int s = 0; c->kv && s < S; s++) {
      int b, q0, nq, k0, nk;
      eseq(c, s, &b, &q0, &nq, &k0, &nk);
      for (size_t x = (((size_t)b * Nk + k0 + nk) * Hk) * D;
           x < (((size_t)b * Nk + k0 + ecap(c, s)) * Hk) * D; x++)
        tu_store(k, c->dt, x, NAN), tu_store(v, c->dt, x, NAN);
    }
    fa_tensor tq = fa_tensor_bnhd(q, c->dt, B, Nq, H, D),
              tk = fa_tensor_bnhd(k, c->dt, B, Nk, Hk, D);
    fa_tensor tv = fa_tensor_bnhd(v, c->dt, B, Nk, Hk, D),
              to = fa_tensor_bnhd(o, c->dt, B, Nq, H, D);
    fa_tensor tdo = fa_tensor_bnhd(dout, c->dt, B, Nq, H, D);
    fa_tensor tdq = fa_tensor_bnhd(dq, c->dt, B, Nq, H, D);
    fa_tensor tdk = fa_tensor_bnhd(dk, c->dt, B, Nk, Hk, D);
    fa_tensor tdv = fa_tensor_bnhd(dv, c->dt, B, Nk, Hk, D);
    if (fa_forward(&p, &tq, &tk, &tv, &to, lse) != FA_OK)
      tr_fail("%s forward: %s", tu_algo_name(p.algorithm), fa_last_error());
    else if (fa_backward(&p, &tq, &tk, &tv, &to, &tdo, lse, &tdq, &tdk, &tdv) != FA_OK)
      tr_fail("%s backward: %s", tu_algo_name(p.algorithm), fa_last_error());
    else {
      struct {
        const char *name;
        void *m;
        const double *ref;
        size_t n;
      } outs[4] = {{"O", o, ro, nq_el},
                   {"dQ", dq, rdq, nq_el},
                   {"dK", dk, rdk, nk_el},
                   {"dV", dv, rdv, nk_el}};
      for (int t = 0; t < 4; t++) {
        from_dtype(got, outs[t].m, outs[t].n, c->dt);
        /* KV cache: dK, dV rows past the used keys stay as they were (poison) */
        for (int s = 0; c->kv && t >= 2 && s < S; s++) {
          int b, q0, nq, k0, nk;
          eseq(c, s, &b, &q0, &nq, &k0, &nk);
          for (size_t x = (((size_t)b * Nk + k0 + nk) * Hk) * D;
               x < (((size_t)b * Nk + k0 + ecap(c, s)) * Hk) * D; x++) {
            if (!isnan(got[x])) {
              tr_fail("%s %s: row past seqused_k written", tu_algo_name(p.algorithm), outs[t].name);
              break;
            }
            got[x] = 0; /* as the reference's */
          }
        }
        double err = rel_err(got, outs[t].ref, outs[t].n);
        if (!(err <= tol))
          tr_fail("%s %s: relative error %.3g > %.3g", tu_algo_name(p.algorithm), outs[t].name, err,
                  tol);
      }
      for (size_t x = 0; x < nlse; x++) {
        double r = rlse[x], g = lse[x];
        int ok = isinf(r) ? (isinf(g) && g < 0) : fabs(g - r) <= 1e-5 * (1 + fabs(r));
        if (!ok) {
          tr_fail("%s lse[%zu] = %g, want %g", tu_algo_name(p.algorithm), x, g, r);
          break;
        }
        if (isinf(r)) { /* a row that sees nothing: O = 0 exactly, its dQ too */
          size_t b = c->nseq ? 0 : x / (size_t)(H * Nq),
                 h = c->nseq ? x / (size_t)Nq : (x / (size_t)Nq) % (size_t)H;
          size_t i = x % (size_t)Nq;
          for (int d = 0; d < D; d++) {
            size_t ix = ((b * (size_t)Nq + i) * (size_t)H + h) * (size_t)D + (size_t)d;
            if (tu_load(o, c->dt, ix) != 0 || tu_load(dq, c->dt, ix) != 0) {
              tr_fail("fully masked row %zu: O or dQ not exactly 0", x);
              break;
            }
          }
        }
      }
    }
    free(q), free(k), free(v), free(dout), free(o), free(dq), free(dk), free(dv), free(lse);
  }
  ext_check_probs(c, &p, &e, B, Nq, Nk, rprobs, prow, pcol);
  free(rprobs);
  free(all);
  free(ro);
  free(e.bm);
}

/* A block mask of 1 x 1 blocks spelling out causal gives causal's results bitwise. */
static void t_block_is_causal(const void *arg) {
  (void)arg;
  const int N = 19, H = 2, D = 8;
  uint64_t rs = 7;
  const size_t n = (size_t)(N * H * D);
  double *x = malloc(sizeof(double) * 6 * n);
  for (size_t e = 0; e < 3 * n; e++) x[e] = 2 * urand(&rs) - 1;
  uint8_t bm[19 * 19];
  for (int i = 0; i < N; i++)
    for (int j = 0; j < N; j++) bm[i * N + j] = j <= i;
  fa_tensor tq = fa_tensor_bnhd(x, FA_DTYPE_F64, 1, N, H, D);
  fa_tensor tk = fa_tensor_bnhd(x + n, FA_DTYPE_F64, 1, N, H, D);
  fa_tensor tv = fa_tensor_bnhd(x + 2 * n, FA_DTYPE_F64, 1, N, H, D);
  fa_tensor o1 = fa_tensor_bnhd(x + 3 * n, FA_DTYPE_F64, 1, N, H, D);
  fa_tensor o2 = fa_tensor_bnhd(x + 4 * n, FA_DTYPE_F64, 1, N, H, D);
  fa_params pc = {0}, pb = {0};
  pc.algorithm = pb.algorithm = FA_ALGO_STANDARD;
  pc.causal = 1;
  pb.block_mask = bm;
  pb.block_size_q = pb.block_size_k = 1;
  if (fa_forward(&pc, &tq, &tk, &tv, &o1, NULL) != FA_OK ||
      fa_forward(&pb, &tq, &tk, &tv, &o2, NULL) != FA_OK)
    tr_fail("%s", fa_last_error());
  else if (memcmp(x + 3 * n, x + 4 * n, sizeof(double) * n) != 0)
    tr_fail("block mask spelling causal differs from causal");
  free(x);
}

/* block_mask_stride_row = 0 means ceil(k's seqlen / block_size_k), k's seqlen
 * being the tensor's: for a varlen batch the total of its sequences (11 keys
 * here: 3 blocks of 4 per row, where its longest sequence's 6 would give 2). */
static void t_block_row_stride_default(const void *arg) {
  (void)arg;
  const int H = 2, D = 8, nq = 11, nk = 11, bq = 3, bk = 4, nbq = 3, nbk = 3;
  const int32_t cq[3] = {0, 4, 11}, ck[3] = {0, 5, 11};
  uint64_t rs = 11;
  double x[3 * 11 * 2 * 8];
  for (size_t e = 0; e < sizeof x / sizeof x[0]; e++) x[e] = 2 * urand(&rs) - 1;
  uint8_t bm[2 * 2 * 3 * 3];
  for (size_t e = 0; e < sizeof bm; e++) bm[e] = urand(&rs) < 0.6;
  for (int a = 0; a < EXT_NALGOS; a++) {
    const fa_dtype dt = ext_algos[a] == FA_ALGO_STANDARD ? FA_DTYPE_F64 : FA_DTYPE_F32;
    void *q = to_dtype(x, (size_t)(nq * H * D), dt),
         *k = to_dtype(x + nq * H * D, (size_t)(nk * H * D), dt);
    void *v = to_dtype(x + 2 * nq * H * D, (size_t)(nk * H * D), dt);
    void *o[2] = {to_dtype(x, (size_t)(nq * H * D), dt), to_dtype(x, (size_t)(nq * H * D), dt)};
    float lse[2][2 * 11];
    fa_tensor tq = fa_tensor_bnhd(q, dt, 1, nq, H, D), tk = fa_tensor_bnhd(k, dt, 1, nk, H, D);
    fa_tensor tv = fa_tensor_bnhd(v, dt, 1, nk, H, D);
    fa_params p = {0};
    p.algorithm = ext_algos[a];
    p.cu_seqlens_q = cq, p.cu_seqlens_k = ck, p.num_seqs = 2;
    p.block_mask = bm, p.block_size_q = bq, p.block_size_k = bk;
    p.block_mask_stride_head = nbq * nbk, p.block_mask_stride_batch = H * nbq * nbk;
    for (int r = 0; r < 2; r++) {
      p.block_mask_stride_row = r ? nbk : 0;
      fa_tensor to = fa_tensor_bnhd(o[r], dt, 1, nq, H, D);
      if (fa_forward(&p, &tq, &tk, &tv, &to, lse[r]) != FA_OK)
        tr_fail("%s, row stride %d: %s", tu_algo_name(p.algorithm), r ? nbk : 0, fa_last_error());
    }
    if (memcmp(o[0], o[1], (size_t)(nq * H * D) * tu_esize(dt)) ||
        memcmp(lse[0], lse[1], sizeof lse[0]))
      tr_fail("%s: row stride 0 is not ceil(k's seqlen / block_size_k) = %d",
              tu_algo_name(p.algorithm), nbk);
    /* the longest sequence's key blocks are too few for a row: refused */
    p.block_mask_stride_row = 2;
    size_t bytes;
    if (fa_workspace_size(FA_PASS_FORWARD, &p, &tq, &tk, &tv, &bytes) != FA_ERR_INVALID_ARGUMENT)
      tr_fail("%s: row stride 2 (< %d key blocks of k's seqlen) accepted",
              tu_algo_name(p.algorithm), nbk);
    free(q), free(k), free(v), free(o[0]), free(o[1]);
  }
}

/* Block sizes as large as int64 allows: one block per row and column of the
 * mask, the same result as blocks of exactly the sequences' lengths (the
 * library's ceil divisions must not overflow: UBSan checks them in CI). */
static void t_block_size_huge(const void *arg) {
  (void)arg;
  const int H = 2, D = 8, nq = 5, nk = 7;
  uint64_t rs = 12;
  double x[(5 + 7 + 7) * 2 * 8];
  for (size_t e = 0; e < sizeof x / sizeof x[0]; e++) x[e] = 2 * urand(&rs) - 1;
  static const uint8_t bm[1] = {1};
  for (int a = 0; a < EXT_NALGOS; a++) {
    const fa_dtype dt = ext_algos[a] == FA_ALGO_STANDARD ? FA_DTYPE_F64 : FA_DTYPE_F32;
    void *q = to_dtype(x, (size_t)(nq * H * D), dt),
         *k = to_dtype(x + nq * H * D, (size_t)(nk * H * D), dt);
    void *v = to_dtype(x + (nq + nk) * H * D, (size_t)(nk * H * D), dt);
    void *o[2] = {to_dtype(x, (size_t)(nq * H * D), dt), to_dtype(x, (size_t)(nq * H * D), dt)};
    fa_tensor tq = fa_tensor_bnhd(q, dt, 1, nq, H, D), tk = fa_tensor_bnhd(k, dt, 1, nk, H, D);
    fa_tensor tv = fa_tensor_bnhd(v, dt, 1, nk, H, D);
    fa_params p = {0};
    p.algorithm = ext_algos[a];
    p.block_mask = bm;
    for (int r = 0; r < 2; r++) {
      p.block_size_q = r ? nq : INT64_MAX, p.block_size_k = r ? nk : INT64_MAX;
      fa_tensor to = fa_tensor_bnhd(o[r], dt, 1, nq, H, D);
      if (fa_forward(&p, &tq, &tk, &tv, &to, NULL) != FA_OK)
        tr_fail("%s, block sizes %s: %s", tu_algo_name(p.algorithm), r ? "nq, nk" : "INT64_MAX",
                fa_last_error());
    }
    if (memcmp(o[0], o[1], (size_t)(nq * H * D) * tu_esize(dt)))
      tr_fail("%s: blocks of INT64_MAX differ from blocks of the sequences' lengths",
              tu_algo_name(p.algorithm));
    free(q), free(k), free(v), free(o[0]), free(o[1]);
  }
}

/* Windows as wide as INT64_MAX on either side (clamped where the problem is
 * resolved, so the backends' sums with them stay in 64 bits; UBSan flags the
 * mask's ranges otherwise): bitwise the unlimited window's O, lse, dQ, dK and
 * dV, with and without a right edge at 0 */
static void t_window_huge(const void *arg) {
  (void)arg;
  const int H = 2, D = 8, nq = 5, nk = 7, nqe = nq * H * D, nke = nk * H * D;
  uint64_t rs = 13;
  double x[(5 + 7 + 7 + 5) * 2 * 8];
  for (size_t e = 0; e < sizeof x / sizeof x[0]; e++) x[e] = 2 * urand(&rs) - 1;
  for (int a = 0; a < EXT_NALGOS; a++) {
    const fa_dtype dt = ext_algos[a] == FA_ALGO_STANDARD ? FA_DTYPE_F64 : FA_DTYPE_F32;
    const size_t es = tu_esize(dt);
    void *q = to_dtype(x, (size_t)nqe, dt), *k = to_dtype(x + nqe, (size_t)nke, dt);
    void *v = to_dtype(x + nqe + nke, (size_t)nke, dt);
    void *dout = to_dtype(x + nqe + 2 * nke, (size_t)nqe, dt);
    fa_tensor tq = fa_tensor_bnhd(q, dt, 1, nq, H, D), tk = fa_tensor_bnhd(k, dt, 1, nk, H, D);
    fa_tensor tv = fa_tensor_bnhd(v, dt, 1, nk, H, D), tdo = fa_tensor_bnhd(dout, dt, 1, nq, H, D);
    for (int right0 = 0; right0 < 2; right0++) {
      void *out[2][4];
      float lse[2][5 * 2];
      for (int r = 0; r < 2; r++) {
        fa_params p = {0};
        p.algorithm = ext_algos[a];
        p.window_enabled = 1;
        p.window_left = r ? -1 : INT64_MAX;
        p.window_right = right0 ? 0 : r ? -1 : INT64_MAX;
        for (int t = 0; t < 4; t++) out[r][t] = calloc((size_t)(t == 0 || t == 1 ? nqe : nke), es);
        fa_tensor to = fa_tensor_bnhd(out[r][0], dt, 1, nq, H, D);
        fa_tensor tdq = fa_tensor_bnhd(out[r][1], dt, 1, nq, H, D);
        fa_tensor tdk = fa_tensor_bnhd(out[r][2], dt, 1, nk, H, D);
        fa_tensor tdv = fa_tensor_bnhd(out[r][3], dt, 1, nk, H, D);
        if (fa_forward(&p, &tq, &tk, &tv, &to, lse[r]) != FA_OK ||
            fa_backward(&p, &tq, &tk, &tv, &to, &tdo, lse[r], &tdq, &tdk, &tdv) != FA_OK)
          tr_fail("%s, window %s: %s", tu_algo_name(p.algorithm), r ? "-1" : "INT64_MAX",
                  fa_last_error());
      }
      const char *nm[4] = {"O", "dQ", "dK", "dV"};
      for (int t = 0; t < 4; t++)
        if (memcmp(out[0][t], out[1][t], (size_t)(t < 2 ? nqe : nke) * es))
          tr_fail("%s%s: %s of a window of INT64_MAX differs from the unlimited one's",
                  tu_algo_name(ext_algos[a]), right0 ? " (right 0)" : "", nm[t]);
      if (memcmp(lse[0], lse[1], sizeof lse[0]))
        tr_fail("%s: lse differs", tu_algo_name(ext_algos[a]));
      for (int r = 0; r < 2; r++)
        for (int t = 0; t < 4; t++) free(out[r][t]);
    }
    free(q), free(k), free(v), free(dout);
  }
}

static void t_indices(const void *arg) {
  (void)arg;
  const int32_t counts[3] = {2, 0, 3}, idx[3 * 4] = {3, 1, 9, 9, 9, 9, 9, 9, 0, 2, 4, 9};
  uint8_t m[3 * 5], m2[3 * 5];
  int32_t c2[3], i2[3 * 5];
  if (fa_block_mask_from_indices(counts, idx, 3, 4, 5, m) != FA_OK)
    return tr_fail("%s", fa_last_error());
  static const uint8_t want[15] = {0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 1};
  if (memcmp(m, want, 15)) tr_fail("from_indices: wrong dense mask");
  if (fa_block_mask_to_indices(m, 3, 5, c2, i2) != FA_OK) return tr_fail("%s", fa_last_error());
  if (fa_block_mask_from_indices(c2, i2, 3, 5, 5, m2) != FA_OK || memcmp(m, m2, 15))
    tr_fail("to_indices then from_indices is not the identity");
  if (c2[0] != 2 || i2[0] != 1 || i2[1] != 3) tr_fail("to_indices: row 0 should be {1, 3}");
  /* an index out of range is refused and nothing is written */
  const int32_t bad[3 * 4] = {3, 5, 9, 9, 9, 9, 9, 9, 0, 2, 4, 9};
  memset(m2, 0x77, sizeof m2);
  if (fa_block_mask_from_indices(counts, bad, 3, 4, 5, m2) != FA_ERR_INVALID_ARGUMENT)
    tr_fail("index 5 of 5 key blocks accepted");
  else if (!strstr(fa_last_error(), "indices"))
    tr_fail("message does not name indices: %s", fa_last_error());
  for (int e = 0; e < 15; e++)
    if (m2[e] != 0x77) return tr_fail("a refused conversion wrote to the mask");
  const int32_t neg[3] = {2, -1, 0};
  if (fa_block_mask_from_indices(neg, idx, 3, 4, 5, m2) != FA_ERR_INVALID_ARGUMENT)
    tr_fail("negative count accepted");
}

/* Bad dropout / block-mask arguments are refused naming the field; algorithms
 * without the feature say so. Outputs stay untouched. */
static void t_ext_validation(const void *arg) {
  (void)arg;
  const int N = 8, H = 2, D = 8;
  float *x = malloc(sizeof(float) * 4 * N * H * D);
  for (int e = 0; e < 4 * N * H * D; e++) x[e] = (float)(e % 13) / 13.0f;
  fa_tensor tq = fa_tensor_bnhd(x, FA_DTYPE_F32, 1, N, H, D);
  fa_tensor tk = fa_tensor_bnhd(x + N * H * D, FA_DTYPE_F32, 1, N, H, D);
  fa_tensor tv = fa_tensor_bnhd(x + 2 * N * H * D, FA_DTYPE_F32, 1, N, H, D);
  fa_tensor to = fa_tensor_bnhd(x + 3 * N * H * D, FA_DTYPE_F32, 1, N, H, D);
  uint8_t bm[64];
  memset(bm, 1, sizeof bm);
  struct {
    const char *what, *field;
    fa_status want;
    fa_params p;
  } cases[11];
  int n = 0;
  static const int32_t bad_used[2] = {N + 1, -1}; /* one sequence of N keys */
  for (int t = 0; t < 2; t++) {
    memset(&cases[n], 0, sizeof cases[n]);
    cases[n].what = "seqused_k outside [0, seqlen_k]", cases[n].field = "seqused_k";
    cases[n].want = FA_ERR_INVALID_ARGUMENT;
    cases[n].p.seqused_k = &bad_used[t];
    n++;
  }
  const float bad_p[3] = {1.0f, -0.1f, NAN};
  for (int t = 0; t < 3; t++) {
    memset(&cases[n], 0, sizeof cases[n]);
    cases[n].what = "dropout_p out of [0, 1)", cases[n].field = "dropout_p";
    cases[n].want = FA_ERR_INVALID_ARGUMENT;
    cases[n].p.algorithm = FA_ALGO_STANDARD, cases[n].p.dropout_p = bad_p[t];
    n++;
  }
  for (int t = 0; t < 3; t++) {
    memset(&cases[n], 0, sizeof cases[n]);
    cases[n].p.algorithm = FA_ALGO_STANDARD;
    cases[n].p.block_mask = bm;
    cases[n].p.block_size_q = cases[n].p.block_size_k = 4;
    cases[n].want = FA_ERR_INVALID_ARGUMENT;
    if (t == 0)
      cases[n].what = "block size 0", cases[n].field = "block_size", cases[n].p.block_size_k = 0;
    if (t == 1)
      cases[n].what = "negative stride", cases[n].field = "stride",
      cases[n].p.block_mask_stride_head = -1;
    if (t == 2)
      cases[n].what = "row stride < key blocks", cases[n].field = "stride_row",
      cases[n].p.block_mask_stride_row = 1;
    n++;
  }
  for (int t = 0; t < 3; t++) { /* algorithms that do not implement them yet */
    memset(&cases[n], 0, sizeof cases[n]);
    cases[n].p.algorithm = t == 2 ? FA_ALGO_FLASH1 : FA_ALGO_FLASH2;
    cases[n].want = FA_ERR_UNSUPPORTED;
    if (t == 1) {
      cases[n].what = "flash2 with a block mask", cases[n].field = "block_mask";
      cases[n].p.block_mask = bm, cases[n].p.block_size_q = cases[n].p.block_size_k = 4;
    } else {
      cases[n].what = "flash with dropout", cases[n].field = "dropout_p";
      cases[n].p.dropout_p = 0.5f;
    }
    n++;
  }
  for (int t = 0; t < n; t++) {
    int supported = 0;
    for (int a = 0; a < EXT_NALGOS; a++) supported |= ext_algos[a] == cases[t].p.algorithm;
    if (cases[t].want == FA_ERR_UNSUPPORTED && supported) continue;
    memset(x + 3 * N * H * D, 0x7F, sizeof(float) * N * H * D);
    fa_status st = fa_forward(&cases[t].p, &tq, &tk, &tv, &to, NULL);
    if (st != cases[t].want)
      tr_fail("%s: status %s, want %s", cases[t].what, fa_status_string(st),
              fa_status_string(cases[t].want));
    else if (!strstr(fa_last_error(), cases[t].field))
      tr_fail("%s: message does not name %s: %s", cases[t].what, cases[t].field, fa_last_error());
    const unsigned char *ob = (const unsigned char *)(x + 3 * N * H * D);
    for (size_t e = 0; e < sizeof(float) * N * H * D; e++)
      if (ob[e] != 0x7F) {
        tr_fail("%s: the output was written", cases[t].what);
        break;
      }
  }
  free(x);
}

/* fa_attention_probs refuses what does not fit, naming it, and writes nothing. */
static void t_probs_validation(const void *arg) {
  (void)arg;
  const int N = 8, H = 2, D = 8;
  float *x = malloc(sizeof(float) * (2 * N * H * D + 2 * H * N * N));
  for (int e = 0; e < 2 * N * H * D; e++) x[e] = (float)(e % 13) / 13.0f;
  fa_tensor tq = fa_tensor_bnhd(x, FA_DTYPE_F32, 1, N, H, D);
  fa_tensor tk = fa_tensor_bnhd(x + N * H * D, FA_DTYPE_F32, 1, N, H, D);
  float *out = x + 2 * N * H * D;
  fa_params p = {0};
  struct {
    const char *what, *field;
    int64_t rows, cols;
    float *probs;
  } cases[5] = {{"rows below seqlen_q", "rows", N - 1, N, out},
                {"cols below seqlen_k", "cols", N, N - 1, out},
                {"cols 0", "cols", N, 0, out},
                {"probs NULL", "probs", N, N, NULL},
                {"probs over k", "overlaps", N, N, x + N * H * D - 4}};
  for (int t = 0; t < 5; t++) {
    memset(out, 0x7F, sizeof(float) * H * N * N);
    const fa_status st =
        fa_attention_probs(&p, &tq, &tk, cases[t].rows, cases[t].cols, cases[t].probs);
    if (st != FA_ERR_INVALID_ARGUMENT)
      tr_fail("%s: status %s", cases[t].what, fa_status_string(st));
    else if (!strstr(fa_last_error(), cases[t].field))
      tr_fail("%s: message does not name %s: %s", cases[t].what, cases[t].field, fa_last_error());
    const unsigned char *ob = (const unsigned char *)out;
    for (size_t e = 0; e < sizeof(float) * H * N * N; e++)
      if (ob[e] != 0x7F) {
        tr_fail("%s: the output was written", cases[t].what);
        break;
      }
  }
  /* a fitting call: rows of probabilities that sum to 1 */
  if (fa_attention_probs(&p, &tq, &tk, N, N, out) != FA_OK) return tr_fail("%s", fa_last_error());
  for (int r = 0; r < H * N; r++) {
    double sum = 0;
    for (int j = 0; j < N; j++) sum += out[r * N + j];
    if (fabs(sum - 1) > 1e-5) return tr_fail("row %d sums to %.9g", r, sum);
  }
  free(x);
}

static void ext_add(const char *name, const ecfg *c) { tr_add(name, t_ext_case, c, sizeof *c, 0); }

void register_extension_tests(void) {
  tr_add("extensions/philox-kat", t_philox_kat, NULL, 0, 0);
  tr_add("extensions/dropout-mask-spec", t_mask_spec, NULL, 0, 0);
  tr_add("extensions/dropout-keep-rate", t_keep_rate, NULL, 0, 0);
  tr_add("extensions/block-mask-is-causal", t_block_is_causal, NULL, 0, 0);
  tr_add("extensions/block-mask-indices", t_indices, NULL, 0, 0);
  tr_add("extensions/block-mask-row-stride-default", t_block_row_stride_default, NULL, 0, 0);
  tr_add("extensions/block-size-huge", t_block_size_huge, NULL, 0, 0);
  tr_add("extensions/window-huge", t_window_huge, NULL, 0, 0);
  tr_add("extensions/validation", t_ext_validation, NULL, 0, 0);
  tr_add("extensions/probs-validation", t_probs_validation, NULL, 0, 0);
  const fa_dtype dts[3] = {FA_DTYPE_F64, FA_DTYPE_F32, FA_DTYPE_BF16};
  char name[128];
  for (int t = 0; t < 3; t++) {
    const char *dn = tu_dtype_name(dts[t]);
    ecfg c = {dts[t], 2, 4, 2, 37, 45, 16, 0, 0.3f, 0, 8, 8, 0, {0}, {0}, 0, {0}};
    snprintf(name, sizeof name, "extensions/dropout/%s/gqa/nq37-nk45", dn);
    ext_add(name, &c);
    c.causal = 1, c.nq = 45, c.nk = 37;
    snprintf(name, sizeof name, "extensions/dropout/%s/gqa/causal/nq45-nk37", dn);
    ext_add(name, &c);
    ecfg b = {dts[t], 2, 3, 3, 41, 50, 16, 0, 0, 1, 8, 16, 0, {0}, {0}, 0, {0}};
    snprintf(name, sizeof name, "extensions/block/%s/per-head/bq8-bk16", dn);
    ext_add(name, &b);
    b.block = 2, b.causal = 1, b.bq = 16, b.bk = 8;
    snprintf(name, sizeof name, "extensions/block/%s/broadcast/causal/bq16-bk8", dn);
    ext_add(name, &b);
    b.block = 3, b.causal = 0, b.p = 0.2f, b.bq = 5, b.bk = 7;
    snprintf(name, sizeof name, "extensions/block+dropout/%s/empty-rows/bq5-bk7", dn);
    ext_add(name, &b);
    /* many tiles: whole-tile skips (aligned blocks) and per-element masks (not aligned) */
    ecfg big = {dts[t], 1, 2, 1, 300, 333, 32, 0, 0, 1, 64, 64, 0, {0}, {0}, 0, {0}};
    snprintf(name, sizeof name, "extensions/block/%s/n300-333/bq64-bk64", dn);
    ext_add(name, &big);
    big.causal = 1, big.p = 0.1f, big.bq = 48, big.bk = 80;
    snprintf(name, sizeof name, "extensions/block+dropout/%s/n300-333/causal/bq48-bk80", dn);
    ext_add(name, &big);
    /* decode shapes (the CPU's split-K path): one and three query rows, GQA */
    ecfg d = {dts[t], 2, 4, 2, 1, 1100, 16, 0, 0.3f, 0, 8, 8, 0, {0}, {0}, 0, {0}};
    snprintf(name, sizeof name, "extensions/dropout/%s/decode/nq1-nk1100", dn);
    ext_add(name, &d);
    d.nq = 3, d.causal = 1, d.p = 0.2f, d.block = 1, d.bq = 2, d.bk = 48;
    snprintf(name, sizeof name, "extensions/block+dropout/%s/decode/causal/nq3-nk1100", dn);
    ext_add(name, &d);
    ecfg v = {dts[t], 1, 2, 1, 0, 0, 16, 1, 0.25f, 1, 4, 4, 3, {9, 0, 14}, {12, 5, 6}, 0, {0}};
    snprintf(name, sizeof name, "extensions/block+dropout/%s/varlen/causal", dn);
    ext_add(name, &v);
    /* KV caches (seqused_k): NaN past the used keys; decode (the CPU's split-K
     * path, GQA), prefill-style rows, varlen, with dropout and block masks */
    ecfg kv = {dts[t], 3, 4, 2, 1, 1100, 16, 1, 0, 0, 8, 8, 0, {0}, {0}, 1, {700, 1100, 0}};
    snprintf(name, sizeof name, "extensions/kvcache/%s/decode/causal/used700-1100-0", dn);
    ext_add(name, &kv);
    kv.nq = 13, kv.nk = 90, kv.used[0] = 57, kv.used[1] = 13, kv.used[2] = 90, kv.p = 0.2f;
    snprintf(name, sizeof name, "extensions/kvcache+dropout/%s/nq13/causal/used57-13-90", dn);
    ext_add(name, &kv);
    kv.block = 1, kv.bq = 4, kv.bk = 16, kv.causal = 0;
    snprintf(name, sizeof name, "extensions/kvcache+block+dropout/%s/nq13/used57-13-90", dn);
    ext_add(name, &kv);
    ecfg kvv = {dts[t], 1, 2, 1, 0, 0, 16, 1, 0, 0, 4, 4, 3, {9, 0, 14}, {40, 5, 60}, 1, {7, 5, 0}};
    snprintf(name, sizeof name, "extensions/kvcache/%s/varlen/causal/used7-5-0", dn);
    ext_add(name, &kvv);
  }
}
