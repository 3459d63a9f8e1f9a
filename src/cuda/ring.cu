/* Ring attention's elementwise steps on CUDA (src/ring.c orchestrates): a
 * strided copy / accumulate with dtype conversion, and the log-sum-exp merge
 * of a block's (O, lse) into float32 accumulators. Memory-bound and small
 * next to the blocks' attention; one grid-stride kernel each. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>

#include "backend.h"

namespace {

struct View {
  char *p;
  fa_dtype dt;
  int64_t N, H, D, sb, ss, sh;
};

View view_of(const fa_tensor *t) {
  return View{(char *)t->data, t->dtype,        t->seqlen,     t->heads,
              t->headdim,      t->stride_batch, t->stride_seq, t->stride_head};
}

__device__ __forceinline__ int64_t at(const View &v, int64_t row, int64_t d) {
  /* row = (b * N + n) * H + h */
  const int64_t h = row % v.H, n = row / v.H % v.N, b = row / (v.H * v.N);
  return b * v.sb + n * v.ss + h * v.sh + d;
}

__device__ __forceinline__ float ld(const View &v, int64_t i) {
  if (v.dt == FA_DTYPE_F16) return __half2float(reinterpret_cast<const __half *>(v.p)[i]);
  if (v.dt == FA_DTYPE_BF16)
    return __bfloat162float(reinterpret_cast<const __nv_bfloat16 *>(v.p)[i]);
  return reinterpret_cast<const float *>(v.p)[i];
}

__device__ __forceinline__ void st(const View &v, int64_t i, float x) {
  if (v.dt == FA_DTYPE_F16)
    reinterpret_cast<__half *>(v.p)[i] = __float2half_rn(x);
  else if (v.dt == FA_DTYPE_BF16)
    reinterpret_cast<__nv_bfloat16 *>(v.p)[i] = __float2bfloat16_rn(x);
  else
    reinterpret_cast<float *>(v.p)[i] = x;
}

__global__ void ring_add_kernel(View dst, View src, bool has_src, bool acc, float fill,
                                int64_t total) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t row = i / dst.D, d = i % dst.D, o = at(dst, row, d);
    float x = has_src ? ld(src, at(src, row, d)) : fill;
    if (acc) x += ld(dst, o);
    st(dst, o, x);
  }
}

/* One warp per row: the row's weights, then its D columns. */
__global__ void ring_merge_kernel(View acc, View lacc, View o, View l, int64_t rows) {
  const int lane = threadIdx.x & 31;
  for (int64_t row = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5; row < rows;
       row += ((int64_t)gridDim.x * blockDim.x) >> 5) {
    float *la = reinterpret_cast<float *>(lacc.p) + at(lacc, row, 0);
    const float lb = ld(l, at(l, row, 0)), lo = *la;
    if (lb == -INFINITY) continue; /* the block's row saw nothing */
    float wa = 0.f, wb = 1.f, L = lb;
    if (lo != -INFINITY) {
      const float m = fmaxf(lo, lb);
      L = m + logf(expf(lo - m) + expf(lb - m));
      wa = expf(lo - L), wb = expf(lb - L);
    }
    for (int64_t d = lane; d < acc.D; d += 32) {
      const int64_t ia = at(acc, row, d);
      const float x = wa == 0.f ? 0.f : wa * ld(acc, ia);
      st(acc, ia, x + wb * ld(o, at(o, row, d)));
    }
    __syncwarp();
    if (lane == 0) *la = L;
  }
}

int grid_for(int64_t threads) {
  const int64_t b = (threads + 255) / 256;
  return (int)(b < 4096 ? (b > 0 ? b : 1) : 4096);
}

fa_status launched(const char *what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return fa_set_error(FA_ERR_DEVICE, "cuda: %s: %s", what, cudaGetErrorString(e));
  return FA_OK;
}

}  // namespace

fa_status fa_cuda_ring_add(const fa_tensor *dst, const fa_tensor *src, int accumulate, float fill,
                           void *stream) {
  const int64_t total = dst->batch * dst->seqlen * dst->heads * dst->headdim;
  if (total == 0) return FA_OK;
  const View d = view_of(dst), s = src ? view_of(src) : d;
  ring_add_kernel<<<grid_for(total), 256, 0, (cudaStream_t)stream>>>(d, s, src != NULL,
                                                                     accumulate != 0, fill, total);
  return launched("ring add");
}

fa_status fa_cuda_ring_merge(const fa_tensor *acc, const fa_tensor *lacc, const fa_tensor *o,
                             const fa_tensor *l, void *stream) {
  const int64_t rows = acc->batch * acc->seqlen * acc->heads;
  if (rows == 0) return FA_OK;
  ring_merge_kernel<<<grid_for(rows * 32), 256, 0, (cudaStream_t)stream>>>(
      view_of(acc), view_of(lacc), view_of(o), view_of(l), rows);
  return launched("ring merge");
}
