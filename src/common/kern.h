/* Vectorised float32 kernels of the CPU backends (flash and standard): a
 * register-blocked matrix product, online softmax, exp, and tile loaders that
 * convert f16/bf16 on the way. One body (kern_body.h) over an 8-wide vector
 * abstraction is compiled three times: with AVX2/FMA/F16C intrinsics
 * (kern_x86.h) as such (kern_avx2.c), with AVX-512F/VL encodings
 * (kern_avx512vl.c) and with the matrix product on 512-bit vectors as well
 * (kern_avx512.c), x86-64 only, and in portable C (kern_portable.c);
 * fa_kern_get() picks one at run time. FLASHATTN_CPU_ISA=portable|avx2|
 * avx512vl|avx512 (read once) forces one the CPU has. */
#ifndef FA_COMMON_KERN_H
#define FA_COMMON_KERN_H

#include <stdint.h>

#include "common/log2.h"
#include "common/philox.h"
#include "flashattn.h"

/* Floats per vector; panel widths and padded dimensions are multiples of it. */
#define FA_VL 8

static inline int64_t fa_round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* C = alpha * A B (beta 0), or C = diag(rowscale) C + alpha * A B (beta 1,
 * rowscale NULL: 1). A(i, p) = a[i*rsa + p*csa] (any strides: transposed
 * operands cost nothing). B (k x n, n a multiple of FA_VL) is stored in
 * panels of bw columns (bw a multiple of FA_VL, n's last panel may be
 * narrower): B(p, j) = b[(j / bw) * bps + p * ldb + j % bw]; a row-major B is bps =
 * bw, ldb = its row length. Row i may restrict its sum
 * to p in [klo[i], khi[i]) (both NULL: [0, k)): masked keys are skipped, not
 * multiplied by zero, so inf/NaN in masked K/V rows cannot leak. */
typedef struct fa_gemm {
  int64_t m, n, k;
  const float *a;
  int64_t rsa, csa;
  const float *b;
  int64_t ldb, bps;
  int bw;
  float *c;
  int64_t ldc;
  float alpha;
  int beta;
  const float *rowscale;
  const int32_t *klo, *khi;
} fa_gemm;

typedef struct fa_kern {
  const char *isa; /* "avx512", "avx512vl", "avx2" or "portable" */
  int tile_lanes;  /* lanes of the matrix product's register tiles: 16 or FA_VL */

  void (*gemm)(const fa_gemm *g);

  /* Online softmax step on a transposed score tile ST (nc keys x ncol query
   * columns, ld lds; ncol a multiple of FA_VL) in base 2: the scores are in
   * log2 units (already times log2 e), and per column m = max(m, max ST),
   * ST = 2^(ST - m), l = alpha l + sum ST with alpha = 2^(m_old - m) written
   * to alpha. A column with no finite score so far keeps m = -inf and gets
   * P = 0 (NaN scores stay NaN, so NaN inputs reach O and l). */
  void (*softmax_cols)(float *ST, int64_t lds, int64_t nc, int64_t ncol, float *m, float *l,
                       float *alpha);

  /* Row-major softmax of a standard-attention row block: each of nr rows of
   * S (ld lds) restricted to [lo[r], hi[r]) becomes exp(s - max) / sum (0
   * outside), lse[r] = max + log(sum) (-inf for an empty row). */
  void (*softmax_rows)(float *S, int64_t lds, int64_t nr, int64_t n, const int32_t *lo,
                       const int32_t *hi, float *lse);

  /* S (nr x n, ld lds, n a multiple of FA_VL) = exp(S - lse[r]); rows with
   * lse = -inf give 0 (the backward's P from the forward's lse). */
  void (*exp_rows)(float *S, int64_t lds, int64_t nr, int64_t n, const float *lse);

  /* dP (nr x n) = P o (dP - Di[r]) [o (1 - T^2) if T], 0 where P is 0. */
  void (*dsoftmax)(float *dP, const float *P, int64_t ld, int64_t nr, int64_t n, const float *Di,
                   const float *T);

  /* Rows r < nr of a tensor (row r at src + r*stride bytes, d floats of dtype
   * dt) to float32 in panels of bw columns: dst[(c / bw)*dps + r*bw + c % bw],
   * columns [d, round_up(d, FA_VL)) zero. Row-major is bw = dps = padded d. */
  void (*load_panels)(float *dst, int bw, int64_t dps, const void *src, int64_t stride, fa_dtype dt,
                      int64_t nr, int64_t d);

  /* Transposed: dst[(r / bw)*dps + c*bw + r % bw] = row r, column c < d, for
   * r < round_up(nr, bw) (rows >= nr zero): the B operand of S = Q K^T; bw a
   * multiple of FA_VL. */
  void (*load_panels_t)(float *dst, int bw, int64_t dps, const void *src, int64_t stride,
                        fa_dtype dt, int64_t nr, int64_t d);

  /* n floats of src to a storage row of dtype dt, times s. */
  void (*store_row)(void *dst, const float *src, float s, fa_dtype dt, int64_t n);

  /* sum a[i] b[i] in order, rounded exactly as one lane of gemm (so D_i =
   * dO_i . O_i cancels dP_ij = dO_i . V_j bitwise when O_i = V_j). */
  float (*rowdot)(const float *a, const float *b, int64_t n);

  /* exp(x[i]) for n floats in place (the fast exp of every kernel above). */
  void (*exp)(float *x, int64_t n);

  /* softmax_cols on a row-major tile: each of nr rows of S (ld lds, n a
   * multiple of FA_VL, -inf in padding) updates its m, l and alpha. */
  void (*softmax_step_rows)(float *S, int64_t lds, int64_t nr, int64_t n, float *m, float *l,
                            float *alpha);

  /* Rows r < nr of K and V (row r at k + r*ks and v + r*vs bytes, d elements
   * of dtype dt) to float32 rows at K + r*ld and V + r*ld, zero-padded to
   * whole vectors; converting row r first prefetches rows r + pf of both where
   * r + pf < npf (rows a head-stride apart defeat the hardware prefetcher). */
  void (*load_kv)(float *K, float *V, int64_t ld, const void *k, int64_t ks, const void *v,
                  int64_t vs, fa_dtype dt, int64_t nr, int64_t d, int64_t pf, int64_t npf);

  /* dots and O += P V with K and V read straight from storage rows (dt f32,
   * f16 or bf16, d a multiple of FA_VL; row j at k + j*ks bytes), converted in
   * registers, never stored: decode's whole job is streaming K and V once.
   * dots_kv: S[r*lds + j] = alpha * sum_c Q[r*ldq + c] K_j[c], r < m, j < n.
   * pv_kv: O[r*ldo + c] = rowscale[r] O[r*ldo + c] + sum_j P[r*ldp + j] V_j[c]
   * over j in [lo[r], hi[r]) (NULL: [0, n)), c < d.
   * Both prefetch row j + pf (below npf) of their operand as they go. */
  void (*dots_kv)(int64_t m, int64_t n, int64_t d, const float *Q, int64_t ldq, const void *k,
                  int64_t ks, fa_dtype dt, float *S, int64_t lds, float alpha, int64_t pf,
                  int64_t npf);
  void (*pv_kv)(int64_t m, int64_t n, int64_t d, const float *P, int64_t ldp, const void *v,
                int64_t vs, fa_dtype dt, float *O, int64_t ldo, const float *rowscale,
                const int32_t *lo, const int32_t *hi, int64_t pf, int64_t npf);

  /* X[t*rs + j*cs] *= dropout's multiplier (0 or keep_scale) of element
   * (bh, r0 + t, c0 + j), t < nr, j < nc: the Philox4x32-10 words of
   * common/philox.h, eight counters per vector, bitwise fa_dropout_keep. */
  void (*dropout)(float *X, int64_t rs, int64_t cs, int64_t nr, int64_t nc, uint64_t bh, int64_t r0,
                  int64_t c0, const fa_dropout *d);
  /* Decode in key-row order, one query row per query head (each K or V row
   * read whole, in address order): rows group*s .. group*s + group-1 (the
   * query heads of K/V head s) read key j's part at k + j*ks + s*khs bytes
   * (dt f32, f16 or bf16, d a multiple of FA_VL; group 1, 2 or 4).
   * dots_rows: ST[j*ldst + r] = alpha * Q_r . K_j for j < n and
   * r < round_up(nr, FA_VL) (0 in the lanes past nr). softmax_step_cols:
   * softmax_cols in base e (decode's units). pv_rows: O_r = rowscale[r] O_r
   * + sum_{j<n} ST[j*ldp + r] V_j, r < nr (rowscale NULL: O_r is not scaled,
   * no pass over it). */
  void (*softmax_step_cols)(float *ST, int64_t lds, int64_t nc, int64_t ncol, float *m, float *l,
                            float *alpha);
  void (*dots_rows)(int64_t nr, int64_t n, int64_t d, const float *Q, int64_t ldq, const void *k,
                    int64_t ks, int64_t khs, int64_t group, fa_dtype dt, float *ST, int64_t ldst,
                    float alpha);
  void (*pv_rows)(int64_t nr, int64_t n, int64_t d, const float *PT, int64_t ldp, const void *v,
                  int64_t vs, int64_t vhs, int64_t group, fa_dtype dt, float *O, int64_t ldo,
                  const float *rowscale);
} fa_kern;

const fa_kern *fa_kern_get(void);

/* The tables; .gemm is NULL in an x86 one where it was not compiled in. */
extern const fa_kern fa_kern_avx512, fa_kern_avx512vl, fa_kern_avx2, fa_kern_portable;

#endif
