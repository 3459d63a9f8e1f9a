/* Float32 tile primitives of the CPU backend. A tile is a row-major block
 * with a leading dimension (ld, in floats); every inner loop runs over a
 * contiguous row with a fixed summation order, so the compiler can vectorise
 * it and results are bitwise reproducible. Kernels are written in terms of
 * these; performance work (register blocking, AVX2) replaces their bodies. */
#ifndef FA_CPU_TILE_H
#define FA_CPU_TILE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* C[r][c] = alpha * sum_d A[r][d] * BT[d][c] for r < nr, c < nc: A is nr x D,
 * BT the transposed (D x nc) second operand. S = Q K^T and dP = dO V^T. */
static inline void tile_abt(float *restrict C, int64_t ldc, const float *restrict A, int64_t lda,
                            int64_t nr, const float *restrict BT, int64_t ldb, int64_t nc,
                            int64_t D, float alpha) {
  for (int64_t r = 0; r < nr; r++) {
    float *restrict c = C + r * ldc;
    const float *restrict a = A + r * lda;
    for (int64_t j = 0; j < nc; j++) c[j] = 0.0f;
    for (int64_t d = 0; d < D; d++) {
      const float ad = a[d];
      const float *restrict b = BT + d * ldb;
      for (int64_t j = 0; j < nc; j++) c[j] += ad * b[j];
    }
    if (alpha != 1.0f)
      for (int64_t j = 0; j < nc; j++) c[j] *= alpha;
  }
}

/* C[r] += sum_c P[r][c] * B[c] (rows of D floats), skipping P == 0 so that
 * masked keys contribute nothing even if B holds inf. O += P V, dQ += dS K. */
static inline void tile_ab_acc(float *restrict C, int64_t ldc, const float *restrict P,
                               int64_t ldp, int64_t nr, int64_t nc, const float *restrict B,
                               int64_t ldb, int64_t D) {
  for (int64_t r = 0; r < nr; r++) {
    float *restrict c = C + r * ldc;
    const float *restrict p = P + r * ldp;
    for (int64_t j = 0; j < nc; j++) {
      const float pj = p[j];
      if (pj == 0.0f) continue;
      const float *restrict b = B + j * ldb;
      for (int64_t d = 0; d < D; d++) c[d] += pj * b[d];
    }
  }
}

/* C[c] += sum_r P[r][c] * B[r] (rows of D floats), skipping P == 0.
 * dV += P^T dO, dK += dS^T Q. */
static inline void tile_atb_acc(float *restrict C, int64_t ldc, const float *restrict P,
                                int64_t ldp, int64_t nr, int64_t nc, const float *restrict B,
                                int64_t ldb, int64_t D) {
  for (int64_t j = 0; j < nc; j++) {
    float *restrict c = C + j * ldc;
    for (int64_t r = 0; r < nr; r++) {
      const float pr = P[r * ldp + j];
      if (pr == 0.0f) continue;
      const float *restrict b = B + r * ldb;
      for (int64_t d = 0; d < D; d++) c[d] += pr * b[d];
    }
  }
}

/* dst[c][r] = src[r][c] for r < rows, c < cols. */
static inline void tile_transpose(float *restrict dst, int64_t ldd, const float *restrict src,
                                  int64_t lds, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++) dst[c * ldd + r] = src[r * lds + c];
}

static inline void tile_fill(float *C, int64_t ldc, int64_t nr, int64_t nc, float x) {
  for (int64_t r = 0; r < nr; r++)
    for (int64_t j = 0; j < nc; j++) C[r * ldc + j] = x;
}

static inline void tile_scale(float *C, int64_t ldc, int64_t nr, int64_t nc, float x) {
  for (int64_t r = 0; r < nr; r++)
    for (int64_t j = 0; j < nc; j++) C[r * ldc + j] *= x;
}

/* Row r of C scaled by alpha[r] (the online-softmax correction e^(m - m_new)). */
static inline void tile_scale_rows(float *C, int64_t ldc, int64_t nr, int64_t nc,
                                   const float *alpha) {
  for (int64_t r = 0; r < nr; r++) {
    const float a = alpha[r];
    if (a == 1.0f) continue;
    for (int64_t j = 0; j < nc; j++) C[r * ldc + j] *= a;
  }
}

/* s = cap * tanh(s / cap); T (optional) keeps tanh for the backward chain rule. */
static inline void tile_softcap(float *S, int64_t lds, int64_t nr, int64_t nc, float cap,
                                float *T) {
  const float inv = 1.0f / cap;
  for (int64_t r = 0; r < nr; r++) {
    float *s = S + r * lds;
    for (int64_t j = 0; j < nc; j++) {
      const float t = tanhf(s[j] * inv);
      s[j] = cap * t;
      if (T) T[r * lds + j] = t;
    }
  }
}

/* ALiBi bias -slope * |diag - col| where row r's diagonal is diag0 + r and
 * column j is col0 + j (diag0 = first row + Nk - Nq). */
static inline void tile_alibi(float *S, int64_t lds, int64_t nr, int64_t nc, float slope,
                              int64_t diag0, int64_t col0) {
  for (int64_t r = 0; r < nr; r++) {
    float *s = S + r * lds;
    const int64_t off = diag0 + r - col0;
    for (int64_t j = 0; j < nc; j++) {
      const int64_t dist = off - j;
      s[j] -= slope * (float)(dist < 0 ? -dist : dist);
    }
  }
}

/* Online softmax over one key tile. S (nr x nc scores, -inf where masked) is
 * turned into P = exp(S - m_new) in place; m, l are updated and alpha[r] =
 * e^(m_old - m_new) is the factor the caller applies to its O rows. Rows that
 * have seen nothing but masked keys keep m = -inf, l = 0, P = 0, alpha = 1. */
static inline void tile_softmax_update(float *S, int64_t lds, int64_t nr, int64_t nc, float *m,
                                       float *l, float *alpha) {
  for (int64_t r = 0; r < nr; r++) {
    float *s = S + r * lds;
    float mx = m[r];
    for (int64_t j = 0; j < nc; j++) mx = s[j] > mx ? s[j] : mx;
    if (mx == -INFINITY) { /* keep NaN scores (NaN inputs) so they reach O and l */
      float sum = 0.0f;
      for (int64_t j = 0; j < nc; j++) {
        s[j] = s[j] == -INFINITY ? 0.0f : s[j];
        sum += s[j];
      }
      alpha[r] = 1.0f;
      l[r] += sum;
      continue;
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < nc; j++) {
      s[j] = expf(s[j] - mx);
      sum += s[j];
    }
    alpha[r] = expf(m[r] - mx);
    l[r] = alpha[r] * l[r] + sum;
    m[r] = mx;
  }
}

/* O[r] /= l[r] and lse[r] = m[r] + log(l[r]); a row with l = 0 (fully masked)
 * gets O = 0 and lse = -inf; a NaN l (NaN inputs) propagates. */
static inline void tile_softmax_finish(float *O, int64_t ldo, int64_t nr, int64_t D,
                                       const float *m, const float *l, float *lse) {
  for (int64_t r = 0; r < nr; r++) {
    float *o = O + r * ldo;
    if (l[r] == 0.0f) {
      for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
      lse[r] = -INFINITY;
    } else {
      const float inv = 1.0f / l[r];
      for (int64_t d = 0; d < D; d++) o[d] *= inv;
      lse[r] = m[r] + logf(l[r]);
    }
  }
}

/* P = exp(S - lse[r]) in place; rows with lse = -inf (fully masked) give 0. */
static inline void tile_exp_lse(float *S, int64_t lds, int64_t nr, int64_t nc,
                                const float *lse) {
  for (int64_t r = 0; r < nr; r++) {
    float *s = S + r * lds;
    const float L = lse[r];
    if (L == -INFINITY) {
      for (int64_t j = 0; j < nc; j++) s[j] = 0.0f;
      continue;
    }
    for (int64_t j = 0; j < nc; j++) s[j] = expf(s[j] - L);
  }
}

/* dS = P * (dP - Di[r]) in place of dP, times (1 - tanh^2) when T (softcap)
 * is given; 0 wherever P is 0. */
static inline void tile_dsoftmax(float *dP, int64_t ld, const float *P, int64_t nr, int64_t nc,
                                 const float *Di, const float *T) {
  for (int64_t r = 0; r < nr; r++) {
    float *g = dP + r * ld;
    const float *p = P + r * ld;
    const float di = Di[r];
    for (int64_t j = 0; j < nc; j++) g[j] = p[j] != 0.0f ? p[j] * (g[j] - di) : 0.0f;
    if (T) {
      const float *t = T + r * ld;
      for (int64_t j = 0; j < nc; j++) g[j] *= 1.0f - t[j] * t[j];
    }
  }
}

#endif
