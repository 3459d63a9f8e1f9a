/* The backward's row-wise kernels, shared by the sm_80 and Hopper
 * backwards: the preparation (Di = rowsum(dO o O), lse * log2(e), the
 * zeroed dQ accumulator) and the conversion of the float32 dQ accumulator
 * to the storage dtype. */
#ifndef FA_CUDA_BWD_ROWS_CUH
#define FA_CUDA_BWD_ROWS_CUH

#include "attn.cuh"

namespace fa {

/* Rows per block of the row-wise kernels (prep, convert): 8 warps x 4 rows. */
constexpr int kBwdRowsPerBlock = 32;

/* Both row kernels walk their grid backwards, so that what one kernel
 * touched last is what the next one starts with, still in L2: the prep
 * kernel ends on the first sequence's first heads (their dO rows and zeroed dQ
 * rows), where the kv kernel begins, and the convert kernel begins on the dQ
 * rows the kv kernel reduced last (block-sparse masks, whose dQ traffic
 * does not shrink with density; docs/PERF.md). The Hopper conversion follows
 * the kv kernel's order instead (sm90::bwd_convert_kernel): it overlaps it. */
__device__ __forceinline__ dim3 rows_block() {
  return dim3(gridDim.x - 1 - blockIdx.x, gridDim.y - 1 - blockIdx.y, gridDim.z - 1 - blockIdx.z);
}

/* Di = rowsum(dO o O), lse2, zeroed dQ accumulator (and kv_done counters)
 * for the block's kBwdRowsPerBlock rows. A row is TPR threads, each 8
 * columns (one 16-byte load of O and one of dO), so a pass covers 256 / TPR
 * rows, and every load of every pass is issued before any sum: the kernel
 * reads at the memory's rate instead of waiting on one row after another
 * (one warp per row, a row at a time, left 24 of 32 lanes idle at D = 64 and
 * ran 1.8x cuDNN's preparation on an H100; docs/PERF.md). */
template <typename T, int DP>
__global__ void __launch_bounds__(256) bwd_prep_kernel(const BwdArgs p) {
  constexpr float LOG2E = FA_LOG2E;
  constexpr int TPR = DP <= 64 ? 8 : DP <= 128 ? 16 : 32; /* a pass: at most the block */
  constexpr int RPP = 256 / TPR, PASSES = kBwdRowsPerBlock / RPP;
  static_assert(TPR * 8 >= DP && PASSES * RPP == kBwdRowsPerBlock, "a thread's 8 columns");
  const dim3 blk = rows_block();
  const int b = blk.z, h = blk.y, sub = threadIdx.x % TPR, c = sub * 8;
  if (p.kv_done && blk.x == 0 && h % p.group == 0 && threadIdx.x == 0)
    *kv_done_of(p, b, h / p.group) = 0;
  if (p.kv_ticket && blk.x == 0 && h == 0 && b == 0 && threadIdx.x == 0) *p.kv_ticket = 0;
  const SeqView sv = seq_view(p, b);
  const int row0 = blk.x * kBwdRowsPerBlock, rows = min(kBwdRowsPerBlock, sv.nq - row0);
  if (rows <= 0) return;
  const int64_t idx0 = sv.lse0 + h * sv.lse_hs + row0; /* the block's first row's index */
  uint4 ov[PASSES], gv[PASSES];
  float lse[PASSES];
#pragma unroll
  for (int i = 0; i < PASSES; ++i) {
    const int r = i * RPP + (int)threadIdx.x / TPR;
    ov[i] = gv[i] = make_uint4(0, 0, 0, 0);
    lse[i] = 0.f;
    if (r >= rows) continue;
    const T *o = (const T *)p.o + row_off(sv, false, p.o_sb, p.o_ss, p.o_sh, row0 + r, h);
    const T *dO = (const T *)p.dout + row_off(sv, false, p.do_sb, p.do_ss, p.do_sh, row0 + r, h);
    if (c + 8 <= p.d) {
      ov[i] = *reinterpret_cast<const uint4 *>(o + c);
      gv[i] = *reinterpret_cast<const uint4 *>(dO + c);
    } else if (c < p.d) { /* the last columns of a head dim that is not a multiple of 8 */
      T ot[8] = {}, gt[8] = {};
      for (int e = 0; c + e < p.d; ++e) ot[e] = o[c + e], gt[e] = dO[c + e];
      memcpy(&ov[i], ot, 16);
      memcpy(&gv[i], gt, 16);
    }
    if (sub == 0) lse[i] = p.lse[idx0 + r];
  }
  /* the accumulator's rows are contiguous: zero them while the loads fly */
  if (p.dq_acc) {
    float4 *acc = reinterpret_cast<float4 *>(p.dq_acc + idx0 * DP);
    for (int j = threadIdx.x; j < rows * DP / 4; j += 256) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
#pragma unroll
  for (int i = 0; i < PASSES; ++i) {
    const uint32_t ar[4] = {ov[i].x, ov[i].y, ov[i].z, ov[i].w};
    const uint32_t gr[4] = {gv[i].x, gv[i].y, gv[i].z, gv[i].w};
    float sum = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 x = unpack2<T>(ar[e]), y = unpack2<T>(gr[e]);
      sum = fmaf(x.x, y.x, fmaf(x.y, y.y, sum));
    }
#pragma unroll
    for (int off = TPR / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    const int r = i * RPP + (int)threadIdx.x / TPR;
    if (sub == 0 && r < rows) {
      p.dsum[idx0 + r] = sum;
      p.lse2[idx0 + r] = lse[i] == -INFINITY ? INFINITY : lse[i] * LOG2E;
      if (p.dq_sem) p.dq_sem[idx0 + r] = 0;
    }
  }
}

/* dQ = scale * accumulator, in the storage dtype, for rows [x
 * kBwdRowsPerBlock, +kBwdRowsPerBlock) of head h of sequence b; 256 threads,
 * each warp kBwdRowsPerBlock / 8 rows, a lane 8 columns. A warp's rows are
 * all loaded before any is stored, so their loads are in flight together. */
template <typename T, int DP>
__device__ __forceinline__ void bwd_dq_convert_rows(const BwdArgs &p, int b, int h, int x) {
  static_assert(DP <= 256, "a lane's 8 columns cover the row");
  constexpr int R = kBwdRowsPerBlock / 8;
  const int c = (threadIdx.x & 31) * 8, row0 = x * kBwdRowsPerBlock + (threadIdx.x >> 5) * R;
  const SeqView sv = seq_view(p, b);
  const int rows = min(R, sv.nq - row0);
  if (c >= p.d || rows <= 0) return;
  float4 v[R][2];
#pragma unroll
  for (int i = 0; i < R; ++i)
    if (i < rows) {
      const float *src = p.dq_acc + (sv.lse0 + h * sv.lse_hs + row0 + i) * DP + c;
      v[i][0] = *reinterpret_cast<const float4 *>(src);
      v[i][1] = *reinterpret_cast<const float4 *>(src + 4);
    }
#pragma unroll
  for (int i = 0; i < R; ++i)
    if (i < rows) {
      T *dst = (T *)p.dq + row_off(sv, false, p.dq_sb, p.dq_ss, p.dq_sh, row0 + i, h) + c;
      const float4 lo = v[i][0], hi = v[i][1];
      if (c + 8 <= p.d) {
        uint4 r;
        r.x = pack2<T>(lo.x * p.scale, lo.y * p.scale);
        r.y = pack2<T>(lo.z * p.scale, lo.w * p.scale);
        r.z = pack2<T>(hi.x * p.scale, hi.y * p.scale);
        r.w = pack2<T>(hi.z * p.scale, hi.w * p.scale);
        *reinterpret_cast<uint4 *>(dst) = r;
      } else {
        const float e8[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        for (int e = 0; e < p.d - c; ++e) dst[e] = T(e8[e] * p.scale);
      }
    }
}

template <typename T, int DP>
__global__ void __launch_bounds__(256) bwd_dq_convert_kernel(const BwdArgs p) {
  const dim3 blk = rows_block();
  bwd_dq_convert_rows<T, DP>(p, blk.z, blk.y, blk.x);
}

/* Launch 1 (convert false: Di, lse2, zeroed dQ accumulator) or launch 3
 * (convert true: dQ from the accumulator) for padded head dim D. Compiled
 * once per (dtype, head dim), in the sm_80 backward's instantiation files (the
 * declarations below), and reused by the Hopper backward. */
template <typename T, int D>
fa_status bwd_rows_launch(const BwdArgs &a, cudaStream_t stream, bool convert) {
  const dim3 rows_grid((unsigned)((a.max_seqlen_q + kBwdRowsPerBlock - 1) / kBwdRowsPerBlock),
                       (unsigned)a.heads_q, (unsigned)a.batch);
  if (rows_grid.x == 0) return FA_OK; /* a zero grid is an error */
  if (convert)
    bwd_dq_convert_kernel<T, D><<<rows_grid, 256, 0, stream>>>(a);
  else
    bwd_prep_kernel<T, D><<<rows_grid, 256, 0, stream>>>(a);
  return launch_status();
}

#define FA_DECLARE_BWD_ROWS(D)                                                               \
  extern template fa_status bwd_rows_launch<__half, D>(const BwdArgs &, cudaStream_t, bool); \
  extern template fa_status bwd_rows_launch<__nv_bfloat16, D>(const BwdArgs &, cudaStream_t, bool);
FA_DECLARE_BWD_ROWS(32)
FA_DECLARE_BWD_ROWS(64)
FA_DECLARE_BWD_ROWS(96)
FA_DECLARE_BWD_ROWS(128)
FA_DECLARE_BWD_ROWS(192)
FA_DECLARE_BWD_ROWS(256)
#undef FA_DECLARE_BWD_ROWS

}  // namespace fa

#endif
