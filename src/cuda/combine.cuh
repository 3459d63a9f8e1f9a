/* The combine after a split forward (FwdArgs::nsplit): each query row's
 * O from the splits' normalised partial O and lse. Both architectures'
 * forward kernels leave the same partials. */
#ifndef FA_CUDA_COMBINE_CUH
#define FA_CUDA_COMBINE_CUH

#include "attn.cuh"

namespace fa {

/* a / b and a % b, in 32 bits where both fit (a 64-bit division is a
 * subroutine of some hundred instructions) */
__device__ __forceinline__ int64_t div_rem(int64_t a, int64_t b, int64_t &rem) {
  if (a <= UINT32_MAX && b <= UINT32_MAX) {
    const uint32_t q = (uint32_t)a / (uint32_t)b;
    rem = (uint32_t)a - q * (uint32_t)b;
    return q;
  }
  const int64_t q = a / b;
  rem = a - q * b;
  return q;
}

/* C consecutive floats at src (aligned to their vector's size), or zeros */
template <int C>
__device__ __forceinline__ void load_cols(float (&x)[C], const float *src, bool live) {
  if constexpr (C % 4 == 0) {
#pragma unroll
    for (int c = 0; c < C; c += 4) {
      const float4 v = live ? *reinterpret_cast<const float4 *>(src + c) : make_float4(0, 0, 0, 0);
      x[c] = v.x, x[c + 1] = v.y, x[c + 2] = v.z, x[c + 3] = v.w;
    }
  } else if constexpr (C % 2 == 0) {
#pragma unroll
    for (int c = 0; c < C; c += 2) {
      const float2 v = live ? *reinterpret_cast<const float2 *>(src + c) : make_float2(0, 0);
      x[c] = v.x, x[c + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int c = 0; c < C; ++c) x[c] = live ? src[c] : 0.f;
  }
}

/* O and lse of each row from its splits' partials (FwdArgs::nsplit > 1):
 * weights e^(lse_s - M), M the largest lse_s; one warp per row, lanes over
 * the writing kernel's D columns. Lane s holds split s's lse (of each 32),
 * and the partials of 8 splits are loaded before any is summed: a decode
 * step's combine is then a few round trips to L2, not two per split. The
 * row's place in O is found before the wait for the partials, in 32-bit
 * arithmetic: a prefill chunk's thousands of rows spent ~3 us on 64-bit
 * divisions (H100, 8192 rows). */
template <typename T, int D>
__global__ void __launch_bounds__(256) fwd_combine_kernel(const FwdArgs p) {
  const int64_t row = (int64_t)blockIdx.x * 8 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31, ns = p.nsplit;
  if (row >= p.part_rows) return;
  /* the row's place: its lse index is lse0 + h lse_hs + r (seq_view) */
  T *dst;
  if (p.cu_q) {
    int64_t pr;
    const int64_t h = div_rem(row, p.total_q, pr);
    /* packed rows past the last sequence belong to none: never written */
    if (pr >= p.cu_q[p.batch]) return;
    dst = (T *)p.o + pr * p.o_ss + h * p.o_sh;
  } else {
    int64_t rest, r;
    const int64_t b = div_rem(row, (int64_t)p.heads_q * p.nq, rest), h = div_rem(rest, p.nq, r);
    dst = (T *)p.o + b * p.o_sb + r * p.o_ss + h * p.o_sh;
  }
  pdl_wait(); /* the split kernel's partials */
  const float *lse_of = p.part_lse + row, *o_of = p.part_o + row * D + lane * (D / 32);
  const int64_t step = p.part_rows, ostep = step * D; /* from one split's partials to the next's */
  float M = -INFINITY;
  for (int s0 = 0; s0 < ns; s0 += 32)
    if (s0 + lane < ns) M = fmaxf(M, lse_of[(s0 + lane) * step]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
  constexpr int C = D / 32, U = 8; /* columns per lane; splits loaded at once */
  float acc[C] = {}, L = 0.f;
  if (M > -INFINITY)
    for (int s0 = 0; s0 < ns; s0 += 32) {
      const int n = min(32, ns - s0);
      const float w_lane = lane < n ? __expf(lse_of[(s0 + lane) * step] - M) : 0.f;
      L += w_lane;
      for (int j0 = 0; j0 < n; j0 += U) {
        const float *po = o_of + (s0 + j0) * ostep;
        float part[U][C];
#pragma unroll
        for (int u = 0; u < U; ++u) load_cols<C>(part[u], po + u * ostep, j0 + u < n);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const float w = __shfl_sync(0xffffffffu, w_lane, (j0 + u) & 31);
#pragma unroll
          for (int c = 0; c < C; ++c) acc[c] += w * part[u][c]; /* 0 past the splits */
        }
      }
    }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
  const float inv = L > 0.f ? 1.f / L : 0.f;
  T *out = dst + lane * C;
  if (C % 2 == 0 && (lane + 1) * C <= p.d && ((uintptr_t)out & 3) == 0) {
#pragma unroll
    for (int c = 0; c + 1 < C; c += 2)
      *reinterpret_cast<uint32_t *>(out + c) = pack2<T>(acc[c] * inv, acc[c + 1] * inv);
  } else {
#pragma unroll
    for (int c = 0; c < C; ++c)
      if (lane * C + c < p.d) out[c] = T(acc[c] * inv);
  }
  if (lane == 0) p.lse[row] = L > 0.f ? M + logf(L) : -INFINITY;
}

/* The combine after a split forward; pdl: as a programmatic dependent launch
 * (the Hopper kernel triggers it at its start). */
template <typename T, int D>
fa_status fwd_combine_launch(const FwdArgs &a, cudaStream_t stream, bool pdl) {
  return launch_dependent(fwd_combine_kernel<T, D>, dim3((unsigned)((a.part_rows + 7) / 8)),
                          dim3(256), stream, pdl, a);
}

}  // namespace fa

#endif
