/* The CPU kernels of kern.h, written once over an 8-lane float vector. The
 * including file defines vf, vi (8 x uint32) and these operations, then SFX:
 *   vf_load/vf_store (unaligned), vf_set1, vf_add, vf_sub, vf_mul,
 *   vf_fma(a, b, c) = a*b + c, vf_max(a, b) / vf_min(a, b) (b when either is NaN),
 *   vf_sel_eq(x, y, a, b) = x == y ? a : b, vf_sel_ne0(p, a) = p != 0 ? a : 0,
 *   vf_bits/vf_from_bits (reinterpret), vi_add_shl23(u, k) = (u + k) << 23,
 *   vf_load_f16(const uint16_t *), vf_store_f16(uint16_t *, vf).
 * Nothing here depends on the ISA otherwise, so both paths share every
 * summation order and differ only in FMA contraction. */
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "common/convert.h"
#include "common/kern.h"

#define KB_L2E 1.44269504088896341f

/* e^x: x = n ln2 + r with n = round(x log2 e) and r reduced in two FMA steps
 * (Cody-Waite: n ln2_hi is exact), e^r by a degree-6 minimax polynomial on
 * [-ln2/2, ln2/2] (approximation error 1.9e-9) in Horner form with FMA, and
 * 2^n built in the exponent bits. Measured: max relative error 1.2e-7 (1 ulp)
 * over 1e8 points of [-87, 88], e^0 = 1 exactly; results below ~2^-126.5 flush
 * to 0, -inf gives 0, NaN stays NaN. */
static inline vf SFX(vexp)(vf x) {
  const vf magic = vf_set1(12582912.0f); /* 1.5 * 2^23: y + magic rounds y to an integer */
  x = vf_max(vf_set1(-88.0f), x);
  x = vf_min(vf_set1(88.7f), x);
  const vf t = vf_fma(x, vf_set1(KB_L2E), magic);
  const vf n = vf_sub(t, magic);
  vf r = vf_fma(n, vf_set1(-0.693359375f), x);
  r = vf_fma(n, vf_set1(2.12194440e-4f), r);
  vf p = vf_set1(1.3836845990719037e-3f);
  p = vf_fma(p, r, vf_set1(8.374815804362865e-3f));
  p = vf_fma(p, r, vf_set1(4.166822556952568e-2f));
  p = vf_fma(p, r, vf_set1(1.6666420169849686e-1f));
  p = vf_fma(p, r, vf_set1(4.9999992079816696e-1f));
  p = vf_fma(p, r, vf_set1(1.0000000363231976f));
  p = vf_fma(p, r, vf_set1(1.0f));
  /* t's bits are magic's + n: 2^n = (bits - magic + 127) << 23 */
  return vf_mul(p, vf_from_bits(vi_add_shl23(vf_bits(t), 127u - 0x4b400000u)));
}

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
#undef KB_UKR

/* Register tile height per vectors per panel, and [vectors][rows]. */
static const int SFX(ukr_mr)[4] = {0, 8, 6, 4};
static const SFX(ukr_fn) SFX(ukrs)[4][9] = {
    {0},
    {NULL, SFX(ukr_1x1), SFX(ukr_2x1), SFX(ukr_3x1), SFX(ukr_4x1), SFX(ukr_5x1), SFX(ukr_6x1),
     SFX(ukr_7x1), SFX(ukr_8x1)},
    {NULL, SFX(ukr_1x2), SFX(ukr_2x2), SFX(ukr_3x2), SFX(ukr_4x2), SFX(ukr_5x2), SFX(ukr_6x2)},
    {NULL, SFX(ukr_1x3), SFX(ukr_2x3), SFX(ukr_3x3), SFX(ukr_4x3)},
};

static void SFX(gemm)(const fa_gemm *g) {
  for (int64_t j0 = 0; j0 < g->n; j0 += g->bw) {
    const int nv = (int)((g->n - j0 < g->bw ? g->n - j0 : g->bw) / FA_VL);
    const int MR = SFX(ukr_mr)[nv];
    const float *bp = g->b + j0 / g->bw * g->bps;
    for (int64_t i0 = 0; i0 < g->m; i0 += MR) {
      const int mr = (int)(g->m - i0 < MR ? g->m - i0 : MR);
      const float *ap = g->a + i0 * g->rsa;
      float *cp = g->c + i0 * g->ldc + j0;
      const float *rs = g->rowscale ? g->rowscale + i0 : NULL;
      if (!g->klo) {
        SFX(ukrs)[nv][mr](g->k, ap, g->rsa, g->csa, bp, g->ldb, cp, g->ldc, g->alpha, g->beta, rs);
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
      SFX(ukrs)
      [nv][mr](hi - lo, ap + lo * g->csa, g->rsa, g->csa, bp + lo * g->ldb, g->ldb, cp, g->ldc,
               g->alpha, g->beta, rs);
      for (int r = 0; r < mr; r++) {
        const int64_t a0 = g->klo[i0 + r], b1 = g->khi[i0 + r];
        const int64_t a1 = b1 < lo ? b1 : lo, b0 = a0 > hi ? a0 : hi;
        const float *ar = ap + r * g->rsa;
        if (a0 < a1) SFX(ukrs)
        [nv][1](a1 - a0, ar + a0 * g->csa, 0, g->csa, bp + a0 * g->ldb, g->ldb, cp + r * g->ldc,
                g->ldc, g->alpha, 1, NULL);
        if (b0 < b1) SFX(ukrs)
        [nv][1](b1 - b0, ar + b0 * g->csa, 0, g->csa, bp + b0 * g->ldb, g->ldb, cp + r * g->ldc,
                g->ldc, g->alpha, 1, NULL);
      }
    }
  }
}

/* ---- softmax ------------------------------------------------------------- */

static void SFX(softmax_cols)(float *ST, int64_t lds, int64_t nc, int64_t ncol, float *m, float *l,
                              float *alpha) {
  const vf ninf = vf_set1(-INFINITY), zero = vf_set1(0.0f);
  for (int64_t i = 0; i < ncol; i += FA_VL) {
    const vf mo = vf_load(m + i);
    vf mx = mo, mx2 = mo;
    int64_t j = 0;
    for (; j + 2 <= nc; j += 2) { /* two chains: max latency, not throughput, binds */
      mx = vf_max(vf_load(ST + j * lds + i), mx);
      mx2 = vf_max(vf_load(ST + (j + 1) * lds + i), mx2);
    }
    if (j < nc) mx = vf_max(vf_load(ST + j * lds + i), mx);
    mx = vf_max(mx2, mx);
    /* exponents relative to 0 while a column has seen no finite score */
    const vf mref = vf_sel_eq(mx, ninf, zero, mx);
    vf sum = zero, sum2 = zero;
    for (j = 0; j + 2 <= nc; j += 2) {
      float *s0 = ST + j * lds + i, *s1 = s0 + lds;
      const vf p0 = SFX(vexp)(vf_sub(vf_load(s0), mref));
      const vf p1 = SFX(vexp)(vf_sub(vf_load(s1), mref));
      vf_store(s0, p0);
      vf_store(s1, p1);
      sum = vf_add(sum, p0);
      sum2 = vf_add(sum2, p1);
    }
    if (j < nc) {
      float *s0 = ST + j * lds + i;
      const vf p0 = SFX(vexp)(vf_sub(vf_load(s0), mref));
      vf_store(s0, p0);
      sum = vf_add(sum, p0);
    }
    const vf al = SFX(vexp)(vf_sub(mo, mref));
    vf_store(alpha + i, al);
    vf_store(l + i, vf_fma(al, vf_load(l + i), vf_add(sum, sum2)));
    vf_store(m + i, mx);
  }
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
  for (int64_t r = 0; r < nr; r++) {
    float *s = S + r * lds;
    if (lse[r] == -INFINITY) {
      memset(s, 0, (size_t)n * sizeof(float));
      continue;
    }
    const vf vl = vf_set1(lse[r]);
    for (int64_t j = 0; j < n; j += FA_VL) vf_store(s + j, SFX(vexp)(vf_sub(vf_load(s + j), vl)));
  }
}

static void SFX(dsoftmax)(float *dP, const float *P, int64_t ld, int64_t nr, int64_t n,
                          const float *Di, const float *T) {
  const vf one = vf_set1(1.0f);
  for (int64_t r = 0; r < nr; r++) {
    float *g = dP + r * ld;
    const float *p = P + r * ld, *t = T ? T + r * ld : NULL;
    const vf di = vf_set1(Di[r]);
    for (int64_t j = 0; j < n; j += FA_VL) {
      const vf pv = vf_load(p + j);
      vf x = vf_mul(pv, vf_sub(vf_load(g + j), di));
      if (t) {
        const vf tv = vf_load(t + j);
        x = vf_mul(x, vf_sub(one, vf_mul(tv, tv)));
      }
      vf_store(g + j, vf_sel_ne0(pv, x));
    }
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

/* ---- loads and stores ----------------------------------------------------- */

/* 8 elements of a storage row to float32 (f16 through vf_load_f16). */
static inline vf SFX(load8)(const void *src, int64_t i, fa_dtype dt) {
  switch (dt) {
    case FA_DTYPE_F32:
      return vf_load((const float *)src + i);
    case FA_DTYPE_F16:
      return vf_load_f16((const uint16_t *)src + i);
    default: {
      float t[FA_VL];
      fa_load_row_f32(t, (const char *)src + i * (int64_t)fa_dtype_size(dt), dt, FA_VL);
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
    fa_load_row_f32(t, (const char *)src + c * (int64_t)fa_dtype_size(dt), dt, d - c);
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
  float row[FA_MAX_HEADDIM + FA_VL];
  const int64_t nrp = fa_round_up(nr, bw);
  for (int64_t r = 0; r < nrp; r++) {
    float *o = dst + r / bw * dps + r % bw;
    if (r < nr)
      SFX(load_row)(row, FA_MAX_HEADDIM + FA_VL, 0, (const char *)src + r * stride, dt, d);
    for (int64_t c = 0; c < d; c++) o[c * bw] = r < nr ? row[c] : 0.0f;
  }
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
    fa_store_row_f32((char *)dst + i * (int64_t)fa_dtype_size(dt), &v, dt, 1);
  }
}

const fa_kern SFX(fa_kern) = {
    KB_ISA,         SFX(gemm),     SFX(softmax_cols), SFX(softmax_rows),
    SFX(exp_rows),  SFX(dsoftmax), SFX(load_panels),  SFX(load_panels_t),
    SFX(store_row), SFX(rowdot),   SFX(exp),
};
