/* The CPU kernels of kern.h, written once over an 8-lane float vector. The
 * including file defines vf, vi (8 x uint32) and these operations, then SFX:
 *   vf_load/vf_store (unaligned), vf_set1, vf_add, vf_sub, vf_mul,
 *   vf_fma(a, b, c) = a*b + c, vf_max(a, b) / vf_min(a, b) (b when either is NaN),
 *   vf_sel_eq(x, y, a, b) = x == y ? a : b, vf_sel_ne0(p, a) = p != 0 ? a : 0,
 *   vf_bits/vf_from_bits (reinterpret), vi_add_shl23(u, k) = (u + k) << 23,
 *   vf_load_f16(const uint16_t *), vf_store_f16(uint16_t *, vf), vf_load_bf16,
 *   vf_sum8(const vf v[8]): lane i = ((v_i0 + v_i1) + (v_i2 + v_i3)) +
 *   ((v_i4 + v_i5) + (v_i6 + v_i7)), the order of AVX's hadd tree;
 *   vf_transpose8(vf v[8]): in place, lane j of v[i] <-> lane i of v[j];
 *   for dropout: vi_set1, vi_iota(x) = x + lane, vi_xor, vi_mullo(a, m) and
 *   vi_mulhi(a, m) (the halves of the 64-bit a * m), vf_sel_ge_u(x, t, a) =
 *   x >= t (unsigned) ? a : 0.
 * With KB_WIDE the matrix product's register tiles also take vw, 16-lane
 * vectors (vw_load, vw_store, vw_set1, vw_mul, vw_fma), summing each element
 * as the 8-lane tiles do, and so do the softmax, the backward's
 * elementwise steps and the decode's P V (kern_lanes.h: vw_add, vw_sub,
 * vw_max, vw_min, vw_sel_eq, vw_sel_ne0, vw_bits, vw_from_bits,
 * vwi_add_shl23, vw_load_f16, vw_load_bf16).
 * Nothing here depends on the ISA otherwise, so both paths share every
 * summation order and differ only in FMA contraction. */
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "common/convert.h"
#include "common/dtype.h"
#include "common/kern.h"

/* Vector registers the including ISA has (16 unless it says 32): the decode
 * kernels' register tiles grow with them. */
#ifndef KB_REGS
#define KB_REGS 16
#endif

/* The exponentials and the online softmax's column chunk (kern_lanes.h),
 * on vf; with KB_WIDE on vw too. */
#define V vf
#define VOP(op) vf_##op
#define VIOP(op) vi_##op
#define VNAME(name) SFX(name)
#include "common/kern_lanes.h"
#ifdef KB_WIDE
#define V vw
#define VOP(op) vw_##op
#define VIOP(op) vwi_##op
#define VNAME(name) SFX(name##_w)
#include "common/kern_lanes.h"
#endif

/* Where the 16-lane part of n columns ends: the kernels below take columns
 * [0, KB_WIDE_END(n)) 16 at a time where the ISA has vw, then 8-lane
 * vectors up to n rounded up to FA_VL (the rows' padding). Each column is a
 * lane, so the split changes no bit. */
#ifdef KB_WIDE
#define KB_WIDE_END(n) ((n) / (2 * FA_VL) * (2 * FA_VL))
#else
#define KB_WIDE_END(n) 0
#endif

/* ---- matrix product ------------------------------------------------------ */

/* Register tile: MR rows x NR vectors of C, the k loop keeps them in
 * registers (MR*NR + NR + 1 <= 16 ymm). */
#define KB_UKR_ARGS                                                                      \
  int64_t k, const float *restrict a, int64_t rsa, int64_t csa, const float *restrict b, \
      int64_t ldb, float *restrict c, int64_t ldc, float alpha, int beta, const float *rs

typedef void (*SFX(ukr_fn))(KB_UKR_ARGS);

static inline __attribute__((always_inline)) void SFX(ukr)(const int MR, const int NR,
                                                           KB_UKR_ARGS) {
  vf acc[8][3];
#pragma GCC unroll 8
  for (int i = 0; i < MR; i++)
#pragma GCC unroll 3
    for (int j = 0; j < NR; j++) acc[i][j] = vf_set1(0.0f);
  for (int64_t p = 0; p < k; p++) {
    vf bv[3];
    const float *ap = a + p * csa;
#pragma GCC unroll 3
    for (int j = 0; j < NR; j++) bv[j] = vf_load(b + p * ldb + FA_VL * j);
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
      const vf av = vf_set1(ap[i * rsa]);
#pragma GCC unroll 3
      for (int j = 0; j < NR; j++) acc[i][j] = vf_fma(av, bv[j], acc[i][j]);
    }
  }
  const vf va = vf_set1(alpha);
#pragma GCC unroll 8
  for (int i = 0; i < MR; i++) {
    const vf s = vf_set1(rs ? rs[i] : 1.0f);
#pragma GCC unroll 3
    for (int j = 0; j < NR; j++) {
      float *cp = c + i * ldc + FA_VL * j;
      const vf r = vf_mul(acc[i][j], va);
      vf_store(cp, beta ? vf_fma(vf_load(cp), s, r) : r);
    }
  }
}

#define KB_UKR(MR, NR)                                                 \
  static void SFX(ukr_##MR##x##NR)(KB_UKR_ARGS) {                      \
    SFX(ukr)(MR, NR, k, a, rsa, csa, b, ldb, c, ldc, alpha, beta, rs); \
  }
KB_UKR(1, 1)
KB_UKR(2, 1)
KB_UKR(3, 1)
KB_UKR(4, 1)
KB_UKR(5, 1)
KB_UKR(6, 1)
KB_UKR(7, 1)
KB_UKR(8, 1)
#ifndef KB_WIDE
KB_UKR(1, 2)
KB_UKR(2, 2)
KB_UKR(3, 2)
KB_UKR(4, 2)
KB_UKR(5, 2)
KB_UKR(6, 2)
KB_UKR(1, 3)
KB_UKR(2, 3)
KB_UKR(3, 3)
KB_UKR(4, 3)
#endif
#undef KB_UKR

/* Register tile height per vectors per panel. Where rows restrict their keys
 * (klo) every table takes these heights: they decide how a row's sum splits
 * between the tile and the row's own tail, so the bits are the same. */
static const int SFX(ukr_mr)[4] = {0, 8, 6, 4};
#ifdef KB_WIDE
/* Register tiles on 16-lane vectors (vw, where the including ISA has them and
 * 512-bit FMA units): MR rows x one vw of the panel at b and, SECOND = 1, a vf
 * of its columns 16-23 (a 24-column panel), or, SECOND = 2, a vw of the next
 * 16-column panel (b + bps): two panels at once, each broadcast of A feeding
 * two FMAs (one vw a row waits on its loads: 71% of the 512-bit FMA peak on a
 * core of an Intel Xeon, 86% for eight rows of two). Every element's sum is
 * SFX(ukr)'s, one FMA per k in order, then alpha, then beta: the same bits
 * with half the instructions. */
#define KB_UKR2_ARGS KB_UKR_ARGS, int64_t bps
typedef void (*SFX(ukr2_fn))(KB_UKR2_ARGS);
static inline __attribute__((always_inline)) void SFX(ukrw)(const int MR, const int SECOND,
                                                            KB_UKR2_ARGS) {
  vw acc0[12], acc1[12];
  vf acc8[12];
#pragma GCC unroll 12
  for (int i = 0; i < MR; i++) {
    acc0[i] = vw_set1(0.0f);
    if (SECOND == 2) acc1[i] = vw_set1(0.0f);
    if (SECOND == 1) acc8[i] = vf_set1(0.0f);
  }
  for (int64_t p = 0; p < k; p++) {
    const vw b0 = vw_load(b + p * ldb);
    const vw b1 = SECOND == 2 ? vw_load(b + bps + p * ldb) : vw_set1(0.0f);
    const vf b8 = SECOND == 1 ? vf_load(b + p * ldb + 2 * FA_VL) : vf_set1(0.0f);
    const float *ap = a + p * csa;
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) {
      const vw av = vw_set1(ap[i * rsa]);
      acc0[i] = vw_fma(av, b0, acc0[i]);
      if (SECOND == 2) acc1[i] = vw_fma(av, b1, acc1[i]);
      if (SECOND == 1) acc8[i] = vf_fma(vf_set1(ap[i * rsa]), b8, acc8[i]);
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < MR; i++) {
    const float s = rs ? rs[i] : 1.0f;
    float *cp = c + i * ldc, *c2 = cp + 2 * FA_VL;
    const vw r0 = vw_mul(acc0[i], vw_set1(alpha));
    vw_store(cp, beta ? vw_fma(vw_load(cp), vw_set1(s), r0) : r0);
    if (SECOND == 2) {
      const vw r1 = vw_mul(acc1[i], vw_set1(alpha));
      vw_store(c2, beta ? vw_fma(vw_load(c2), vw_set1(s), r1) : r1);
    }
    if (SECOND == 1) {
      const vf r8 = vf_mul(acc8[i], vf_set1(alpha));
      vf_store(c2, beta ? vf_fma(vf_load(c2), vf_set1(s), r8) : r8);
    }
  }
}
/* one panel of NV vectors (2 or 3); a pair of 16-column panels */
#define KB_UKRW(MR, NV)                                                        \
  static void SFX(ukrw_##MR##x##NV)(KB_UKR_ARGS) {                             \
    SFX(ukrw)(MR, NV - 2, k, a, rsa, csa, b, ldb, c, ldc, alpha, beta, rs, 0); \
  }
#define KB_UKR2(MR)                                                         \
  static void SFX(ukr2_##MR)(KB_UKR2_ARGS) {                                \
    SFX(ukrw)(MR, 2, k, a, rsa, csa, b, ldb, c, ldc, alpha, beta, rs, bps); \
  }
#define KB_UKRW_ROWS(NV)                                                                    \
  KB_UKRW(1, NV)                                                                            \
  KB_UKRW(2, NV)                                                                            \
  KB_UKRW(3, NV)                                                                            \
  KB_UKRW(4, NV) KB_UKRW(5, NV) KB_UKRW(6, NV) KB_UKRW(7, NV) KB_UKRW(8, NV) KB_UKRW(9, NV) \
      KB_UKRW(10, NV) KB_UKRW(11, NV) KB_UKRW(12, NV)
KB_UKRW_ROWS(2)
KB_UKRW_ROWS(3)
KB_UKR2(1)
KB_UKR2(2)
KB_UKR2(3)
KB_UKR2(4)
KB_UKR2(5)
KB_UKR2(6)
KB_UKR2(7)
KB_UKR2(8)
#undef KB_UKRW_ROWS
#undef KB_UKRW
#undef KB_UKR2
#define KB_UKRW_ROW(NV)                                                                           \
  {                                                                                               \
    NULL, SFX(ukrw_1x##NV), SFX(ukrw_2x##NV), SFX(ukrw_3x##NV), SFX(ukrw_4x##NV),                 \
        SFX(ukrw_5x##NV), SFX(ukrw_6x##NV), SFX(ukrw_7x##NV), SFX(ukrw_8x##NV), SFX(ukrw_9x##NV), \
        SFX(ukrw_10x##NV), SFX(ukrw_11x##NV), SFX(ukrw_12x##NV)                                   \
  }
/* Heights where rows are independent (no klo), and [vectors][rows]; the
 * pairs' tiles, [rows] */
static const int SFX(ukr_mr_full)[4] = {0, 8, 12, 12};
static const SFX(ukr_fn) SFX(ukrs)[4][13] = {
    {0},
    {NULL, SFX(ukr_1x1), SFX(ukr_2x1), SFX(ukr_3x1), SFX(ukr_4x1), SFX(ukr_5x1), SFX(ukr_6x1),
     SFX(ukr_7x1), SFX(ukr_8x1)},
    KB_UKRW_ROW(2),
    KB_UKRW_ROW(3),
};
#undef KB_UKRW_ROW
static const SFX(ukr2_fn)
    SFX(ukr2s)[9] = {NULL,        SFX(ukr2_1), SFX(ukr2_2), SFX(ukr2_3), SFX(ukr2_4),
                     SFX(ukr2_5), SFX(ukr2_6), SFX(ukr2_7), SFX(ukr2_8)};
#else
/* [vectors][rows] */
static const SFX(ukr_fn) SFX(ukrs)[4][9] = {
    {0},
    {NULL, SFX(ukr_1x1), SFX(ukr_2x1), SFX(ukr_3x1), SFX(ukr_4x1), SFX(ukr_5x1), SFX(ukr_6x1),
     SFX(ukr_7x1), SFX(ukr_8x1)},
    {NULL, SFX(ukr_1x2), SFX(ukr_2x2), SFX(ukr_3x2), SFX(ukr_4x2), SFX(ukr_5x2), SFX(ukr_6x2)},
    {NULL, SFX(ukr_1x3), SFX(ukr_2x3), SFX(ukr_3x3), SFX(ukr_4x3)},
};
#endif

#ifdef KB_WIDE
/* a register tile of rows rows: a pair of panels, or nv vectors of one */
#define KB_TILE(rows, K, A, RSA, B, C, BETA, RS)                                                \
  (PAIR ? SFX(ukr2s)[rows](K, A, RSA, g->csa, B, g->ldb, C, g->ldc, g->alpha, BETA, RS, g->bps) \
        : SFX(ukrs)[nv][rows](K, A, RSA, g->csa, B, g->ldb, C, g->ldc, g->alpha, BETA, RS))
#else
#define KB_TILE(rows, K, A, RSA, B, C, BETA, RS) \
  SFX(ukrs)[nv][rows](K, A, RSA, g->csa, B, g->ldb, C, g->ldc, g->alpha, BETA, RS)
#endif

/* Columns [j0, j0 + nv vectors) of C, or the two panels from j0 (PAIR) */
static inline __attribute__((always_inline)) void SFX(gemm_cols)(const fa_gemm *g, int64_t j0,
                                                                 const int nv, const int PAIR) {
#ifdef KB_WIDE
  const int MR = g->klo ? SFX(ukr_mr)[nv] : PAIR ? 8 : SFX(ukr_mr_full)[nv];
#else
  const int MR = SFX(ukr_mr)[nv];
  (void)PAIR;
#endif
  const float *bp = g->b + j0 / g->bw * g->bps;
  for (int64_t i0 = 0, mr; i0 < g->m; i0 += mr) {
    mr = (int)(g->m - i0 < MR ? g->m - i0 : MR);
    /* 8 rows left: 4 + 4, not 6 + 2, and 10 rows: 5 + 5, not 6 + 4 (a
     * 2- or 4-row tile has too few accumulators to cover the FMA latency);
     * rows are independent, so same bits */
    if (MR == 6 && (g->m - i0 == 8 || g->m - i0 == 10)) mr = (int)(g->m - i0) / 2;
    /* (12-row tiles: 13 to 23 rows left in two halves) */
    if (MR == 12 && g->m - i0 > 12 && g->m - i0 < 24) mr = (int)(g->m - i0 + 1) / 2;
    const float *ap = g->a + i0 * g->rsa;
    float *cp = g->c + i0 * g->ldc + j0;
    const float *rs = g->rowscale ? g->rowscale + i0 : NULL;
    if (!g->klo) {
      KB_TILE(mr, g->k, ap, g->rsa, bp, cp, g->beta, rs);
      continue;
    }
    /* The keys every row of the group sees go through the register tile;
     * what single rows see beyond that, row by row. */
    int64_t lo = 0, hi = g->k;
    for (int r = 0; r < mr; r++) {
      lo = g->klo[i0 + r] > lo ? g->klo[i0 + r] : lo;
      hi = g->khi[i0 + r] < hi ? g->khi[i0 + r] : hi;
    }
    if (hi < lo) hi = lo;
    KB_TILE(mr, hi - lo, ap + lo * g->csa, g->rsa, bp + lo * g->ldb, cp, g->beta, rs);
    for (int r = 0; r < mr; r++) {
      const int64_t a0 = g->klo[i0 + r], b1 = g->khi[i0 + r];
      const int64_t a1 = b1 < lo ? b1 : lo, b0 = a0 > hi ? a0 : hi;
      const float *ar = ap + r * g->rsa;
      if (a0 < a1)
        KB_TILE(1, a1 - a0, ar + a0 * g->csa, 0, bp + a0 * g->ldb, cp + r * g->ldc, 1, NULL);
      if (b0 < b1)
        KB_TILE(1, b1 - b0, ar + b0 * g->csa, 0, bp + b0 * g->ldb, cp + r * g->ldc, 1, NULL);
    }
  }
}
#undef KB_TILE

static void SFX(gemm)(const fa_gemm *g) {
  int64_t j0 = 0;
#ifdef KB_WIDE
  if (g->bw == 2 * FA_VL)
    for (; j0 + 2 * g->bw <= g->n; j0 += 2 * g->bw) SFX(gemm_cols)(g, j0, 2, 1);
#endif
  for (; j0 < g->n; j0 += g->bw)
    SFX(gemm_cols)(g, j0, (int)((g->n - j0 < g->bw ? g->n - j0 : g->bw) / FA_VL), 0);
}

/* ---- softmax ------------------------------------------------------------- */

/* softmax_cols in base 2 (E2) or base e (decode's scores are natural units),
 * 16 columns at a time where the vectors have them (KB_WIDE_END) */
static inline __attribute__((always_inline)) void SFX(softmax_cols_base)(const int E2, float *ST,
                                                                         int64_t lds, int64_t nc,
                                                                         int64_t ncol, float *m,
                                                                         float *l, float *alpha) {
  int64_t i = 0;
#ifdef KB_WIDE
  for (; i < KB_WIDE_END(ncol); i += 2 * FA_VL)
    SFX(softmax_chunk_w)(E2, ST + i, lds, nc, m + i, l + i, alpha + i);
#endif
  for (; i < ncol; i += FA_VL) SFX(softmax_chunk)(E2, ST + i, lds, nc, m + i, l + i, alpha + i);
}

static void SFX(softmax_cols)(float *ST, int64_t lds, int64_t nc, int64_t ncol, float *m, float *l,
                              float *alpha) {
  SFX(softmax_cols_base)(1, ST, lds, nc, ncol, m, l, alpha);
}

static void SFX(softmax_step_cols)(float *ST, int64_t lds, int64_t nc, int64_t ncol, float *m,
                                   float *l, float *alpha) {
  SFX(softmax_cols_base)(0, ST, lds, nc, ncol, m, l, alpha);
}

/* n floats of x -> vectors, with -inf (or 0) in the lanes past n */
static inline vf SFX(load_tail)(const float *x, int64_t n, float fill) {
  float t[FA_VL];
  for (int q = 0; q < FA_VL; q++) t[q] = q < n ? x[q] : fill;
  return vf_load(t);
}

static inline void SFX(store_tail)(float *x, int64_t n, vf v) {
  float t[FA_VL];
  vf_store(t, v);
  for (int64_t q = 0; q < n; q++) x[q] = t[q];
}

static inline float SFX(hsum)(vf v) {
  float t[FA_VL], s = 0.0f;
  vf_store(t, v);
  for (int q = 0; q < FA_VL; q++) s += t[q];
  return s;
}

static inline float SFX(hmax)(vf v) {
  float t[FA_VL], s = -INFINITY;
  vf_store(t, v);
  for (int q = 0; q < FA_VL; q++) s = t[q] > s ? t[q] : s;
  return s;
}

static void SFX(softmax_rows)(float *S, int64_t lds, int64_t nr, int64_t n, const int32_t *lo,
                              const int32_t *hi, float *lse) {
  for (int64_t r = 0; r < nr; r++) {
    float *s = S + r * lds;
    const int64_t a = lo[r], b = hi[r] > lo[r] ? hi[r] : lo[r];
    vf mx = vf_set1(-INFINITY);
    int64_t j = a;
    for (; j + FA_VL <= b; j += FA_VL) mx = vf_max(vf_load(s + j), mx);
    if (j < b) mx = vf_max(SFX(load_tail)(s + j, b - j, -INFINITY), mx);
    const float m = SFX(hmax)(mx), mref = m == -INFINITY ? 0.0f : m;
    const vf vmref = vf_set1(mref);
    vf sum = vf_set1(0.0f);
    for (j = a; j + FA_VL <= b; j += FA_VL) {
      const vf p = SFX(vexp)(vf_sub(vf_load(s + j), vmref));
      vf_store(s + j, p);
      sum = vf_add(sum, p);
    }
    if (j < b) {
      const vf p = SFX(vexp)(vf_sub(SFX(load_tail)(s + j, b - j, -INFINITY), vmref));
      SFX(store_tail)(s + j, b - j, p);
      sum = vf_add(sum, p);
    }
    const float l = SFX(hsum)(sum), inv = l > 0.0f ? 1.0f / l : 0.0f;
    lse[r] = l > 0.0f ? mref + logf(l) : l == 0.0f ? -INFINITY : l;
    const vf vinv = vf_set1(inv);
    for (j = a; j + FA_VL <= b; j += FA_VL) vf_store(s + j, vf_mul(vf_load(s + j), vinv));
    for (; j < b; j++) s[j] *= inv;
    for (j = 0; j < a; j++) s[j] = 0.0f;
    for (j = b; j < n; j++) s[j] = 0.0f;
  }
}

static void SFX(exp_rows)(float *S, int64_t lds, int64_t nr, int64_t n, const float *lse) {
  const int64_t jw = KB_WIDE_END(n), jn = fa_round_up(n, FA_VL);
  for (int64_t r = 0; r < nr; r++) {
    float *s = S + r * lds;
    if (lse[r] == -INFINITY) {
      memset(s, 0, (size_t)n * sizeof(float));
      continue;
    }
#ifdef KB_WIDE
    SFX(exp_span_w)(s, 0, jw, lse[r]);
#endif
    SFX(exp_span)(s, jw, jn, lse[r]);
  }
}

static void SFX(dsoftmax)(float *dP, const float *P, int64_t ld, int64_t nr, int64_t n,
                          const float *Di, const float *T) {
  const int64_t jw = KB_WIDE_END(n), jn = fa_round_up(n, FA_VL);
  for (int64_t r = 0; r < nr; r++) {
    float *g = dP + r * ld;
    const float *p = P + r * ld, *t = T ? T + r * ld : NULL;
#ifdef KB_WIDE
    SFX(dsoftmax_span_w)(g, p, t, 0, jw, Di[r]);
#endif
    SFX(dsoftmax_span)(g, p, t, jw, jn, Di[r]);
  }
}

static void SFX(exp)(float *x, int64_t n) {
  int64_t i = 0;
  for (; i + FA_VL <= n; i += FA_VL) vf_store(x + i, SFX(vexp)(vf_load(x + i)));
  if (i < n) SFX(store_tail)(x + i, n - i, SFX(vexp)(SFX(load_tail)(x + i, n - i, 0)));
}

static float SFX(rowdot)(const float *a, const float *b, int64_t n) {
  vf acc = vf_set1(0.0f);
  for (int64_t i = 0; i < n; i++) acc = vf_fma(vf_set1(a[i]), vf_set1(b[i]), acc);
  float t[FA_VL];
  vf_store(t, acc);
  return t[0];
}

/* ---- decode: row-wise online softmax ------------------------------------- */

static void SFX(softmax_step_rows)(float *S, int64_t lds, int64_t nr, int64_t n, float *m, float *l,
                                   float *alpha) {
  for (int64_t r = 0; r < nr; r++) {
    float *s = S + r * lds;
    vf mx = vf_set1(m[r]), mx2 = mx;
    int64_t j = 0;
    for (; j + 2 * FA_VL <= n; j += 2 * FA_VL) {
      mx = vf_max(vf_load(s + j), mx);
      mx2 = vf_max(vf_load(s + j + FA_VL), mx2);
    }
    if (j < n) mx = vf_max(vf_load(s + j), mx);
    const float mn = SFX(hmax)(vf_max(mx2, mx)), mref = mn == -INFINITY ? 0.0f : mn;
    const vf vmr = vf_set1(mref);
    vf sum = vf_set1(0.0f), sum2 = sum;
    for (j = 0; j + 2 * FA_VL <= n; j += 2 * FA_VL) {
      const vf p0 = SFX(vexp)(vf_sub(vf_load(s + j), vmr));
      const vf p1 = SFX(vexp)(vf_sub(vf_load(s + j + FA_VL), vmr));
      vf_store(s + j, p0);
      vf_store(s + j + FA_VL, p1);
      sum = vf_add(sum, p0);
      sum2 = vf_add(sum2, p1);
    }
    if (j < n) {
      const vf p0 = SFX(vexp)(vf_sub(vf_load(s + j), vmr));
      vf_store(s + j, p0);
      sum = vf_add(sum, p0);
    }
    float al[FA_VL];
    vf_store(al, SFX(vexp)(vf_set1(m[r] - mref)));
    alpha[r] = al[0];
    l[r] = al[0] * l[r] + SFX(hsum)(vf_add(sum, sum2));
    m[r] = mn;
  }
}

/* ---- loads and stores ----------------------------------------------------- */

/* 8 elements of a storage row to float32 (f16 and bf16 in registers). */
static inline vf SFX(load8)(const void *src, int64_t i, fa_dtype dt) {
  switch (dt) {
    case FA_DTYPE_F32:
      return vf_load((const float *)src + i);
    case FA_DTYPE_F16:
      return vf_load_f16((const uint16_t *)src + i);
    case FA_DTYPE_BF16:
      return vf_load_bf16((const uint16_t *)src + i);
    default: {
      float t[FA_VL] = {0}; /* an unknown dtype writes nothing */
      fa_load_row_f32(t, (const char *)src + i * (int64_t)fa_dtype_bytes(dt), dt, FA_VL);
      return vf_load(t);
    }
  }
}

/* Row of d elements to float32 at dst[c / bw * dps + c % bw], zero-padded to
 * a whole vector. */
static inline void SFX(load_row)(float *dst, int bw, int64_t dps, const void *src, fa_dtype dt,
                                 int64_t d) {
  int64_t c = 0;
  for (float *o = dst; c + FA_VL <= d; o += dps - bw) /* panel by panel: no division */
    for (int q = 0; q < bw && c + FA_VL <= d; q += FA_VL, c += FA_VL, o += FA_VL)
      vf_store(o, SFX(load8)(src, c, dt));
  if (c < d) {
    float t[FA_VL] = {0};
    fa_load_row_f32(t, (const char *)src + c * (int64_t)fa_dtype_bytes(dt), dt, d - c);
    memcpy(dst + c / bw * dps + c % bw, t, sizeof t);
  }
}

static void SFX(load_panels)(float *dst, int bw, int64_t dps, const void *src, int64_t stride,
                             fa_dtype dt, int64_t nr, int64_t d) {
  for (int64_t r = 0; r < nr; r++)
    SFX(load_row)(dst + r * bw, bw, dps, (const char *)src + r * stride, dt, d);
}

static void SFX(load_panels_t)(float *dst, int bw, int64_t dps, const void *src, int64_t stride,
                               fa_dtype dt, int64_t nr, int64_t d) {
  /* 8 rows at a time: converted into a row block, then 8 x 8 transposes put
   * each column's 8 rows into one vector store (bw is a multiple of 8) */
  float rows[FA_VL][FA_MAX_HEADDIM + FA_VL];
  const int64_t nrp = fa_round_up(nr, bw), dv = fa_round_up(d, FA_VL);
  const int64_t bytes = d * (int64_t)fa_dtype_bytes(dt);
  for (int64_t r0 = 0; r0 < nrp; r0 += FA_VL) {
    /* the next 8 rows, a row stride apart (too far for the hardware
     * prefetcher), while these convert */
    for (int64_t q = r0 + FA_VL; q < r0 + 2 * FA_VL && q < nr; q++)
      for (int64_t o = 0; o < bytes; o += 64)
        __builtin_prefetch((const char *)src + q * stride + o);
    for (int q = 0; q < FA_VL; q++) {
      if (r0 + q < nr) SFX(load_row)
      (rows[q], FA_MAX_HEADDIM + FA_VL, 0, (const char *)src + (r0 + q) * stride, dt, d);
      else memset(rows[q], 0, sizeof rows[q]); /* load_row zero-pads its last vector */
    }
    float *o = dst + r0 / bw * dps + r0 % bw;
    for (int64_t c0 = 0; c0 < dv; c0 += FA_VL) {
      vf v[FA_VL];
      for (int q = 0; q < FA_VL; q++) v[q] = vf_load(rows[q] + c0);
      vf_transpose8(v);
      for (int q = 0; q < FA_VL && c0 + q < d; q++) vf_store(o + (c0 + q) * bw, v[q]);
    }
  }
}

/* One row of d elements to float32, zero-padded to a whole vector; the
 * dtype's loop is chosen once per row, not per vector. */
static inline void SFX(conv_row)(float *dst, const char *src, fa_dtype dt, int64_t d) {
  const int64_t dv = d / FA_VL * FA_VL;
  int64_t c = 0;
  if (dt == FA_DTYPE_F16)
    for (; c < dv; c += FA_VL) vf_store(dst + c, vf_load_f16((const uint16_t *)src + c));
  else if (dt == FA_DTYPE_BF16)
    for (; c < dv; c += FA_VL) vf_store(dst + c, vf_load_bf16((const uint16_t *)src + c));
  else if (dt == FA_DTYPE_F32)
    for (; c < dv; c += FA_VL) vf_store(dst + c, vf_load((const float *)src + c));
  if (c < d) /* row-major: one panel as wide as any row */
    SFX(load_row)
  (dst + c, FA_MAX_HEADDIM + FA_VL, 0, src + c * (int64_t)fa_dtype_bytes(dt), dt, d - c);
}

static void SFX(load_kv)(float *K, float *V, int64_t ld, const void *k, int64_t ks, const void *v,
                         int64_t vs, fa_dtype dt, int64_t nr, int64_t d, int64_t pf, int64_t npf) {
  const int64_t bytes = d * (int64_t)fa_dtype_bytes(dt);
  const char *kc = (const char *)k, *vc = (const char *)v;
  for (int64_t r = 0; r < nr; r++) {
    if (r + pf < npf)
      for (int64_t o = 0; o < bytes; o += 64) {
        __builtin_prefetch(kc + (r + pf) * ks + o);
        __builtin_prefetch(vc + (r + pf) * vs + o);
      }
    SFX(conv_row)(K + r * ld, kc + r * ks, dt, d);
    SFX(conv_row)(V + r * ld, vc + r * vs, dt, d);
  }
}

/* fn(T, ...) with T the dtype dt as a constant: f16, bf16, else f32. */
#define KB_BY_DT(dt, fn, ...)         \
  do {                                \
    if ((dt) == FA_DTYPE_F16)         \
      fn(FA_DTYPE_F16, __VA_ARGS__);  \
    else if ((dt) == FA_DTYPE_BF16)   \
      fn(FA_DTYPE_BF16, __VA_ARGS__); \
    else                              \
      fn(FA_DTYPE_F32, __VA_ARGS__);  \
  } while (0)

static inline void SFX(prefetch_row)(const char *row, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(row + o);
}

/* dots_kv's register tile: RG query rows x KB_DOT_NV * 8 / RG keys, one
 * vector of sums per 8 products (two where the ISA has 32 registers: K
 * vectors then serve 4 rows x 4 keys, not 4 x 2). */
enum { KB_DOT_NV = KB_REGS >= 32 ? 2 : 1 };

/* Lane rl*KG + kl of the results (KG = KB_DOT_NV * 8 / RG keys) is row rl
 * against key kl, each K vector converted once for the RG rows. */
static inline __attribute__((always_inline)) void SFX(dots_tile)(const fa_dtype dt, const int RG,
                                                                 const float *q, int64_t ldq,
                                                                 const char *const *kr, int64_t d,
                                                                 float *out) {
  const int KG = KB_DOT_NV * FA_VL / RG;
  vf acc[KB_DOT_NV * FA_VL];
#pragma GCC unroll 16
  for (int t = 0; t < KB_DOT_NV * FA_VL; t++) acc[t] = vf_set1(0.0f);
  for (int64_t c = 0; c < d; c += FA_VL) {
    vf kv[KB_DOT_NV * FA_VL];
#pragma GCC unroll 16
    for (int kl = 0; kl < KG; kl++) kv[kl] = SFX(kv_load)(kr[kl], c, dt);
#pragma GCC unroll 4
    for (int rl = 0; rl < RG; rl++) {
      const vf x = vf_load(q + rl * ldq + c);
#pragma GCC unroll 16
      for (int kl = 0; kl < KG; kl++) acc[rl * KG + kl] = vf_fma(x, kv[kl], acc[rl * KG + kl]);
    }
  }
#pragma GCC unroll 2
  for (int v = 0; v < KB_DOT_NV; v++) vf_store(out + v * FA_VL, vf_sum8(acc + v * FA_VL));
}

#define KB_DT(RG)                                                                               \
  static void SFX(dots_tile##RG)(const float *q, int64_t ldq, const char *const *kr, int64_t d, \
                                 fa_dtype dt, float *out) {                                     \
    KB_BY_DT(dt, SFX(dots_tile), RG, q, ldq, kr, d, out);                                       \
  }
KB_DT(1)
KB_DT(2)
KB_DT(4)
#undef KB_DT

static void SFX(dots_kv)(int64_t m, int64_t n, int64_t d, const float *Q, int64_t ldq,
                         const void *k, int64_t ks, fa_dtype dt, float *S, int64_t lds, float alpha,
                         int64_t pf, int64_t npf) {
  const char *kc = (const char *)k;
  const int64_t bytes = d * (int64_t)fa_dtype_bytes(dt);
  for (int64_t r0 = 0; r0 < m;) {
    const int RG = m - r0 >= 4 ? 4 : m - r0 >= 2 ? 2 : 1, KG = KB_DOT_NV * FA_VL / RG;
    for (int64_t j0 = 0; j0 < n; j0 += KG) {
      const char *kr[KB_DOT_NV * FA_VL];
      for (int t = 0; t < KG; t++) { /* past n: repeat the last row, discarded */
        kr[t] = kc + (j0 + t < n ? j0 + t : n - 1) * ks;
        if (r0 == 0 && j0 + t + pf < npf) SFX(prefetch_row)(kc + (j0 + t + pf) * ks, bytes);
      }
      const float *q = Q + r0 * ldq;
      float t8[KB_DOT_NV * FA_VL];
      if (RG == 4)
        SFX(dots_tile4)(q, ldq, kr, d, dt, t8);
      else if (RG == 2)
        SFX(dots_tile2)(q, ldq, kr, d, dt, t8);
      else
        SFX(dots_tile1)(q, ldq, kr, d, dt, t8);
      for (int rl = 0; rl < RG; rl++)
        for (int kl = 0; kl < KG && j0 + kl < n; kl++)
          S[(r0 + rl) * lds + j0 + kl] = alpha * t8[rl * KG + kl];
    }
    r0 += RG;
  }
}

/* Columns [c0, c0 + 8*CG) of one O row += P_j V_j over keys [a, b). */
static inline __attribute__((always_inline)) void SFX(pv_kv_cols)(
    const fa_dtype dt, const int CG, const float *p, const char *vc, int64_t vs, float *o, float s,
    int64_t a, int64_t b, int64_t c0, int64_t bytes, int64_t pf, int64_t npf) {
  vf acc[8];
  const vf vs1 = vf_set1(s);
#pragma GCC unroll 8
  for (int t = 0; t < CG; t++) acc[t] = vf_mul(vf_load(o + c0 + FA_VL * t), vs1);
  for (int64_t j = a; j < b; j++) {
    if (j + pf < npf && c0 == 0) SFX(prefetch_row)(vc + (j + pf) * vs, bytes);
    const vf pj = vf_set1(p[j]);
    const char *row = vc + j * vs;
#pragma GCC unroll 8
    for (int t = 0; t < CG; t++)
      acc[t] = vf_fma(pj, SFX(kv_load)(row, c0 + FA_VL * t, dt), acc[t]);
  }
#pragma GCC unroll 8
  for (int t = 0; t < CG; t++) vf_store(o + c0 + FA_VL * t, acc[t]);
}

#define KB_PVC(CG)                                                                         \
  static void SFX(pv_kv_cols##CG)(const float *p, const char *vc, int64_t vs, fa_dtype dt, \
                                  float *o, float s, int64_t a, int64_t b, int64_t c0,     \
                                  int64_t bytes, int64_t pf, int64_t npf) {                \
    KB_BY_DT(dt, SFX(pv_kv_cols), CG, p, vc, vs, o, s, a, b, c0, bytes, pf, npf);          \
  }
KB_PVC(1)
KB_PVC(2)
KB_PVC(3)
KB_PVC(4)
KB_PVC(5)
KB_PVC(6)
KB_PVC(7)
KB_PVC(8)
#undef KB_PVC

typedef void (*SFX(pvc_fn))(const float *, const char *, int64_t, fa_dtype, float *, float, int64_t,
                            int64_t, int64_t, int64_t, int64_t, int64_t);
static const SFX(pvc_fn) SFX(pvcs)[9] = {NULL,
                                         SFX(pv_kv_cols1),
                                         SFX(pv_kv_cols2),
                                         SFX(pv_kv_cols3),
                                         SFX(pv_kv_cols4),
                                         SFX(pv_kv_cols5),
                                         SFX(pv_kv_cols6),
                                         SFX(pv_kv_cols7),
                                         SFX(pv_kv_cols8)};

/* Column vectors per pv_tile: 4 rows x 3 (2 x 6) in 16 registers, 4 x 4
 * (2 x 8) where the ISA has 32: D = 128 then splits into whole tiles with no
 * row-by-row remainder (GQA decode, 4 rows per K/V head: +13% in cache). */
enum { KB_PV_CG4 = KB_REGS >= 32 ? 4 : 3, KB_PV_CG2 = 2 * KB_PV_CG4 };

/* RG rows x CG column vectors of O += P V over keys [0, n), each V vector
 * converted once for the RG rows (RG * CG <= 16 accumulators). */
static inline __attribute__((always_inline)) void SFX(pv_tile)(
    const fa_dtype dt, const int RG, const int CG, const float *P, int64_t ldp, const char *vc,
    int64_t vs, float *O, int64_t ldo, const float *rowscale, int64_t n, int64_t c0) {
  vf acc[4][8];
#pragma GCC unroll 4
  for (int rl = 0; rl < RG; rl++) {
    const vf s1 = vf_set1(rowscale ? rowscale[rl] : 1.0f);
#pragma GCC unroll 8
    for (int t = 0; t < CG; t++) acc[rl][t] = vf_mul(vf_load(O + rl * ldo + c0 + FA_VL * t), s1);
  }
  for (int64_t j = 0; j < n; j++) {
    vf vv[8];
    const char *row = vc + j * vs;
#pragma GCC unroll 8
    for (int t = 0; t < CG; t++) vv[t] = SFX(kv_load)(row, c0 + FA_VL * t, dt);
#pragma GCC unroll 4
    for (int rl = 0; rl < RG; rl++) {
      const vf pj = vf_set1(P[rl * ldp + j]);
#pragma GCC unroll 8
      for (int t = 0; t < CG; t++) acc[rl][t] = vf_fma(pj, vv[t], acc[rl][t]);
    }
  }
#pragma GCC unroll 4
  for (int rl = 0; rl < RG; rl++)
#pragma GCC unroll 8
    for (int t = 0; t < CG; t++) vf_store(O + rl * ldo + c0 + FA_VL * t, acc[rl][t]);
}

#define KB_PVT(RG, CG)                                                                    \
  static void SFX(pv_tile##RG)(const float *P, int64_t ldp, const char *vc, int64_t vs,   \
                               fa_dtype dt, float *O, int64_t ldo, const float *rowscale, \
                               int64_t n, int64_t c0) {                                   \
    KB_BY_DT(dt, SFX(pv_tile), RG, CG, P, ldp, vc, vs, O, ldo, rowscale, n, c0);          \
  }
KB_PVT(2, KB_PV_CG2)
KB_PVT(4, KB_PV_CG4)
#undef KB_PVT

static void SFX(pv_kv)(int64_t m, int64_t n, int64_t d, const float *P, int64_t ldp, const void *v,
                       int64_t vs, fa_dtype dt, float *O, int64_t ldo, const float *rowscale,
                       const int32_t *lo, const int32_t *hi, int64_t pf, int64_t npf) {
  const int64_t bytes = d * (int64_t)fa_dtype_bytes(dt);
  int64_t r = 0;
  if (!lo && m > 1) { /* row groups share each V vector; a row's columns past whole groups below */
    for (int64_t j = 0; j < npf - pf && j < n; j++)
      SFX(prefetch_row)((const char *)v + (j + pf) * vs, bytes);
    pf = 0, npf = 0;
    for (; r + 2 <= m; r += m - r >= 4 ? 4 : 2) {
      const int RG = m - r >= 4 ? 4 : 2, CG = RG == 4 ? KB_PV_CG4 : KB_PV_CG2;
      int64_t c0 = 0;
      for (; c0 + CG * FA_VL <= d; c0 += CG * FA_VL)
        (RG == 4 ? SFX(pv_tile4) : SFX(pv_tile2))(P + r * ldp, ldp, (const char *)v, vs, dt,
                                                  O + r * ldo, ldo, rowscale ? rowscale + r : NULL,
                                                  n, c0);
      for (int64_t rr = r; rr < r + RG && c0 < d; rr++)
        for (int64_t c1 = c0; c1 < d; c1 += 8 * FA_VL) {
          const int cg = (int)((d - c1 < 8 * FA_VL ? d - c1 : 8 * FA_VL) / FA_VL);
          SFX(pvcs)
          [cg](P + rr * ldp, (const char *)v, vs, dt, O + rr * ldo, rowscale ? rowscale[rr] : 1.0f,
               0, n, c1, bytes, 0, 0);
        }
    }
  }
  for (; r < m; r++) {
    const int64_t a = lo ? lo[r] : 0, b = hi ? hi[r] : n;
    for (int64_t c0 = 0; c0 < d; c0 += 8 * FA_VL) {
      const int cg = (int)((d - c0 < 8 * FA_VL ? d - c0 : 8 * FA_VL) / FA_VL);
      SFX(pvcs)
      [cg](P + r * ldp, (const char *)v, vs, dt, O + r * ldo, rowscale ? rowscale[r] : 1.0f, a, b,
           c0, bytes, r == 0 ? pf : npf, npf);
    }
  }
}

/* ---- decode in key-row order ---------------------------------------------- */

/* Whether the key-row kernels take several keys a pass over the query (or
 * O) rows of a call, loading each of their vectors once for them: when those
 * rows (nr x d floats) outgrow half of L1 (MHA) or all of it (GQA). Below,
 * key after key reads the rows in address order, which streamed better: on a
 * Zen 4 host, 64 and 48 heads of 128 (MHA) went 17-25% faster blocked, 48
 * query heads on 24 K/V heads (24 KiB) 15% slower, 64 on 32 (32 KiB) faster. */
static inline int SFX(rows_blocked)(const int SG, int64_t nr, int64_t d) {
  return nr * d * (int64_t)sizeof(float) > (SG == 1 ? 16 << 10 : (32 << 10) - 1);
}

/* One query row per query head: key j's row holds every K/V head's part side
 * by side, and reading it whole, in address order, is what the hardware
 * prefetcher streams (head by head, a head's 256 bytes every 2 KiB, it
 * fetched half the bandwidth on a Zen 4 host). Under GQA the SG =
 * group rows of a K/V head share its part: each K or V vector is converted
 * once for them. */
static inline __attribute__((always_inline)) void SFX(dots_rows_dt)(
    const fa_dtype dt, const int SG, int64_t nr, int64_t n, int64_t d, const float *Q, int64_t ldq,
    const char *k, int64_t ks, int64_t khs, int64_t group, float *ST, int64_t ldst, float alpha) {
  /* two chains a row (FMA latency) while the run has few rows */
  const int CH = SG <= 2 || (SG == 4 && KB_REGS >= 32) ? 2 : 1;
  const vf va = vf_set1(alpha), zero = vf_set1(0.0f);
  int64_t j = 0;
  /* Q rows past L1 (rows_blocked): two keys a pass over them, four rows at a
   * time, each Q vector loaded once for both keys (as P V does with O) */
  if (SFX(rows_blocked)(SG, nr, d))
    for (; j + 2 <= n; j += 2)
      for (int64_t r0 = 0; r0 < fa_round_up(nr, FA_VL); r0 += 4) {
        vf a[8]; /* a[t * 4 + g]: row r0 + g, key j + t */
#pragma GCC unroll 8
        for (int e = 0; e < 8; e++) a[e] = zero;
#pragma GCC unroll 4
        for (int g = 0; g < 4; g += SG) { /* rows r0 + g .. + SG - 1: one K part */
          const int64_t r = r0 + g;
          if (r >= nr) break; /* lanes past nr: 0 */
          const float *q = Q + r * ldq;
          const char *kh = k + j * ks + (r / group) * khs;
          for (int64_t c = 0; c < d; c += FA_VL) {
            const vf k0 = SFX(kv_load)(kh, c, dt), k1 = SFX(kv_load)(kh + ks, c, dt);
#pragma GCC unroll 4
            for (int s = 0; s < SG; s++) {
              const vf qv = vf_load(q + s * ldq + c);
              a[g + s] = vf_fma(qv, k0, a[g + s]);
              a[4 + g + s] = vf_fma(qv, k1, a[4 + g + s]);
            }
          }
        }
        float sums[FA_VL];
        vf_store(sums, vf_mul(va, vf_sum8(a)));
        for (int g = 0; g < 4; g++) {
          ST[j * ldst + r0 + g] = sums[g];
          ST[(j + 1) * ldst + r0 + g] = sums[4 + g];
        }
      }
  for (; j < n; j++)
    for (int64_t r0 = 0; r0 < nr; r0 += FA_VL) {
      vf acc[FA_VL];
#pragma GCC unroll 8
      for (int s0 = 0; s0 < FA_VL; s0 += SG) { /* rows r0 + s0 .. + SG - 1: one K part */
        const int64_t r = r0 + s0;
        vf a[4][2]; /* lanes past nr: 0, no loads (a group is wholly in or out) */
#pragma GCC unroll 8
        for (int g = 0; g < SG; g++) a[g][0] = a[g][1] = zero;
        if (r < nr) {
          const float *q = Q + r * ldq;
          const char *kh = k + j * ks + (r / group) * khs;
          int64_t c = 0;
          for (; c + 2 * FA_VL <= d; c += 2 * FA_VL) {
            const vf k0 = SFX(kv_load)(kh, c, dt), k1 = SFX(kv_load)(kh, c + FA_VL, dt);
#pragma GCC unroll 8
            for (int g = 0; g < SG; g++) {
              a[g][0] = vf_fma(vf_load(q + g * ldq + c), k0, a[g][0]);
              a[g][CH - 1] = vf_fma(vf_load(q + g * ldq + c + FA_VL), k1, a[g][CH - 1]);
            }
          }
          if (c < d) {
            const vf k0 = SFX(kv_load)(kh, c, dt);
#pragma GCC unroll 8
            for (int g = 0; g < SG; g++) a[g][0] = vf_fma(vf_load(q + g * ldq + c), k0, a[g][0]);
          }
        }
#pragma GCC unroll 8
        for (int g = 0; g < SG; g++) acc[s0 + g] = CH == 2 ? vf_add(a[g][0], a[g][1]) : a[g][0];
      }
      vf_store(ST + j * ldst + r0, vf_mul(va, vf_sum8(acc)));
    }
}

/* fn(T, SG, ...) with the group (1, 2 or 4) as a constant */
#define KB_BY_RUN(group, dt, fn, ...)   \
  do {                                  \
    if ((group) == 4)                   \
      KB_BY_DT(dt, fn, 4, __VA_ARGS__); \
    else if ((group) == 2)              \
      KB_BY_DT(dt, fn, 2, __VA_ARGS__); \
    else                                \
      KB_BY_DT(dt, fn, 1, __VA_ARGS__); \
  } while (0)

static void SFX(dots_rows)(int64_t nr, int64_t n, int64_t d, const float *Q, int64_t ldq,
                           const void *k, int64_t ks, int64_t khs, int64_t group, fa_dtype dt,
                           float *ST, int64_t ldst, float alpha) {
  KB_BY_RUN(group, dt, SFX(dots_rows_dt), nr, n, d, Q, ldq, (const char *)k, ks, khs, group, ST,
            ldst, alpha);
}

/* O rows r < nr += the products of keys j .. j + KB - 1, added in key order
 * (each O vector loaded and stored once for them; with KB > 1 the same
 * roundings as key by key). */
static inline __attribute__((always_inline)) void SFX(pv_keys)(
    const fa_dtype dt, const int SG, const int KB, int64_t j, int64_t nr, int64_t d,
    const float *PT, int64_t ldp, const char *v, int64_t vs, int64_t vhs, int64_t group, float *O,
    int64_t ldo) {
  const int64_t cw = KB_WIDE_END(d), cn = fa_round_up(d, FA_VL);
  for (int64_t r = 0; r < nr; r += SG) {
    float pt[4][4];
#pragma GCC unroll 4
    for (int t = 0; t < KB; t++)
#pragma GCC unroll 4
      for (int g = 0; g < SG; g++) pt[t][g] = PT[(j + t) * ldp + r + g];
    const char *vh = v + j * vs + (r / group) * vhs;
    float *o = O + r * ldo;
#ifdef KB_WIDE
    SFX(pv_span_w)(dt, SG, KB, (const float(*)[4])pt, vh, vs, o, ldo, 0, cw);
#endif
    SFX(pv_span)(dt, SG, KB, (const float(*)[4])pt, vh, vs, o, ldo, cw, cn);
  }
}

/* The O rows stay in L1 (H x D floats) and take one key at a time, so V is
 * read in address order too; rows past L1 (rows_blocked) take 4 keys a pass
 * (2 under GQA). */
static inline __attribute__((always_inline)) void SFX(pv_rows_dt)(
    const fa_dtype dt, const int SG, int64_t nr, int64_t n, int64_t d, const float *PT, int64_t ldp,
    const char *v, int64_t vs, int64_t vhs, int64_t group, float *O, int64_t ldo,
    const float *rowscale) {
  for (int64_t r = 0; rowscale && r < nr; r++) {
    const vf s = vf_set1(rowscale[r]);
    float *o = O + r * ldo;
    for (int64_t c = 0; c < d; c += FA_VL) vf_store(o + c, vf_mul(vf_load(o + c), s));
  }
  const int KB = SG == 1 ? 4 : 2;
  int64_t j = 0;
  if (SFX(rows_blocked)(SG, nr, d))
    for (; j + KB <= n; j += KB)
      SFX(pv_keys)(dt, SG, KB, j, nr, d, PT, ldp, v, vs, vhs, group, O, ldo);
  for (; j < n; j++) SFX(pv_keys)(dt, SG, 1, j, nr, d, PT, ldp, v, vs, vhs, group, O, ldo);
}

static void SFX(pv_rows)(int64_t nr, int64_t n, int64_t d, const float *PT, int64_t ldp,
                         const void *v, int64_t vs, int64_t vhs, int64_t group, fa_dtype dt,
                         float *O, int64_t ldo, const float *rowscale) {
  KB_BY_RUN(group, dt, SFX(pv_rows_dt), nr, n, d, PT, ldp, (const char *)v, vs, vhs, group, O, ldo,
            rowscale);
}

static void SFX(store_row)(void *dst, const float *src, float s, fa_dtype dt, int64_t n) {
  const vf vs = vf_set1(s);
  int64_t i = 0;
  if (dt == FA_DTYPE_F32 || dt == FA_DTYPE_F16)
    for (; i + FA_VL <= n; i += FA_VL) {
      const vf v = vf_mul(vf_load(src + i), vs);
      if (dt == FA_DTYPE_F32)
        vf_store((float *)dst + i, v);
      else
        vf_store_f16((uint16_t *)dst + i, v);
    }
  for (; i < n; i++) {
    const float v = src[i] * s;
    fa_store_row_f32((char *)dst + i * (int64_t)fa_dtype_bytes(dt), &v, dt, 1);
  }
}

/* ---- dropout --------------------------------------------------------------- */

/* fa_philox4x32_10 on eight counters: lane g of w[0..3] is counter g's words. */
static inline void SFX(philox8)(vi w[4], uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; r++) {
    if (r) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const vi hi0 = vi_mulhi(w[0], 0xD2511F53u), lo0 = vi_mullo(w[0], 0xD2511F53u);
    const vi hi1 = vi_mulhi(w[2], 0xCD9E8D57u), lo1 = vi_mullo(w[2], 0xCD9E8D57u);
    w[0] = vi_xor(vi_xor(hi1, w[1]), vi_set1(k0));
    w[1] = lo1;
    w[2] = vi_xor(vi_xor(hi0, w[3]), vi_set1(k1));
    w[3] = lo0;
  }
}

/* 32 keys (8 counters of 4 words) per draw; the multipliers go through a
 * small table because X may be strided along the keys (the forward's S^T). */
static void SFX(dropout)(float *X, int64_t rs, int64_t cs, int64_t nr, int64_t nc, uint64_t bh,
                         int64_t r0, int64_t c0, const fa_dropout *d) {
  float mul[4][8];
  for (int64_t t = 0; t < nr; t++) {
    float *x = X + t * rs; /* x[(j - c0) * cs] is key j */
    for (int64_t j = c0 & ~(int64_t)3; j < c0 + nc; j += 32) {
      vi w[4] = {vi_iota((uint32_t)(j >> 2) + d->col4), vi_set1((uint32_t)(r0 + t) + d->row0),
                 vi_set1((uint32_t)bh), vi_set1(d->offset_lo)};
      SFX(philox8)(w, d->k0, d->k1);
      for (int q = 0; q < 4; q++) vf_store(mul[q], vf_sel_ge_u(w[q], d->threshold, d->keep_scale));
      const int64_t a = j > c0 ? j : c0, b = j + 32 < c0 + nc ? j + 32 : c0 + nc;
      for (int64_t k = a; k < b; k++) x[(k - c0) * cs] *= mul[k & 3][(k - j) >> 2];
    }
  }
}

const fa_kern SFX(fa_kern) = {
    KB_ISA,
#ifdef KB_WIDE
    2 * FA_VL,
#else
    FA_VL,
#endif
    SFX(gemm),
    SFX(softmax_cols),
    SFX(softmax_rows),
    SFX(exp_rows),
    SFX(dsoftmax),
    SFX(load_panels),
    SFX(load_panels_t),
    SFX(store_row),
    SFX(rowdot),
    SFX(exp),
    SFX(softmax_step_rows),
    SFX(load_kv),
    SFX(dots_kv),
    SFX(pv_kv),
    SFX(dropout),
    SFX(softmax_step_cols),
    SFX(dots_rows),
    SFX(pv_rows),
};
