/* Standard attention (Algorithm 0): S = scale * Q K^T and P = softmax(S) are
 * materialised per (sequence, head), then O = P V. In float64 storage it is the
 * oracle every test compares against (the simple body of standard_impl.h); in
 * f32/f16/bf16 it is the baseline every benchmark compares against, forward
 * and backward in standard_fast.c (P is rounded to the storage type, as
 * Algorithm 0 writes it to memory). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "common/convert.h"
#include "common/dtype.h"
#include "common/mask.h"
#include "common/philox.h"
#include "ref/standard_fast.h"

/* Rounds a P value to what the storage dtype can hold. */
static inline float fa_round_to_storage(float x, fa_dtype dt) {
  switch (dt) {
    case FA_DTYPE_F16:
      return fa_f16_to_f32(fa_f32_to_f16(x));
    case FA_DTYPE_BF16:
      return fa_bf16_to_f32(fa_f32_to_bf16(x));
    default:
      return x;
  }
}

static inline void fa_load_row_f64(double *dst, const void *src, fa_dtype dt, int64_t n) {
  int64_t i;
  switch (dt) {
    case FA_DTYPE_F64:
      memcpy(dst, src, (size_t)n * sizeof(double));
      break;
    case FA_DTYPE_F32:
      for (i = 0; i < n; i++) dst[i] = ((const float *)src)[i];
      break;
    case FA_DTYPE_F16:
      for (i = 0; i < n; i++) dst[i] = fa_f16_to_f32(((const uint16_t *)src)[i]);
      break;
    case FA_DTYPE_BF16:
      for (i = 0; i < n; i++) dst[i] = fa_bf16_to_f32(((const uint16_t *)src)[i]);
      break;
  }
}

static inline void fa_store_row_f64(void *dst, const double *src, fa_dtype dt, int64_t n) {
  int64_t i;
  if (dt == FA_DTYPE_F64) {
    memcpy(dst, src, (size_t)n * sizeof(double));
    return;
  }
  for (i = 0; i < n; i++) {
    float f = (float)src[i];
    fa_store_row_f32((char *)dst + i * (int64_t)fa_dtype_bytes(dt), &f, dt, 1);
  }
}

static size_t fa_align64(size_t n) { return (n + 63) & ~(size_t)63; }

#define REAL double
#define SFX(name) name##_f64
#define LOAD_ROW fa_load_row_f64
#define STORE_ROW fa_store_row_f64
#define EXP exp
#define LOG log
#define TANH tanh
#include "standard_impl.h"
#undef REAL
#undef SFX
#undef LOAD_ROW
#undef STORE_ROW
#undef EXP
#undef LOG
#undef TANH

size_t fa_ref_forward_workspace(const fa_problem *pb) {
  return pb->dtype == FA_DTYPE_F64 ? ref_fwd_workspace_f64(pb) : fa_ref_fast_forward_workspace(pb);
}
size_t fa_ref_backward_workspace(const fa_problem *pb) {
  return pb->dtype == FA_DTYPE_F64 ? ref_bwd_workspace_f64(pb) : fa_ref_fast_backward_workspace(pb);
}
fa_status fa_ref_forward(const fa_problem *pb) {
  return pb->dtype == FA_DTYPE_F64 ? ref_forward_f64(pb) : fa_ref_fast_forward(pb);
}
fa_status fa_ref_backward(const fa_problem *pb) {
  return pb->dtype == FA_DTYPE_F64 ? ref_backward_f64(pb) : fa_ref_fast_backward(pb);
}
size_t fa_ref_probs_workspace(const fa_problem *pb) { return ref_probs_workspace_f64(pb); }
fa_status fa_ref_probs(const fa_problem *pb) { return ref_probs_f64(pb); }
