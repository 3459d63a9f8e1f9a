/* FlashAttention-2 backward on tensor cores (mma.sync m16n8k16, sm_80+).
 *
 * Three launches (docs/ALGORITHM.md has the derivation):
 *  1. bwd_prep_kernel: Di = rowsum(dO o O) and lse * log2(e) (+inf for fully
 *     masked rows, so P = exp2(s - lse2) is 0 there with no test), float32, in
 *     the lse layout; zeroes the float32 dQ accumulator.
 *  2. flash_bwd_kv_kernel: one thread block per (BC keys, K/V head, sequence),
 *     looping over the query heads of its GQA group and the BR-row query
 *     blocks that see its keys. Per block, with K and V resident in shared
 *     memory and Q_i, dO_i streamed in by cp.async:
 *       S^T = K Q_i^T, dP^T = V dO_i^T       (warps split the keys: 16 each)
 *       P^T = exp2(S^T scale log2e - lse2), dS^T = P^T o (dP^T - Di)
 *       dV += P^T dO_i, dK += dS^T Q_i       (float32 registers, written once)
 *       dQ_i += dS K                          (dS^T through shared memory,
 *                                              float32 atomics into the workspace)
 *     Computing the transposed scores puts the keys on the rows of the
 *     accumulators, so P^T and dS^T are the A operands of dV and dK straight
 *     from registers (REG) when one warp holds all of a key's queries; wider
 *     head dims split the warps over queries and D and pass P^T, dS^T through
 *     shared memory instead.
 *  3. bwd_dq_convert_kernel: dQ = scale * accumulator in the storage dtype.
 * Deterministic mode replaces the atomics: the kv kernel skips dQ and
 * flash_bwd_dq_kernel (query-outer, like the forward; the FlashAttention-2
 * paper's alternative) recomputes S and dP per (query block, key block) and
 * accumulates dQ in registers in a fixed order: bitwise reproducible, at the
 * cost of the extra S and dP products (docs/PERF.md). */
#ifndef FA_CUDA_BACKWARD_KERNEL_CUH
#define FA_CUDA_BACKWARD_KERNEL_CUH

#include "bwd_rows.cuh"
#include "forward_kernel.cuh"

namespace fa {

/* Tile shapes per (padded) head dim. kv kernel: BC keys per block, BR query
 * rows per step, NW warps (BC / 16 of them along the keys; the rest split the
 * queries of S and the columns of dK, dV). dq kernel (deterministic mode):
 * QNW warps of 16 query rows, QBC keys per step. MINB: kv blocks per SM the
 * register allocation must allow. Each FA_BWD<D>_BC/_BR/_NW/_MINB/_QNW/_QBC can be overridden with -D for tuning builds; the defaults are the
 * spill-free shapes measured fastest (docs/PERF.md). */
template <int D>
struct BwdTraits;
#ifndef FA_BWD32_BC
#define FA_BWD32_BC 128
#endif
#ifndef FA_BWD32_BR
#define FA_BWD32_BR 64
#endif
#ifndef FA_BWD32_NW
#define FA_BWD32_NW 8
#endif
#ifndef FA_BWD32_QNW
#define FA_BWD32_QNW 4
#endif
#ifndef FA_BWD32_QBC
#define FA_BWD32_QBC 64
#endif
#ifndef FA_BWD32_MINB
#define FA_BWD32_MINB 1
#endif
template <>
struct BwdTraits<32> {
  static constexpr int BC = FA_BWD32_BC, BR = FA_BWD32_BR, NW = FA_BWD32_NW, MINB = FA_BWD32_MINB;
  static constexpr int QNW = FA_BWD32_QNW, QBC = FA_BWD32_QBC;
};
#ifndef FA_BWD64_BC
#define FA_BWD64_BC 128
#endif
#ifndef FA_BWD64_BR
#define FA_BWD64_BR 64
#endif
#ifndef FA_BWD64_NW
#define FA_BWD64_NW 8
#endif
#ifndef FA_BWD64_QNW
#define FA_BWD64_QNW 4
#endif
#ifndef FA_BWD64_QBC
#define FA_BWD64_QBC 64
#endif
#ifndef FA_BWD64_MINB
#define FA_BWD64_MINB 1
#endif
template <>
struct BwdTraits<64> {
  static constexpr int BC = FA_BWD64_BC, BR = FA_BWD64_BR, NW = FA_BWD64_NW, MINB = FA_BWD64_MINB;
  static constexpr int QNW = FA_BWD64_QNW, QBC = FA_BWD64_QBC;
};
#ifndef FA_BWD96_BC
#define FA_BWD96_BC 64
#endif
#ifndef FA_BWD96_BR
#define FA_BWD96_BR 32
#endif
#ifndef FA_BWD96_NW
#define FA_BWD96_NW 4
#endif
#ifndef FA_BWD96_QNW
#define FA_BWD96_QNW 4
#endif
#ifndef FA_BWD96_QBC
#define FA_BWD96_QBC 64
#endif
#ifndef FA_BWD96_MINB
#define FA_BWD96_MINB 1
#endif
template <>
struct BwdTraits<96> {
  static constexpr int BC = FA_BWD96_BC, BR = FA_BWD96_BR, NW = FA_BWD96_NW, MINB = FA_BWD96_MINB;
  static constexpr int QNW = FA_BWD96_QNW, QBC = FA_BWD96_QBC;
};
#ifndef FA_BWD128_BC
#define FA_BWD128_BC 128
#endif
#ifndef FA_BWD128_BR
#define FA_BWD128_BR 32
#endif
#ifndef FA_BWD128_NW
#define FA_BWD128_NW 8
#endif
#ifndef FA_BWD128_QNW
#define FA_BWD128_QNW 4
#endif
#ifndef FA_BWD128_QBC
#define FA_BWD128_QBC 64
#endif
#ifndef FA_BWD128_MINB
#define FA_BWD128_MINB 1
#endif
template <>
struct BwdTraits<128> {
  static constexpr int BC = FA_BWD128_BC, BR = FA_BWD128_BR, NW = FA_BWD128_NW, MINB = FA_BWD128_MINB;
  static constexpr int QNW = FA_BWD128_QNW, QBC = FA_BWD128_QBC;
};
#ifndef FA_BWD192_BC
#define FA_BWD192_BC 64
#endif
#ifndef FA_BWD192_BR
#define FA_BWD192_BR 64
#endif
#ifndef FA_BWD192_NW
#define FA_BWD192_NW 8
#endif
#ifndef FA_BWD192_QNW
#define FA_BWD192_QNW 4
#endif
#ifndef FA_BWD192_QBC
#define FA_BWD192_QBC 32
#endif
#ifndef FA_BWD192_MINB
#define FA_BWD192_MINB 1
#endif
template <>
struct BwdTraits<192> {
  static constexpr int BC = FA_BWD192_BC, BR = FA_BWD192_BR, NW = FA_BWD192_NW, MINB = FA_BWD192_MINB;
  static constexpr int QNW = FA_BWD192_QNW, QBC = FA_BWD192_QBC;
};
#ifndef FA_BWD256_BC
#define FA_BWD256_BC 64
#endif
#ifndef FA_BWD256_BR
#define FA_BWD256_BR 64
#endif
#ifndef FA_BWD256_NW
#define FA_BWD256_NW 8
#endif
#ifndef FA_BWD256_QNW
#define FA_BWD256_QNW 4
#endif
#ifndef FA_BWD256_QBC
#define FA_BWD256_QBC 32
#endif
#ifndef FA_BWD256_MINB
#define FA_BWD256_MINB 1
#endif
template <>
struct BwdTraits<256> {
  static constexpr int BC = FA_BWD256_BC, BR = FA_BWD256_BR, NW = FA_BWD256_NW, MINB = FA_BWD256_MINB;
  static constexpr int QNW = FA_BWD256_QNW, QBC = FA_BWD256_QBC;
};

/* The score transform of the forward, in log2 units, for one element: raw
 * q.k in, log2-domain score out; *dfac = d(score)/d(scale q.k) (softcap's
 * 1 - tanh^2, else 1). */
template <bool XF>
__device__ __forceinline__ float bwd_score(const BwdArgs &p, float x, float slope_log2, int rel,
                                           float *dfac) {
  *dfac = 1.f;
  if constexpr (XF) {
    if (p.cap_log2 > 0.f) {
      const float th = tanhf(x * p.scale_over_cap);
      *dfac = 1.f - th * th;
      x = p.cap_log2 * th;
    } else {
      x *= p.scale_log2;
    }
    return x - slope_log2 * fabsf((float)rel);
  } else {
    return x * p.scale_log2;
  }
}

/* c1 = A1 B1^T and c2 = A2 B2^T for one warp, K = D: A (16 rows) row-major
 * and B (N rows) stored [n][k] in shared memory with row stride LD; a1, a2,
 * b1, b2 are the lanes' ldmatrix addresses of the first tiles (bytes). The S
 * and dP products of the backward, interleaved. */
template <typename T, int D, int N, int LD>
__device__ __forceinline__ void mma_abt_pair(float (&c1)[N / 8][4], float (&c2)[N / 8][4],
                                             uint32_t a1, uint32_t a2, uint32_t b1, uint32_t b2) {
  constexpr int ES = (int)sizeof(T);
#pragma unroll
  for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) c1[nt][e] = c2[nt][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t x1[4], x2[4];
    ldmatrix_x4(x1, a1 + kk * 16 * ES);
    ldmatrix_x4(x2, a2 + kk * 16 * ES);
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      uint32_t y1[4], y2[4];
      ldmatrix_x4(y1, b1 + (np * 16 * LD + kk * 16) * ES);
      mma16816<T>(c1[2 * np], x1, y1[0], y1[1]);
      mma16816<T>(c1[2 * np + 1], x1, y1[2], y1[3]);
      ldmatrix_x4(y2, b2 + (np * 16 * LD + kk * 16) * ES);
      mma16816<T>(c2[2 * np], x2, y2[0], y2[1]);
      mma16816<T>(c2[2 * np + 1], x2, y2[2], y2[3]);
    }
  }
}

/* c[..][2 dp + {0,1}] += A[..] B over the 16x16 k-slice at row k0 of B, for
 * DN / 16 column pairs: B stored [k][n] (row stride LD, loaded with .trans
 * from lane address b, bytes); M A fragments. */
template <typename T, int M, int DN, int LD>
__device__ __forceinline__ void mma_ab_slice(float (&c)[M][DN / 8][4], const uint32_t (&a)[M][4],
                                             uint32_t b) {
  constexpr int ES = (int)sizeof(T);
#pragma unroll
  for (int dp = 0; dp < DN / 16; ++dp) {
    uint32_t y[4];
    ldmatrix_x4_trans(y, b + dp * 16 * ES);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      mma16816<T>(c[m][2 * dp], a[m], y[0], y[1]);
      mma16816<T>(c[m][2 * dp + 1], a[m], y[2], y[3]);
    }
  }
}

template <typename T, int D, int BC, int BR, int NW, int MINB, bool XF, bool DQ, bool EXT>
__global__ void __launch_bounds__(NW * 32, MINB) flash_bwd_kv_kernel(const BwdArgs p) {
  static_assert(!EXT || XF, "EXT kernels take the general score path");
  constexpr int NT = NW * 32, LD = D + 8, LDS = BR + 8, ES = (int)sizeof(T);
  constexpr int WSK = BC / 16, WSQ = NW / WSK, QW = BR / WSQ, DW = D / WSQ;
  constexpr bool REG = WSQ == 1; /* P^T, dS^T stay in registers for dV, dK */
  constexpr int QT = BR / 16, WQ = QT < NW ? QT : NW, MQ = QT / WQ, DQW = D / (NW / WQ);
  static_assert(NW % WSK == 0 && QW % 16 == 0 && DW % 16 == 0, "kv warp layout");
  static_assert(QT % WQ == 0 && NW % WQ == 0 && DQW % 16 == 0, "dq warp layout");
  constexpr bool SDS = DQ || !REG;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T *sK = reinterpret_cast<T *>(smem_raw);
  T *sV = sK + BC * LD;
  T *sQ = sV + BC * LD;
  T *sdO = sQ + BR * LD;
  T *sP = sdO + BR * LD;                 /* BC x LDS, !REG only */
  T *sdS = sP + (REG ? 0 : BC * LDS);    /* BC x LDS, when SDS */
  float *sL = reinterpret_cast<float *>(sdS + (SDS ? BC * LDS : 0));
  float *sDi = sL + BR;

  const int b = blockIdx.z, hk = blockIdx.y;
  const SeqView sv = seq_view(p, b);
  const int nq = sv.nq, nk = sv.nk;
  const int c0 = blockIdx.x * BC; /* causal: the longest blocks first */
  if (c0 >= nk) return;
  const int cols = min(BC, nk - c0);
  const fa_mask mk = attn_mask<EXT>(p, nq, nk);
  const QueryTiles qt = query_tiles<BR, BC>(mk, c0, cols);
  const int m_begin = qt.m_begin, nm = qt.nm;
  const int steps = nm * p.group;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int kw0 = (warp % WSK) * 16; /* this warp's keys (S phase and dK/dV phase) */
  const int qw0 = (warp / WSK) * QW; /* its queries in the S phase */
  const int dw0 = (warp / WSK) * DW; /* its dK/dV columns */
  const int qt0 = (warp % WQ) * MQ;  /* its query tiles in the dQ phase */
  const int dq0 = (warp / WQ) * DQW; /* its dQ columns */

  const T *gK = (const T *)p.k + row_off(sv, true, p.k_sb, p.k_ss, p.k_sh, c0, hk);
  const T *gV = (const T *)p.v + row_off(sv, true, p.v_sb, p.v_ss, p.v_sh, c0, hk);
  load_tile<T, BC, D, NT>(sK, gK, p.k_ss, cols, p.d, tid);
  load_tile<T, BC, D, NT>(sV, gV, p.v_ss, cols, p.d, tid);

  /* Step s: query head hk * group + s / nm, rows (m_begin + s % nm) * BR + [0, BR). */
  auto load_q = [&](int s) {
    const int h = hk * p.group + s / nm, r = (m_begin + s % nm) * BR;
    const T *gQ = (const T *)p.q + row_off(sv, false, p.q_sb, p.q_ss, p.q_sh, r, h);
    const T *gdO = (const T *)p.dout + row_off(sv, false, p.do_sb, p.do_ss, p.do_sh, r, h);
    load_tile<T, BR, D, NT>(sQ, gQ, p.q_ss, nq - r, p.d, tid);
    load_tile<T, BR, D, NT>(sdO, gdO, p.do_ss, nq - r, p.d, tid);
    /* rows past nq read as lse2 = +inf and Di = 0: P = 0 there whatever the score
     * (ALiBi with a negative slope makes it grow with the distance, and
     * exp2(score) would overflow the 16-bit P of dV's product), and dO = 0 */
    for (int j = tid; j < 2 * BR; j += NT) {
      const int i = j % BR, row = r + i;
      const float *src = (j < BR ? p.lse2 : p.dsum) + sv.lse0 + h * sv.lse_hs;
      float *dst = (j < BR ? sL : sDi) + i;
      if (j < BR && row >= nq)
        *dst = INFINITY;
      else
        cp_async4(smem_addr(dst), row < nq ? src + row : src, row < nq ? 4 : 0);
    }
  };
  /* Block-sparse: steps whose tile's blocks are all zero are skipped; cls is
   * the class of the step about to run (kTileAll without a block mask). */
  const bool bm = EXT && p.bmask;
  const TileWalk walk{bm ? bmask_head(p, b, 0) : nullptr,
                      p.bm_sh, p.bm_sr, p.bm_q, p.bm_k, BR, BC, nq, c0 + cols, hk * p.group, nm,
                      m_begin * BR, BR, c0, 0};
  TileSkipper<NT> skip{reinterpret_cast<uint8_t *>(sDi + BR), INT_MIN / 2};
  int cls = kTileAll;
  int s_first = 0, s_next;
  if constexpr (EXT)
    if (bm) s_first = skip.next(0, steps, walk, &cls);
  if (s_first < steps) load_q(s_first);
  cp_async_commit();

  /* Per-lane ldmatrix addresses (bytes). A operands (row-major, 16 rows):
   * a_*; B operands from [n][k] storage: b_*; B from [k][n] storage (.trans):
   * t_*; the dQ phase's A = dS from dS^T storage (.trans): a_dst. */
  const int a_row = lane & 15, a_col = (lane >> 4) * 8;
  const int b_row = (lane & 7) + ((lane >> 4) << 3), b_col = ((lane >> 3) & 1) * 8;
  const int t_row = (lane & 7) + (((lane >> 3) & 1) << 3), t_col = (lane >> 4) * 8;
  const uint32_t a_k = smem_addr(sK) + ((kw0 + a_row) * LD + a_col) * ES;
  const uint32_t a_v = smem_addr(sV) + ((kw0 + a_row) * LD + a_col) * ES;
  const uint32_t b_q = smem_addr(sQ) + ((qw0 + b_row) * LD + b_col) * ES;
  const uint32_t b_do = smem_addr(sdO) + ((qw0 + b_row) * LD + b_col) * ES;
  const uint32_t t_q = smem_addr(sQ) + (t_row * LD + t_col + dw0) * ES;
  const uint32_t t_do = smem_addr(sdO) + (t_row * LD + t_col + dw0) * ES;
  const uint32_t t_k = smem_addr(sK) + (t_row * LD + t_col + dq0) * ES;
  const uint32_t a_p = smem_addr(sP) + ((kw0 + a_row) * LDS + a_col) * ES;
  const uint32_t a_ds = smem_addr(sdS) + ((kw0 + a_row) * LDS + a_col) * ES;
  const uint32_t a_dst = smem_addr(sdS) + (b_row * LDS + b_col + qt0 * 16) * ES;

  float acc_dk[1][DW / 8][4], acc_dv[1][DW / 8][4];
  zero_tiles(acc_dk);
  zero_tiles(acc_dv);

  auto step = [&](const int s, auto masked, const bool some) {
    constexpr bool MASK = decltype(masked)::value;
    const int h = hk * p.group + s / nm, r = (m_begin + s % nm) * BR;
    cp_async_wait<0>();
    __syncthreads(); /* Q, dO, lse2, Di of this step landed */
    const uint8_t *bmh = EXT && some ? bmask_head(p, b, h) : nullptr;

    float acc_s[QW / 8][4], acc_dp[QW / 8][4];
    mma_abt_pair<T, D, QW, LD>(acc_s, acc_dp, a_k, a_v, b_q, b_do);

    /* P^T and dS^T, in place of S^T and dP^T. Element (nt, e): key
     * c0 + kw0 + g + 8 (e / 2), query r + qw0 + nt * 8 + 2 t + e % 2. */
    const float slope_log2 =
        XF && p.alibi ? p.alibi[(int64_t)b * p.alibi_sb + h] * FA_LOG2E : 0.f;
#pragma unroll
    for (int nt = 0; nt < QW / 8; ++nt) {
      const int ql = qw0 + nt * 8 + 2 * t;
      const float2 l2 = *reinterpret_cast<const float2 *>(sL + ql);
      const float2 di = *reinterpret_cast<const float2 *>(sDi + ql);
      uint32_t keep = 0; /* dropout's keep bits */
      if (EXT && p.drop.keep_scale > 0.f)
        keep = dropout_col16(p.drop, (uint32_t)(b * p.heads_q + h), r + qw0 + nt * 8, c0 + kw0, lane);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int kc = c0 + kw0 + g + 8 * (e >> 1);
        const int qi = r + ql + (e & 1);
        /* diag - key; EXT kernels add a shard's shift (from the mask, which holds it, at
         * D = 32: the same value spelled so that ptxas allocates each kernel without
         * spills at its register limit) */
        const int rel = !EXT      ? attn_rel<false>(p, nq, nk, qi, kc)
                        : D <= 32 ? (qi - kc) + (int)mk.diag0
                                  : attn_rel<true>(p, nq, nk, qi, kc);
        float dfac;
        const float x = bwd_score<XF>(p, acc_s[nt][e], slope_log2, rel, &dfac);
        float pe = exp2f(x - ((e & 1) ? l2.y : l2.x));
        if constexpr (MASK) {
          bool vis = kc < nk && fa_mask_in_window(&mk, rel);
          if (EXT && some && vis && qi < nq)
            vis = bmh[(int64_t)(qi / p.bm_q) * p.bm_sr + kc / p.bm_k] != 0;
          if (!vis) pe = 0.f;
        }
        /* dV takes Z o P; dS = P o (Z o dP - Di) */
        const float z = EXT && p.drop.keep_scale > 0.f ? dropout_z(p.drop, keep, e) : 1.f;
        acc_s[nt][e] = EXT ? pe * z : pe;
        const float dpz = EXT ? acc_dp[nt][e] * z : acc_dp[nt][e];
        acc_dp[nt][e] = pe * (dpz - ((e & 1) ? di.y : di.x)) * dfac;
      }
    }

    if constexpr (REG) {
      /* dV += P^T dO, dK += dS^T Q: A operands from the accumulators */
#pragma unroll
      for (int kk = 0; kk < BR / 16; ++kk) {
        uint32_t ap[1][4], ad[1][4];
        c_to_a<T>(ap[0], acc_s[2 * kk], acc_s[2 * kk + 1]);
        c_to_a<T>(ad[0], acc_dp[2 * kk], acc_dp[2 * kk + 1]);
        if constexpr (DQ) {
          uint32_t *ds = reinterpret_cast<uint32_t *>(sdS + (kw0 + g) * LDS + kk * 16 + 2 * t);
          ds[0] = ad[0][0];
          ds[8 * LDS / 2] = ad[0][1];
          ds[4] = ad[0][2];
          ds[8 * LDS / 2 + 4] = ad[0][3];
        }
        mma_ab_slice<T, 1, D, LD>(acc_dv, ap, t_do + kk * 16 * LD * ES);
        mma_ab_slice<T, 1, D, LD>(acc_dk, ad, t_q + kk * 16 * LD * ES);
      }
      __syncthreads(); /* dS^T stored; every warp is done with Q, dO, lse2, Di */
    } else {
#pragma unroll
      for (int nt = 0; nt < QW / 8; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int off = (kw0 + g + 8 * hr) * LDS + qw0 + nt * 8 + 2 * t;
          *reinterpret_cast<uint32_t *>(sP + off) =
              pack2<T>(acc_s[nt][2 * hr], acc_s[nt][2 * hr + 1]);
          *reinterpret_cast<uint32_t *>(sdS + off) =
              pack2<T>(acc_dp[nt][2 * hr], acc_dp[nt][2 * hr + 1]);
        }
      __syncthreads(); /* P^T, dS^T stored */
#pragma unroll
      for (int kk = 0; kk < BR / 16; ++kk) {
        uint32_t ap[1][4], ad[1][4];
        ldmatrix_x4(ap[0], a_p + kk * 16 * ES);
        ldmatrix_x4(ad[0], a_ds + kk * 16 * ES);
        mma_ab_slice<T, 1, DW, LD>(acc_dv, ap, t_do + kk * 16 * LD * ES);
        mma_ab_slice<T, 1, DW, LD>(acc_dk, ad, t_q + kk * 16 * LD * ES);
      }
      __syncthreads(); /* every warp is done with Q, dO, lse2, Di */
    }
    s_next = s + 1;
    if constexpr (EXT)
      if (bm) s_next = skip.next(s + 1, steps, walk, &cls);
    if (s_next < steps) load_q(s_next); /* overlaps the dQ phase */
    cp_async_commit();

    if constexpr (DQ) {
      /* dQ_i += dS K, float32 atomics (one per element and block) */
      float acc_q[MQ][DQW / 8][4];
      zero_tiles(acc_q);
#pragma unroll
      for (int kk = 0; kk < BC / 16; ++kk) {
        uint32_t a[MQ][4];
#pragma unroll
        for (int mq = 0; mq < MQ; ++mq)
          ldmatrix_x4_trans(a[mq], a_dst + (kk * 16 * LDS + mq * 16) * ES);
        mma_ab_slice<T, MQ, DQW, LD>(acc_q, a, t_k + kk * 16 * LD * ES);
      }
#pragma unroll
      for (int mq = 0; mq < MQ; ++mq)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int row = r + (qt0 + mq) * 16 + g + 8 * hr;
          if (row < nq) {
            float *dst = p.dq_acc + (sv.lse0 + h * sv.lse_hs + row) * D + dq0 + 2 * t;
#pragma unroll
            for (int nt = 0; nt < DQW / 8; ++nt)
              atomic_add2(dst + nt * 8, acc_q[mq][nt][2 * hr], acc_q[mq][nt][2 * hr + 1]);
          }
        }
    }
  };
  for (int s = s_first; s < steps; s = s_next) {
    const int r = (m_begin + s % nm) * BR;
    const bool some = EXT && cls == kTileSome;
    if (some || qt.masked(r, BR, nq))
      step(s, std::true_type(), some);
    else
      step(s, std::false_type(), false);
  }
  cp_async_wait<0>();
  __syncthreads(); /* every warp is done with sK, sV (and sdS) */

  /* dK (times scale) and dV through shared memory (over K and V) to 16-byte stores. */
#pragma unroll
  for (int dt = 0; dt < DW / 8; ++dt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int off = (kw0 + g + 8 * hr) * LD + dw0 + dt * 8 + 2 * t;
      *reinterpret_cast<uint32_t *>(sK + off) =
          pack2<T>(acc_dk[0][dt][2 * hr] * p.scale, acc_dk[0][dt][2 * hr + 1] * p.scale);
      *reinterpret_cast<uint32_t *>(sV + off) =
          pack2<T>(acc_dv[0][dt][2 * hr], acc_dv[0][dt][2 * hr + 1]);
    }
  __syncthreads();
  const SeqView so = seq_view(p, blockIdx.z);
  const int co = blockIdx.x * BC, cols_o = min(BC, so.nk - co);
  store_tile<T, BC, D, NT>((T *)p.dk + row_off(so, true, p.dk_sb, p.dk_ss, p.dk_sh, co, blockIdx.y),
                           p.dk_ss, sK, cols_o, p.d, tid);
  store_tile<T, BC, D, NT>((T *)p.dv + row_off(so, true, p.dv_sb, p.dv_ss, p.dv_sh, co, blockIdx.y),
                           p.dv_ss, sV, cols_o, p.d, tid);
}

/* Deterministic dQ: one block per (BR = 16 NW query rows, query head,
 * sequence), key blocks in a fixed order, dQ in float32 registers. K and V
 * are double-buffered. */
template <typename T, int D, int NW, int BC, bool XF, bool EXT>
__global__ void __launch_bounds__(NW * 32, EXT ? 1 : 0) flash_bwd_dq_kernel(const BwdArgs p) {
  static_assert(!EXT || XF, "EXT kernels take the general score path");
  constexpr int BR = 16 * NW, NT = NW * 32, LD = D + 8, ES = (int)sizeof(T);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T *sQ = reinterpret_cast<T *>(smem_raw);
  T *sdO = sQ + BR * LD;
  T *sK = sdO + BR * LD; /* [2][BC][LD] */
  T *sV = sK + 2 * BC * LD;

  const int b = blockIdx.z, h = blockIdx.y;
  const int r0 = (gridDim.x - 1 - blockIdx.x) * BR;
  const SeqView sv = seq_view(p, b);
  const int nq = sv.nq, nk = sv.nk;
  if (r0 >= nq) return;
  const int rows = min(BR, nq - r0), hk = h / p.group;
  const fa_mask mk = attn_mask<EXT>(p, nq, nk);
  const KeyTiles kt = key_tiles<BC>(mk, r0, rows);
  const int n_begin = kt.n_begin, n_end = kt.n_end;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3, wrow = warp * 16;
  load_tile<T, BR, D, NT>(sQ, (const T *)p.q + row_off(sv, false, p.q_sb, p.q_ss, p.q_sh, r0, h),
                          p.q_ss, rows, p.d, tid);
  load_tile<T, BR, D, NT>(sdO,
                          (const T *)p.dout + row_off(sv, false, p.do_sb, p.do_ss, p.do_sh, r0, h),
                          p.do_ss, rows, p.d, tid);
  const T *gK = (const T *)p.k + row_off(sv, true, p.k_sb, p.k_ss, p.k_sh, 0, hk);
  const T *gV = (const T *)p.v + row_off(sv, true, p.v_sb, p.v_ss, p.v_sh, 0, hk);
  auto load_kv = [&](int n, int buf) {
    const int c = n * BC;
    load_tile<T, BC, D, NT>(sK + buf * BC * LD, gK + (int64_t)c * p.k_ss, p.k_ss, nk - c, p.d, tid);
    load_tile<T, BC, D, NT>(sV + buf * BC * LD, gV + (int64_t)c * p.v_ss, p.v_ss, nk - c, p.d, tid);
  };
  /* Block-sparse: key tiles whose blocks are all zero are skipped; cls is the
   * class of the tile about to run (kTileAll without a block mask). */
  const uint8_t *bm = EXT && p.bmask ? bmask_head(p, b, h) : nullptr;
  const TileWalk walk{bm ? bmask_head(p, b, 0) : nullptr,
                      p.bm_sh, p.bm_sr, p.bm_q, p.bm_k, BR, BC, nq, nk, h, n_end - n_begin, r0, 0,
                      n_begin * BC, BC};
  TileSkipper<NT> skip{reinterpret_cast<uint8_t *>(sV + 2 * BC * LD), INT_MIN / 2};
  int cls = kTileAll;
  int n = n_begin, n_next, buf = 0; /* buf: K/V buffer of tile n */
  if constexpr (EXT)
    if (bm) n = n_begin + skip.next(0, n_end - n_begin, walk, &cls);
  if (n < n_end) load_kv(n, 0);
  cp_async_commit();

  /* this thread's rows g, g + 8 of its warp: lse2 and Di (+inf and 0 past nq) */
  float l2[2], di[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int row = r0 + wrow + g + 8 * hr;
    const int64_t idx = sv.lse0 + h * sv.lse_hs + row;
    l2[hr] = row < nq ? p.lse2[idx] : INFINITY; /* P = 0 past nq (see load_q) */
    di[hr] = row < nq ? p.dsum[idx] : 0.f;
  }
  const float slope_log2 =
      XF && p.alibi ? p.alibi[(int64_t)b * p.alibi_sb + h] * FA_LOG2E : 0.f;

  const int a_row = lane & 15, a_col = (lane >> 4) * 8;
  const int b_row = (lane & 7) + ((lane >> 4) << 3), b_col = ((lane >> 3) & 1) * 8;
  const int t_row = (lane & 7) + (((lane >> 3) & 1) << 3), t_col = (lane >> 4) * 8;
  const uint32_t a_q = smem_addr(sQ) + ((wrow + a_row) * LD + a_col) * ES;
  const uint32_t a_do = smem_addr(sdO) + ((wrow + a_row) * LD + a_col) * ES;

  float acc_q[1][D / 8][4];
  zero_tiles(acc_q);

  auto step = [&](const int n, auto masked, const bool some) {
    constexpr bool MASK = decltype(masked)::value;
    const int c0 = n * BC;
    cp_async_wait<0>();
    __syncthreads(); /* K_n, V_n landed; every warp is done with the other buffer */
    n_next = n + 1;
    if constexpr (EXT)
      if (bm) n_next = n_begin + skip.next(n + 1 - n_begin, n_end - n_begin, walk, &cls);
    if (n_next < n_end) load_kv(n_next, buf ^ 1);
    cp_async_commit();
    const uint32_t b_k = smem_addr(sK + buf * BC * LD) + (b_row * LD + b_col) * ES;
    const uint32_t b_v = smem_addr(sV + buf * BC * LD) + (b_row * LD + b_col) * ES;
    const uint32_t t_k = smem_addr(sK + buf * BC * LD) + (t_row * LD + t_col) * ES;

    float acc_s[BC / 8][4], acc_dp[BC / 8][4];
    mma_abt_pair<T, D, BC, LD>(acc_s, acc_dp, a_q, a_do, b_k, b_v);
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int i = r0 + wrow + g + 8 * hr;
      int row_lo = 0, row_hi = nk;
      if constexpr (MASK) {
        int64_t lo, hi;
        fa_mask_row_range(&mk, i, &lo, &hi);
        row_lo = (int)lo;
        row_hi = (int)hi;
      }
      const uint8_t *brow = nullptr; /* this row's block-mask bytes, on mixed tiles */
      if (EXT && some) brow = bm + (int64_t)(min(i, nq - 1) / p.bm_q) * p.bm_sr;
      uint32_t keep = 0; /* dropout's keep bits: 4 per 16 columns */
#pragma unroll
      for (int np = 0; np < BC / 16; ++np)
        if (EXT && p.drop.keep_scale > 0.f)
          keep |= dropout_row16(p.drop, (uint32_t)(b * p.heads_q + h), i, c0 + np * 16, t) << (4 * np);
#pragma unroll
      for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = c0 + nt * 8 + 2 * t + e;
          float dfac;
          const float x = bwd_score<XF>(p, acc_s[nt][2 * hr + e], slope_log2,
                                        attn_rel<EXT>(p, nq, nk, i, col), &dfac);
          float pe = exp2f(x - l2[hr]);
          if (MASK && (col < row_lo || col >= row_hi || (EXT && some && !brow[col / p.bm_k])))
            pe = 0.f;
          const float z = EXT && p.drop.keep_scale > 0.f ? dropout_z(p.drop, keep, 2 * nt + e) : 1.f;
          const float dpz = EXT ? acc_dp[nt][2 * hr + e] * z : acc_dp[nt][2 * hr + e];
          acc_s[nt][2 * hr + e] = pe * (dpz - di[hr]) * dfac;
        }
    }
    /* dQ += dS K, dS straight from the accumulators */
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      uint32_t a[1][4];
      c_to_a<T>(a[0], acc_s[2 * kk], acc_s[2 * kk + 1]);
      mma_ab_slice<T, 1, D, LD>(acc_q, a, t_k + kk * 16 * LD * ES);
    }
  };
  for (; n < n_end; n = n_next, buf ^= 1) {
    const bool some = EXT && cls == kTileSome;
    if (some || kt.masked(n * BC, BC, nk))
      step(n, std::true_type(), some);
    else
      step(n, std::false_type(), false);
  }
  cp_async_wait<0>();
  __syncthreads(); /* every warp is done with sQ */
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
      *reinterpret_cast<uint32_t *>(sQ + (wrow + g + 8 * hr) * LD + dt * 8 + 2 * t) =
          pack2<T>(acc_q[0][dt][2 * hr] * p.scale, acc_q[0][dt][2 * hr + 1] * p.scale);
  __syncthreads();
  const SeqView so = seq_view(p, blockIdx.z);
  const int ro = (gridDim.x - 1 - blockIdx.x) * BR;
  store_tile<T, BR, D, NT>((T *)p.dq + row_off(so, false, p.dq_sb, p.dq_ss, p.dq_sh, ro, blockIdx.y),
                           p.dq_ss, sQ, min(BR, so.nq - ro), p.d, tid);
}

/* The backward for padded head dim D: prep, kv (+ dq when deterministic),
 * convert; dq_acc NULL selects deterministic mode. */
template <typename T, int D>
fa_status flash_bwd_launch(const BwdArgs &a, cudaStream_t stream) {
  using C = BwdTraits<D>;
  const bool ext = ext_launch(a);
  const int xf = ext ? 2 : a.cap_log2 > 0.f || a.alibi != NULL; /* 2: EXT kernels */
  const bool det = a.dq_acc == NULL;
  fa_status st = bwd_rows_launch<T, D>(a, stream, false);
  if (st != FA_OK) return st;

  constexpr int LD = D + 8;
  /* the EXT variant steps 32 query rows at D = 64 and 256, the XF one at
   * 256: with 64 they spill on sm_80 */
  constexpr int XBR = (D == 64 || D == 256) && C::BR > 32 ? 32 : C::BR;
  constexpr int FBR = D == 256 && C::BR > 32 ? 32 : C::BR;
  /* K, V, Q, dO tiles, P^T (unless in registers), dS^T (unless in registers
   * without dQ), L and Di; EXT: one byte per thread for the block-mask tile classes */
  auto kv_smem_for = [&](int br) {
    const bool reg = C::NW == C::BC / 16;
    const size_t lds = (size_t)C::BC * (br + 8) * sizeof(T);
    return (size_t)(2 * C::BC + 2 * br) * LD * sizeof(T) + (reg ? 0 : lds) + 2 * br * 4 +
           (det && reg ? 0 : lds) + (ext ? 256 : 0);
  };
  const size_t kv_smem = kv_smem_for(xf == 2 ? XBR : xf == 1 ? FBR : C::BR);
  using KV = void (*)(BwdArgs);
  const KV kvs[3][2] = {{flash_bwd_kv_kernel<T, D, C::BC, C::BR, C::NW, C::MINB, false, true, false>,
                         flash_bwd_kv_kernel<T, D, C::BC, C::BR, C::NW, C::MINB, false, false, false>},
                        {flash_bwd_kv_kernel<T, D, C::BC, FBR, C::NW, C::MINB, true, true, false>,
                         flash_bwd_kv_kernel<T, D, C::BC, FBR, C::NW, C::MINB, true, false, false>},
                        {flash_bwd_kv_kernel<T, D, C::BC, XBR, C::NW, C::MINB, true, true, true>,
                         flash_bwd_kv_kernel<T, D, C::BC, XBR, C::NW, C::MINB, true, false, true>}};
  const KV kv = kvs[xf][det];
  static bool kv_done[3][2] = {{false, false}, {false, false}, {false, false}};
  st = smem_limit_once(kv, kv_smem, kv_done[xf][det]);
  if (st != FA_OK) return st;
  const dim3 kv_grid((unsigned)((a.max_seqlen_k + C::BC - 1) / C::BC),
                     (unsigned)(a.heads_q / a.group), (unsigned)a.batch);
  if (kv_grid.x > 0) kv<<<kv_grid, C::NW * 32, kv_smem, stream>>>(a);
  st = launch_status();
  if (st != FA_OK) return st;

  if (det) {
    constexpr int QBR = 16 * C::QNW;
    /* the EXT variant takes 32-key steps from D = 96 up: with 64 it spills on sm_80 */
    constexpr int XQBC = D >= 96 && C::QBC > 32 ? 32 : C::QBC;
    const size_t dq_smem =
        (size_t)(2 * QBR + 4 * (ext ? XQBC : C::QBC)) * LD * sizeof(T) + (ext ? 256 : 0);
    const KV dqs[3] = {flash_bwd_dq_kernel<T, D, C::QNW, C::QBC, false, false>,
                       flash_bwd_dq_kernel<T, D, C::QNW, C::QBC, true, false>,
                       flash_bwd_dq_kernel<T, D, C::QNW, XQBC, true, true>};
    const KV dq = dqs[xf];
    static bool dq_done[3] = {false, false, false};
    st = smem_limit_once(dq, dq_smem, dq_done[xf]);
    if (st != FA_OK) return st;
    const dim3 dq_grid((unsigned)((a.max_seqlen_q + QBR - 1) / QBR), (unsigned)a.heads_q,
                       (unsigned)a.batch);
    if (dq_grid.x > 0) dq<<<dq_grid, C::QNW * 32, dq_smem, stream>>>(a);
    return launch_status();
  }
  return bwd_rows_launch<T, D>(a, stream, true);
}

#define FA_DECLARE_BWD(D)                                                               \
  extern template fa_status flash_bwd_launch<__half, D>(const BwdArgs &, cudaStream_t); \
  extern template fa_status flash_bwd_launch<__nv_bfloat16, D>(const BwdArgs &, cudaStream_t);
FA_DECLARE_BWD(32)
FA_DECLARE_BWD(64)
FA_DECLARE_BWD(96)
FA_DECLARE_BWD(128)
FA_DECLARE_BWD(192)
FA_DECLARE_BWD(256)
#undef FA_DECLARE_BWD

}  // namespace fa

#endif
