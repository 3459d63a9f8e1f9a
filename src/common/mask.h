/* Mask and score rules shared by every backend (plain C, usable from CUDA).
 *
 * Causal and sliding-window masks are both bottom-right aligned, so for each
 * query row the visible keys form one contiguous range [lo, hi). Soft-capping
 * and ALiBi are pointwise transforms of the scaled score. */
#ifndef FA_COMMON_MASK_H
#define FA_COMMON_MASK_H

#include <stdint.h>

#ifdef __CUDACC__
#define FA_HD __host__ __device__ __forceinline__
#else
#define FA_HD static inline
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fa_mask {
  int64_t nq, nk;        /* this sequence's lengths */
  int64_t left, right;   /* window bounds; < 0: unlimited */
} fa_mask;

/* causal is the window (unlimited, 0); causal + window clips right to <= 0. */
FA_HD fa_mask fa_mask_make(int64_t nq, int64_t nk, int causal, int window_enabled,
                           int64_t window_left, int64_t window_right) {
  fa_mask m;
  m.nq = nq;
  m.nk = nk;
  m.left = window_enabled ? window_left : -1;
  m.right = window_enabled ? window_right : -1;
  if (causal && (m.right < 0 || m.right > 0)) m.right = 0;
  return m;
}

/* Visible key range [*lo, *hi) of query row i; empty when *lo >= *hi. */
FA_HD void fa_mask_row_range(const fa_mask *m, int64_t i, int64_t *lo, int64_t *hi) {
  int64_t diag = i + m->nk - m->nq;
  int64_t a = 0, b = m->nk;
  if (m->left >= 0 && diag - m->left > a) a = diag - m->left;
  if (m->right >= 0 && diag + m->right + 1 < b) b = diag + m->right + 1;
  *lo = a;
  *hi = b > a ? b : a;
}

/* Visible key range of the union of rows [i0, i1): tiles outside it are skipped. */
FA_HD void fa_mask_block_range(const fa_mask *m, int64_t i0, int64_t i1, int64_t *lo,
                               int64_t *hi) {
  int64_t lo0, hi0, lo1, hi1;
  fa_mask_row_range(m, i0, &lo0, &hi0);
  fa_mask_row_range(m, i1 - 1, &lo1, &hi1);
  *lo = lo0; /* both bounds are non-decreasing in i, so the band is [lo(i0), hi(i1-1)) */
  *hi = hi1 > *lo ? hi1 : *lo;
  (void)hi0;
  (void)lo1;
}

/* Query rows [*r0, *r1) that see key column j (the transpose view, for the
 * key-outer backward pass). */
FA_HD void fa_mask_col_range(const fa_mask *m, int64_t j, int64_t *r0, int64_t *r1) {
  /* row i sees j iff diag - left <= j <= diag + right, diag = i + nk - nq */
  int64_t off = m->nk - m->nq;
  int64_t a = 0, b = m->nq;
  if (m->right >= 0 && j - m->right - off > a) a = j - m->right - off;
  if (m->left >= 0 && j + m->left - off + 1 < b) b = j + m->left - off + 1;
  *r0 = a;
  *r1 = b > a ? b : a;
}

/* Whether a key at rel = diag - key from a row's diagonal lies inside the
 * window (keys past nk are the caller's to exclude). The element-wise form of
 * fa_mask_row_range, for kernels that hold the transposed scores; rel fits in
 * an int there (the CUDA backend limits sequences to 32-bit lengths). */
FA_HD int fa_mask_in_window(const fa_mask *m, int rel) {
  return (m->left < 0 || -rel >= -m->left) && (m->right < 0 || -rel <= m->right);
}

/* ALiBi bias of (row i, key j) for a slope. */
FA_HD float fa_alibi_bias(const fa_mask *m, float slope, int64_t i, int64_t j) {
  int64_t d = i + m->nk - m->nq - j;
  return -slope * (float)(d < 0 ? -d : d);
}

#ifdef __cplusplus
}
#endif

#endif
