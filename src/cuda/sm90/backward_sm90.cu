/* FlashAttention-2 backward on Hopper: the key/value kernel of
 * backward_kernel.cuh (launch 2 of 3; the Di/lse2 preparation is
 * bwd_rows.cuh's kernel) on warpgroup MMA fed by TMA, with warp specialisation as in
 * forward_sm90.cu, and the dQ conversion (launch 3) overlapping its last
 * blocks: each block counts itself done per (sequence, K/V head) once its dQ
 * reductions have completed, and the conversion, a programmatic dependent
 * launch, converts a head's rows once all of its blocks are counted.
 *
 * A thread block owns BC = 128 keys of one (K/V head, sequence): warpgroup 0
 * is the producer (one thread: K and V once, then Q_i and dO_i tiles of BR
 * rows through an ST-deep ring, for every query head of the GQA group and
 * every query block that sees the keys; its warp puts each tile's lse2 and
 * Di rows beside them); warpgroups 1 and 2 each own 64 keys
 * and keep dK, dV in float32 registers. Per query tile, each consumer:
 *   S^T = K Q_i^T, dP^T = V dO_i^T        wgmma SS (K-major operands)
 *   P^T = exp2(S^T scale log2e - lse2),  dS^T = P^T o (dP^T - Di)   registers
 *   dV += P^T dO_i, dK += dS^T Q_i        wgmma RS (Q, dO as MN-major B)
 *   dQ_i += dS K                          both warpgroups' dS^T -> shared memory
 *                                         (SW128); each warpgroup takes a 64 x 64
 *                                         block of the tile's dQ over all BC keys
 *                                         (wgmma SS, both operands MN-major) and
 *                                         reduce-adds it (TMA, swizzled tensor
 *                                         map) into the float32 dQ accumulator
 * (Element-wise float atomics for dQ halved the kernel's speed: 277 against
 * 538 TFLOP/s with them left out, D = 128 on an H200.)
 * Above D = 128 (BwdShape::COLS; 129-192 padded to 192, 193-256 to 256)
 * both warpgroups take the same 64 keys, each owning half of the columns of
 * dK, dV and dQ, and each computes the whole S^T and dP^T. Plain score path
 * (block masks as in the forward), padded head dims 64, 128, 192 and 256.
 *
 * Deterministic mode (DET): the dQ reduce-adds into each query tile go in the
 * fixed order of common/dq_order.h. The consumers stage their dQ blocks as
 * before; a writer warp of the producer warpgroup waits for the block's turn
 * at the tile (a per-tile count in global memory), issues both warpgroups'
 * reduce-adds, waits for them to complete and counts the block in. Blocks
 * take their index from a ticket as they start, so that they only ever wait
 * for blocks already running; tiles a block mask skips are counted in
 * without an add. docs/ALGORITHM.md, "Deterministic dQ". */
#include "../attn.cuh"
#include "../bwd_rows.cuh"
#include "common/dq_order.h"
#include "schedule.cuh"
#include "shapes.cuh"
#include "sm90.h"
#include "wgmma.cuh"

#ifdef FA_SM90_TRACE
#include <cstdio>
#endif

namespace fa {
namespace sm90 {

/* Slices J0.. of an accumulator as an N-column one (constant J0: the
 * registers stay registers). */
template <int N, int J0, int M>
__device__ __forceinline__ auto acc_part(float (&a)[M][4]) -> float (&)[N / 8][4] {
  static_assert(J0 + N / 8 <= M, "inside the accumulator");
  return *reinterpret_cast<float(*)[N / 8][4]>(&a[J0][0]);
}

struct BwdParams {
  BwdArgs a;
  CUtensorMap tq, tk, tv, tdo;
  /* the dQ accumulator, mapped as Q is (the same coordinates), so boxes
   * clip at each sequence's end, varlen too. Partials are staged 128-byte
   * swizzled (2-way bank conflicts) as 32-column boxes. */
  CUtensorMap tdq;
  int kv_rows; /* a KV cache's map: rows from one sequence to the next (kv_map_rows) */
};

#ifdef FA_SM90_TRACE
/* Timing probe (a build with -DFA_SM90_TRACE only): per block, the global
 * timer at entry, after K/V arrived, after the last step and at the end, the
 * SM and the steps visited; fa_sm90_trace_dump() writes them as CSV. */
constexpr int kTraceBlocks = 1 << 16;
__device__ unsigned long long g_trace[kTraceBlocks][6];
__device__ __forceinline__ void trace_set(int slot, unsigned long long v) {
  const unsigned blk = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (blk < kTraceBlocks) g_trace[blk][slot] = v;
}
#define FA_TRACE_SET(slot, v) trace_set(slot, v)
#else
#define FA_TRACE_SET(slot, v) ((void)0)
#endif
#define FA_TRACE(slot) FA_TRACE_SET(slot, global_timer())

/* Named barriers of the deterministic mode's dQ hand-over, per consumer
 * warpgroup wg (128 threads) and the writer warp: its staging tile is full
 * (kDqFull + wg), the writer has read it (kDqEmpty + wg). */
constexpr int kDqFull = 4, kDqEmpty = 6, kDqBarThreads = 128 + 32;

/* The dynamic shared memory (BwdSmem from its first 1024-byte boundary) */
extern __shared__ __align__(16) unsigned char smem_raw[];

/* A thread block's keys, its walk of the query tiles and its shared memory
 * (BwdSmem, from sK): what each role works from. It refers to the kernel's
 * values, as lambdas capturing them would: copies of them compiled to 1-2%
 * more instructions (nvcc 13.0). */
template <typename T, int D, bool DET>
struct BwdBlock {
  using S = BwdShape<D>;
  using L = BwdSmem<D>;
  const BwdArgs &p;
  const uint32_t &sK; /* the first 1024-byte boundary of shared memory: K, then BwdSmem's layout */
  const int &bx, &hk, &b; /* key block, K/V head, sequence */
  int *const &done;       /* the (sequence, K/V head) count of finished blocks */
  const SeqView &sv;
  const int &nq, &nk, &c0; /* c0: the block's first key */
  const fa_mask &mk;
  const QueryTiles &qt;
  /* the query tiles that see the block (qt's), as dq_order.h counts them */
  const int &m_begin, &nm;
  const int &steps, &rot; /* steps: nm per query head of the group */
  /* this sequence's row 0 in the Q, dO and dQ maps, and in the K and V maps */
  const MapSeq &mq, &mkv;

  __device__ __forceinline__ uint32_t kv_full() const { return sK + L::BARS; }
  __device__ __forceinline__ uint32_t q_full(int st) const { return kv_full() + 8 * (1 + st); }
  __device__ __forceinline__ uint32_t q_empty(int st) const {
    return kv_full() + 8 * (1 + S::ST + st);
  }
  __device__ __forceinline__ uint32_t q_tile(int st) const { return sK + L::Q0 + st * L::QBYTES; }
  __device__ __forceinline__ uint32_t do_tile(int st) const { return sK + L::DO0 + st * L::QBYTES; }
  /* stage st's lse2 row, then its Di row (BR floats each) */
  __device__ __forceinline__ float *lse_stage(int st) const {
    return reinterpret_cast<float *>(smem_raw + (sK + L::LSE0 - smem_addr(smem_raw))) +
           st * 2 * S::BR;
  }
  /* warpgroup w's dS^T tile in buffer buf */
  __device__ __forceinline__ uint32_t ds_tile(int buf, int w) const {
    return sK + L::DS0 + (buf * S::NWG + w) * L::DSBYTES;
  }
  /* Step s: query head hk group + s / nm, query tile m_begin + (s % nm + rot)
   * % nm; DET full masks rotate the walk (dq_order.h), else rot = 0 */
  __device__ __forceinline__ void tile_of(int s, int &h, int &r) const {
    const int hs = s / nm;
    int pos = s - hs * nm + rot;
    if (pos >= nm) pos -= nm;
    h = hk * p.group + hs;
    r = (m_begin + pos) * S::BR;
  }
  /* Steps a block mask (blocks a multiple of the tiles, sm90_forward_covers)
   * skips; producer and consumers each walk the same steps */
  __device__ __forceinline__ bool skip(int s) const {
    if (!p.bmask) return false;
    int h, r;
    tile_of(s, h, r);
    return !__ldg(bmask_head(p, b, h) + c0 / p.bm_k + (int64_t)(r / p.bm_q) * p.bm_sr);
  }
};

/* The producer warp: K and V once, then, per live step, Q_i and dO_i into
 * the ring's next stage (lane 0 issues the copies) with the tile's lse2 and
 * Di rows (the warp). */
template <typename T, int D, bool DET>
__device__ __forceinline__ void bwd_produce(const BwdParams &P, const BwdBlock<T, D, DET> &k) {
  using L = BwdSmem<D>;
  constexpr int BC = BwdShape<D>::BC, BR = BwdShape<D>::BR, ST = BwdShape<D>::ST;
  const BwdArgs &p = P.a;
  const int tid = threadIdx.x;
  if (tid == 0) {
    mbar_expect_tx(k.kv_full(), 2 * L::KBYTES);
    tma_load_tile<BC, D>(k.sK, &P.tk, k.kv_full(), k.mkv.row + k.c0, k.hk, k.mkv.batch);
    tma_load_tile<BC, D>(k.sK + L::V0, &P.tv, k.kv_full(), k.mkv.row + k.c0, k.hk, k.mkv.batch);
  }
  int i = 0;
  auto load = [&](int s) {
    int h, r;
    k.tile_of(s, h, r);
    const int st = i % ST, ph = (i / ST) & 1;
    ++i;
    mbar_wait(k.q_empty(st), ph ^ 1);
    if (tid == 0) {
      mbar_expect_tx(k.q_full(st), 2 * L::QBYTES);
      tma_load_tile<BR, D>(k.q_tile(st), &P.tq, k.q_full(st), k.mq.row + r, h, k.mq.batch);
      tma_load_tile<BR, D>(k.do_tile(st), &P.tdo, k.q_full(st), k.mq.row + r, h, k.mq.batch);
      /* the tile's dQ accumulator rows into L2 a step or two before the
       * reduce-adds read them (with sparse masks they are not there yet) */
      for (int rr = 0; rr < BR; rr += 64)
        for (int cc = 0; cc < D; cc += 32)
          tma_prefetch_4d(&P.tdq, cc, k.mq.row + r + rr, h, k.mq.batch);
    }
    /* The tile's lse2 and Di rows into the stage, +inf and 0 past the
     * sequence's end (P = dS = 0 there): loaded here, a stage ahead, their
     * latency is off the consumers' path (read from global after the S^T
     * product, they were the largest stall: ncu, D = 128) */
    float *sl = k.lse_stage(st);
    const int64_t row = k.sv.lse0 + h * k.sv.lse_hs + r;
#pragma unroll
    for (int u = tid; u < BR; u += 32) {
      const bool in = r + u < k.nq;
      sl[u] = in ? __ldg(p.lse2 + row + u) : INFINITY;
      sl[BR + u] = in ? __ldg(p.dsum + row + u) : 0.f;
    }
    mbar_arrive(k.q_full(st));
  };
  auto skip = [&](int s) { return k.skip(s); };
  for_each_live(k.steps, skip, load);
}

/* The dQ writer (deterministic mode), per step of the walk (skipped steps
 * too): the block's turn at the tile, both warpgroups' reduce-adds, their
 * completion, the count. Lane 0 waits and issues; the warp takes the named
 * barriers. Kept short, as it runs once per step and the next block in a
 * tile's order is often only a step behind: the turns come 32 steps at a
 * time, one per lane, and the tile's count is read before the staging
 * barriers (it only grows). */
template <typename T, int D, bool DET>
__device__ __forceinline__ void bwd_dq_writer(const BwdParams &P, const BwdBlock<T, D, DET> &k) {
  using S = BwdShape<D>;
  using L = BwdSmem<D>;
  const BwdArgs &p = P.a;
  const int steps = k.steps; /* once, into a register */
  const int lane = threadIdx.x & 31;
  const fa_dq_order ord = fa_dq_order_make(&k.mk, S::BC, S::BR, p.det_wave);
  named_arrive(kDqEmpty, kDqBarThreads); /* both staging tiles start empty */
  named_arrive(kDqEmpty + 1, kDqBarThreads);
  int turn = 0; /* this lane's: that of step (s & ~31) + lane */
  for (int s = 0; s < steps; ++s) {
    int h, r;
    if ((s & 31) == 0 && s + lane < steps) {
      k.tile_of(s + lane, h, r);
      turn = fa_dq_turn(&ord, k.bx, r / S::BR);
    }
    const int want = __shfl_sync(0xffffffffu, turn, s & 31);
    k.tile_of(s, h, r);
    const bool live = !k.skip(s);
    int *const sem = p.dq_sem + k.sv.lse0 + (int64_t)h * k.sv.lse_hs + r;
    int n = 0;
    if (lane == 0) n = ld_acquire_gpu(sem);
    if (live)
#pragma unroll
      for (int w = 0; w < S::NWG; ++w)
        named_sync(kDqFull + w, kDqBarThreads); /* both warpgroups' dQ blocks are staged */
    if (lane == 0) {
      while (n < want) {
        __nanosleep(32);
        n = ld_acquire_gpu(sem);
      }
      fence_proxy_async_global(); /* the adds come after */
      if (live) {
#pragma unroll
        for (int w = 0; w < S::NWG; ++w) {
          const int qw = S::ROW_SPLIT ? w * 64 : 0, dw = S::ROW_SPLIT ? 0 : w * S::DQC;
          const uint32_t src = k.sK + L::DQ0 + w * L::DQBYTES;
          if (r + qw < k.nq)
#pragma unroll
            for (int bb = 0; bb < S::DQC / 32; ++bb)
              tma_reduce_add_4d(&P.tdq, src + bb * 8192, dw + bb * 32, k.mq.row + r + qw, h,
                                k.mq.batch);
        }
        bulk_commit();
        bulk_wait<0, true>();
      }
    }
    __syncwarp();
    if (live)
#pragma unroll
      for (int w = 0; w < S::NWG; ++w) named_arrive(kDqEmpty + w, kDqBarThreads);
    if (lane == 0) {
      if (live) { /* the sums are in memory before the count says so */
        bulk_wait<0, false>();
        fence_proxy_async_global();
      }
      red_release_gpu_add(sem, 1);
    }
    __syncwarp();
  }
  /* every add of the block has completed: the conversion may take its head */
  if (lane == 0) red_release_gpu_add(k.done, 1);
}

/* A consumer thread's share of the block: its warpgroup's keys, its columns
 * of dK and dV, and its warpgroup's block of each tile's dQ. */
template <int D>
struct BwdConsumer {
  using S = BwdShape<D>;
  int ctid, wg, g, t;
  int kw0; /* this warpgroup's first key in the block */
  int kw;  /* this warp's */
  uint32_t k_wg, v_wg, dq_wg;
  /* dQ rows [qw, qw + 64), columns [dw, dw + DQC) of the tile */
  int qw, dw;
  /* first columns of this warpgroup's dK/dV pieces and dQ pieces (BwdShape) */
  int pc0, pc1, qc0;
  bool issuer; /* issues this warpgroup's dQ reductions (DET: the writer warp does) */

  __device__ __forceinline__ explicit BwdConsumer(uint32_t sK)
      : ctid((int)threadIdx.x - 128),
        wg(ctid >> 7),
        g((threadIdx.x & 31) >> 2),
        t(threadIdx.x & 3),
        kw0(S::COLS ? 0 : wg * 64),
        kw(kw0 + ((ctid >> 5) & 3) * 16),
        k_wg(sK + kw0 * 128),
        v_wg(sK + BwdSmem<D>::V0 + kw0 * 128),
        dq_wg(sK + BwdSmem<D>::DQ0 + wg * BwdSmem<D>::DQBYTES),
        qw(S::ROW_SPLIT ? wg * 64 : 0),
        dw(S::ROW_SPLIT ? 0 : wg * S::DQC),
        pc0(!S::COLS ? 0 : (S::PN1 ? 128 * wg : wg * S::DC)),
        pc1(64 + 32 * wg),
        qc0(S::COLS ? pc0 : dw),
        issuer((ctid & 127) == 0) {}
  /* the column of an accumulator's slice j, given its pieces */
  __device__ __forceinline__ static int slice_col(int j, int n0, int c0, int c1) {
    return j < n0 / 8 ? c0 + 8 * j : c1 + 8 * (j - n0 / 8);
  }
};

/* S^T = K Q_i^T and dP^T = V dO_i^T, this warpgroup's 64 keys x BR queries */
template <typename T, int D>
__device__ __forceinline__ void bwd_scores(const BwdConsumer<D> &c, uint32_t q_st, uint32_t do_st,
                                           float (&sa)[BwdShape<D>::BR / 8][4],
                                           float (&dp)[BwdShape<D>::BR / 8][4]) {
  constexpr int BC = BwdShape<D>::BC, BR = BwdShape<D>::BR;
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wgmma_ss<T, BR>(sa, sw128_kmajor<BC>(c.k_wg, kk), sw128_kmajor<BR>(q_st, kk), kk > 0);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wgmma_ss<T, BR>(dp, sw128_kmajor<BC>(c.v_wg, kk), sw128_kmajor<BR>(do_st, kk), kk > 0);
  wg_commit();
  wg_wait<0>();
  reg_fence(sa);
  reg_fence(dp);
}

/* A masked step's invisible scores -> -inf, so P = 0 (and dS = 0) there:
 * from each key's visible row range (two per thread), not a window test per
 * element, which made masked steps cost ~1.9x an unmasked one (timed per
 * block with -DFA_SM90_TRACE; H100, D = 128). */
template <typename T, int D, bool DET>
__device__ __forceinline__ void bwd_mask(const BwdBlock<T, D, DET> &k, const BwdConsumer<D> &c,
                                         int r, float (&sa)[BwdShape<D>::BR / 8][4]) {
  int qlo[2], qhi[2]; /* rows that see this thread's two keys */
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int kc = k.c0 + c.kw + c.g + 8 * hr;
    int64_t a, z;
    fa_mask_col_range(&k.mk, kc, &a, &z);
    qlo[hr] = (int)a;
    qhi[hr] = kc < k.nk ? (int)z : 0;
  }
#pragma unroll
  for (int j = 0; j < BwdShape<D>::BR / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int qi = r + j * 8 + 2 * c.t + (e & 1);
      if (qi < qlo[e >> 1] || qi >= qhi[e >> 1]) sa[j][e] = -INFINITY;
    }
}

/* P^T and dS^T, rounded to A fragments 16 queries at a time (measured: +8%
 * at D = 128 over computing all of them first). Element (j, e): key c0 + kw
 * + g + 8 (e / 2), query r + 8 j + 2 t + e % 2; rows past nq have lse2 =
 * +inf in the stage, so P = 0 there. */
template <typename T, int D, bool DET>
__device__ __forceinline__ void bwd_probs(const BwdBlock<T, D, DET> &k, const BwdConsumer<D> &c,
                                          const float *sl, float (&sa)[BwdShape<D>::BR / 8][4],
                                          float (&dp)[BwdShape<D>::BR / 8][4],
                                          uint32_t (&pa)[BwdShape<D>::BR / 16][4],
                                          uint32_t (&da)[BwdShape<D>::BR / 16][4]) {
  constexpr int BR = BwdShape<D>::BR;
#pragma unroll
  for (int kk = 0; kk < BR / 16; ++kk) {
#pragma unroll
    for (int j = 2 * kk; j < 2 * kk + 2; ++j) {
      const float2 l2v = *reinterpret_cast<const float2 *>(sl + j * 8 + 2 * c.t);
      const float2 div = *reinterpret_cast<const float2 *>(sl + BR + j * 8 + 2 * c.t);
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        const float l2r = cc ? l2v.y : l2v.x, di = cc ? div.y : div.x;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int e = 2 * hr + cc;
          const float pe = exp2f(sa[j][e] * k.p.scale_log2 - l2r);
          sa[j][e] = pe;
          dp[j][e] = pe * (dp[j][e] - di);
        }
      }
    }
    c_to_a<T>(pa[kk], sa[2 * kk], sa[2 * kk + 1]);
    c_to_a<T>(da[kk], dp[2 * kk], dp[2 * kk + 1]);
  }
}

/* dV += P^T dO_i, dK += dS^T Q_i (wgmma RS, Q and dO as MN-major B) */
template <typename T, int D>
__device__ __forceinline__ void bwd_dkdv(const BwdConsumer<D> &c, uint32_t q_st, uint32_t do_st,
                                         const uint32_t (&pa)[BwdShape<D>::BR / 16][4],
                                         const uint32_t (&da)[BwdShape<D>::BR / 16][4],
                                         float (&dk)[BwdShape<D>::DC / 8][4],
                                         float (&dv)[BwdShape<D>::DC / 8][4]) {
  using S = BwdShape<D>;
  constexpr int BR = S::BR;
  /* acc (dK or dV) += A (registers) B (the MN-major tile at b), by pieces */
  auto pieces_rs = [&](float(&acc)[S::DC / 8][4], const uint32_t(&a)[4], uint32_t b, int kk) {
    wgmma_rs<T, S::PN0>(acc_part<S::PN0, 0>(acc), a,
                        sw128_mnmajor(sw128_mn_col<BR>(b, c.pc0), kk, BR * 128), 1);
    if constexpr (S::PN1 > 0)
      wgmma_rs<T, S::PN1>(acc_part<S::PN1, S::PN0 / 8>(acc), a,
                          sw128_mnmajor(sw128_mn_col<BR>(b, c.pc1), kk, BR * 128), 1);
  };
#pragma unroll
  for (int kk = 0; kk < BR / 16; ++kk) pieces_rs(dv, pa[kk], do_st, kk);
#pragma unroll
  for (int kk = 0; kk < BR / 16; ++kk) pieces_rs(dk, da[kk], q_st, kk);
  wg_commit();
}

/* dS^T (this warpgroup's 64 keys x BR queries) -> SW128 tile for dQ.
 * Double-buffered: the other warpgroup read this buffer two steps ago and
 * has passed the last step's barrier since. COLS: each warpgroup's own copy
 * (the same dS^T), read only by its own dQ product, which it waited for in
 * the last step. */
template <typename T, int D, bool DET>
__device__ __forceinline__ void bwd_stage_ds(const BwdBlock<T, D, DET> &k, const BwdConsumer<D> &c,
                                             int i, const uint32_t (&da)[BwdShape<D>::BR / 16][4]) {
  using S = BwdShape<D>;
  const uint32_t ds_wg = k.ds_tile(i % S::DS_BUFS, c.wg);
  const int kr = c.kw - c.kw0 + c.g;
#pragma unroll
  for (int kk = 0; kk < S::BR / 16; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = kr + 8 * (e & 1), col = kk * 16 + 8 * (e >> 1) + 2 * c.t;
      st_shared_u32(ds_wg + sw128_offset<64>(row, col), da[kk][e]);
    }
  fence_proxy_async();
  if (S::COLS)
    named_sync(2 + c.wg, 128); /* this warpgroup's dS^T is stored */
  else
    named_sync(1, S::NWG * 128); /* both warpgroups' dS^T are stored */
}

/* dQ_i[qw.., dw..] (64 x DQC) += dS[qw.., all BC keys] K[all keys, dw..]:
 * the product (wgmma SS, both operands MN-major) into the warpgroup's
 * staging tile, once the last reduction has read it, then its reduce-add
 * into the float32 accumulator (DET: handed to the writer warp) */
template <typename T, int D, bool DET>
__device__ __forceinline__ void bwd_dq(const BwdParams &P, const BwdBlock<T, D, DET> &k,
                                       const BwdConsumer<D> &c, int i, int h, int r) {
  using S = BwdShape<D>;
  using L = BwdSmem<D>;
  constexpr int BC = S::BC;
  if constexpr (DET) {
    named_sync(kDqEmpty + c.wg, kDqBarThreads); /* the writer has read the staging tile */
  } else {
    if (c.issuer) bulk_wait<0, true>();
    named_sync(2 + c.wg, 128); /* the previous reduction has read the staging tile */
  }
  const uint32_t ds_buf = k.ds_tile(i % S::DS_BUFS, S::COLS ? c.wg : 0) + (c.qw / 64) * 64 * 128;
  const uint32_t dq_row0 = c.dq_wg + (((c.ctid >> 5) & 3) * 16 + c.g) * 128 + (c.t & 1) * 8;
  float dq[S::DQC / 8][4];
  wg_fence();
#pragma unroll
  for (int kb = 0; kb < BC / 16; ++kb) { /* key step in the block; dS^T tile kb / 4 */
    const uint64_t ds_d = sw128_mnmajor(ds_buf + (kb / 4) * L::DSBYTES, kb % 4, 64 * 128);
    wgmma_ss_mn<T, S::QN0>(acc_part<S::QN0, 0>(dq), ds_d,
                           sw128_mnmajor(sw128_mn_col<BC>(k.sK, c.qc0), kb, BC * 128), kb > 0);
    if constexpr (S::QN1 > 0)
      wgmma_ss_mn<T, S::QN1>(acc_part<S::QN1, S::QN0 / 8>(dq), ds_d,
                             sw128_mnmajor(sw128_mn_col<BC>(k.sK, c.pc1), kb, BC * 128), kb > 0);
  }
  wg_commit();
  wg_wait<0>();
  reg_fence(dq);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr)
#pragma unroll
    for (int j = 0; j < S::DQC / 8; ++j) {
      /* 8-column slice in the block */
      const int jj = (BwdConsumer<D>::slice_col(j, S::QN0, c.qc0, c.pc1) - c.dw) / 8;
      st_shared_f32x2(
          dq_row0 + (jj / 4) * 8192 + 8 * hr * 128 + ((((jj % 4) * 2 + (c.t >> 1)) ^ c.g) << 4),
          dq[j][2 * hr], dq[j][2 * hr + 1]);
    }
  fence_proxy_async();
  if constexpr (DET) {
    named_arrive(kDqFull + c.wg, kDqBarThreads); /* the staging tile is complete */
  } else {
    named_sync(2 + c.wg, 128); /* the staging tile is complete */
    if (c.issuer && r + c.qw < k.nq) {
#pragma unroll
      for (int bb = 0; bb < S::DQC / 32; ++bb)
        tma_reduce_add_4d(&P.tdq, c.dq_wg + bb * 8192, c.dw + bb * 32, k.mq.row + r + c.qw, h,
                          k.mq.batch);
      bulk_commit();
    }
  }
}

/* One step of a consumer warpgroup: step s of the walk, the ring's position
 * i. One body for masked and unmasked steps; a masked step first sets the
 * scores its rows cannot see to -inf (bwd_mask). */
template <typename T, int D, bool DET>
__device__ __forceinline__ void bwd_step(const BwdParams &P, const BwdBlock<T, D, DET> &k,
                                         const BwdConsumer<D> &c, const int s, const int i,
                                         const bool masked, float (&dk)[BwdShape<D>::DC / 8][4],
                                         float (&dv)[BwdShape<D>::DC / 8][4]) {
  constexpr int BR = BwdShape<D>::BR;
  const int st = i % BwdShape<D>::ST;
  int h, r;
  k.tile_of(s, h, r);
  const uint32_t q_st = k.q_tile(st), do_st = k.do_tile(st);
  const float *sl = k.lse_stage(st);
  float sa[BR / 8][4], dp[BR / 8][4];
  bwd_scores<T>(c, q_st, do_st, sa, dp);
  if (masked) bwd_mask(k, c, r, sa);
  uint32_t pa[BR / 16][4], da[BR / 16][4];
  bwd_probs(k, c, sl, sa, dp, pa, da);
  wg_fence();
  bwd_dkdv<T>(c, q_st, do_st, pa, da, dk, dv);
  bwd_stage_ds(k, c, i, da);
  wg_wait<0>();
  reg_fence(dv);
  reg_fence(dk);
  reg_fence(pa);
  reg_fence(da);
  mbar_arrive(k.q_empty(st)); /* done with Q_i, dO_i and the lse rows */
  bwd_dq(P, k, c, i, h, r);
}

/* dK (times scale) and dV, each warpgroup its 64 keys (COLS: its DC columns
 * of the block's 64 keys), staged (row stride DC + 8) over the Q/dO ring and
 * the dS^T tiles, which nobody reads any more. The last dQ reductions only
 * have to have read their staging tile (outside the dK/dV staging) before
 * the block exits, so that wait comes last; the kernel's end makes their
 * writes visible to the dQ conversion. */
template <typename T, int D, bool DET>
__device__ __forceinline__ void bwd_epilogue(const BwdParams &P, const BwdBlock<T, D, DET> &k,
                                             const BwdConsumer<D> &c,
                                             float (&dk)[BwdShape<D>::DC / 8][4],
                                             float (&dv)[BwdShape<D>::DC / 8][4]) {
  using S = BwdShape<D>;
  using L = BwdSmem<D>;
  const BwdArgs &p = P.a;
  named_sync(1, S::NWG * 128);
  constexpr int DC = S::DC, LD = DC + 8;
  T *stage = reinterpret_cast<T *>(smem_raw + (k.sK - smem_addr(smem_raw)) + L::Q0);
  T *sdk = stage + c.wg * 2 * 64 * LD, *sdv = sdk + 64 * LD;
  static_assert(2 * S::NWG * 64 * (DC + 8) * 2 <= L::DQ0 - L::Q0, "dK, dV staging fits");
  const int kl = c.kw - c.kw0 + c.g, c_lo = S::COLS ? c.wg * DC : 0;
#pragma unroll
  for (int j = 0; j < DC / 8; ++j)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int off =
          (kl + 8 * hr) * LD + BwdConsumer<D>::slice_col(j, S::PN0, c.pc0, c.pc1) - c_lo + 2 * c.t;
      *reinterpret_cast<uint32_t *>(sdk + off) =
          pack2<T>(dk[j][2 * hr] * p.scale, dk[j][2 * hr + 1] * p.scale);
      *reinterpret_cast<uint32_t *>(sdv + off) = pack2<T>(dv[j][2 * hr], dv[j][2 * hr + 1]);
    }
  named_sync(2 + c.wg, 128);
  /* this warpgroup's keys and columns of dK and dV */
  const int k_lo = k.c0 + c.kw0, valid = min(64, k.nk - k_lo);
  if (valid > 0 && c_lo < p.d) {
    const int cols = min(DC, p.d - c_lo);
    store_tile<T, 64, DC, 128>(
        (T *)p.dk + row_off(k.sv, true, p.dk_sb, p.dk_ss, p.dk_sh, k_lo, k.hk) + c_lo, p.dk_ss, sdk,
        valid, cols, c.ctid & 127);
    store_tile<T, 64, DC, 128>(
        (T *)p.dv + row_off(k.sv, true, p.dv_sb, p.dv_ss, p.dv_sh, k_lo, k.hk) + c_lo, p.dv_ss, sdv,
        valid, cols, c.ctid & 127);
  }
  /* The block's dQ reductions complete (not only read their staging: the
   * conversion reads the sums); then it counts itself done for its head,
   * the release ordering those sums before the count (DET: the writer
   * does, after its last add). */
  if constexpr (!DET) {
    if (c.issuer) {
      bulk_wait<0, false>();
      fence_proxy_async_global();
    }
    named_sync(1, S::NWG * 128);
    if (c.ctid == 0) red_release_gpu_add(k.done, 1);
  }
}

/* The consumer warpgroups: dK and dV in float32 registers over the walk's
 * live steps, then the epilogue. */
template <typename T, int D, bool DET>
__device__ __forceinline__ void bwd_consume(const BwdParams &P, const BwdBlock<T, D, DET> &k) {
  using S = BwdShape<D>;
  regs_alloc<DET ? S::DET_CONSUMER_REGS : S::CONSUMER_REGS>();
  const BwdConsumer<D> c(k.sK);
  float dk[S::DC / 8][4], dv[S::DC / 8][4];
#pragma unroll
  for (int j = 0; j < S::DC / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[j][e] = dv[j][e] = 0.f;
  mbar_wait(k.kv_full(), 0);
  if (c.ctid == 0) FA_TRACE(1);
  int i = 0; /* visited steps so far: the ring's position */
  auto skip = [&](int s) { return k.skip(s); };
  for_each_live(k.steps, skip, [&](int s) {
    mbar_wait(k.q_full(i % S::ST), (i / S::ST) & 1);
    int h, r;
    k.tile_of(s, h, r);
    bwd_step(P, k, c, s, i++, k.qt.masked(r, S::BR, k.nq), dk, dv);
  });
  if (c.ctid == 0) {
    FA_TRACE(2);
    FA_TRACE_SET(4, sm_id());
    FA_TRACE_SET(5, (unsigned long long)i);
  }
  bwd_epilogue(P, k, c, dk, dv);
  if (c.ctid == 0) FA_TRACE(3);
}

template <typename T, int D, bool DET>
__global__ void __launch_bounds__((BwdShape<D>::NWG + 1) * 128, 1)
    bwd_kv_kernel(const __grid_constant__ BwdParams P) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = BwdShape<D>;
  using L = BwdSmem<D>;
  constexpr int BC = S::BC, BR = S::BR, ST = S::ST, NC = S::NWG * 128;
  const BwdArgs &p = P.a;
  const uint32_t sK = (smem_addr(smem_raw) + 1023) & ~1023u;

  if (threadIdx.x == 0) {
    FA_TRACE(0);
    tma_prefetch_map(&P.tq);
    tma_prefetch_map(&P.tk);
    tma_prefetch_map(&P.tv);
    tma_prefetch_map(&P.tdo);
    tma_prefetch_map(&P.tdq);
  }
  /* the dQ conversion may launch once every block has started (it waits
   * for each head's blocks through kv_done) */
  pdl_launch_dependents();
  /* (key block, K/V head, sequence): the block's own, or (DET) those of the
   * ticket it takes, in the launch order of common/dq_order.h */
  int bx = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  if constexpr (DET) {
    volatile int *slot =
        reinterpret_cast<volatile int *>(smem_raw + (sK + L::TICKET - smem_addr(smem_raw)));
    if (threadIdx.x == 0) *slot = atomicAdd(p.kv_ticket, 1);
    __syncthreads();
    const int t = *slot, rest = t / (int)gridDim.x;
    const fa_mask band =
        fa_mask_make(0, 0, p.causal, p.window_enabled, p.window_left, p.window_right);
    bx = fa_dq_block_of(fa_dq_banded(&band), (int)gridDim.x, t - rest * (int)gridDim.x);
    hk = rest % (int)gridDim.y;
    b = rest / (int)gridDim.y;
  }
  int *const done = kv_done_of(p, b, hk);
  const SeqView sv = seq_view(p, b);
  const int nq = sv.nq, nk = sv.nk;
  const int c0 = bx * BC;
  if (c0 >= nk) {
    if (threadIdx.x == 0) atomicAdd(done, 1); /* nothing to reduce: counted at once */
    return;
  }
  const int cols = min(BC, nk - c0);
  const fa_mask mk = attn_mask(p, nq, nk);
  const QueryTiles qt = query_tiles<BR, BC>(mk, c0, cols);
  int m_begin, nm; /* the query tiles that see the block (qt's), as dq_order.h counts them */
  fa_dq_block_tiles(&mk, bx, BC, BR, &m_begin, &nm);
  const int steps = nm * p.group;
  int rot = 0; /* the walk's rotation (BwdBlock::tile_of) */
  if constexpr (DET) {
    const fa_dq_order ord = fa_dq_order_make(&mk, BC, BR, p.det_wave);
    rot = fa_dq_rot(&ord, bx, nm);
  }
  const MapSeq mq = map_seq(p.cu_q != nullptr, b, p.nq, sv.q0, nq),
               mkv = map_kv(p, P.kv_rows, b, sv);
  const BwdBlock<T, D, DET> k{p,  sK, bx, hk,      b,  done,  sv,  nq, nk,
                              c0, mk, qt, m_begin, nm, steps, rot, mq, mkv};

  const int tid = threadIdx.x;
  if (tid == 0) {
    mbar_init(k.kv_full(), 1);
    for (int st = 0; st < ST; ++st) {
      mbar_init(k.q_full(st), 1 + 32); /* the copies' expect_tx, then each producer lane */
      mbar_init(k.q_empty(st), NC);    /* every consumer thread: each read the lse rows */
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (tid < 128) { /* ---- producer warpgroup ---- */
    regs_dealloc<DET ? S::DET_PRODUCER_REGS : S::PRODUCER_REGS>();
    if (tid < 32) /* one warp walks the steps, its lane 0 issues the copies */
      bwd_produce(P, k);
    else if (DET && tid < 64)
      bwd_dq_writer(P, k);
    return;
  }
  bwd_consume(P, k); /* ---- consumer warpgroups ---- */
#endif
}

/* dQ = scale * accumulator (bwd_dq_convert_rows), launched to overlap the
 * kv kernel's last blocks (a programmatic dependent launch: its CTAs take the
 * SMs those blocks free). Persistent: CTA i converts the i-th run of row
 * blocks in the kv kernel's order (sequences, heads, rows), so that the CTAs
 * that start first convert the heads finished first, each head once its
 * kv_blocks blocks are done (one acquire per head and run); then it waits for
 * the whole kv grid, so that the stream's next work sees dK and dV too. */
template <typename T, int DP>
__global__ void __launch_bounds__(256) bwd_convert_kernel(const BwdArgs p, int kv_blocks) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const int nx = (p.max_seqlen_q + kBwdRowsPerBlock - 1) / kBwdRowsPerBlock;
  const int total = nx * p.heads_q * p.batch;
  const int run = (total + gridDim.x - 1) / gridDim.x, t1 = min(total, (blockIdx.x + 1) * run);
  const int *known = nullptr; /* the (sequence, K/V head) counter last waited for */
  for (int t = blockIdx.x * run; t < t1; ++t) {
    const int x = t % nx, h = t / nx % p.heads_q, b = t / nx / p.heads_q;
    const int *done = kv_done_of(p, b, h / p.group);
    if (done != known) {
      if (threadIdx.x == 0) {
        for (;;) {
          const int n = ld_acquire_gpu(done);
          if (n >= kv_blocks) break;
          __nanosleep(256);
        }
      }
      __syncthreads();
      known = done;
    }
    bwd_dq_convert_rows<T, DP>(p, b, h, x);
  }
  pdl_wait();
#endif
}

template <typename T, int D>
fa_status bwd_launch(const BwdArgs &a, cudaStream_t stream) {
  using S = BwdShape<D>;
  constexpr size_t smem = BwdSmem<D>::BYTES;
  static_assert(smem <= 227 * 1024, "fits Hopper's shared memory");
  constexpr bool BF = std::is_same<T, __nv_bfloat16>::value;
  BwdParams prm; /* maps first: a layout TMA cannot map launches nothing */
  prm.a = a;
  /* deterministic, full masks: waves of as many blocks as are resident at
   * once (one per SM), which dq_order.h lets wait for each other */
  if (a.deterministic) prm.a.det_wave = persistent_ctas(INT_MAX / 2);
  const bool pk = a.cu_q != nullptr; /* varlen: packed maps (forward_sm90.cu) */
  const int64_t hk = a.heads_q / a.group;
  const bool cache = a.used_k != nullptr && !pk;
  prm.kv_rows = cache ? (int)kv_map_rows(a) : a.nk;
  fa_status st;
  if ((st = make_map(&prm.tq, BF, a.q, a.d, a.nq, a.heads_q, a.batch, a.q_ss, a.q_sh, a.q_sb, pk,
                     S::BR)) != FA_OK ||
      (st = make_map(&prm.tdo, BF, a.dout, a.d, a.nq, a.heads_q, a.batch, a.do_ss, a.do_sh, a.do_sb,
                     pk, S::BR)) != FA_OK ||
      (st = make_kv_map(&prm.tk, BF, a.k, a.d, prm.kv_rows, hk, a.batch, a.k_ss, a.k_sh, a.k_sb, pk,
                        cache, S::BC)) != FA_OK ||
      (st = make_kv_map(&prm.tv, BF, a.v, a.d, prm.kv_rows, hk, a.batch, a.v_ss, a.v_sh, a.v_sb, pk,
                        cache, S::BC)) != FA_OK ||
      (st = make_map_f32(&prm.tdq, a.dq_acc, D, a.nq, a.heads_q, a.batch, pk, 64)) != FA_OK)
    return st;
  if ((st = bwd_rows_launch<T, D>(a, stream, false)) != FA_OK) return st;
  const bool det = a.deterministic != 0;
  auto kernel = det ? bwd_kv_kernel<T, D, true> : bwd_kv_kernel<T, D, false>;
  static bool attr_done[2] = {false, false};
  if ((st = smem_limit_once(kernel, smem, attr_done[det])) != FA_OK) return st;
  const dim3 kv_grid((unsigned)((a.max_seqlen_k + S::BC - 1) / S::BC), (unsigned)hk,
                     (unsigned)a.batch);
  if (kv_grid.x == 0) return bwd_rows_launch<T, D>(a, stream, true); /* dQ = 0 */
  kernel<<<kv_grid, (S::NWG + 1) * 128, smem, stream>>>(prm);
  if ((st = launch_status()) != FA_OK) return st;
  /* the conversion, 8 CTAs of 256 threads per SM (as many as fit), launched
   * as the kv kernel's programmatic dependent */
  const int64_t rows =
      (a.max_seqlen_q + kBwdRowsPerBlock - 1) / kBwdRowsPerBlock * a.heads_q * a.batch;
  if (rows == 0) return FA_OK;
  if (rows > INT_MAX / 2) return bwd_rows_launch<T, D>(a, stream, true); /* 32-bit indices */
  const int64_t ctas = std::min<int64_t>(rows, 8 * (int64_t)persistent_ctas(rows, a.sm_margin));
  return launch_dependent(bwd_convert_kernel<T, D>, dim3((unsigned)ctas), dim3(256), stream, true,
                          a, (int)kv_grid.x);
}

}  // namespace sm90

#ifdef FA_SM90_TRACE
/* CSV of the last traced launch: block, entry, K/V ready, loop done, end (ns), SM, steps.
 * Clears the record, so a smaller grid traced next shows only its own blocks. */
extern "C" __attribute__((visibility("default"))) int fa_sm90_trace_dump(const char *path) {
  static unsigned long long h[sm90::kTraceBlocks][6];
  void *dev = nullptr;
  if (cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpyFromSymbol(h, sm90::g_trace, sizeof h) != cudaSuccess ||
      cudaGetSymbolAddress(&dev, sm90::g_trace) != cudaSuccess ||
      cudaMemset(dev, 0, sizeof h) != cudaSuccess)
    return -1;
  FILE *f = fopen(path, "w");
  if (!f) return -1;
  fprintf(f, "block,t0,t1,t2,t3,sm,steps\n");
  for (int i = 0; i < sm90::kTraceBlocks; ++i)
    if (h[i][0])
      fprintf(f, "%d,%llu,%llu,%llu,%llu,%llu,%llu\n", i, h[i][0], h[i][1], h[i][2], h[i][3],
              h[i][4], h[i][5]);
  fclose(f);
  return 0;
}
#endif

bool sm90_backward_covers(const BwdArgs &a) {
  /* head dims 33-256, padded to 64, 128, 192 or 256 (65-96 pay 128 columns,
   * still faster than the sm_80 kernel at 96, docs/PERF.md) */
  return a.dq_acc != NULL && sm90_forward_covers(a);
}

template <typename T>
fa_status sm90_backward(const BwdArgs &a, cudaStream_t s) {
  return sm90::dispatch_headdim(
      a.d, [&](auto dd) { return sm90::bwd_launch<T, decltype(dd)::value>(a, s); });
}
template fa_status sm90_backward<__half>(const BwdArgs &, cudaStream_t);
template fa_status sm90_backward<__nv_bfloat16>(const BwdArgs &, cudaStream_t);

}  // namespace fa
