/* Tile primitives for the tensor-core kernels (sm_80+): cp.async copies into
 * shared memory, ldmatrix fragment loads, mma.sync m16n8k16 with float32
 * accumulation, and the online-softmax row update. Fragment layouts are the
 * PTX ISA's for mma.m16n8k16 (g = lane / 4, t = lane % 4):
 *   A (16x16, row): a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
 *   B (16x8, col):  b0 (k 2t..2t+1, n g)  b1 (k 2t+8.., n g)
 *   C (16x8, f32):  c0 c1 (g, 2t..2t+1)  c2 c3 (g+8, 2t..2t+1) */
#ifndef FA_CUDA_TILE_CUH
#define FA_CUDA_TILE_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "common/log2.h"

namespace fa {

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

/* x as the compiler must take it: unknown, recomputed where used rather
 * than hoisted or folded (a pointer: kept in one register, not as one
 * precomputed value per unrolled use) */
__device__ __forceinline__ void opaque(uint32_t &x) { asm volatile("" : "+r"(x)); }
template <typename P>
__device__ __forceinline__ void opaque(P *&p) {
  asm volatile("" : "+l"(p));
}

/* Programmatic dependent launch (sm_90 and later; nothing before): the
 * stream's next kernel may launch now, its CTAs taking the SMs this grid frees
 * (launch_dependents); this kernel waits for the whole preceding grid's
 * writes (wait). */
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

/* 16 bytes global -> shared; only src_bytes (0..16) are read, the rest of the
 * 16 is zero-filled (predicated tails and padded head dims). */
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
/* 4 bytes global -> shared through L1; src_bytes 0 writes zeros */
__device__ __forceinline__ void cp_async4(uint32_t dst, const void *src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

/* c += a * b for one m16n8k16 tile; T selects f16 or bf16 operands. */
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                 uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                        uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Two floats -> one register of two T (x in the low half), round to nearest. */
template <typename T>
__device__ __forceinline__ uint32_t pack2(float x, float y);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float x, float y) {
  __half2 h = __floats2half2_rn(x, y);
  return *reinterpret_cast<uint32_t *>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float x, float y) {
  __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<uint32_t *>(&h);
}

/* Zeroes M x N accumulator tiles. */
template <int M, int N>
__device__ __forceinline__ void zero_tiles(float (&c)[M][N][4]) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[m][n][e] = 0.f;
}

/* Two float32 C tiles (n-tiles 2kk and 2kk + 1 of one 16-row m-tile) -> the
 * A fragment of the 16x16 k-slice kk (C layout == A layout, rounded to T). */
template <typename T>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack2<T>(c0[0], c0[1]);
  a[1] = pack2<T>(c0[2], c0[3]);
  a[2] = pack2<T>(c1[0], c1[1]);
  a[3] = pack2<T>(c1[2], c1[3]);
}

/* One register of two T -> two floats (x from the low half). */
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t r);
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t r) {
  return __half22float2(*reinterpret_cast<const __half2 *>(&r));
}
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t r) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&r));
}

/* dst[0..1] += (x, y) atomically (one vector reduction on sm_90). */
__device__ __forceinline__ void atomic_add2(float *dst, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2 *>(dst), make_float2(x, y));
#else
  atomicAdd(dst, x);
  atomicAdd(dst + 1, y);
#endif
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

/* Online softmax, one row held by a quad of threads. Scores are held in some
 * unit and mul (> 0) turns them into log2 units. Folds a new tile's row
 * maximum into m and returns the factor that rescales the old l and O; sets
 * *base to max * mul, the value to subtract before exp2 (0 while the row has
 * seen only masked scores, so -inf - -inf never happens). */
__device__ __forceinline__ float online_rescale(float &m, float tile_max, float mul, float *base) {
  const float m_new = fmaxf(m, quad_max(tile_max));
  const float b = m_new == -INFINITY ? 0.f : m_new;
  const float alpha = exp2f((m - b) * mul); /* m = -inf: 0 */
  m = m_new;
  *base = b * mul;
  return alpha;
}

/* The online softmax's step for row r of a tile of scores s (rows g and g +
 * 8 of a quad's accumulator fragments: s[j][2 r + e], columns 2 t + e of each
 * 8), whose maximum over the tile is mx (this thread's part; masked scores
 * -inf): folds mx into m, turns the scores into P = exp2(s mul - m mul) in
 * place, adds their sum into l (rescaled) and, with RESCALE_O, rescales O's
 * row r; alpha: the rescaling factor (for a caller that rescales O later). */
template <bool RESCALE_O, int NS, int NO>
__device__ __forceinline__ void online_row(float (&s)[NS][4], float (&o)[NO][4], int r, float mx,
                                           float &m, float &l, float &alpha, float mul) {
  float base;
  alpha = online_rescale(m, mx, mul, &base);
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < NS; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float pe = exp2f(fmaf(s[j][2 * r + e], mul, -base));
      s[j][2 * r + e] = pe;
      sum += pe;
    }
  l = l * alpha + sum;
  if (RESCALE_O)
#pragma unroll
    for (int j = 0; j < NO; ++j) {
      o[j][2 * r] *= alpha;
      o[j][2 * r + 1] *= alpha;
    }
}

/* Final normalisation of a row: 1/l (0 for a fully masked row) and the
 * natural-log log-sum-exp (-inf for a fully masked row). */
__device__ __forceinline__ float online_finish(float m, float l_partial, float *lse) {
  const float l = quad_sum(l_partial);
  *lse = l > 0.f ? (m + __log2f(l)) * FA_LN2 : -INFINITY;
  return l > 0.f ? 1.f / l : 0.f;
}

}  // namespace fa

#endif
