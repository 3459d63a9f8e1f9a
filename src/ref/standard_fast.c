/* Standard attention (Algorithm 0) in float32 for f32/f16/bf16 storage: the
 * benchmark baseline as the papers run it (PyTorch's softmax(Q K^T) V): every
 * step is one pass over the whole batch, each writing its B x H x Nq x Nk
 * matrix to memory before the next reads it, so the baseline has its real
 * memory footprint and traffic. The products are the register-tiled gemm of
 * common/kern.h, blocked here for the cache, the softmax its vectorised row
 * kernel; every pass runs on all threads (work items: a head's rows, or keys,
 * split in parts when there are fewer heads than threads). Softcap, ALiBi,
 * windows, block masks and dropout apply to the materialised matrices; P is
 * rounded to the storage type, as Algorithm 0 writes it to memory. Products
 * skip the 16-column panels that a band of rows cannot see (causal, windows);
 * masked entries of P are 0. The float64 oracle stays the simple code of
 * standard_impl.h.
 *
 * Forward: S = scale Q K^T (softcap, ALiBi, block mask applied); P = softmax(S)
 * (times dropout's Z), lse; O = P V.
 * Backward (P recomputed from Q and K, as the API keeps only lse): P and
 * Di = rowsum(dO o O); dP = dO V^T (times Z) and in place dS = P o (dP - Di)
 * [o (1 - tanh^2) with softcap]; dV = sum over the group's query heads of
 * (Z o P)^T dO and dK = dS^T Q (per K/V head: one writer each); dQ = dS K.
 *
 * Workspace (floats, each buffer rounded up to 64 bytes; Dp = D rounded up to 8,
 * Nkp = Nk rounded up to 16, U = batch x query heads): forward S and P, backward
 * P and dS (and with softcap T, tanh of the capped scores), each U x Nq x Nkp,
 * backward Di (U x Nq); per thread forward Q and O (Nq x Dp), K^T (Nkp x D),
 * V (Nk x Dp), backward Q, dO, dQ (Nq x Dp), K^T and V^T (Nkp x D), K, dK, dV
 * (Nk x Dp); int32 ranges: two of Nq, two of max(Nq, Nk), backward two of Nk. */
#include "ref/standard_fast.h"

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "backend.h"
#include "common/convert.h"
#include "common/dtype.h"
#include "common/kern.h"
#include "common/mask.h"
#include "common/philox.h"

/* Blocking (measured on a Zen 3 core, N = 4096, D = 64 and 128; flat within
 * ~3% from 192 to 256 along k and 24 to 96 along m): rows per band of
 * S = Q K^T, and k and m per call of the D-wide products. */
#define SF_RB 64
#define SF_KC 256
#define SF_MC 48
/* Parts of a head start at multiples of this (of SF_RB and SF_MC): every band and
 * block of the products is the same as in one part, so the result does not depend
 * on the thread count, bit for bit. */
#define SF_PART 192

/* The whole-batch matrices, U x Nq x Nkp each (NULL where the pass has none). */
typedef struct sf_mats {
  float *S, *P, *dS, *T, *Di;
} sf_mats;

/* One thread's buffers. */
typedef struct sf_bufs {
  float *Q, *O, *KT, *V;             /* forward (Q, K^T also backward) */
  float *dO, *dQ, *VT, *K, *dK, *dV; /* backward */
  int32_t *lo, *hi;                  /* per query row: visible keys [lo, hi) */
  int32_t *clo, *chi;                /* backward, per key: query rows that see it */
  int32_t *lo2, *hi2;                /* ranges within a block of sf_gemm_nd */
} sf_bufs;

static void *sf_take(char *base, size_t *off, int64_t nfloats) {
  void *p = base ? base + *off : NULL;
  *off += ((size_t)nfloats * sizeof(float) + 63) & ~(size_t)63;
  return p;
}

/* Query-head units (sequence, query head): the rows of each whole-batch matrix. */
static int64_t sf_units(const fa_problem *pb) { return pb->batch * pb->heads_q; }

static int64_t sf_mat_floats(const fa_problem *pb) {
  return sf_units(pb) * pb->max_seqlen_q * fa_round_up(pb->max_seqlen_k, 16);
}

/* Carves the pass's whole-batch matrices out of base (NULL: size only). */
static size_t sf_mats_layout(const fa_problem *pb, int bwd, char *base, sf_mats *m) {
  const int64_t n = sf_mat_floats(pb);
  size_t off = 0;
  sf_mats t = {NULL, NULL, NULL, NULL, NULL};
  if (!bwd) t.S = sf_take(base, &off, n);
  t.P = sf_take(base, &off, n);
  if (bwd) {
    t.dS = sf_take(base, &off, n);
    if (pb->softcap > 0.0f) t.T = sf_take(base, &off, n);
    t.Di = sf_take(base, &off, sf_units(pb) * pb->max_seqlen_q);
  }
  if (m) *m = t;
  return off;
}

/* Carves one thread's buffers of the pass out of base (NULL: size only). */
static size_t sf_layout(const fa_problem *pb, int bwd, char *base, sf_bufs *b) {
  const int64_t D = pb->headdim, Dp = fa_round_up(D, FA_VL);
  const int64_t nq = pb->max_seqlen_q, nk = pb->max_seqlen_k, nkp = fa_round_up(nk, 16);
  const int64_t fw = bwd ? 0 : 1, bw = bwd ? 1 : 0;
  size_t off = 0;
  sf_bufs t;
  t.Q = sf_take(base, &off, nq * Dp);
  t.O = sf_take(base, &off, fw * nq * Dp);
  t.KT = sf_take(base, &off, nkp * D);
  t.V = sf_take(base, &off, fw * nk * Dp);
  t.dO = sf_take(base, &off, bw * nq * Dp);
  t.dQ = sf_take(base, &off, bw * nq * Dp);
  t.VT = sf_take(base, &off, bw * nkp * D);
  t.K = sf_take(base, &off, bw * nk * Dp);
  t.dK = sf_take(base, &off, bw * nk * Dp);
  t.dV = sf_take(base, &off, bw * nk * Dp);
  t.lo = sf_take(base, &off, nq);
  t.hi = sf_take(base, &off, nq);
  t.clo = sf_take(base, &off, bw * nk);
  t.chi = sf_take(base, &off, bw * nk);
  t.lo2 = sf_take(base, &off, nq > nk ? nq : nk);
  t.hi2 = sf_take(base, &off, nq > nk ? nq : nk);
  if (b) *b = t;
  return off;
}

static int sf_threads(const fa_problem *pb) {
  const int64_t rows = sf_units(pb) * ((pb->max_seqlen_q + SF_RB - 1) / SF_RB);
  return (int)(rows < 1 ? 1 : rows < pb->num_threads ? rows : pb->num_threads);
}

static size_t sf_workspace(const fa_problem *pb, int bwd) {
  return sf_mats_layout(pb, bwd, NULL, NULL) +
         (size_t)sf_threads(pb) * sf_layout(pb, bwd, NULL, NULL);
}

size_t fa_ref_fast_forward_workspace(const fa_problem *pb) { return sf_workspace(pb, 0); }

size_t fa_ref_fast_backward_workspace(const fa_problem *pb) { return sf_workspace(pb, 1); }

/* The pass's matrices, and the calling thread's buffers after them. */
static void sf_carve(const fa_problem *pb, int bwd, sf_mats *m, sf_bufs *b) {
  const size_t mats = sf_mats_layout(pb, bwd, (char *)pb->workspace, m);
  sf_layout(
      pb, bwd,
      (char *)pb->workspace + mats + (size_t)omp_get_thread_num() * sf_layout(pb, bwd, NULL, NULL),
      b);
}

/* A work item: rows (or, per K/V head, keys) [r0, r1) of head h of sequence s. */
typedef struct sf_item {
  int64_t s, h, r0, r1;
  fa_seq sq;
  fa_mask mk;
} sf_item;

/* Parts per head: enough items for every thread when heads are few, but no
 * more than a head has SF_PART-row blocks (the others would be empty: a
 * num_threads of 10^9 made 10^9 items of nothing; the parts' rows, and so the
 * results, are the same either way). */
static int64_t sf_parts(const fa_problem *pb, int64_t heads) {
  const int64_t units = pb->batch * heads;
  const int64_t n = pb->max_seqlen_q > pb->max_seqlen_k ? pb->max_seqlen_q : pb->max_seqlen_k;
  const int64_t most = n > SF_PART ? (n + SF_PART - 1) / SF_PART : 1;
  const int64_t want = units >= pb->num_threads ? 1 : (pb->num_threads + units - 1) / units;
  return want < most ? want : most;
}

/* Item it of heads x parts (keys: its range counts keys, else query rows); 0 when
 * that range is empty. */
static int sf_item_of(const fa_problem *pb, int64_t it, int64_t heads, int64_t parts, int keys,
                      sf_item *w) {
  const int64_t u = it / parts, part = it % parts;
  w->s = u / heads;
  w->h = u % heads;
  w->sq = fa_problem_seq(pb, w->s);
  const int64_t n = keys ? w->sq.nk : w->sq.nq, per = fa_round_up((n + parts - 1) / parts, SF_PART);
  w->r0 = part * per;
  w->r1 = w->r0 + per < n ? w->r0 + per : n;
  w->mk = fa_problem_mask(pb, &w->sq);
  return w->r0 < w->r1;
}

/* The item's query head's rows of a whole-batch matrix (Nkp apart), and of Di. */
static int64_t sf_unit(const fa_problem *pb, const sf_item *w) { return w->s * pb->heads_q + w->h; }
static float *sf_mat(const fa_problem *pb, float *M, const sf_item *w) {
  return M + sf_unit(pb, w) * pb->max_seqlen_q * fa_round_up(pb->max_seqlen_k, 16);
}
static float *sf_di(const fa_problem *pb, const sf_mats *m, const sf_item *w) {
  return m->Di + sf_unit(pb, w) * pb->max_seqlen_q + w->r0;
}

/* Panel width of a row-major Dp-column B operand (V, dO, Q, K in the products
 * whose result is D wide): 2 or 3 vectors, whichever divides D's vectors. */
static int sf_dbw(int64_t Dp) {
  const int64_t nv = Dp / FA_VL;
  return nv % 2 != 0 && nv % 3 == 0 ? 3 * FA_VL : 2 * FA_VL;
}

static const char *sf_row(const fa_problem *pb, const fa_tensor *t, int64_t b, int64_t n,
                          int64_t h) {
  return (const char *)t->data + fa_tensor_offset(t, b, n, h) * (int64_t)fa_dtype_bytes(pb->dtype);
}

/* Rows [r0, r0 + n) of head h of tensor t (sequence start b, base row q0) to
 * float32 rows of Dp. */
static void sf_load_rows(const fa_problem *pb, const fa_kern *kn, float *dst, const fa_tensor *t,
                         int64_t b, int64_t r0, int64_t h, int64_t n) {
  const int64_t Dp = fa_round_up(pb->headdim, FA_VL);
  kn->load_panels(dst, (int)Dp, 0, sf_row(pb, t, b, r0, h),
                  t->stride_seq * (int64_t)fa_dtype_bytes(pb->dtype), pb->dtype, n, pb->headdim);
}

/* The same, transposed into 16-wide panels (Nkp x D): the B operand of X Y^T. */
static void sf_load_rows_t(const fa_problem *pb, const fa_kern *kn, float *dst, const fa_tensor *t,
                           int64_t b, int64_t r0, int64_t h, int64_t n) {
  kn->load_panels_t(dst, 16, 16 * pb->headdim, sf_row(pb, t, b, r0, h),
                    t->stride_seq * (int64_t)fa_dtype_bytes(pb->dtype), pb->dtype, n, pb->headdim);
}

/* Keys [0, nk) of sequence sq, head hk, of K or V (t) wherever their rows lie (a
 * cache's rows, a paged cache's pages: fa_problem_krow), in runs of consecutive rows:
 * as float32 rows of Dp (transposed 0), or into K^T's 16-wide panels (transposed 1). */
static void sf_load_keys(const fa_problem *pb, const fa_kern *kn, float *dst, const fa_tensor *t,
                         const fa_seq *sq, int64_t hk, int transposed) {
  const int64_t D = pb->headdim, Dp = fa_round_up(D, FA_VL), nk = sq->nk;
  for (int64_t j = 0; j < nk;) {
    int64_t kb, kr, n = fa_problem_krow(pb, sq, j, &kb, &kr);
    if (n > nk - j) n = nk - j;
    if (!transposed) {
      sf_load_rows(pb, kn, dst + j * Dp, t, kb, kr, hk, n);
    } else if (j % 16 == 0) {
      sf_load_rows_t(pb, kn, dst + j * D, t, kb, kr, hk, n);
    } else { /* a run starting inside a panel: row by row */
      float row[FA_MAX_HEADDIM];
      for (int64_t r = 0; r < n; r++) {
        fa_load_row_f32(row, sf_row(pb, t, kb, kr + r, hk), pb->dtype, D);
        const int64_t jr = j + r;
        for (int64_t d = 0; d < D; d++) dst[jr / 16 * 16 * D + d * 16 + jr % 16] = row[d];
      }
    }
    j += n;
  }
  if (transposed) /* K^T's last panel past the keys: 0 */
    for (int64_t jr = nk; jr < fa_round_up(nk, 16); jr++)
      for (int64_t d = 0; d < D; d++) dst[jr / 16 * 16 * D + d * 16 + jr % 16] = 0.0f;
}

/* Columns [*c0, *c1) of rows [i0, i0+n): the 16-wide panels that hold their
 * visible keys (row ranges are non-decreasing in the row). */
static void sf_band(const int32_t *lo, const int32_t *hi, int64_t i0, int64_t n, int64_t *c0,
                    int64_t *c1) {
  *c0 = lo[i0] / 16 * 16;
  *c1 = fa_round_up(hi[i0 + n - 1], 16);
  if (*c1 < *c0) *c1 = *c0;
}

/* X (nq x Nkp) = alpha A B^T with A (nq x Dp rows) and B^T in 16-wide panels,
 * on each block of SF_RB rows' band of visible keys [lo, hi) only (other
 * entries are left as they are: masked, never read). */
static void sf_gemm_nt(const fa_problem *pb, const fa_kern *kn, const int32_t *lo,
                       const int32_t *hi, float *X, const float *A, const float *BT, int64_t nq,
                       int64_t nk, float alpha) {
  const int64_t D = pb->headdim, Dp = fa_round_up(D, FA_VL), nkp = fa_round_up(nk, 16);
  for (int64_t i0 = 0; i0 < nq; i0 += SF_RB) {
    const int64_t mr = nq - i0 < SF_RB ? nq - i0 : SF_RB;
    int64_t c0, c1;
    sf_band(lo, hi, i0, mr, &c0, &c1);
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

/* Each query row's visible keys [lo, hi) (range: fa_mask_row_range; with nk = 0: empty),
 * or each key's query rows (fa_mask_col_range), for n rows or keys. */
typedef void (*sf_range_fn)(const fa_mask *m, int64_t i, int64_t *lo, int64_t *hi);
static void sf_ranges(const fa_mask *mk, sf_range_fn range, int64_t n, int32_t *lo, int32_t *hi) {
  for (int64_t i = 0; i < n; i++) {
    int64_t a, z;
    range(mk, i, &a, &z);
    lo[i] = (int32_t)a;
    hi[i] = (int32_t)z;
  }
}

/* X (rows [r0, r1) of the item's head, ld Nkp) *= dropout's Z over each row's
 * visible keys (elsewhere P is 0 already). */
static void sf_dropout(const fa_problem *pb, const fa_kern *kn, float *X, const sf_item *w,
                       const int32_t *lo, const int32_t *hi) {
  const fa_dropout dr = pb->dropout;
  const uint64_t bh = (uint64_t)(w->s * pb->heads_q + w->h);
  const int64_t nkp = fa_round_up(w->sq.nk, 16);
  for (int64_t i = w->r0; i < w->r1; i++)
    if (lo[i] < hi[i])
      kn->dropout(X + (i - w->r0) * nkp + lo[i], 0, 1, 1, hi[i] - lo[i], bh, i, lo[i], &dr);
}

/* X (rows [r0, r1) of the item's head) = the masked, capped, biased scores
 * scale Q K^T, from b->Q (those rows) and b->KT loaded and b->lo/hi set (rows
 * of the whole head); T (or NULL), with softcap, tanh(scale qk / cap) over
 * [lo, hi) for the backward. */
static void sf_scores(const fa_problem *pb, const fa_kern *kn, const sf_bufs *b, const sf_item *w,
                      float *X, float *T) {
  const int64_t nk = w->sq.nk, nkp = fa_round_up(nk, 16);
  if (nk == 0) return;
  sf_gemm_nt(pb, kn, b->lo + w->r0, b->hi + w->r0, X, b->Q, b->KT, w->r1 - w->r0, nk, pb->scale);
  const float cap = pb->softcap;
  const float slope =
      pb->alibi_slopes ? pb->alibi_slopes[w->s * pb->alibi_stride_batch + w->h] : 0.0f;
  for (int64_t i = w->r0; i < w->r1; i++) {
    float *row = X + (i - w->r0) * nkp;
    const int32_t lo = b->lo[i], hi = b->hi[i];
    if (cap > 0.0f) {
      const float inv = 1.0f / cap;
      for (int64_t j = lo; j < hi; j++) {
        const float t = tanhf(row[j] * inv);
        row[j] = cap * t;
        if (T) T[(i - w->r0) * nkp + j] = t;
      }
    }
    if (slope != 0.0f)
      for (int64_t j = lo; j < hi; j++) row[j] += fa_alibi_bias(&w->mk, slope, i, j);
    const uint8_t *brow = fa_problem_block_row(pb, w->s, w->h, i);
    if (brow)
      for (int64_t j = lo; j < hi; j++)
        if (!brow[j / pb->block_size_k]) row[j] = -INFINITY;
  }
}

/* P (rows [r0, r1), scores there already) = their softmax, 0 outside each row's
 * visible keys, rounded to the storage type as Algorithm 0 stores it; lse
 * (r1 - r0) receives each row's log-sum-exp. With lse_in (a shard's backward),
 * P = exp(S - lse_in): the given normaliser may be the whole sequence's, of
 * which these keys are a part. */
static void sf_softmax(const fa_problem *pb, const fa_kern *kn, const sf_bufs *b, const sf_item *w,
                       float *P, float *lse, const float *lse_in) {
  const int64_t nkp = fa_round_up(w->sq.nk, 16), n = w->r1 - w->r0;
  kn->softmax_rows(P, nkp, n, nkp, b->lo + w->r0, b->hi + w->r0, lse);
  if (lse_in)
    for (int64_t i = 0; i < n; i++) {
      if (lse[i] == -INFINITY) continue; /* no visible key: P is 0 already */
      const float f = lse_in[i] == -INFINITY ? 0.0f : expf(lse[i] - lse_in[i]);
      for (int64_t j = b->lo[w->r0 + i]; j < b->hi[w->r0 + i]; j++) P[i * nkp + j] *= f;
    }
  if (pb->dtype != FA_DTYPE_F32)
    for (int64_t i = 0; i < n; i++)
      for (int64_t j = b->lo[w->r0 + i]; j < b->hi[w->r0 + i]; j++) {
        float *x = P + i * nkp + j;
        *x = pb->dtype == FA_DTYPE_F16 ? fa_f16_to_f32(fa_f32_to_f16(*x))
                                       : fa_bf16_to_f32(fa_f32_to_bf16(*x));
      }
}

/* The K/V head of query head h. */
static int64_t sf_kv_head(const fa_problem *pb, int64_t h) { return h / pb->group; }

/* A step's start: the matrices, this thread's buffers, the item's row ranges. */
static const fa_seq *sf_begin(const fa_problem *pb, int bwd, const sf_item *w, sf_mats *m,
                              sf_bufs *b) {
  sf_carve(pb, bwd, m, b);
  sf_ranges(&w->mk, fa_mask_row_range, w->sq.nq, b->lo, b->hi);
  return &w->sq;
}

/* The item's Q rows and its K/V head's K^T, the operands of its scores. */
static void sf_load_qk(const fa_problem *pb, const fa_kern *kn, const sf_item *w, sf_bufs *b) {
  const fa_seq *sq = &w->sq;
  sf_load_rows(pb, kn, b->Q, &pb->q, sq->qb, sq->q0 + w->r0, w->h, w->r1 - w->r0);
  if (sq->nk > 0) sf_load_keys(pb, kn, b->KT, &pb->k, sq, sf_kv_head(pb, w->h), 1);
}

/* ---- forward: S, then P, then O, each a pass over the whole batch ---------- */

static void sf_fwd_scores(const fa_problem *pb, const fa_kern *kn, const sf_item *w) {
  sf_mats m;
  sf_bufs b;
  const fa_seq *sq = sf_begin(pb, 0, w, &m, &b);
  const int64_t nkp = fa_round_up(sq->nk, 16);
  sf_load_qk(pb, kn, w, &b);
  sf_scores(pb, kn, &b, w, sf_mat(pb, m.S, w) + w->r0 * nkp, NULL);
}

static void sf_fwd_probs(const fa_problem *pb, const fa_kern *kn, const sf_item *w) {
  sf_mats m;
  sf_bufs b;
  const fa_seq *sq = sf_begin(pb, 0, w, &m, &b);
  const int64_t nkp = fa_round_up(sq->nk, 16);
  const float *S = sf_mat(pb, m.S, w) + w->r0 * nkp;
  float *P = sf_mat(pb, m.P, w) + w->r0 * nkp;
  for (int64_t i = 0; i < w->r1 - w->r0; i++) { /* P = S, then softmax in place */
    const int32_t lo = b.lo[w->r0 + i], hi = b.hi[w->r0 + i];
    if (hi > lo) memcpy(P + i * nkp + lo, S + i * nkp + lo, (size_t)(hi - lo) * sizeof(float));
  }
  float *lse = pb->lse ? pb->lse + sq->lse0 + w->h * sq->lse_head_stride + w->r0 : b.O;
  sf_softmax(pb, kn, &b, w, P, lse, NULL);
  if (pb->dropout_p > 0.0f) sf_dropout(pb, kn, P, w, b.lo, b.hi);
}

/* Rows [r0, r1) of the item's head (row ranges set): out = M X (M those rows of a whole-batch
 * matrix, X the head's K/V rows of tensor x loaded into X) over each row's visible keys only
 * (masked rows of X may hold inf/NaN; a row that sees none gets 0), stored to dst times scale. */
static void sf_rows_product(const fa_problem *pb, const fa_kern *kn, const sf_item *w, sf_bufs *b,
                            const float *M, const fa_tensor *x, float *X, float *out,
                            const fa_tensor *dst, float scale) {
  const fa_seq *sq = &w->sq;
  const int64_t D = pb->headdim, Dp = fa_round_up(D, FA_VL), nkp = fa_round_up(sq->nk, 16);
  if (sq->nk > 0) sf_load_keys(pb, kn, X, x, sq, sf_kv_head(pb, w->h), 0);
  sf_gemm_nd(pb, kn, out, 0, w->r1 - w->r0, sq->nk, M + w->r0 * nkp, nkp, 1, X, b->lo + w->r0,
             b->hi + w->r0, b->lo2, b->hi2);
  for (int64_t i = w->r0; i < w->r1; i++)
    kn->store_row((char *)sf_row(pb, dst, sq->qb, sq->q0 + i, w->h), out + (i - w->r0) * Dp, scale,
                  pb->dtype, D);
}

/* O = P V */
static void sf_fwd_out(const fa_problem *pb, const fa_kern *kn, const sf_item *w) {
  sf_mats m;
  sf_bufs b;
  sf_begin(pb, 0, w, &m, &b);
  sf_rows_product(pb, kn, w, &b, sf_mat(pb, m.P, w), &pb->v, b.V, b.O, &pb->o, 1.0f);
}

typedef void (*sf_step)(const fa_problem *pb, const fa_kern *kn, const sf_item *w);

/* One pass: step on every item of heads x parts (keys: rows are keys), on all threads. */
static void sf_pass(const fa_problem *pb, const fa_kern *kn, sf_step step, int64_t heads,
                    int keys) {
  const int64_t parts = sf_parts(pb, heads), items = pb->batch * heads * parts;
#pragma omp parallel for num_threads(sf_threads(pb)) schedule(dynamic, 1)
  for (int64_t it = 0; it < items; it++) {
    sf_item w;
    if (sf_item_of(pb, it, heads, parts, keys, &w)) step(pb, kn, &w);
  }
}

fa_status fa_ref_fast_forward(const fa_problem *pb) {
  const fa_kern *kn = fa_kern_get();
  sf_pass(pb, kn, sf_fwd_scores, pb->heads_q, 0);
  sf_pass(pb, kn, sf_fwd_probs, pb->heads_q, 0);
  sf_pass(pb, kn, sf_fwd_out, pb->heads_q, 0);
  return FA_OK;
}

/* ---- backward: P and Di, dS, then dK dV and dQ ---------------------------- */

static void sf_bwd_probs(const fa_problem *pb, const fa_kern *kn, const sf_item *w) {
  sf_mats m;
  sf_bufs b;
  const fa_seq *sq = sf_begin(pb, 1, w, &m, &b);
  const int64_t D = pb->headdim, Dp = fa_round_up(D, FA_VL), nkp = fa_round_up(sq->nk, 16);
  const int64_t n = w->r1 - w->r0, row0 = w->r0 * nkp;
  float *P = sf_mat(pb, m.P, w) + row0, *Di = sf_di(pb, &m, w);
  sf_load_qk(pb, kn, w, &b);
  sf_scores(pb, kn, &b, w, P, m.T ? sf_mat(pb, m.T, w) + row0 : NULL);
  const float *lse_in =
      pb->shard_enabled ? pb->lse + sq->lse0 + w->h * sq->lse_head_stride + w->r0 : NULL;
  sf_softmax(pb, kn, &b, w, P, Di, lse_in); /* its lse lands in Di, overwritten below */
  sf_load_rows(pb, kn, b.dO, &pb->dout, sq->qb, sq->q0 + w->r0, w->h, n);
  sf_load_rows(pb, kn, b.dQ, &pb->o, sq->qb, sq->q0 + w->r0, w->h, n);
  for (int64_t i = 0; i < n; i++) Di[i] = kn->rowdot(b.dO + i * Dp, b.dQ + i * Dp, D);
}

/* dropout (docs/DROPOUT.md): dS = P o (Z o dP - Di), and dV takes Z o P */
static void sf_bwd_dscores(const fa_problem *pb, const fa_kern *kn, const sf_item *w) {
  sf_mats m;
  sf_bufs b;
  const fa_seq *sq = sf_begin(pb, 1, w, &m, &b);
  const int64_t nkp = fa_round_up(sq->nk, 16), n = w->r1 - w->r0, row0 = w->r0 * nkp;
  if (sq->nk == 0) return;
  float *P = sf_mat(pb, m.P, w) + row0, *dS = sf_mat(pb, m.dS, w) + row0;
  const float *Di = sf_di(pb, &m, w);
  const float *T = m.T ? sf_mat(pb, m.T, w) + row0 : NULL;
  const int dropout = pb->dropout_p > 0.0f;
  sf_load_rows(pb, kn, b.dO, &pb->dout, sq->qb, sq->q0 + w->r0, w->h, n);
  sf_load_rows_t(pb, kn, b.VT, &pb->v, sq->kb, sq->k0, sf_kv_head(pb, w->h), sq->nk);
  sf_gemm_nt(pb, kn, b.lo + w->r0, b.hi + w->r0, dS, b.dO, b.VT, n, sq->nk, 1.0f); /* dP */
  if (dropout) sf_dropout(pb, kn, dS, w, b.lo, b.hi);
  for (int64_t i0 = 0; i0 < n; i0 += SF_RB) {
    const int64_t mr = n - i0 < SF_RB ? n - i0 : SF_RB;
    int64_t c0, c1;
    sf_band(b.lo + w->r0, b.hi + w->r0, i0, mr, &c0, &c1);
    const int64_t o = i0 * nkp + c0;
    kn->dsoftmax(dS + o, P + o, nkp, mr, c1 - c0, Di + i0, T ? T + o : NULL);
  }
  if (dropout) sf_dropout(pb, kn, P, w, b.lo, b.hi);
}

/* Keys [r0, r1) of K/V head h of sequence s: dV = sum (Z o P)^T dO and
 * dK = sum dS^T Q over the group's query heads, over the rows that see each key. */
static void sf_bwd_kv(const fa_problem *pb, const fa_kern *kn, const sf_item *w) {
  sf_mats m;
  sf_bufs b;
  const fa_seq *sq = sf_begin(pb, 1, w, &m, &b);
  const int64_t D = pb->headdim, Dp = fa_round_up(D, FA_VL), nkp = fa_round_up(sq->nk, 16);
  const int64_t n = w->r1 - w->r0;
  sf_ranges(&w->mk, fa_mask_col_range, sq->nk, b.clo, b.chi);
  memset(b.dK, 0, (size_t)(n * Dp) * sizeof(float));
  memset(b.dV, 0, (size_t)(n * Dp) * sizeof(float));
  for (int64_t h = w->h * pb->group; h < (w->h + 1) * pb->group && sq->nq > 0; h++) {
    sf_item qh = *w;
    qh.h = h;
    sf_load_rows(pb, kn, b.Q, &pb->q, sq->qb, sq->q0, h, sq->nq);
    sf_load_rows(pb, kn, b.dO, &pb->dout, sq->qb, sq->q0, h, sq->nq);
    sf_gemm_nd(pb, kn, b.dV, 1, n, sq->nq, sf_mat(pb, m.P, &qh) + w->r0, 1, nkp, b.dO,
               b.clo + w->r0, b.chi + w->r0, b.lo2, b.hi2);
    sf_gemm_nd(pb, kn, b.dK, 1, n, sq->nq, sf_mat(pb, m.dS, &qh) + w->r0, 1, nkp, b.Q,
               b.clo + w->r0, b.chi + w->r0, b.lo2, b.hi2);
  }
  for (int64_t j = w->r0; j < w->r1; j++) {
    kn->store_row((char *)sf_row(pb, &pb->dk, sq->kb, sq->k0 + j, w->h), b.dK + (j - w->r0) * Dp,
                  pb->scale, pb->dtype, D);
    kn->store_row((char *)sf_row(pb, &pb->dv, sq->kb, sq->k0 + j, w->h), b.dV + (j - w->r0) * Dp,
                  1.0f, pb->dtype, D);
  }
}

/* dQ = dS K (scaled) */
static void sf_bwd_dq(const fa_problem *pb, const fa_kern *kn, const sf_item *w) {
  sf_mats m;
  sf_bufs b;
  sf_begin(pb, 1, w, &m, &b);
  sf_rows_product(pb, kn, w, &b, sf_mat(pb, m.dS, w), &pb->k, b.K, b.dQ, &pb->dq, pb->scale);
}

fa_status fa_ref_fast_backward(const fa_problem *pb) {
  const fa_kern *kn = fa_kern_get();
  sf_pass(pb, kn, sf_bwd_probs, pb->heads_q, 0);
  sf_pass(pb, kn, sf_bwd_dscores, pb->heads_q, 0);
  sf_pass(pb, kn, sf_bwd_kv, pb->heads_k, 1);
  sf_pass(pb, kn, sf_bwd_dq, pb->heads_q, 0);
  return FA_OK;
}
