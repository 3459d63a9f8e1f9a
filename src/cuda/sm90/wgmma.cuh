/* Warpgroup tile primitives for Hopper (sm_90a, PTX ISA "asynchronous warpgroup
 * level matrix multiply"): shared-memory matrix descriptors for tiles stored in
 * the 128-byte swizzled layout, cp.async loads into that layout, and
 * wgmma.mma_async m64nNk16 (N = 32, 64, 128) with float32 accumulators, A
 * from shared memory (SS) or from registers (RS).
 *
 * Tile layout ("SW128"): a ROWS x D tile of 16-bit elements is stored as D/64
 * column blocks, each ROWS rows of 128 bytes; the 16-byte chunk c of row r sits
 * at chunk c ^ (r % 8) of its row. Blocks start on 1024-byte boundaries, so the
 * descriptors' base offset is 0. As a K-major operand (Q, K: rows are M or N,
 * D is the reduction) the stride between 8-row groups (SBO) is 1024 bytes and a
 * k16 step inside a block moves the start address by 32 bytes. As an MN-major
 * operand (V: rows are the reduction, D is N) SBO is again the 8-row group
 * stride and LBO the stride between 64-column blocks.
 *
 * Accumulators use the mma.sync C layout per 8-column slice: acc[j][0..1] are
 * (row g, cols 8j + 2t, +1) and acc[j][2..3] row g + 8, where g = lane / 4,
 * t = lane % 4 and warp w of the warpgroup owns rows 16w..16w+15. The RS A
 * fragment of a k16 slice is mma.sync's A fragment (c_to_a in tile.cuh). */
#ifndef FA_CUDA_SM90_WGMMA_CUH
#define FA_CUDA_SM90_WGMMA_CUH

#include <type_traits>

#include "../tile.cuh"

namespace fa {
namespace sm90 {

/* Descriptor of a SW128 operand starting at shared address addr (bytes). */
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo_bytes) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo_bytes >> 4) << 16) |
         ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

/* Descriptor d moved off bytes (a multiple of 16) further: its start
 * address field only, in 32 bits (shared addresses stay below 2^18, so the
 * field does not carry). One descriptor per operand base, then an add per
 * k16 step, rather than the fields rebuilt from each step's address. */
__device__ __forceinline__ uint64_t desc_add(uint64_t d, uint32_t off) {
  return (d & 0xFFFFFFFF00000000ull) | (uint32_t)((uint32_t)d + (off >> 4));
}

/* Descriptor of k16 step kk of a K-major SW128 operand whose tile has ROWS
 * rows (column block kk / 4, 32 bytes per step inside it); base may point at
 * a row of block 0 that is a multiple of 8. */
template <int ROWS>
__device__ __forceinline__ uint64_t sw128_kmajor(uint32_t base, int kk) {
  return desc_add(sw128_desc(base, 16), (kk >> 2) * ROWS * 128 + (kk & 3) * 32);
}
/* Descriptor of k16 step kk (16 rows) of an MN-major SW128 operand whose
 * 64-column blocks are block_bytes apart. */
__device__ __forceinline__ uint64_t sw128_mnmajor(uint32_t base, int kk, uint32_t block_bytes) {
  return desc_add(sw128_desc(base, block_bytes), kk * 16 * 128);
}

/* Start of column col (a multiple of 8) of a SW128 tile of ROWS rows as an
 * MN-major operand: its 64-column block, then 2 bytes a column inside it
 * (the hardware swizzles the final address bits, as for a K-major k16 step's
 * 32-byte offset). An operand that starts inside a block must end in it. */
template <int ROWS>
__device__ __forceinline__ uint32_t sw128_mn_col(uint32_t base, int col) {
  return base + (uint32_t)((col >> 6) * ROWS * 128 + (col & 63) * 2);
}

/* Byte offset of element (row, col) in a SW128 tile of ROWS rows. */
template <int ROWS>
__device__ __forceinline__ uint32_t sw128_offset(int row, int col) {
  return (uint32_t)((col >> 6) * ROWS * 128 + row * 128 + ((((col >> 3) & 7) ^ (row & 7)) << 4) +
                    (col & 7) * 2);
}

/* ROWS x D tile of a strided tensor -> SW128 tile at shared address s; rows
 * >= valid_rows and columns >= d are zero-filled. Each thread keeps one
 * 16-byte column chunk and walks rows NT / (D / 8) apart (a multiple of 8, so
 * its swizzled chunk is the same in every row it visits). */
template <typename T, int ROWS, int D, int NT>
__device__ __forceinline__ void load_tile_sw128(uint32_t s, const T *g, int64_t stride,
                                                int valid_rows, int d, int tid) {
  constexpr int CPR = D / 8, RS = NT / CPR, ITERS = ROWS / RS;
  static_assert(NT % CPR == 0 && RS % 8 == 0 && ROWS % RS == 0, "whole passes of 8-row groups");
  const int row0 = tid / CPR, ch = tid % CPR;
  int cb = (d - ch * 8) * 2;
  cb = cb > 16 ? 16 : (cb < 0 ? 0 : cb);
  const T *src = g + row0 * stride + ch * 8;
  const uint32_t dst = s + sw128_offset<ROWS>(row0, ch * 8);
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int bytes = row0 + it * RS < valid_rows ? cb : 0;
    cp_async16(dst + it * RS * 128, bytes ? src : g, bytes);
    src += RS * stride;
    asm volatile("" : "+l"(src));
  }
}

/* Generic-proxy writes (cp.async, st.shared) -> visible to the async
 * proxy's reads (wgmma, TMA stores). */
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* Pins registers the asynchronous MMAs read or write: nothing touching them
 * moves across this point. */
template <int M>
__device__ __forceinline__ void reg_fence(float (&a)[M][4]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(a[i][e])::"memory");
}
template <int M>
__device__ __forceinline__ void reg_fence(uint32_t (&a)[M][4]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[i][e])::"memory");
}

#define FA_WGMMA_SS_N64(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32" TY TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]) \
               : "l"(da), "l"(db), "r"(scale_d))
#define FA_WGMMA_SS_N80(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n80k16.f32" TY TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, %40, %41, p, 1, 1, 0, 0;\n}\n" \
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]) \
               : "l"(da), "l"(db), "r"(scale_d))
#define FA_WGMMA_SS_N112(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %58, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n112k16.f32" TY TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55}, %56, %57, p, 1, 1, 0, 0;\n}\n" \
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]) \
               : "l"(da), "l"(db), "r"(scale_d))
#define FA_WGMMA_SS_N176(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n176k16.f32" TY TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}, %88, %89, p, 1, 1, 0, 0;\n}\n" \
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]) \
               : "l"(da), "l"(db), "r"(scale_d))
#define FA_WGMMA_RS_N64(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32" TY TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n" \
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d))
#define FA_WGMMA_SS_N128(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32" TY TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n" \
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]) \
               : "l"(da), "l"(db), "r"(scale_d))
#define FA_WGMMA_RS_N128(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32" TY TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d))

#define FA_WGMMA_RS_N32(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n32k16.f32" TY TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 1;\n}\n" \
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d))

/* ---- mbarriers, the tensor copy engine (TMA), register reallocation -------- */

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
/* Makes initialised barriers visible to the other threads and the async proxy. */
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
/* Arrives (one count) and announces bytes the copy engine will deliver. */
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
/* Waits for the phase of parity `parity` to complete (a fresh barrier counts
 * its phase of parity 1 as complete). */
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
/* One box of a 4-d tensor map -> shared memory at dst, completing on bar. */
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void *map, uint32_t bar, int c0,
                                            int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
      "{%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
      "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
/* A ROWS x D tile of a tensor map's (d, seqlen, heads, batch) tensor, rows
 * from row of (head, batch), as D / 64 boxes of 64 columns into the SW128
 * tile at dst (blocks ROWS x 128 bytes apart), completing on bar. */
template <int ROWS, int D>
__device__ __forceinline__ void tma_load_tile(uint32_t dst, const void *map, uint32_t bar, int row,
                                              int head, int batch) {
#pragma unroll
  for (int c = 0; c < D / 64; ++c)
    tma_load_4d(dst + c * ROWS * 128, map, bar, c * 64, row, head, batch);
}
/* A tensor map's descriptor into the copy engine's cache ahead of its first
 * copy (a grid constant's generic address) */
__device__ __forceinline__ void tma_prefetch_map(const void *map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}
/* One box of a 4-d tensor map into L2 only: a hint, with no completion to
 * wait for; a box outside the tensor is dropped. */
__device__ __forceinline__ void tma_prefetch_4d(const void *map, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];\n" ::
                   "l"(map),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
/* Where a sequence's row 0 sits in make_map's maps, as (row, batch)
 * coordinates: (0, b) in a fixed-length batch; in a packed (varlen) map of
 * total rows, (total - len, start + len) for the len rows from packed row
 * start, so the map ends where the sequence does (tma.cu). */
struct MapSeq {
  int row, batch;
};
__device__ __forceinline__ MapSeq map_seq(bool packed, int b, int total, int64_t start, int len) {
  return packed ? MapSeq{total - len, (int)start + len} : MapSeq{0, b};
}
/* Sequence b's row 0 in the K and V maps (make_kv_map): packed for varlen and
 * for a KV cache (used_k; its batch's rows as one packed sequence, rows apart
 * from one sequence's first key to the next's: kv_map_rows), so the map ends
 * at the sequence's last used key (sv.nk) and rows past it load as zeros: a
 * cache's unused rows, NaN or not, never reach P V. */
template <typename Args, typename View>
__device__ __forceinline__ MapSeq map_kv(const Args &p, int rows, int b, const View &sv) {
  if (p.cu_q) return map_seq(true, b, p.nk, sv.k0, sv.nk);
  if (p.used_k) return map_seq(true, b, p.kv_batch * rows, (int64_t)b * rows, sv.nk);
  return map_seq(false, b, p.nk, 0, sv.nk);
}
/* Named barrier over `count` threads (id 0 is __syncthreads'). */
__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
/* Arrival at a named barrier of `count` threads without waiting for it. */
__device__ __forceinline__ void named_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
/* ---- memory ordering across CTAs, bulk reductions, shared-memory words ----- */

/* Generic-proxy global accesses ordered against the async proxy's (TMA
 * reduce-adds after the loads that allowed them, and before a release). */
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
/* A counter in global memory, read with acquire / added to with release
 * semantics at GPU scope: what the adder wrote before is seen by the reader. */
__device__ __forceinline__ int ld_acquire_gpu(const int *p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_gpu_add(int *p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
/* Adds the box of a 4-d tensor map at (c0..c3) from shared memory at src
 * (float32 elements), in the current bulk group. */
__device__ __forceinline__ void tma_reduce_add_4d(const void *map, uint32_t src, int c0, int c1,
                                                  int c2, int c3) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, "
      "{%1, %2, %3, %4}], [%5];\n" ::"l"(map),
      "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
      : "memory");
}
/* Stores the box of a 4-d tensor map at (c0..c3) from shared memory at src,
 * in the current bulk group. The box's parts outside the tensor are not
 * written, in whole 16-byte pieces: a row that ends inside one is written
 * to the piece's end. */
__device__ __forceinline__ void tma_store_4d(const void *map, uint32_t src, int c0, int c1, int c2,
                                             int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::
          "l"(map),
      "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
      : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
/* Waits until at most N bulk groups are pending: their sources read (READ)
 * or their writes complete. */
template <int N, bool READ>
__device__ __forceinline__ void bulk_wait() {
  if constexpr (READ)
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
  else
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared_f32x2(uint32_t addr, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x), "f"(y) : "memory");
}
/* 16 bytes of zeros */
__device__ __forceinline__ void st_shared_zero16(uint32_t addr) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0) : "memory");
}
__device__ __forceinline__ uint32_t ld_shared_volatile_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.volatile.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
/* The global nanosecond timer and the SM's id (timing probes) */
__device__ __forceinline__ unsigned long long global_timer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned sm_id() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
/* setmaxnreg only moves registers within the CTA's allocation, which ptxas
 * sizes from __launch_bounds__(WGS * 128, 1): 64K / (WGS * 128) per thread,
 * rounded down to 8. An increase past what the other warpgroups gave back
 * waits forever (a hang, not an error), so every split must fit. */
constexpr bool regs_split_fits(int wgs, int producer, int consumer) {
  return producer + (wgs - 1) * consumer <= wgs * (65536 / (wgs * 128) / 8 * 8);
}
template <int N>
__device__ __forceinline__ void regs_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void regs_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

#define FA_WGMMA_SST_N64(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32" TY TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 1, 1;\n}\n" \
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]) \
               : "l"(da), "l"(db), "r"(scale_d))
#define FA_WGMMA_SST_N128(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32" TY TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 1, 1;\n}\n" \
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]) \
               : "l"(da), "l"(db), "r"(scale_d))
#define FA_WGMMA_SST_N32(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n32k16.f32" TY TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 1, 1;\n}\n" \
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]) \
               : "l"(da), "l"(db), "r"(scale_d))
/* d (64 x N) = A B + (scale_d ? d : 0); A (64 x 16) K-major at descriptor da,
 * B (16 x N) K-major at db. */
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], uint64_t da, uint64_t db, int scale_d) {
  constexpr bool BF = std::is_same<T, __nv_bfloat16>::value;
  static_assert(N == 64 || N == 80 || N == 112 || N == 128 || N == 176, "instantiated widths");
  if constexpr (N == 64) {
    if constexpr (BF) FA_WGMMA_SS_N64(".bf16"); else FA_WGMMA_SS_N64(".f16");
  } else if constexpr (N == 80) {
    if constexpr (BF) FA_WGMMA_SS_N80(".bf16"); else FA_WGMMA_SS_N80(".f16");
  } else if constexpr (N == 128) {
    if constexpr (BF) FA_WGMMA_SS_N128(".bf16"); else FA_WGMMA_SS_N128(".f16");
  } else if constexpr (N == 112) {
    if constexpr (BF) FA_WGMMA_SS_N112(".bf16"); else FA_WGMMA_SS_N112(".f16");
  } else {
    if constexpr (BF) FA_WGMMA_SS_N176(".bf16"); else FA_WGMMA_SS_N176(".f16");
  }
}

/* d (64 x N) = A B + (scale_d ? d : 0); A (64 x 16) MN-major at da (M
 * contiguous), B (16 x N) MN-major at db. */
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss_mn(float (&d)[N / 8][4], uint64_t da, uint64_t db,
                                            int scale_d) {
  constexpr bool BF = std::is_same<T, __nv_bfloat16>::value;
  static_assert(N == 32 || N == 64 || N == 128, "instantiated widths");
  if constexpr (N == 32) {
    if constexpr (BF) FA_WGMMA_SST_N32(".bf16"); else FA_WGMMA_SST_N32(".f16");
  } else if constexpr (N == 64) {
    if constexpr (BF) FA_WGMMA_SST_N64(".bf16"); else FA_WGMMA_SST_N64(".f16");
  } else {
    if constexpr (BF) FA_WGMMA_SST_N128(".bf16"); else FA_WGMMA_SST_N128(".f16");
  }
}

/* d (64 x N) = A B + (scale_d ? d : 0); A (64 x 16) the registers a (mma.sync
 * A fragment of the warp's 16 rows), B (16 x N) MN-major at db. a must stay
 * untouched until the group is waited for (reg_fence after wg_wait). */
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t db,
                                         int scale_d) {
  constexpr bool BF = std::is_same<T, __nv_bfloat16>::value;
  static_assert(N == 32 || N == 64 || N == 128, "instantiated widths");
  if constexpr (N == 32) {
    if constexpr (BF) FA_WGMMA_RS_N32(".bf16"); else FA_WGMMA_RS_N32(".f16");
  } else if constexpr (N == 64) {
    if constexpr (BF) FA_WGMMA_RS_N64(".bf16"); else FA_WGMMA_RS_N64(".f16");
  } else {
    if constexpr (BF) FA_WGMMA_RS_N128(".bf16"); else FA_WGMMA_RS_N128(".f16");
  }
}

}  // namespace sm90
}  // namespace fa

#endif
