/* Ring attention's elementwise steps on the CPU (src/ring.c orchestrates). */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "backend.h"
#include "common/convert.h"
#include "common/dtype.h"

static char *at(const fa_tensor *t, int64_t b, int64_t n, int64_t h) {
  return (char *)t->data + fa_tensor_offset(t, b, n, h) * (int64_t)fa_dtype_bytes(t->dtype);
}

fa_status fa_cpu_ring_add(const fa_tensor *dst, const fa_tensor *src, int accumulate, float fill,
                          int num_threads) {
  const int64_t D = dst->headdim, rows = dst->batch * dst->seqlen * dst->heads;
  float *buf = malloc(sizeof(float) * 2 * (size_t)D * (size_t)(num_threads > 0 ? num_threads : 1));
  if (!buf)
    return fa_set_error(FA_ERR_OUT_OF_MEMORY, "ring: cannot allocate %lld floats",
                        (long long)(2 * D));
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t r = 0; r < rows; r++) {
    const int64_t b = r / (dst->seqlen * dst->heads), n = r / dst->heads % dst->seqlen,
                  h = r % dst->heads;
    float *x = buf + 2 * D * omp_get_thread_num(), *y = x + D;
    if (src)
      fa_load_row_f32(x, at(src, b, n, h), src->dtype, D);
    else
      for (int64_t d = 0; d < D; d++) x[d] = fill;
    if (accumulate) {
      fa_load_row_f32(y, at(dst, b, n, h), dst->dtype, D);
      for (int64_t d = 0; d < D; d++) x[d] += y[d];
    }
    fa_store_row_f32(at(dst, b, n, h), x, dst->dtype, D);
  }
  free(buf);
  return FA_OK;
}

fa_status fa_cpu_ring_merge(const fa_tensor *acc, const fa_tensor *lacc, const fa_tensor *o,
                            const fa_tensor *l, int num_threads) {
  const int64_t D = acc->headdim, rows = acc->batch * acc->seqlen * acc->heads;
  float *buf = malloc(sizeof(float) * (size_t)D * (size_t)(num_threads > 0 ? num_threads : 1));
  if (!buf)
    return fa_set_error(FA_ERR_OUT_OF_MEMORY, "ring: cannot allocate %lld floats", (long long)D);
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t r = 0; r < rows; r++) {
    const int64_t b = r / (acc->seqlen * acc->heads), n = r / acc->heads % acc->seqlen,
                  h = r % acc->heads;
    float *la = (float *)at(lacc, b, n, h), *x = (float *)at(acc, b, n, h);
    const float lb = *(const float *)at(l, b, n, h);
    if (lb == -INFINITY) continue; /* the block's row saw nothing */
    float *ob = buf + D * omp_get_thread_num();
    fa_load_row_f32(ob, at(o, b, n, h), o->dtype, D);
    if (*la == -INFINITY) {
      for (int64_t d = 0; d < D; d++) x[d] = ob[d];
      *la = lb;
      continue;
    }
    const float m = *la > lb ? *la : lb, s = expf(*la - m) + expf(lb - m), L = m + logf(s);
    const float wa = expf(*la - L), wb = expf(lb - L);
    for (int64_t d = 0; d < D; d++) x[d] = wa * x[d] + wb * ob[d];
    *la = L;
  }
  free(buf);
  return FA_OK;
}
