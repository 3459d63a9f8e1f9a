/* FlashAttention-2 forward on tensor cores (mma.sync m16n8k16, sm_80+).
 *
 * One thread block computes BR = 16 * MT * NW query rows of one (sequence,
 * head): NW warps, each owning MT m-tiles of 16 rows. Q is staged through
 * shared memory (and kept in registers when QREG), K and V tiles of BC keys
 * stream through shared memory with cp.async, S = Q K^T stays in registers,
 * is turned into P by the online softmax (log2 domain, exp2) and fed to
 * O += P V straight from registers. Shared memory rows are padded by 16 bytes
 * so every ldmatrix phase hits 8 different bank groups.
 *
 * Pipeline (FlashAttention-2's): one load is always in flight behind math:
 *   wait K_j; sync; load V_j   | S = Q K_j^T, softmax
 *   wait V_j; sync; load K_j-1 | O += P V_j
 * Key tiles run from the last to the first, so the masked tiles of a causal
 * block (the diagonal and the ragged tail) come first and the rest run with
 * no masking arithmetic. */
#ifndef FA_CUDA_FORWARD_KERNEL_CUH
#define FA_CUDA_FORWARD_KERNEL_CUH

#include <cuda_runtime.h>
#include <limits.h>

#include <type_traits>
#include <utility>

#include "attn.cuh"
#include "backend.h"
#include "combine.cuh"
#include "common/log2.h"
#include "common/mask.h"
#include "common/philox.h"
#include "extension.cuh"
#include "tile.cuh"

namespace fa {

/* Tile shapes per (padded) head dim: MT m-tiles of 16 rows per warp, NW warps,
 * BC keys per tile, Q fragments kept in registers (QREG) or re-read from
 * shared memory. Two m-tiles per warp halve the shared-memory reads of K and V
 * per mma; the accumulators then limit BC. Every choice compiles without
 * spills on sm_80 and sm_90 (the build treats spills as errors) and was the
 * fastest spill-free one measured on an H100 (docs/PERF.md). */
/* Each FA_FWD<D>_MT/_NW/_BC/_QREG can be overridden with -D for tuning builds. */
template <int D>
struct FwdTraits;
#ifndef FA_FWD32_MT
#define FA_FWD32_MT 2
#endif
#ifndef FA_FWD32_NW
#define FA_FWD32_NW 4
#endif
#ifndef FA_FWD32_QREG
#define FA_FWD32_QREG true
#endif
#ifndef FA_FWD32_BC
#define FA_FWD32_BC 64
#endif
template <>
struct FwdTraits<32> {
  static constexpr int MT = FA_FWD32_MT, NW = FA_FWD32_NW, BC = FA_FWD32_BC;
  static constexpr bool QREG = FA_FWD32_QREG;
};
#ifndef FA_FWD64_MT
#define FA_FWD64_MT 2
#endif
#ifndef FA_FWD64_NW
#define FA_FWD64_NW 4
#endif
#ifndef FA_FWD64_QREG
#define FA_FWD64_QREG false
#endif
#ifndef FA_FWD64_BC
#define FA_FWD64_BC 64
#endif
template <>
struct FwdTraits<64> {
  static constexpr int MT = FA_FWD64_MT, NW = FA_FWD64_NW, BC = FA_FWD64_BC;
  static constexpr bool QREG = FA_FWD64_QREG;
};
#ifndef FA_FWD96_MT
#define FA_FWD96_MT 2
#endif
#ifndef FA_FWD96_NW
#define FA_FWD96_NW 4
#endif
#ifndef FA_FWD96_QREG
#define FA_FWD96_QREG false
#endif
#ifndef FA_FWD96_BC
#define FA_FWD96_BC 64
#endif
template <>
struct FwdTraits<96> {
  static constexpr int MT = FA_FWD96_MT, NW = FA_FWD96_NW, BC = FA_FWD96_BC;
  static constexpr bool QREG = FA_FWD96_QREG;
};
#ifndef FA_FWD128_MT
#define FA_FWD128_MT 2
#endif
#ifndef FA_FWD128_NW
#define FA_FWD128_NW 4
#endif
#ifndef FA_FWD128_QREG
#define FA_FWD128_QREG false
#endif
#ifndef FA_FWD128_BC
#define FA_FWD128_BC 32
#endif
template <>
struct FwdTraits<128> {
  static constexpr int MT = FA_FWD128_MT, NW = FA_FWD128_NW, BC = FA_FWD128_BC;
  static constexpr bool QREG = FA_FWD128_QREG;
};
#ifndef FA_FWD192_MT
#define FA_FWD192_MT 1
#endif
#ifndef FA_FWD192_NW
#define FA_FWD192_NW 8
#endif
#ifndef FA_FWD192_QREG
#define FA_FWD192_QREG false
#endif
#ifndef FA_FWD192_BC
#define FA_FWD192_BC 64
#endif
template <>
struct FwdTraits<192> {
  static constexpr int MT = FA_FWD192_MT, NW = FA_FWD192_NW, BC = FA_FWD192_BC;
  static constexpr bool QREG = FA_FWD192_QREG;
};
#ifndef FA_FWD256_MT
#define FA_FWD256_MT 1
#endif
#ifndef FA_FWD256_NW
#define FA_FWD256_NW 8
#endif
#ifndef FA_FWD256_QREG
#define FA_FWD256_QREG false
#endif
#ifndef FA_FWD256_BC
#define FA_FWD256_BC 64
#endif
template <>
struct FwdTraits<256> {
  static constexpr int MT = FA_FWD256_MT, NW = FA_FWD256_NW, BC = FA_FWD256_BC;
  static constexpr bool QREG = FA_FWD256_QREG;
};

/* ROWS x D tile of a strided tensor -> shared memory (row stride D + 8).
 * Rows >= valid_rows and columns >= d are zero-filled. Each thread owns one
 * 16-byte column chunk and walks rows NT / CPR apart, so its source address is
 * one pointer bumped by a stride (no per-iteration 64-bit index registers). */
template <typename T, int ROWS, int D, int NT>
__device__ __forceinline__ void load_tile(T *s, const T *g, int64_t stride, int valid_rows, int d,
                                          int tid) {
  constexpr int CPR = D / 8, LD = D + 8, RS = NT / CPR, ITERS = (ROWS + RS - 1) / RS;
  static_assert(RS >= 1, "one row of chunks per pass at least");
  const int row0 = tid / CPR, ch = tid % CPR;
  if (NT % CPR != 0 && row0 >= RS) return; /* idle lanes when CPR does not divide NT */
  int cb = (d - ch * 8) * 2;
  cb = cb > 16 ? 16 : (cb < 0 ? 0 : cb);
  const T *src = g + row0 * stride + ch * 8;
  const uint32_t dst = smem_addr(s + row0 * LD + ch * 8);
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int row = row0 + it * RS;
    if (ROWS % RS == 0 || row < ROWS) {
      const int bytes = row < valid_rows ? cb : 0;
      cp_async16(dst + it * RS * LD * (int)sizeof(T), bytes ? src : g, bytes);
    }
    src += RS * stride;
    opaque(src); /* one pointer, not ITERS precomputed ones */
  }
}

/* load_tile for the K or V rows of a paged cache: tile row r is key c0 + r
 * of a sequence whose table row is pages, at base + page x page_stride +
 * (key % page size) x stride (base: the K/V head's first row of page 0). */
template <typename T, int ROWS, int D, int NT>
__device__ __forceinline__ void load_tile_paged(T *s, const T *base, int64_t page_stride,
                                                int64_t stride, const AttnArgs &p,
                                                const int32_t *pages, int c0, int valid_rows, int d,
                                                int tid) {
  constexpr int CPR = D / 8, LD = D + 8, RS = NT / CPR, ITERS = (ROWS + RS - 1) / RS;
  const int row0 = tid / CPR, ch = tid % CPR;
  if (NT % CPR != 0 && row0 >= RS) return; /* idle lanes when CPR does not divide NT */
  int cb = (d - ch * 8) * 2;
  cb = cb > 16 ? 16 : (cb < 0 ? 0 : cb);
  const uint32_t dst = smem_addr(s + row0 * LD + ch * 8);
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int row = row0 + it * RS;
    if (ROWS % RS == 0 || row < ROWS) {
      const T *src = base; /* rows past the keys: zeros, their table entries unread */
      if (row < valid_rows) {
        const int j = c0 + row, pg = j / p.page;
        src = base + (int64_t)page_of(p, pages, j) * page_stride +
              (int64_t)(j - pg * p.page) * stride + ch * 8;
      }
      cp_async16(dst + it * RS * LD * (int)sizeof(T), src, row < valid_rows ? cb : 0);
    }
  }
}

/* XF: the score transform (softcap, ALiBi, any scale). EXT (implies XF):
 * dropout and block-sparse masks; tiles whose blocks are all zero are never
 * loaded. */
template <typename T, int D, int MT, int NW, int BC, bool QREG, bool XF, bool EXT,
          bool PAGED = false>
__global__ void __launch_bounds__(NW * 32, EXT ? 1 : 0) flash_fwd_kernel(const FwdArgs p) {
  static_assert(!EXT || XF, "EXT kernels take the general score path");
  static_assert(!(EXT && PAGED), "paged caches take no dropout or block mask");
  /* launched as a programmatic dependent: the KV-cache call's preparation
   * (rotated q, appended rows) must be done */
  if (p.pdl) pdl_wait();
  constexpr int BR = 16 * MT * NW, NT = NW * 32, LD = D + 8;
  constexpr float LOG2E = FA_LOG2E;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T *sQ = reinterpret_cast<T *>(smem_raw);
  T *sK = sQ + BR * LD;
  T *sV = sK + BC * LD;

  /* Query blocks are the fastest grid dimension, so the blocks resident at
   * once share a few heads' K and V in L2; within a head the longest (causal)
   * blocks start first. */
  /* grid y: (head, key split) pairs; one split unless FwdArgs::nsplit > 1 */
  const int b = blockIdx.z, h = blockIdx.y / p.nsplit, sp = blockIdx.y - h * p.nsplit;
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const SeqView sv = seq_view<kSeqAll>(p, b);
  const int nq = sv.nq, nk = sv.nk;
  const int r0 = m_block * BR;
  if (r0 >= nq) return;
  const int rows = min(BR, nq - r0);
  const int hk = h / p.group;

  /* key_tiles<BC>(), written out: with the struct, ptxas spills in the D=128
   * EXT variant of this kernel */
  int64_t klo, khi, t_lo, t_hi;
  const fa_mask mk = attn_mask<EXT>(p, nq, nk);
  fa_mask_block_range(&mk, r0, r0 + rows, &klo, &khi);
  int n_begin = (int)(klo / BC);
  int n_end = khi > klo ? (int)((khi + BC - 1) / BC) : n_begin;
  if (p.nsplit > 1) { /* this split's tiles only (none: an empty walk, lse -inf) */
    const int spt = EXT ? p.ext_split_tiles : split_tiles<BC>(p, nk);
    n_begin = max(n_begin, sp * spt);
    n_end = max(n_begin, min(n_end, (sp + 1) * spt));
  }
  fa_mask_row_range(&mk, r0 + rows - 1, &t_lo, &t_hi);
  const int lo_max = (int)t_lo;
  fa_mask_row_range(&mk, r0, &t_lo, &t_hi);
  const int hi_min = (int)t_hi;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;

  /* Block-sparse: tiles n_end - 1 - idx (idx = 0, 1, ...) whose blocks are all
   * zero are skipped; cls is the class of the tile about to run (kTileAll
   * without a block mask). */
  const uint8_t *bm = EXT && p.bmask ? bmask_head(p, b, h) : nullptr;
  const TileWalk walk{bm ? bmask_head(p, b, 0) : nullptr,
                      p.bm_sh, p.bm_sr, p.bm_q, p.bm_k, BR, BC, nq, nk, h, n_end - n_begin, r0, 0,
                      (n_end - 1) * BC, -BC};
  TileSkipper<NT> skip{reinterpret_cast<uint8_t *>(sV + BC * LD), INT_MIN / 2};
  int cls = kTileAll;

  const T *gQ = (const T *)p.q + sv.qb * p.q_sb + (sv.q0 + r0) * p.q_ss + h * p.q_sh;
  /* paged: gK, gV are the K/V head's row 0 of page 0; the rows come from
   * the sequence's table row */
  const T *gK = (const T *)p.k + (PAGED ? 0 : sv.kb * p.k_sb + sv.k0 * p.k_ss) + hk * p.k_sh;
  const T *gV = (const T *)p.v + (PAGED ? 0 : sv.kb * p.v_sb + sv.k0 * p.v_ss) + hk * p.v_sh;
  const int32_t *pages = PAGED ? page_row(p, b) : nullptr;
  /* keys [c0, c0 + valid) of K or V (g: gK or gV) into a tile */
  auto load_kv = [&](T *dst, const T *g, int64_t sb, int64_t ss, int c0, int valid) {
    if constexpr (PAGED)
      load_tile_paged<T, BC, D, NT>(dst, g, sb, ss, p, pages, c0, valid, p.d, tid);
    else
      load_tile<T, BC, D, NT>(dst, g + (int64_t)c0 * ss, ss, valid, p.d, tid);
  };

  int n = n_end - 1, n_next;
  if constexpr (EXT)
    if (bm) n = n_end - 1 - skip.next(0, n_end - n_begin, walk, &cls);
  load_tile<T, BR, D, NT>(sQ, gQ, p.q_ss, rows, p.d, tid);
  if (n >= n_begin) load_kv(sK, gK, p.k_sb, p.k_ss, n * BC, min(BC, nk - n * BC));
  cp_async_commit();

  const int wrow = warp * MT * 16; /* first row of this warp inside the block */
  /* Per-lane shared addresses (bytes) of the ldmatrix sources: Q as the
   * row-major A operand, K as the "col" B operand, V through .trans. */
  constexpr int ES = (int)sizeof(T);
  const uint32_t q_lane = smem_addr(sQ) + ((wrow + (lane & 15)) * LD + (lane >> 4) * 8) * ES;
  const uint32_t k_lane =
      smem_addr(sK) + (((lane & 7) + ((lane >> 4) << 3)) * LD + ((lane >> 3) & 1) * 8) * ES;
  const uint32_t v_lane =
      smem_addr(sV) + (((lane & 7) + (((lane >> 3) & 1) << 3)) * LD + (lane >> 4) * 8) * ES;

  uint32_t qf[QREG ? MT : 1][QREG ? D / 16 : 1][4];
  if constexpr (QREG) {
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        ldmatrix_x4(qf[mt][kk], q_lane + (mt * 16 * LD + kk * 16) * ES);
  }

  float acc_o[MT][D / 8][4];
  zero_tiles(acc_o);

  /* Per-row state: running max (units of the score as held), partial sum. */
  float m_run[MT][2], l_run[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      m_run[mt][r] = -INFINITY;
      l_run[mt][r] = 0.f;
    }
  /* exp2 argument = score * mul - max * mul: raw scores times scale*log2e on the
   * plain path, already-transformed log2-domain scores otherwise. */
  const float mul = XF ? 1.f : p.scale_log2;
  const float slope_log2 = XF && p.alibi ? p.alibi[(int64_t)b * p.alibi_sb + h] * LOG2E : 0.f;

  /* One key tile: the body is instantiated twice, with and without masking
   * arithmetic, so unmasked tiles (most of them) carry none of it. */
  auto step = [&](const int n, auto masked, const bool some) {
    constexpr bool MASK = decltype(masked)::value;
    const int c0 = n * BC;
    cp_async_wait<0>();
    __syncthreads(); /* K_n landed; every warp is done with V_{n+1} */
    load_kv(sV, gV, p.v_sb, p.v_ss, c0, min(BC, nk - c0));
    cp_async_commit();

    float acc_s[MT][BC / 8][4];
    zero_tiles(acc_s);

#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (QREG) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[mt][e] = qf[mt][kk][e];
        } else {
          ldmatrix_x4(a[mt], q_lane + (mt * 16 * LD + kk * 16) * ES);
        }
      }
#pragma unroll
      for (int np = 0; np < BC / 16; ++np) {
        uint32_t bk[4];
        ldmatrix_x4(bk, k_lane + (np * 16 * LD + kk * 16) * ES);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<T>(acc_s[mt][2 * np], a[mt], bk[0], bk[1]);
          mma16816<T>(acc_s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
        }
      }
    }

    /* Scores -> probabilities (online softmax); masks only in MASK steps. */
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = r0 + wrow + mt * 16 + g + 8 * r; /* this row, in the sequence */
        int row_lo = 0, row_hi = nk;
        const uint8_t *brow = nullptr; /* its block-mask bytes, on mixed tiles */
        if (EXT && some) brow = bm + (int64_t)(min(i, nq - 1) / p.bm_q) * p.bm_sr;
        if constexpr (MASK) {
          int64_t lo, hi;
          /* rebuilt from the kernel arguments, not kept live across the loop; a
           * shard's shift (EXT) moves the row along the unshifted diagonal */
          const fa_mask mr = attn_mask<false>(p, nq, nk);
          fa_mask_row_range(&mr, EXT ? i + p.diag_shift : i, &lo, &hi);
          row_lo = (int)lo;
          row_hi = (int)hi;
        }
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float x = acc_s[mt][nt][2 * r + e];
            const int col = c0 + nt * 8 + 2 * t + e;
            if constexpr (XF) {
              x = p.cap_log2 > 0.f ? p.cap_log2 * tanhf(x * p.scale_over_cap) : x * p.scale_log2;
              x -= slope_log2 * fabsf((float)attn_rel<EXT>(p, nq, nk, i, col));
            }
            if (MASK && (col < row_lo || col >= row_hi || (EXT && some && !brow[col / p.bm_k])))
              x = -INFINITY;
            acc_s[mt][nt][2 * r + e] = x;
            mx = fmaxf(mx, x);
          }
        float alpha;
        online_row<true>(acc_s[mt], acc_o[mt], r, mx, m_run[mt][r], l_run[mt][r], alpha, mul);
        /* dropout: P -> Z o P after l took the undropped P */
        if (EXT && p.drop.keep_scale > 0.f) {
          const uint32_t bh = (uint32_t)(b * p.heads_q + h);
#pragma unroll
          for (int np = 0; np < BC / 16; ++np) {
            const uint32_t keep = dropout_row16(p.drop, bh, i, c0 + np * 16, t);
            acc_s[mt][2 * np][2 * r] *= dropout_z(p.drop, keep, 0);
            acc_s[mt][2 * np][2 * r + 1] *= dropout_z(p.drop, keep, 1);
            acc_s[mt][2 * np + 1][2 * r] *= dropout_z(p.drop, keep, 2);
            acc_s[mt][2 * np + 1][2 * r + 1] *= dropout_z(p.drop, keep, 3);
          }
        }
      }

    cp_async_wait<0>();
    __syncthreads(); /* V_n landed; every warp is done with K_n */
    n_next = n - 1; /* a full tile: only the last one is ragged */
    if constexpr (EXT)
      if (bm) n_next = n_end - 1 - skip.next(n_end - n, n_end - n_begin, walk, &cls);
    if (n_next >= n_begin) load_kv(sK, gK, p.k_sb, p.k_ss, n_next * BC, BC);
    cp_async_commit();

    /* O += P V, P straight from the S accumulators (C layout == A layout). */
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) c_to_a<T>(a[mt], acc_s[mt][2 * kk], acc_s[mt][2 * kk + 1]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, v_lane + (kk * 16 * LD + dp * 16) * ES);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<T>(acc_o[mt][2 * dp], a[mt], bv[0], bv[1]);
          mma16816<T>(acc_o[mt][2 * dp + 1], a[mt], bv[2], bv[3]);
        }
      }
    }
  };
  for (; n >= n_begin; n = n_next) {
    const int c0 = n * BC;
    const bool some = EXT && cls == kTileSome;
    if (some || c0 + BC > nk || c0 < lo_max || c0 + BC > hi_min)
      step(n, std::true_type(), some);
    else
      step(n, std::false_type(), false);
  }
  cp_async_wait<0>();

  /* Normalise, write lse, stage O through shared memory for 16-byte stores. */
  __syncthreads(); /* every warp is done with sQ/sK/sV */
  /* Output addresses are rebuilt here rather than kept live through the loop. */
  const SeqView so = seq_view<kSeqAll>(p, blockIdx.z);
  const int ho = blockIdx.y / p.nsplit, ro = (gridDim.x - 1 - blockIdx.x) * BR;
  const int rows_o = min(BR, so.nq - ro);
  float *lse_row = p.lse + so.lse0 + ho * so.lse_hs + ro;
  /* A split writes its normalised O and lse (float32) for the combine. A loop
   * of its own: folded into the staging loop below (one branch per row or
   * per element) it spilled the D = 128 EXT kernel (20-36 bytes). */
  if (p.nsplit > 1) {
    const int64_t prow0 =
        (blockIdx.y - ho * p.nsplit) * p.part_rows + so.lse0 + ho * so.lse_hs + ro;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float lse;
        const float inv = online_finish(m_run[mt][r] * mul, l_run[mt][r], &lse);
        const int lr = wrow + mt * 16 + g + 8 * r;
        if (lr >= rows_o) continue;
        if (t == 0) p.part_lse[prow0 + lr] = lse;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt)
          *reinterpret_cast<float2 *>(p.part_o + (prow0 + lr) * D + dt * 8 + 2 * t) =
              make_float2(acc_o[mt][dt][2 * r] * inv, acc_o[mt][dt][2 * r + 1] * inv);
      }
    return;
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float lse;
      const float inv = online_finish(m_run[mt][r] * mul, l_run[mt][r], &lse);
      const int lr = wrow + mt * 16 + g + 8 * r;
      if (t == 0 && lr < rows_o) lse_row[lr] = lse;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
        *reinterpret_cast<uint32_t *>(sQ + lr * LD + dt * 8 + 2 * t) =
            pack2<T>(acc_o[mt][dt][2 * r] * inv, acc_o[mt][dt][2 * r + 1] * inv);
    }
  __syncthreads();
  store_tile<T, BR, D, NT>((T *)p.o + so.qb * p.o_sb + (so.q0 + ro) * p.o_ss + ho * p.o_sh, p.o_ss,
                           sQ, rows_o, p.d, tid);
}


/* Launches the kernel for padded head dim D with tile shape C (MT, NW, BC,
 * QREG; the library uses FwdTraits<D>, the block-size experiment others); sets
 * its shared-memory limit on first use (once per instantiation). */
template <typename T, int D, typename C = FwdTraits<D>>
fa_status flash_fwd_launch(const FwdArgs &a, cudaStream_t stream) {
  constexpr int BR = 16 * C::MT * C::NW;
  const bool ext = ext_launch(a);
  /* EXT: one byte per thread for the block-mask tile classes; 32-key tiles
   * for the widest head dims, whose accumulators leave no registers spare */
  constexpr int XBC = D >= 96 ? 32 : C::BC;
  const size_t smem = (size_t)(BR + 2 * (ext ? XBC : C::BC)) * (D + 8) * sizeof(T) + (ext ? 256 : 0);
  /* 0: plain scores, 1: transformed, 2: EXT; + 3: a paged cache (no EXT) */
  const int kind = (ext ? 2 : a.cap_log2 > 0.f || a.alibi != NULL || !(a.scale_log2 > 0.f)) +
                   (a.block_table && !ext ? 3 : 0);
  constexpr int MT = C::MT, NW = C::NW, BC = C::BC;
  constexpr bool QR = C::QREG;
  /* paged kernels at the library's tile shapes only (the block-size
   * experiment's other shapes would spill some) */
  constexpr bool PG = std::is_same<C, FwdTraits<D>>::value;
  if (!PG && kind >= 3)
    return fa_set_error(FA_ERR_UNSUPPORTED, "cuda: paged caches at the library's tile shapes only");
  auto kernel = kind == 2   ? flash_fwd_kernel<T, D, MT, NW, XBC, QR, true, true>
                : kind == 1 ? flash_fwd_kernel<T, D, MT, NW, BC, QR, true, false>
                : kind == 0 ? flash_fwd_kernel<T, D, MT, NW, BC, QR, false, false>
                : kind == 4 ? flash_fwd_kernel<T, D, MT, NW, BC, QR, true, false, PG>
                            : flash_fwd_kernel<T, D, MT, NW, BC, QR, false, false, PG>;
  static bool attr_done[5] = {false, false, false, false, false};
  fa_status st = smem_limit_once(kernel, smem, attr_done[kind]);
  if (st != FA_OK) return st;
  const dim3 grid((unsigned)((a.max_seqlen_q + BR - 1) / BR), (unsigned)(a.heads_q * a.nsplit),
                  (unsigned)a.batch);
  FwdArgs args = a;
  args.ext_split_tiles = ((a.max_seqlen_k + XBC - 1) / XBC + a.nsplit - 1) / a.nsplit;
  if (a.pdl)
    st = launch_dependent_smem(kernel, grid, dim3(C::NW * 32), smem, stream, true, args);
  else
    kernel<<<grid, C::NW * 32, smem, stream>>>(args);
  if (a.nsplit == 1) return a.pdl ? st : launch_status();
  if ((st = a.pdl ? st : launch_status()) != FA_OK) return st;
  return fwd_combine_launch<T, D>(a, stream, false);
}

/* The KV-cache call's preparation (kvcache.cu): q rotated into its copy, the
 * new rows appended, in stream order before the attention. */
fa_status kvcache_prepare(const fa_problem *pb, cudaStream_t stream);

/* Block rows of every configuration (the grid's y extent is max_seqlen_q / this). */
constexpr int kFwdMaxGridYZ = 65535; /* heads_q and batch (num_seqs) are grid y and z */

#define FA_DECLARE_FWD(D)                                                               \
  extern template fa_status flash_fwd_launch<__half, D>(const FwdArgs &, cudaStream_t); \
  extern template fa_status flash_fwd_launch<__nv_bfloat16, D>(const FwdArgs &, cudaStream_t);
FA_DECLARE_FWD(32)
FA_DECLARE_FWD(64)
FA_DECLARE_FWD(96)
FA_DECLARE_FWD(128)
FA_DECLARE_FWD(192)
FA_DECLARE_FWD(256)
#undef FA_DECLARE_FWD

}  // namespace fa

#endif
