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
#include "common/convert.h"
#include "common/rotary.h"

static double kv_load(const void *base, fa_dtype dt, int64_t i) {
  switch (dt) {
    case FA_DTYPE_F32:
      return ((const float *)base)[i];
    case FA_DTYPE_F16:
      return fa_f16_to_f32(((const uint16_t *)base)[i]);
    case FA_DTYPE_BF16:
      return fa_bf16_to_f32(((const uint16_t *)base)[i]);
    case FA_DTYPE_F64:
      return ((const double *)base)[i];
  }
  return 0;
}

static void kv_store(void *base, fa_dtype dt, int64_t i, double x) {
  switch (dt) {
    case FA_DTYPE_F32:
      ((float *)base)[i] = (float)x;
      break;
    case FA_DTYPE_F16:
      ((uint16_t *)base)[i] = fa_f32_to_f16((float)x);
      break;
    case FA_DTYPE_BF16:
      ((uint16_t *)base)[i] = fa_f32_to_bf16((float)x);
      break;
    case FA_DTYPE_F64:
      ((double *)base)[i] = x;
      break;
  }
}

static char *kv_row(const fa_tensor *t, int64_t b, int64_t n, int64_t h) {
  return (char *)t->data + fa_tensor_offset(t, b, n, h) * (int64_t)fa_dtype_size(t->dtype);
}

/* dst = src (D elements) with its first rotary_dim columns rotated to
 * position pos (pos < 0: copied as is). dst and src may be the same row. */
static void kv_rotate_row(const fa_kvcache *kv, fa_dtype dt, int64_t D, void *dst, const void *src,
                          int64_t pos) {
  const int64_t rd = pos >= 0 ? kv->rotary_dim : 0, half = rd / 2;
  const int64_t st = kv->rotary_stride ? kv->rotary_stride : half;
  for (int64_t d = rd; d < D; d++) kv_store(dst, dt, d, kv_load(src, dt, d));
  for (int64_t c = 0; c < half; c++) {
    int64_t c1, c2;
    fa_rotary_cols(c, rd, kv->rotary_interleaved, &c1, &c2);
    const double x1 = kv_load(src, dt, c1), x2 = kv_load(src, dt, c2);
    const double cs = kv_load(kv->rotary_cos, dt, pos * st + c);
    const double sn = kv_load(kv->rotary_sin, dt, pos * st + c);
    if (dt == FA_DTYPE_F64) {
      kv_store(dst, dt, c1, x1 * cs - x2 * sn);
      kv_store(dst, dt, c2, x1 * sn + x2 * cs);
    } else {
      const float a = (float)x1, b = (float)x2, fc = (float)cs, fs = (float)sn;
      kv_store(dst, dt, c1, (double)(a * fc - b * fs));
      kv_store(dst, dt, c2, (double)(a * fs + b * fc));
    }
  }
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
  for (int64_t b = 0; b < B; b++) {
    const fa_seq sq = fa_problem_seq(pb, b);
    const int64_t sl = kv->cache_seqlens[b];
    for (int64_t i = 0; i < pb->k_new.seqlen; i++) {
      int64_t kb, kn;
      fa_problem_krow(pb, &sq, sl + i - sq.k0, &kb, &kn);
      for (int64_t h = 0; h < pb->heads_k; h++) {
        kv_rotate_row(kv, dt, D, kv_row(&pb->k, kb, kn, h), kv_row(&pb->k_new, b, i, h),
                      rot ? sl + i : -1);
        kv_rotate_row(kv, dt, D, kv_row(&pb->v, kb, kn, h), kv_row(&pb->v_new, b, i, h), -1);
      }
    }
  }
  return FA_OK;
}
