/* Device helpers of the EXT kernels: dropout (Philox, docs/DROPOUT.md) on
 * mma fragments, and block-sparse tile classification and skipping. */
#ifndef FA_CUDA_EXTENSION_CUH
#define FA_CUDA_EXTENSION_CUH

#include <stdint.h>

#include "common/philox.h"

namespace fa {

/* A tile's block-mask blocks: all zero (skipped), all nonzero (no element
 * mask), or mixed (element mask). */
enum { kTileNone = 0, kTileAll = 1, kTileSome = 2 };

/* Class of rows [r0, r1) x keys [c0, c1) of one head's block mask m (rows
 * bm_sr bytes apart, blocks of bq x bk). Empty ranges are kTileNone. */
__device__ __forceinline__ int bmask_tile_class(const uint8_t *m, int64_t sr, int bq, int bk,
                                                int r0, int r1, int c0, int c1) {
  if (r1 <= r0 || c1 <= c0) return kTileNone;
  int any = 0, all = 1;
  const int kb0 = c0 / bk, kb1 = (c1 - 1) / bk;
  for (int qb = r0 / bq; qb <= (r1 - 1) / bq; ++qb) {
    const uint8_t *row = m + (int64_t)qb * sr;
    for (int kb = kb0; kb <= kb1; ++kb) {
      const int v = __ldg(row + kb) != 0;
      any |= v;
      all &= v;
      if (any && !all) return kTileSome;
    }
  }
  return all ? kTileAll : kTileNone;
}

/* The tiles of a kernel's loop, in visiting order: tile idx is query head
 * h0 + idx / per, rows [r, min(r + BR, nq)) and keys [c, min(c + BC, nk))
 * with r = r0 + (idx % per) * rstep, c = c0 + (idx % per) * cstep. */
struct TileWalk {
  const uint8_t *m; /* block mask of (sequence, head 0) */
  int64_t sh, sr;   /* head and row strides */
  int bq, bk, br, bc, nq, nk;
  int h0, per, r0, rstep, c0, cstep;
  __device__ __forceinline__ int classify(int idx) const {
    const int h = h0 + idx / per, j = idx % per, r = r0 + j * rstep, c = c0 + j * cstep;
    return bmask_tile_class(m + h * sh, sr, bq, bk, r, min(r + br, nq), c, min(c + bc, nk));
  }
};

/* Walks a loop's tiles 0..count-1 in order, skipping kTileNone ones. Classes
 * are computed NT tiles at a time, one per thread, into shared memory (NT
 * bytes at cls): one round of global reads per NT tiles. Every thread of the
 * block calls next() with the same arguments (it synchronises the block). */
template <int NT>
struct TileSkipper {
  uint8_t *cls;
  int base; /* tile index of cls[0]; INT_MIN / 2 before the first chunk */
  /* The first tile >= idx that is not kTileNone (count if none), its class in *c. */
  __device__ __forceinline__ int next(int idx, int count, const TileWalk &w, int *c) {
    for (; idx < count; ++idx) {
      if (idx < base || idx >= base + NT) {
        __syncthreads(); /* every thread is done reading the previous chunk */
        const int i = idx + (int)threadIdx.x;
        cls[threadIdx.x] = (uint8_t)(i < count ? w.classify(i) : kTileNone);
        __syncthreads();
        base = idx;
      }
      const int k = cls[idx - base];
      if (k != kTileNone) {
        *c = k;
        return idx;
      }
    }
    *c = kTileNone;
    return count;
  }
};

/* Keep bits (bit w: word w >= threshold) of one Philox call. */
__device__ __forceinline__ uint32_t dropout_keep4(const fa_dropout &d, uint32_t bh, int i, int j) {
  const fa_u32x4 r = fa_dropout_bits(&d, bh, i, j);
  return (uint32_t)(r.v[0] >= d.threshold) | (uint32_t)(r.v[1] >= d.threshold) << 1 |
         (uint32_t)(r.v[2] >= d.threshold) << 2 | (uint32_t)(r.v[3] >= d.threshold) << 3;
}

/* Dropout's multiplier of element bit of a keep mask: 0 or keep_scale. */
__device__ __forceinline__ float dropout_z(const fa_dropout &d, uint32_t keep, int bit) {
  return (keep >> bit) & 1u ? d.keep_scale : 0.f;
}

/* Keep bits of a lane's elements of row i in the 16 columns from c (a
 * multiple of 4), in the mma C layout: bits 0, 1 at columns c + 2t, c + 2t + 1
 * and bits 2, 3 at c + 8 + 2t, c + 9 + 2t, t = lane % 4. The quad's lanes make
 * one Philox call each (column groups c/4 + {0, 2, 1, 3}) and swap the halves
 * they need with their neighbour. All 32 lanes must call it together. */
__device__ __forceinline__ uint32_t dropout_row16(const fa_dropout &d, uint32_t bh, int i, int c,
                                                  int t) {
  const int odd = t & 1;
  const uint32_t k = dropout_keep4(d, bh, i, c + 4 * ((t >> 1) + 2 * odd));
  const uint32_t recv = __shfl_xor_sync(0xffffffffu, odd ? (k & 3u) : (k >> 2), 1);
  return odd ? (recv | (k & 12u)) : ((k & 3u) | recv << 2);
}

/* The same for the transposed (keys on rows) C layout of the backward's kv
 * kernel: bit e of a lane is key kc + g + 8 (e / 2), query q + 2t + e % 2,
 * g = lane / 4, kc a multiple of 16. The four lanes of equal t and g / 4 make
 * one call each (lane with g % 4 = e makes element e's call) and gather the
 * word g % 4 of each by two exchanges. All 32 lanes must call it together. */
__device__ __forceinline__ uint32_t dropout_col16(const fa_dropout &d, uint32_t bh, int q, int kc,
                                                  int lane) {
  const int g = lane >> 2, t = lane & 3, gg = g & 3;
  const uint32_t n =
      dropout_keep4(d, bh, q + 2 * t + (gg & 1), kc + 4 * ((g >> 2) + 2 * (gg >> 1)));
  const uint32_t x1 = __shfl_xor_sync(0xffffffffu, n, 4);
  const uint32_t n8 = (gg & 1) ? (x1 | n << 4) : (n | x1 << 4);
  const uint32_t x2 = __shfl_xor_sync(0xffffffffu, n8, 8);
  const uint32_t n16 = (gg & 2) ? (x2 | n8 << 8) : (n8 | x2 << 8);
  const uint32_t w = n16 >> gg;
  return (w & 1u) | (w >> 3 & 2u) | (w >> 6 & 4u) | (w >> 9 & 8u);
}

}  // namespace fa

#endif
