/* The KV-cache call's first step in host memory (fa_forward_kvcache on the
 * CPU, every algorithm): q rotated into its copy (fa_problem.q) when rotary,
 * and the new keys (rotated) and values written into each batch entry's
 * cache rows cache_seqlens[b] .. + seqlen_new - 1 (paged: through its row of
 * the block table). The attention that follows reads them like any cache
 * row. Rotations run in float32 for 16- and 32-bit types (as the CUDA
 * kernels do) and in float64 for the f64 oracle, then round to the storage
 * type. Appends run batch entry after batch entry, so entries that share a
 * cache row (cache_batch_idx) write in a fixed order. */
#include <omp.h>

#include "backend.h"
#include "common/dtype.h"
#include "common/convert.h"
#include "common/rotary.h"

static char *kv_row(const fa_tensor *t, int64_t b, int64_t n, int64_t h) {
  return (char *)t->data + fa_tensor_offset(t, b, n, h) * (int64_t)fa_dtype_bytes(t->dtype);
}

/* dst = src (D elements of dt) with its first rotary_dim columns rotated to
 * position pos (pos < 0: copied as is), through rows of REAL: float (the
 * 16- and 32-bit types) or double (f64). */
#define KV_ROTATE(NAME, REAL, LOAD, STORE)                                                     \
  static void NAME(const fa_kvcache *kv, fa_dtype dt, int64_t D, void *dst, const void *src,   \
                   int64_t pos) {                                                              \
    REAL x[FA_MAX_HEADDIM], y[FA_MAX_HEADDIM], cs[FA_MAX_HEADDIM / 2], sn[FA_MAX_HEADDIM / 2]; \
    const int64_t rd = pos >= 0 ? kv->rotary_dim : 0, half = rd / 2;                           \
    const int64_t st = kv->rotary_stride ? kv->rotary_stride : half;                           \
    const size_t es = fa_dtype_bytes(dt);                                                       \
    LOAD(x, src, dt, D);                                                                       \
    memcpy(y, x, sizeof(REAL) * (size_t)D);                                                    \
    if (half) {                                                                                \
      LOAD(cs, (const char *)kv->rotary_cos + pos * st * (int64_t)es, dt, half);               \
      LOAD(sn, (const char *)kv->rotary_sin + pos * st * (int64_t)es, dt, half);               \
    }                                                                                          \
    for (int64_t c = 0; c < half; c++) {                                                       \
      int64_t c1, c2;                                                                          \
      fa_rotary_cols(c, rd, kv->rotary_interleaved, &c1, &c2);                                 \
      y[c1] = x[c1] * cs[c] - x[c2] * sn[c];                                                   \
      y[c2] = x[c1] * sn[c] + x[c2] * cs[c];                                                   \
    }                                                                                          \
    STORE(dst, y, dt, D);                                                                      \
  }

static void kv_load_f64(double *dst, const void *src, fa_dtype dt, int64_t n) {
  (void)dt;
  memcpy(dst, src, sizeof(double) * (size_t)n);
}
static void kv_store_f64(void *dst, const double *src, fa_dtype dt, int64_t n) {
  (void)dt;
  memcpy(dst, src, sizeof(double) * (size_t)n);
}
KV_ROTATE(kv_rotate_f32, float, fa_load_row_f32, fa_store_row_f32)
KV_ROTATE(kv_rotate_f64, double, kv_load_f64, kv_store_f64)

static void kv_rotate_row(const fa_kvcache *kv, fa_dtype dt, int64_t D, void *dst, const void *src,
                          int64_t pos) {
  if (dt == FA_DTYPE_F64)
    kv_rotate_f64(kv, dt, D, dst, src, pos);
  else
    kv_rotate_f32(kv, dt, D, dst, src, pos);
}

fa_status fa_host_kvcache_prepare(const fa_problem *pb) {
  const fa_kvcache *kv = pb->kv;
  const fa_dtype dt = pb->dtype;
  const int64_t B = pb->batch, D = pb->headdim, nq = pb->q_in.seqlen;
  const int rot = kv->rotary_cos != NULL;
  if (rot) {
    const int nt = (int)(B * nq < pb->num_threads ? (B * nq > 0 ? B * nq : 1) : pb->num_threads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < B * nq; r++) {
      const int64_t b = r / nq, i = r % nq;
      const int64_t pos = fa_rotary_qpos(kv->cache_seqlens[b], i, pb->rotary_all_rows);
      for (int64_t h = 0; h < pb->heads_q; h++)
        kv_rotate_row(kv, dt, D, kv_row(&pb->q, b, i, h), kv_row(&pb->q_in, b, i, h), pos);
    }
  }
  if (!pb->k_new.data) return FA_OK;
  /* entry after entry (those sharing a cache row write in order), its new
   * rows and heads in parallel */
  const int64_t rows = pb->k_new.seqlen * pb->heads_k;
  const int nt = (int)(rows < pb->num_threads ? rows : pb->num_threads);
  for (int64_t b = 0; b < B; b++) {
    const fa_seq sq = fa_problem_seq(pb, b);
    const int64_t sl = kv->cache_seqlens[b];
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
      const int64_t i = r / pb->heads_k, h = r % pb->heads_k;
      int64_t kb, kn;
      fa_problem_krow(pb, &sq, sl + i - sq.k0, &kb, &kn);
      kv_rotate_row(kv, dt, D, kv_row(&pb->k, kb, kn, h), kv_row(&pb->k_new, b, i, h),
                    rot ? sl + i : -1);
      kv_rotate_row(kv, dt, D, kv_row(&pb->v, kb, kn, h), kv_row(&pb->v_new, b, i, h), -1);
    }
  }
  return FA_OK;
}
