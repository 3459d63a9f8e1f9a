/* Standard attention (Algorithm 0) in float32 for f32/f16/bf16 storage: the
 * benchmark baseline, made as fast as the algorithm allows so that flash vs
 * standard is a fair comparison. Per (sequence, query head) S = scale Q K^T
 * and P = softmax(S) are materialised (Nq x Nk); the products are the
 * register-tiled gemm of common/kern.h, blocked here for the cache, and the
 * softmax its vectorised row kernel. Softcap, ALiBi, windows, block masks and
 * dropout apply to the materialised matrices; P is rounded to the storage
 * type, as Algorithm 0 writes it to memory. Products skip the 16-column panels
 * that a band of rows cannot see (causal, windows); masked entries of P are 0.
 * The float64 oracle stays the simple code of standard_impl.h.
 *
 * Forward, per (sequence, query head): P as above, O = P V.
 * Backward, per (sequence, K/V head), so dK and dV have one writer each: for
 * every query head of the group P is rebuilt exactly as the forward builds it,
 * Di = rowsum(dO o O), dP = dO V^T (times dropout's Z), dS = P o (dP - Di)
 * [o (1 - tanh^2) with softcap], then dV += (Z o P)^T dO, dK += dS^T Q and
 * dQ = dS K (dK and dQ times scale on the way out); dS is materialised too.
 *
 * Workspace per thread (floats, each buffer rounded up to 64 bytes; Dp = D
 * rounded up to 8, Nkp = Nk rounded up to 16): forward Q and O (Nq x Dp), K^T
 * (Nkp x D, 16-wide panels), V (Nk x Dp), P (Nq x Nkp); backward Q, dO, dQ
 * (Nq x Dp), K^T and V^T (Nkp x D), K, dK, dV (Nk x Dp), P and dS (Nq x Nkp),
 * with softcap T (Nq x Nkp), Di (Nq); int32 ranges: two of Nq, two of
 * max(Nq, Nk), backward two of Nk. */
#include "ref/standard_fast.h"

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "backend.h"
#include "common/convert.h"
#include "common/kern.h"
#include "common/mask.h"
#include "common/philox.h"

/* Blocking (measured on a Zen 3 core, N = 4096, D = 64 and 128; flat within
 * ~3% from 192 to 256 along k and 24 to 96 along m): rows per band of
 * S = Q K^T, and k and m per call of the D-wide products. */
#define SF_RB 64
#define SF_KC 256
#define SF_MC 48

typedef struct sf_bufs {
  float *Q, *O, *KT, *V, *P;              /* forward (Q, K^T, P also backward) */
  float *dO, *dQ, *VT, *K, *dK, *dV, *dS; /* backward */
  float *T, *Di;                          /* backward: tanh of softcap, rowsum(dO o O) */
  int32_t *lo, *hi;                       /* per query row: visible keys [lo, hi) */
  int32_t *clo, *chi;                     /* backward, per key: query rows that see it */
  int32_t *lo2, *hi2;                     /* ranges within a block of sf_gemm_nd */
} sf_bufs;

static void *sf_take(char *base, size_t *off, int64_t nfloats) {
  void *p = base ? base + *off : NULL;
  *off += ((size_t)nfloats * sizeof(float) + 63) & ~(size_t)63;
  return p;
}

/* Carves one thread's buffers of the pass out of base (NULL: size only). */
static size_t sf_layout(const fa_problem *pb, int bwd, char *base, sf_bufs *b) {
  const int64_t D = pb->headdim, Dp = fa_round_up(D, FA_VL);
  const int64_t nq = pb->max_seqlen_q, nk = pb->max_seqlen_k, nkp = fa_round_up(nk, 16);
  const int64_t fw = bwd ? 0 : 1, bw = bwd ? 1 : 0, cap = bwd && pb->params->softcap > 0.0f;
  size_t off = 0;
  sf_bufs t;
  t.Q = sf_take(base, &off, nq * Dp);
  t.O = sf_take(base, &off, fw * nq * Dp);
  t.KT = sf_take(base, &off, nkp * D);
  t.V = sf_take(base, &off, fw * nk * Dp);
  t.P = sf_take(base, &off, nq * nkp);
  t.dO = sf_take(base, &off, bw * nq * Dp);
  t.dQ = sf_take(base, &off, bw * nq * Dp);
  t.VT = sf_take(base, &off, bw * nkp * D);
  t.K = sf_take(base, &off, bw * nk * Dp);
  t.dK = sf_take(base, &off, bw * nk * Dp);
  t.dV = sf_take(base, &off, bw * nk * Dp);
  t.dS = sf_take(base, &off, bw * nq * nkp);
  t.T = sf_take(base, &off, cap * nq * nkp);
  t.Di = sf_take(base, &off, bw * nq);
  t.lo = sf_take(base, &off, nq);
  t.hi = sf_take(base, &off, nq);
  t.clo = sf_take(base, &off, bw * nk);
  t.chi = sf_take(base, &off, bw * nk);
  t.lo2 = sf_take(base, &off, nq > nk ? nq : nk);
  t.hi2 = sf_take(base, &off, nq > nk ? nq : nk);
  if (b) *b = t;
  return off;
}

/* Work units: (sequence, query head) forward, (sequence, K/V head) backward. */
static int64_t sf_units(const fa_problem *pb, int bwd) {
  return pb->batch * (bwd ? pb->heads_k : pb->heads_q);
}

static int sf_threads(const fa_problem *pb, int bwd) {
  const int64_t units = sf_units(pb, bwd);
  return (int)(units < 1 ? 1 : units < pb->num_threads ? units : pb->num_threads);
}

size_t fa_ref_fast_forward_workspace(const fa_problem *pb) {
  return (size_t)sf_threads(pb, 0) * sf_layout(pb, 0, NULL, NULL);
}

size_t fa_ref_fast_backward_workspace(const fa_problem *pb) {
  return (size_t)sf_threads(pb, 1) * sf_layout(pb, 1, NULL, NULL);
}

/* Panel width of a row-major Dp-column B operand (V, dO, Q, K in the products
 * whose result is D wide): 2 or 3 vectors, whichever divides D's vectors. */
static int sf_dbw(int64_t Dp) {
  const int64_t nv = Dp / FA_VL;
  return nv % 2 != 0 && nv % 3 == 0 ? 3 * FA_VL : 2 * FA_VL;
}

static const char *sf_row(const fa_problem *pb, const fa_tensor *t, int64_t b, int64_t n,
                          int64_t h) {
  return (const char *)t->data + fa_tensor_offset(t, b, n, h) * (int64_t)fa_dtype_size(pb->dtype);
}

/* Rows [0, n) of head h of tensor t (sequence start b, r0) to float32 rows of Dp. */
static void sf_load_rows(const fa_problem *pb, const fa_kern *kn, float *dst, const fa_tensor *t,
                         int64_t b, int64_t r0, int64_t h, int64_t n) {
  const int64_t Dp = fa_round_up(pb->headdim, FA_VL);
  kn->load_panels(dst, (int)Dp, 0, sf_row(pb, t, b, r0, h),
                  t->stride_seq * (int64_t)fa_dtype_size(pb->dtype), pb->dtype, n, pb->headdim);
}

/* The same, transposed into 16-wide panels (Nkp x D): the B operand of X Y^T. */
static void sf_load_rows_t(const fa_problem *pb, const fa_kern *kn, float *dst, const fa_tensor *t,
                           int64_t b, int64_t r0, int64_t h, int64_t n) {
  kn->load_panels_t(dst, 16, 16 * pb->headdim, sf_row(pb, t, b, r0, h),
                    t->stride_seq * (int64_t)fa_dtype_size(pb->dtype), pb->dtype, n, pb->headdim);
}

/* Keys [j, j + n) of K^T (16-wide panels) and V, rows kr.. of batch entry kb. */
static void sf_load_kv_run(const fa_problem *pb, const fa_kern *kn, sf_bufs *b, int64_t kb,
                           int64_t kr, int64_t hk, int64_t j, int64_t n) {
  const int64_t Dp = fa_round_up(pb->headdim, FA_VL);
  if (j % 16 == 0) {
    sf_load_rows_t(pb, kn, b->KT + j * pb->headdim, &pb->k, kb, kr, hk, n);
  } else { /* a run starting inside a panel: row by row */
    float row[FA_MAX_HEADDIM];
    for (int64_t r = 0; r < n; r++) {
      fa_load_row_f32(row, sf_row(pb, &pb->k, kb, kr + r, hk), pb->dtype, pb->headdim);
      const int64_t jr = j + r;
      for (int64_t d = 0; d < pb->headdim; d++)
        b->KT[jr / 16 * 16 * pb->headdim + d * 16 + jr % 16] = row[d];
    }
  }
  sf_load_rows(pb, kn, b->V + j * Dp, &pb->v, kb, kr, hk, n);
}

/* Columns [*c0, *c1) of rows [i0, i0+n): the 16-wide panels that hold their
 * visible keys (row ranges are non-decreasing in the row). */
static void sf_band(const sf_bufs *b, int64_t i0, int64_t n, int64_t *c0, int64_t *c1) {
  *c0 = b->lo[i0] / 16 * 16;
  *c1 = fa_round_up(b->hi[i0 + n - 1], 16);
  if (*c1 < *c0) *c1 = *c0;
}

/* X (nq x Nkp) = alpha A B^T with A (nq x Dp rows) and B^T in 16-wide panels,
 * on each block of SF_RB rows' band of visible keys only (other entries are
 * left as they are: masked, never read). */
static void sf_gemm_nt(const fa_problem *pb, const fa_kern *kn, const sf_bufs *b, float *X,
                       const float *A, const float *BT, int64_t nq, int64_t nk, float alpha) {
  const int64_t D = pb->headdim, Dp = fa_round_up(D, FA_VL), nkp = fa_round_up(nk, 16);
  for (int64_t i0 = 0; i0 < nq; i0 += SF_RB) {
    const int64_t mr = nq - i0 < SF_RB ? nq - i0 : SF_RB;
    int64_t c0, c1;
    sf_band(b, i0, mr, &c0, &c1);
    const fa_gemm g = {mr, c1 - c0,           D,   A + i0 * Dp, Dp, 1,    BT + c0 * D, 16,  16 * D,
                       16, X + i0 * nkp + c0, nkp, alpha,       0,  NULL, NULL,        NULL};
    if (c1 > c0) kn->gemm(&g);
  }
}

/* C (m x Dp; beta 0: =, 1: +=) A B with A(i, p) = a[i*rsa + p*csa] (m x k) and
 * B row-major k x Dp; row i sums p in [klo[i], khi[i]) only (masked rows of B
 * may hold inf/NaN). Blocked SF_KC along k and SF_MC along m, so a block of A
 * (strided along k in P^T dO and dS^T Q) and SF_KC rows of B stay in cache
 * across the panels of C; lo2/hi2 (m) take the ranges within a block. */
static void sf_gemm_nd(const fa_problem *pb, const fa_kern *kn, float *C, int beta, int64_t m,
                       int64_t k, const float *a, int64_t rsa, int64_t csa, const float *B,
                       const int32_t *klo, const int32_t *khi, int32_t *lo2, int32_t *hi2) {
  const int64_t Dp = fa_round_up(pb->headdim, FA_VL);
  const int bw = sf_dbw(Dp);
  if (k == 0 && !beta) memset(C, 0, (size_t)(m * Dp) * sizeof(float));
  for (int64_t p0 = 0; p0 < k; p0 += SF_KC) {
    const int64_t kc = k - p0 < SF_KC ? k - p0 : SF_KC;
    for (int64_t i = 0; i < m; i++) {
      const int64_t lo = klo[i] - p0, hi = khi[i] - p0;
      lo2[i] = (int32_t)(lo < 0 ? 0 : lo > kc ? kc : lo);
      hi2[i] = (int32_t)(hi < lo2[i] ? lo2[i] : hi > kc ? kc : hi);
    }
    for (int64_t i0 = 0; i0 < m; i0 += SF_MC) {
      const int64_t mc = m - i0 < SF_MC ? m - i0 : SF_MC;
      const fa_gemm g = {
          mc,          Dp, kc,   a + i0 * rsa + p0 * csa, rsa,  csa,      B + p0 * Dp, Dp, bw, bw,
          C + i0 * Dp, Dp, 1.0f, beta || p0 > 0,          NULL, lo2 + i0, hi2 + i0};
      kn->gemm(&g);
    }
  }
}

/* X (nq rows, ld) *= dropout's Z of query head h of sequence s, each row over
 * its visible keys [lo, hi) (elsewhere P is 0 already). */
static void sf_dropout(const fa_problem *pb, const fa_kern *kn, float *X, int64_t ld, int64_t nq,
                       const int32_t *lo, const int32_t *hi, int64_t s, int64_t h) {
  const fa_params *pr = pb->params;
  const fa_dropout dr = fa_dropout_make(pr->dropout_p, pr->dropout_seed, pr->dropout_offset);
  const uint64_t bh = (uint64_t)(s * pb->heads_q + h);
  for (int64_t i = 0; i < nq; i++)
    if (lo[i] < hi[i]) kn->dropout(X + i * ld + lo[i], 0, 1, 1, hi[i] - lo[i], bh, i, lo[i], &dr);
}

/* P (b->P, nq x Nkp) = softmax of the masked, capped, biased scores scale Q K^T of
 * query head h of sequence s, from b->Q and b->KT loaded and b->lo/hi set;
 * entries outside a row's [lo, hi) and block-masked ones are 0, P is rounded
 * to the storage type. lse (nq) receives each row's log-sum-exp; T (or NULL),
 * with softcap, tanh(scale qk / cap) over [lo, hi) for the backward. */
static void sf_probs(const fa_problem *pb, const fa_kern *kn, sf_bufs *b, const fa_seq *sq,
                     const fa_mask *mk, int64_t s, int64_t h, float *lse, float *T) {
  const fa_params *pr = pb->params;
  const int64_t nq = sq->nq, nk = sq->nk, nkp = fa_round_up(nk, 16);
  if (nk > 0) sf_gemm_nt(pb, kn, b, b->P, b->Q, b->KT, nq, nk, pb->scale);
  const float cap = pr->softcap;
  const float slope = pr->alibi_slopes ? pr->alibi_slopes[s * pr->alibi_stride_batch + h] : 0.0f;
  for (int64_t i = 0; i < nq; i++) {
    float *row = b->P + i * nkp;
    if (cap > 0.0f) {
      const float inv = 1.0f / cap;
      for (int64_t j = b->lo[i]; j < b->hi[i]; j++) {
        const float t = tanhf(row[j] * inv);
        row[j] = cap * t;
        if (T) T[i * nkp + j] = t;
      }
    }
    if (slope != 0.0f)
      for (int64_t j = b->lo[i]; j < b->hi[i]; j++) row[j] += fa_alibi_bias(mk, slope, i, j);
    const uint8_t *brow = fa_problem_block_row(pb, s, h, i);
    if (brow)
      for (int64_t j = b->lo[i]; j < b->hi[i]; j++)
        if (!brow[j / pr->block_size_k]) row[j] = -INFINITY;
  }
  kn->softmax_rows(b->P, nkp, nq, nkp, b->lo, b->hi, lse);
  if (pb->dtype != FA_DTYPE_F32)
    for (int64_t i = 0; i < nq; i++) /* P as Algorithm 0 stores it */
      for (int64_t j = b->lo[i]; j < b->hi[i]; j++) {
        float *x = b->P + i * nkp + j;
        *x = pb->dtype == FA_DTYPE_F16 ? fa_f16_to_f32(fa_f32_to_f16(*x))
                                       : fa_bf16_to_f32(fa_f32_to_bf16(*x));
      }
}

/* Each query row's visible keys [lo, hi) (with nk = 0: empty). */
static void sf_row_ranges(const fa_mask *mk, int64_t nq, int32_t *lo, int32_t *hi) {
  for (int64_t i = 0; i < nq; i++) {
    int64_t a, z;
    fa_mask_row_range(mk, i, &a, &z);
    lo[i] = (int32_t)a;
    hi[i] = (int32_t)z;
  }
}

static fa_mask sf_mask(const fa_problem *pb, const fa_seq *sq) {
  const fa_params *pr = pb->params;
  return fa_mask_make(sq->nq, sq->nk, pr->causal, pr->window_enabled, pr->window_left,
                      pr->window_right);
}

static void sf_unit(const fa_problem *pb, const fa_kern *kn, sf_bufs *b, int64_t s, int64_t h) {
  const fa_seq sq = fa_problem_seq(pb, s);
  const int64_t D = pb->headdim, Dp = fa_round_up(D, FA_VL), nq = sq.nq, nk = sq.nk;
  const int64_t nkp = fa_round_up(nk, 16), hk = h / pb->group;
  const fa_mask mk = sf_mask(pb, &sq);
  if (nq == 0) return;
  sf_load_rows(pb, kn, b->Q, &pb->q, sq.qb, sq.q0, h, nq);
  sf_row_ranges(&mk, nq, b->lo, b->hi);
  if (nk > 0) { /* in runs of consecutive rows (a paged cache's pages) */
    for (int64_t j = 0; j < nk;) {
      int64_t kb, kr, n = fa_problem_krow(pb, &sq, j, &kb, &kr);
      if (n > nk - j) n = nk - j;
      sf_load_kv_run(pb, kn, b, kb, kr, hk, j, n);
      j += n;
    }
    for (int64_t jr = nk; jr < nkp; jr++) /* K^T's last panel past the keys: 0 */
      for (int64_t d = 0; d < D; d++) b->KT[jr / 16 * 16 * D + d * 16 + jr % 16] = 0.0f;
  }
  float *lse = pb->lse ? pb->lse + sq.lse0 + h * sq.lse_head_stride : b->O;
  sf_probs(pb, kn, b, &sq, &mk, s, h, lse, NULL);
  if (pb->params->dropout_p > 0.0f) sf_dropout(pb, kn, b->P, nkp, nq, b->lo, b->hi, s, h);
  /* O = P V over each row's visible keys only (masked V rows may hold inf/NaN) */
  sf_gemm_nd(pb, kn, b->O, 0, nq, nk, b->P, nkp, 1, b->V, b->lo, b->hi, b->lo2, b->hi2);
  for (int64_t i = 0; i < nq; i++)
    kn->store_row((char *)sf_row(pb, &pb->o, sq.qb, sq.q0 + i, h), b->O + i * Dp, 1.0f, pb->dtype,
                  D);
}

fa_status fa_ref_fast_forward(const fa_problem *pb) {
  const fa_kern *kn = fa_kern_get();
  const int64_t units = sf_units(pb, 0);
  const size_t slice = sf_layout(pb, 0, NULL, NULL);
#pragma omp parallel for num_threads(sf_threads(pb, 0)) schedule(dynamic, 1)
  for (int64_t u = 0; u < units; u++) {
    sf_bufs b;
    sf_layout(pb, 0, (char *)pb->workspace + (size_t)omp_get_thread_num() * slice, &b);
    sf_unit(pb, kn, &b, u / pb->heads_q, u % pb->heads_q);
  }
  return FA_OK;
}

/* Query head h of the backward unit: dQ stored, dK (unscaled) and dV accumulated. */
static void sf_bwd_head(const fa_problem *pb, const fa_kern *kn, sf_bufs *b, const fa_seq *sq,
                        const fa_mask *mk, int64_t s, int64_t h) {
  const fa_params *pr = pb->params;
  const int64_t D = pb->headdim, Dp = fa_round_up(D, FA_VL), nq = sq->nq, nk = sq->nk;
  const int64_t nkp = fa_round_up(nk, 16);
  float *T = pr->softcap > 0.0f ? b->T : NULL;
  sf_load_rows(pb, kn, b->Q, &pb->q, sq->qb, sq->q0, h, nq);
  sf_load_rows(pb, kn, b->dO, &pb->dout, sq->qb, sq->q0, h, nq);
  sf_probs(pb, kn, b, sq, mk, s, h, b->Di, T); /* its lse lands in Di, overwritten below */
  sf_load_rows(pb, kn, b->dQ, &pb->o, sq->qb, sq->q0, h, nq); /* O, until dQ replaces it */
  for (int64_t i = 0; i < nq; i++) b->Di[i] = kn->rowdot(b->dO + i * Dp, b->dQ + i * Dp, D);
  if (nk > 0) {
    /* dropout (docs/DROPOUT.md): dS = P o (Z o dP - Di), and dV takes Z o P */
    sf_gemm_nt(pb, kn, b, b->dS, b->dO, b->VT, nq, nk, 1.0f);
    if (pr->dropout_p > 0.0f) sf_dropout(pb, kn, b->dS, nkp, nq, b->lo, b->hi, s, h);
    for (int64_t i0 = 0; i0 < nq; i0 += SF_RB) {
      const int64_t mr = nq - i0 < SF_RB ? nq - i0 : SF_RB;
      int64_t c0, c1;
      sf_band(b, i0, mr, &c0, &c1);
      const int64_t o = i0 * nkp + c0;
      kn->dsoftmax(b->dS + o, b->P + o, nkp, mr, c1 - c0, b->Di + i0, T ? T + o : NULL);
    }
    if (pr->dropout_p > 0.0f) sf_dropout(pb, kn, b->P, nkp, nq, b->lo, b->hi, s, h);
    /* dV += (Z o P)^T dO, dK += dS^T Q over the rows that see each key */
    sf_gemm_nd(pb, kn, b->dV, 1, nk, nq, b->P, 1, nkp, b->dO, b->clo, b->chi, b->lo2, b->hi2);
    sf_gemm_nd(pb, kn, b->dK, 1, nk, nq, b->dS, 1, nkp, b->Q, b->clo, b->chi, b->lo2, b->hi2);
  }
  /* dQ = dS K over each row's visible keys (0 for a row that sees none) */
  sf_gemm_nd(pb, kn, b->dQ, 0, nq, nk, b->dS, nkp, 1, b->K, b->lo, b->hi, b->lo2, b->hi2);
  for (int64_t i = 0; i < nq; i++)
    kn->store_row((char *)sf_row(pb, &pb->dq, sq->qb, sq->q0 + i, h), b->dQ + i * Dp, pb->scale,
                  pb->dtype, D);
}

/* Backward of K/V head hk of sequence s: every query head of its group. */
static void sf_bwd_unit(const fa_problem *pb, const fa_kern *kn, sf_bufs *b, int64_t s,
                        int64_t hk) {
  const fa_seq sq = fa_problem_seq(pb, s);
  const int64_t D = pb->headdim, Dp = fa_round_up(D, FA_VL), nk = sq.nk;
  const fa_mask mk = sf_mask(pb, &sq);
  sf_row_ranges(&mk, sq.nq, b->lo, b->hi);
  for (int64_t j = 0; j < nk; j++) {
    int64_t a, z;
    fa_mask_col_range(&mk, j, &a, &z);
    b->clo[j] = (int32_t)a;
    b->chi[j] = (int32_t)z;
  }
  if (nk > 0) {
    sf_load_rows_t(pb, kn, b->KT, &pb->k, sq.kb, sq.k0, hk, nk);
    sf_load_rows_t(pb, kn, b->VT, &pb->v, sq.kb, sq.k0, hk, nk);
    sf_load_rows(pb, kn, b->K, &pb->k, sq.kb, sq.k0, hk, nk);
  }
  memset(b->dK, 0, (size_t)(nk * Dp) * sizeof(float));
  memset(b->dV, 0, (size_t)(nk * Dp) * sizeof(float));
  if (sq.nq > 0)
    for (int64_t h = hk * pb->group; h < (hk + 1) * pb->group; h++)
      sf_bwd_head(pb, kn, b, &sq, &mk, s, h);
  for (int64_t j = 0; j < nk; j++) {
    kn->store_row((char *)sf_row(pb, &pb->dk, sq.kb, sq.k0 + j, hk), b->dK + j * Dp, pb->scale,
                  pb->dtype, D);
    kn->store_row((char *)sf_row(pb, &pb->dv, sq.kb, sq.k0 + j, hk), b->dV + j * Dp, 1.0f,
                  pb->dtype, D);
  }
}

fa_status fa_ref_fast_backward(const fa_problem *pb) {
  const fa_kern *kn = fa_kern_get();
  const int64_t units = sf_units(pb, 1);
  const size_t slice = sf_layout(pb, 1, NULL, NULL);
#pragma omp parallel for num_threads(sf_threads(pb, 1)) schedule(dynamic, 1)
  for (int64_t u = 0; u < units; u++) {
    sf_bufs b;
    sf_layout(pb, 1, (char *)pb->workspace + (size_t)omp_get_thread_num() * slice, &b);
    sf_bwd_unit(pb, kn, &b, u / pb->heads_k, u % pb->heads_k);
  }
  return FA_OK;
}
