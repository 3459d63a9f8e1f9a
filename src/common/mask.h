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
  int64_t nq, nk;      /* this sequence's lengths */
  int64_t left, right; /* window bounds; < 0: unlimited */
  int64_t diag0;       /* row i's diagonal key is i + diag0 */
} fa_mask;

/* causal is the window (unlimited, 0); causal + window clips right to <= 0.
 * The diagonal is aligned to the bottom-right corner: diag0 = nk - nq. */
FA_HD fa_mask fa_mask_make(int64_t nq, int64_t nk, int causal, int window_enabled,
                           int64_t window_left, int64_t window_right) {
  fa_mask m;
  m.nq = nq;
  m.nk = nk;
  m.left = window_enabled ? window_left : -1;
  m.right = window_enabled ? window_right : -1;
  if (causal && (m.right < 0 || m.right > 0)) m.right = 0;
  m.diag0 = nk - nq;
  return m;
}

/* A shard of one longer sequence (fa_params.shard_enabled): query row i and
 * key j sit at positions q_offset + i and k_offset + j of it, and the
 * diagonal is where the positions meet. */
FA_HD void fa_mask_shard(fa_mask *m, int64_t q_offset, int64_t k_offset) {
  m->diag0 = q_offset - k_offset;
}

/* Visible key range [*lo, *hi) of query row i; empty when *lo >= *hi. */
FA_HD void fa_mask_row_range(const fa_mask *m, int64_t i, int64_t *lo, int64_t *hi) {
  int64_t diag = i + m->diag0;
  int64_t a = 0, b = m->nk;
  if (m->left >= 0 && diag - m->left > a) a = diag - m->left;
  if (m->right >= 0 && diag + m->right + 1 < b) b = diag + m->right + 1;
  if (a > m->nk) a = m->nk; /* a shard's row whose window starts past the keys */
  *lo = a;
  *hi = b > a ? b : a;
}

/* Visible key range of the union of rows [i0, i1): tiles outside it are skipped. */
FA_HD void fa_mask_block_range(const fa_mask *m, int64_t i0, int64_t i1, int64_t *lo,
                               int64_t *hi) {
  int64_t lo0, hi0, lo1, hi1;
  fa_mask_row_range(m, i0, &lo0, &hi0);
  fa_mask_row_range(m, i1 - 1, &lo1, &hi1);
  /* both bounds are non-decreasing in i, so the band is [lo(i0), hi(i1-1)) */
  int64_t a = lo0, b = hi1 > lo0 ? hi1 : lo0;
  if (b == a) a = b = 0; /* empty (a shard's rows may see none): no tile at all */
  *lo = a;
  *hi = b;
  (void)hi0;
  (void)lo1;
}

/* Query rows [*r0, *r1) that see key column j (the transpose view, for the
 * key-outer backward pass). */
FA_HD void fa_mask_col_range(const fa_mask *m, int64_t j, int64_t *r0, int64_t *r1) {
  /* row i sees j iff diag - left <= j <= diag + right, diag = i + diag0 */
  int64_t off = m->diag0;
  int64_t a = 0, b = m->nq;
  if (m->right >= 0 && j - m->right - off > a) a = j - m->right - off;
  if (m->left >= 0 && j + m->left - off + 1 < b) b = j + m->left - off + 1;
  if (a > m->nq) a = m->nq; /* a shard's key whose window starts past the rows */
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
  int64_t d = i + m->diag0 - j;
  return -slope * (float)(d < 0 ? -d : d);
}

#ifdef __cplusplus
}
#endif

#endif
