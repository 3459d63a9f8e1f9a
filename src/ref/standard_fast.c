/* Standard attention (Algorithm 0) forward in float32 for f32/f16/bf16 storage:
 * the benchmark baseline, made as fast as the algorithm allows so that flash
 * vs standard is a fair comparison. Per (sequence, query head) S = scale Q K^T
 * and P = softmax(S) are materialised (Nq x Nk), then O = P V; the products
 * are the register-tiled gemm of common/kern.h and the softmax its vectorised
 * row kernel. Softcap, ALiBi, windows, block masks and dropout apply to the
 * materialised matrices; P is rounded to the storage type, as Algorithm 0
 * writes it to memory. The float64 oracle stays the simple code of
 * standard_impl.h.
 *
 * Workspace per thread (floats, each buffer rounded up to 64 bytes; Dp = D
 * rounded up to 8, Nkp = Nk rounded up to 16): Q and O (Nq x Dp), K^T
 * (Nkp x D, 16-wide panels), V (Nk x Dp), S (Nq x Nkp), two int32 ranges (Nq). */
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

typedef struct sf_bufs {
  float *Q, *O, *KT, *V, *S;
  int32_t *lo, *hi;
} sf_bufs;

static size_t sf_take(char *base, size_t *off, int64_t nfloats, void **p) {
  if (base) *p = base + *off;
  *off += ((size_t)nfloats * sizeof(float) + 63) & ~(size_t)63;
  return *off;
}

static size_t sf_layout(const fa_problem *pb, char *base, sf_bufs *b) {
  const int64_t D = pb->headdim, Dp = fa_round_up(D, FA_VL);
  const int64_t nq = pb->max_seqlen_q, nk = pb->max_seqlen_k, nkp = fa_round_up(nk, 16);
  size_t off = 0;
  sf_bufs t;
  void *p[7] = {0};
  sf_take(base, &off, nq * Dp, &p[0]);
  sf_take(base, &off, nq * Dp, &p[1]);
  sf_take(base, &off, nkp * D, &p[2]);
  sf_take(base, &off, nk * Dp, &p[3]);
  sf_take(base, &off, nq * nkp, &p[4]);
  sf_take(base, &off, nq, &p[5]);
  sf_take(base, &off, nq, &p[6]);
  t.Q = p[0], t.O = p[1], t.KT = p[2], t.V = p[3], t.S = p[4];
  t.lo = p[5], t.hi = p[6];
  if (b) *b = t;
  return off;
}

static int sf_threads(const fa_problem *pb) {
  const int64_t units = pb->batch * pb->heads_q;
  return (int)(units < 1 ? 1 : units < pb->num_threads ? units : pb->num_threads);
}

size_t fa_ref_fast_forward_workspace(const fa_problem *pb) {
  return (size_t)sf_threads(pb) * sf_layout(pb, NULL, NULL);
}

/* V's panel width for O = P V: 2 or 3 vectors, whichever divides D's vectors. */
static int sf_vbw(int64_t Dp) {
  const int64_t nv = Dp / FA_VL;
  return nv % 2 != 0 && nv % 3 == 0 ? 3 * FA_VL : 2 * FA_VL;
}

static void sf_unit(const fa_problem *pb, const fa_kern *kn, sf_bufs *b, int64_t s, int64_t h) {
  const fa_params *pr = pb->params;
  const fa_seq sq = fa_problem_seq(pb, s);
  const int64_t D = pb->headdim, Dp = fa_round_up(D, FA_VL), nq = sq.nq, nk = sq.nk;
  const int64_t nkp = fa_round_up(nk, 16), hk = h / pb->group;
  const size_t es = fa_dtype_size(pb->dtype);
  const fa_mask mk =
      fa_mask_make(nq, nk, pr->causal, pr->window_enabled, pr->window_left, pr->window_right);
  if (nq == 0) return;
  const char *q =
      (const char *)pb->q.data + fa_tensor_offset(&pb->q, sq.qb, sq.q0, h) * (int64_t)es;
  const char *k =
      (const char *)pb->k.data + fa_tensor_offset(&pb->k, sq.kb, sq.k0, hk) * (int64_t)es;
  const char *v =
      (const char *)pb->v.data + fa_tensor_offset(&pb->v, sq.kb, sq.k0, hk) * (int64_t)es;
  kn->load_panels(b->Q, (int)Dp, 0, q, pb->q.stride_seq * (int64_t)es, pb->dtype, nq, D);
  for (int64_t i = 0; i < nq; i++) {
    int64_t lo, hi;
    fa_mask_row_range(&mk, i, &lo, &hi);
    b->lo[i] = (int32_t)lo;
    b->hi[i] = (int32_t)hi;
  }
  if (nk > 0) {
    kn->load_panels_t(b->KT, 16, 16 * D, k, pb->k.stride_seq * (int64_t)es, pb->dtype, nk, D);
    kn->load_panels(b->V, (int)Dp, 0, v, pb->v.stride_seq * (int64_t)es, pb->dtype, nk, D);
    /* S = scale Q K^T */
    const fa_gemm gs = {nq, nkp,  D,   b->Q,      Dp, 1,    b->KT, 16,  16 * D,
                        16, b->S, nkp, pb->scale, 0,  NULL, NULL,  NULL};
    kn->gemm(&gs);
  }
  const float cap = pr->softcap;
  const float slope = pr->alibi_slopes ? pr->alibi_slopes[s * pr->alibi_stride_batch + h] : 0.0f;
  for (int64_t i = 0; i < nq; i++) {
    float *row = b->S + i * nkp;
    if (cap > 0.0f) {
      const float inv = 1.0f / cap;
      for (int64_t j = b->lo[i]; j < b->hi[i]; j++) row[j] = cap * tanhf(row[j] * inv);
    }
    if (slope != 0.0f)
      for (int64_t j = b->lo[i]; j < b->hi[i]; j++) row[j] += fa_alibi_bias(&mk, slope, i, j);
    const uint8_t *brow = fa_problem_block_row(pb, s, h, i);
    if (brow)
      for (int64_t j = b->lo[i]; j < b->hi[i]; j++)
        if (!brow[j / pr->block_size_k]) row[j] = -INFINITY;
  }
  float *lse = pb->lse ? pb->lse + sq.lse0 + h * sq.lse_head_stride : b->O;
  kn->softmax_rows(b->S, nkp, nq, nk, b->lo, b->hi, lse);
  if (pb->dtype != FA_DTYPE_F32)
    for (int64_t i = 0; i < nq; i++) /* P as Algorithm 0 stores it */
      for (int64_t j = b->lo[i]; j < b->hi[i]; j++) {
        float *x = b->S + i * nkp + j;
        *x = pb->dtype == FA_DTYPE_F16 ? fa_f16_to_f32(fa_f32_to_f16(*x))
                                       : fa_bf16_to_f32(fa_f32_to_bf16(*x));
      }
  if (pr->dropout_p > 0.0f) {
    const fa_dropout dr = fa_dropout_make(pr->dropout_p, pr->dropout_seed, pr->dropout_offset);
    const uint64_t bh = (uint64_t)(s * pb->heads_q + h);
    for (int64_t i = 0; i < nq; i++) {
      float *row = b->S + i * nkp;
      for (int64_t j = b->lo[i]; j < b->hi[i]; j = (j | 3) + 1) {
        const fa_u32x4 r = fa_dropout_bits(&dr, bh, i, j);
        for (int64_t t = j; t <= (j | 3) && t < b->hi[i]; t++)
          row[t] *= r.v[t & 3] >= dr.threshold ? dr.keep_scale : 0.0f;
      }
    }
  }
  /* O = P V over each row's visible keys only (masked V rows may hold inf/NaN) */
  const int vbw = sf_vbw(Dp);
  const fa_gemm go = {nq,  Dp,   nk, b->S, nkp, 1,    b->V,  Dp,   vbw,
                      vbw, b->O, Dp, 1.0f, 0,   NULL, b->lo, b->hi};
  kn->gemm(&go);
  for (int64_t i = 0; i < nq; i++)
    kn->store_row((char *)pb->o.data + fa_tensor_offset(&pb->o, sq.qb, sq.q0 + i, h) * (int64_t)es,
                  b->O + i * Dp, 1.0f, pb->dtype, D);
}

fa_status fa_ref_fast_forward(const fa_problem *pb) {
  const fa_kern *kn = fa_kern_get();
  const int64_t units = pb->batch * pb->heads_q;
  const size_t slice = sf_layout(pb, NULL, NULL);
#pragma omp parallel for num_threads(sf_threads(pb)) schedule(dynamic, 1)
  for (int64_t u = 0; u < units; u++) {
    sf_bufs b;
    sf_layout(pb, (char *)pb->workspace + (size_t)omp_get_thread_num() * slice, &b);
    sf_unit(pb, kn, &b, u / pb->heads_q, u % pb->heads_q);
  }
  return FA_OK;
}
