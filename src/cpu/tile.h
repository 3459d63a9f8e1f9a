/* Scalar float32 tile helpers of the CPU backend for what the vector kernels
 * (common/kern.h) leave out: fills and the optional score transforms
 * (softcap, ALiBi). A tile is a row-major block with a leading dimension (ld,
 * in floats). */
#ifndef FA_CPU_TILE_H
#define FA_CPU_TILE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline void tile_fill(float *C, int64_t ldc, int64_t nr, int64_t nc, float x) {
  for (int64_t r = 0; r < nr; r++)
    for (int64_t j = 0; j < nc; j++) C[r * ldc + j] = x;
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

/* tile_alibi on a transposed tile: S[j][i] is row diag0 + i against key col0 + j. */
static inline void tile_alibi_t(float *S, int64_t lds, int64_t nk, int64_t nq, float slope,
                                int64_t diag0, int64_t col0) {
  for (int64_t j = 0; j < nk; j++) {
    float *s = S + j * lds;
    const int64_t off = diag0 - col0 - j;
    for (int64_t i = 0; i < nq; i++) {
      const int64_t dist = off + i;
      s[i] -= slope * (float)(dist < 0 ? -dist : dist);
    }
  }
}

#endif
