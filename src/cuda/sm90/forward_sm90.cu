/* FlashAttention-2 forward on Hopper: warpgroup MMA (wgmma, sm_90a) fed by the
 * tensor copy engine (TMA), with warp specialisation.
 *
 * The algorithm is forward_kernel.cuh's; the machinery is Hopper's. A thread
 * block (one per SM, persistent and dynamically scheduled: schedule.cuh)
 * computes block after block of BR = 64 * NWG query rows of one (sequence,
 * head) with NWG + 1 warpgroups: warpgroup 0 is the producer (one thread
 * issues TMA copies of Q and of each K and V tile into ST-deep rings),
 * warpgroups 1..NWG consume, each owning 64 query rows. Tiles are stored in
 * the 128-byte swizzled layout that TMA writes and wgmma reads (wgmma.cuh).
 * mbarriers hand stages back and forth: full[s] completes when the copy
 * engine delivered the bytes, empty[s] when every consumer warp is done
 * reading. Per key tile, each consumer:
 *   S = Q K_j^T   wgmma, both operands from shared memory, f32 accumulators
 *   P = online softmax of S, in the accumulators (log2 domain, exp2)
 *   O += P V_j    wgmma, P from registers (the accumulator layout is the A
 *                 fragment layout), V from shared memory as an MN-major operand
 * At D = 128, and on the wide tiles at D = 192 and 256 (FwdShape::OVERLAP),
 * O += P V_j is issued together with S_{j+1}, so the tile's softmax runs
 * under it, and the two consumer warpgroups take turns issuing
 * (FlashAttention-3's intra-warpgroup pipelining and pingpong).
 * The producer gives its registers to the consumers (setmaxnreg). Key tiles
 * run from the last to the first, so a causal block's masked tiles come first
 * and the rest carry no masking arithmetic; walks that no band cuts take
 * wider tiles (fwd_bc).
 *
 * Covers the plain score path (no softcap, ALiBi or dropout; block masks of
 * 128-multiple blocks, skipped a whole tile at a time) at padded head dims 64,
 * 128, 192 and 256 (FwdShape); forward.cu sends everything else to the sm_80
 * kernels. Built only for sm_90a; other targets compile an empty body. */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include <numeric>
#include <type_traits>

#include "../attn.cuh"
#include "../combine.cuh"
#include "../layout.cuh"
#include "schedule.cuh"
#include "shapes.cuh"
#include "sm90.h"
#include "wgmma.cuh"

namespace fa {
namespace sm90 {

struct FwdParams {
  FwdArgs a;
  CUtensorMap tq, tk, tv;    /* (d, seqlen, heads, batch) boxes of 64 columns */
  CUtensorMap to;            /* O's (boxes of StagedO's rows), where o_map */
  Schedule sched;            /* query blocks per (sequence, head), in launch order */
  FastDiv by_nsplit;         /* a decode schedule's heads are (head, split) pairs */
  int box;                   /* a paged cache: rows per K/V box, gcd(page size, BC) */
  int kv_rows;               /* a KV cache's map: rows from one sequence to the next */
  int o_map;                 /* a staged epilogue whose O has 16-byte aligned rows */
  int tile_pages, tile_rest; /* a paged cache: BC = tile_pages pages + tile_rest rows */
};

/* Online softmax over one S tile held as accumulators s (rows g and g + 8 of
 * the warp's 16; masked scores already -inf): folds the tile into m and l,
 * leaves P in s and the factor O's rows must be rescaled by in alpha, and
 * rescales o row by row unless O is still the previous tile's product's
 * target (OVERLAP: then the caller does, after waiting for it). */
template <int BC, int D, bool OVERLAP>
__device__ __forceinline__ void softmax_tile(float (&s)[BC / 8][4], float (&o)[D / 8][4],
                                             float (&m)[2], float (&l)[2], float (&alpha)[2],
                                             float mul) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < BC / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) mx = fmaxf(mx, s[j][2 * r + e]);
    online_row<!OVERLAP>(s, o, r, mx, m[r], l[r], alpha[r], mul);
  }
}

/* A generic pointer to shared-memory address a of the dynamic allocation */
template <typename U>
__device__ __forceinline__ U *smem_at(uint32_t a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  return reinterpret_cast<U *>(smem_raw + (a - smem_addr(smem_raw)));
}
/* A query block: rows r0.. (rq of each of pack heads) of sequence b, and
 * the key tiles it walks */
struct FwdBlock {
  int b, h, sp, r0, rows; /* h: the first query head (of pack); sp: the key split */
  SeqView sv;
  fa_mask mk;
  KeyTiles kt;
};
/* The blocks of the schedule: block t's rows and key tiles. Both roles hold
 * one, built once the grid's preparation is done; it refers to pack and rq,
 * which the kernel keeps (references, not copies: the machine code depends
 * on where these values are read). */
template <int D, int NWG, int KB, bool DECODE, bool PAGED>
struct FwdSetup {
  static constexpr int BC = FwdShape<D, NWG, KB>::BC;
  const FwdParams &P;
  const FwdArgs &p;
  const int &pack, &rq;
  /* block t's rows and key tiles; false past a varlen sequence's end */
  __device__ __forceinline__ bool setup(int t, FwdBlock &k) const {
    int x;
    P.sched.decode(t, x, k.h, k.b);
    k.sp = 0;
    if (DECODE) { /* the schedule's heads are (head, split) pairs */
      const int h = P.by_nsplit.div(k.h);
      k.sp = k.h - h * p.nsplit;
      k.h = h;
    }
    k.h *= pack;
    constexpr int KV = PAGED ? kSeqAdd | kSeqPaged : kSeqAdd;
    k.sv = seq_view<KV>(p, k.b);
    k.r0 = (P.sched.nblk - 1 - x) * rq; /* query rows r0.. of each head */
    if (k.r0 >= k.sv.nq) return false;
    k.rows = min(rq, k.sv.nq - k.r0);
    k.mk = attn_mask(p, k.sv.nq, k.sv.nk);
    k.kt = key_tiles<BC>(k.mk, k.r0, k.rows);
    if (DECODE) { /* this split's tiles only (none: an empty walk, lse -inf) */
      const int spt = split_tiles<BC>(p, k.sv.nk);
      k.kt.n_begin = max(k.kt.n_begin, k.sp * spt);
      k.kt.n_end = max(k.kt.n_begin, min(k.kt.n_end, (k.sp + 1) * spt));
    }
    return true;
  }
  __device__ __forceinline__ auto tile_skip(const FwdBlock &k) const {
    const FwdArgs &p = this->p;
    return [&p, &k](int i) {
      return p.bmask && !__ldg(bmask_head(p, k.b, k.h) + (int64_t)(k.r0 / p.bm_q) * p.bm_sr +
                               (k.kt.n_end - 1 - i) * BC / p.bm_k);
    };
  }
};
/* What the producer and the consumers share: the shared memory (Q's ring at
 * sQ, then K's and V's, O's staging tile, the barriers at bars) and the
 * barriers' addresses. */
template <int D, int NWG, int KB, bool DECODE, bool PAGED>
struct FwdCtx {
  using S = FwdShape<D, NWG, KB>;
  using L = FwdSmem<D, NWG, KB>;
  static_assert(sizeof(FwdBlock) <= L::BLOCK_BYTES, "a block fits its slot");
  static constexpr int BR = S::BR, BC = S::BC, ST = S::ST, NC = S::NWG * 128; /* consumer threads */
  static constexpr int QST = L::QST;
  const int &pack, &rq;
  uint32_t sQ, bars;
  /* The producer takes the blocks (schedule.cuh) and hands each one's index
   * to the consumers in slot[j & 1] with its Q (Q stage j % QST); -1 ends the
   * walk. Both roles then walk the block's same live key tiles, so the K/V
   * ring's position i runs in step; a block's tiles run from the last to the
   * first, so a causal block's masked tiles come first. */
  volatile int *slot;
  /* Block j (FwdSetup::setup) as the producer's walking warp resolves it,
   * in place: the producer's other warps and the consumers read it rather
   * than resolve it again. Three places: the walker's tid 0 writes block j
   * once Q's stage of block j - 2 (j - 1 with one stage) is free, so every
   * reader is done with block j - 3. */
  __device__ __forceinline__ FwdBlock &block(int j) const {
    return *smem_at<FwdBlock>(sQ + L::BLOCKS + (j % 3) * L::BLOCK_BYTES);
  }
  __device__ __forceinline__ uint32_t q_full(int qs) const { return bars + 8 * qs; }
  __device__ __forceinline__ uint32_t q_empty(int qs) const { return bars + 8 * (QST + qs); }
  __device__ __forceinline__ uint32_t k_full(int st) const { return bars + 8 * (2 * QST + st); }
  __device__ __forceinline__ uint32_t v_full(int st) const {
    return bars + 8 * (2 * QST + ST + st);
  }
  __device__ __forceinline__ uint32_t k_empty(int st) const {
    return bars + 8 * (2 * QST + 2 * ST + st);
  }
  __device__ __forceinline__ uint32_t v_empty(int st) const {
    return bars + 8 * (2 * QST + 3 * ST + st);
  }
};
/* A lane's box of a paged cache's key tile n: lane l of producer warp w
 * (of NW) holds box l * NW + w, a page-aligned run of the tile's keys from
 * key `key`, at row `row` of page pg, the table's entry idx (live: the box
 * holds keys). pg is the entry as read, clamped to the pools where a copy
 * uses it: a load is waited for where its value is first used, and the
 * next tile's boxes are read ahead of their copies. */
struct PagedBox {
  int n, key, idx, row, pg, live;
};
__device__ __forceinline__ int paged_entry(const FwdArgs &p, const FwdBlock &k, const PagedBox &b) {
  return b.live ? __ldg(page_row(p, k.b) + b.idx) : 0;
}
template <int NW, int BC>
__device__ __forceinline__ PagedBox paged_box(const FwdParams &P, const FwdBlock &k, int n,
                                              int warp, int lane) {
  const FwdArgs &p = P.a;
  const int bx = lane * NW + warp, key = n * BC + bx * P.box;
  PagedBox b{n, key, key / p.page, 0, 0, bx * P.box < BC && key < k.sv.nk};
  b.row = key - b.idx * p.page;
  b.pg = paged_entry(p, k, b);
  return b;
}
/* The same lane's box of tile b.n - 1, stepped down from b's without a
 * division: the producer's instructions between a stage's release and its
 * copy are on the walk's path */
template <int NW, int BC>
__device__ __forceinline__ PagedBox paged_step(const FwdParams &P, const FwdBlock &k,
                                               const PagedBox &b, int warp, int lane) {
  PagedBox d{b.n - 1, b.key - BC, b.idx - P.tile_pages, b.row - P.tile_rest, 0, 0};
  if (d.row < 0) d.row += P.a.page, --d.idx;
  d.live = (lane * NW + warp) * P.box < BC && d.key < k.sv.nk;
  d.pg = paged_entry(P.a, k, d);
  return d;
}
/* A paged cache's key tile n (K/V head hk) into stage st, whose ring phase
 * is ph, each lane its box. The next tile's boxes (n - 1: the walk runs
 * down) are looked up into nb while V's stage is awaited, so the table's
 * read is off the path from the consumers' release to K's copy. */
template <int NW, int D, int NWG, int KB, bool DECODE, bool PAGED>
__device__ __forceinline__ void fwd_load_boxes(const FwdParams &P,
                                               const FwdCtx<D, NWG, KB, DECODE, PAGED> &c,
                                               const FwdBlock &k, int n, int st, int ph, int hk,
                                               int warp, int lane, PagedBox &nb) {
  using L = typename FwdCtx<D, NWG, KB, DECODE, PAGED>::L;
  constexpr int BC = FwdCtx<D, NWG, KB, DECODE, PAGED>::BC;
  const PagedBox b = nb.n == n ? nb : paged_box<NW, BC>(P, k, n, warp, lane);
  const int bx = lane * NW + warp;
  /* the boxes that hold keys: the tile's bytes (a whole tile's are
   * TBYTES, a division only for the last; one warp holding them all
   * counts its lanes: the D = 64 decode kernel has no registers for the
   * division) */
  const int left = k.sv.nk - n * BC; /* keys from the tile's start */
  const int boxes = NW > 1 ? (left >= BC ? 0 : (left + P.box - 1) / P.box)
                           : __popc(__ballot_sync(0xffffffffu, b.live));
  const uint32_t bytes = NW > 1 && left >= BC ? L::TBYTES : (uint32_t)boxes * P.box * D * 2;
  const uint32_t dk = c.sQ + L::K0 + st * L::TBYTES + bx * P.box * 128;
  const uint32_t dv = c.sQ + L::V0 + st * L::TBYTES + bx * P.box * 128;
  /* another warp's boxes may land before warp 0 announces the
   * bytes: the phase also waits for that arrival */
  if (lane == 0) {
    mbar_wait(c.k_empty(st), ph ^ 1);
    if (warp == 0) mbar_expect_tx(c.k_full(st), bytes);
  }
  __syncwarp();
  const int pg = page_clamp(P.a, b.pg);
  if (b.live)
#pragma unroll
    for (int cc = 0; cc < D / 64; ++cc)
      tma_load_4d(dk + cc * BC * 128, &P.tk, c.k_full(st), cc * 64, b.row, hk, pg);
  if (n > k.kt.n_begin) nb = paged_step<NW, BC>(P, k, b, warp, lane);
  if (lane == 0) {
    mbar_wait(c.v_empty(st), ph ^ 1);
    if (warp == 0) mbar_expect_tx(c.v_full(st), bytes);
  }
  __syncwarp();
  if (b.live)
#pragma unroll
    for (int cc = 0; cc < D / 64; ++cc)
      tma_load_4d(dv + cc * BC * 128, &P.tv, c.v_full(st), cc * 64, b.row, hk, pg);
}

template <int PW, int D, int NWG, int KB, bool DECODE, bool PAGED>
__device__ __forceinline__ void fwd_producer(const FwdParams &P,
                                             const FwdCtx<D, NWG, KB, DECODE, PAGED> &c,
                                             const FwdSetup<D, NWG, KB, DECODE, PAGED> &su,
                                             int tid) {
  using C = FwdCtx<D, NWG, KB, DECODE, PAGED>;
  using S = typename C::S;
  using L = typename C::L;
  constexpr int BR = C::BR, BC = C::BC, ST = C::ST, QST = C::QST;
  const FwdArgs &p = P.a;
  regs_dealloc<S::PRODUCER_REGS>();
  /* Warp 0 walks the tiles, its lanes issue the copies. A paged cache's
   * tile is a TMA box per page-aligned run of keys, which a warp issues
   * lane after lane: at pages of 16 (8 boxes for each 64 columns of K and
   * of V) one warp's issue outlasted the consumers' tile (prefill 1.38-1.42x
   * a contiguous cache on an H100, 1.07-1.09x with the four warps). So the
   * forward's producer warps (PW) all walk a paged cache's tiles, warp 0
   * telling the others each block (pslot, named barrier 7), and share the
   * boxes. */
  constexpr int NW = PW;
  const int warp = tid >> 5, lane = tid & 31;
  if (warp < NW) {
    const uint32_t pslot = c.sQ + L::PSLOTS; /* a 32-bit address: fewer registers */
    const bool walker = NW == 1 || warp == 0;
    const int total = P.sched.total();
    int i = 0, t = blockIdx.x;
    for (int j = 0;; ++j) {
      FwdBlock &k = c.block(j);
      /* tid 0 takes the next block and writes it (after its wait, in the
       * previous block, for the slot's last readers to be done), and
       * publishes it: to the consumers with Q's barrier, to its warp with
       * the warp barrier */
      if (walker) {
        if (tid == 0) {
          if (j > 0) t = P.sched.take();
          while (t < total && !su.setup(t, k)) t = P.sched.take();
        }
        t = __shfl_sync(0xffffffffu, t, 0);
        __syncwarp();
      }
      if (NW > 1) {
        if (tid == 0) st_shared_u32(pslot + 4 * (j & 1), t);
        named_sync(7, 32 * NW);
        if (!walker) t = ld_shared_volatile_u32(pslot + 4 * (j & 1));
      }
      const bool more = t < total;
      if (tid == 0) { /* Q once the consumers are done with the stage's last block */
        const int qs = j % QST;
        mbar_wait(c.q_empty(qs), ((j / QST) & 1) ^ 1);
        c.slot[j & 1] = more ? t : -1;
        if (more) {
          mbar_expect_tx(c.q_full(qs), (uint32_t)(c.rq * c.pack) * D * 2); /* QBYTES unpacked */
          const MapSeq mq = map_seq(p.cu_q != nullptr, k.b, p.nq, k.sv.q0, k.sv.nq);
          tma_load_tile<BR, D>(c.sQ + qs * L::QBYTES, &P.tq, c.q_full(qs), mq.row + k.r0, k.h,
                               mq.batch);
        } else {
          mbar_arrive(c.q_full(qs));
        }
      }
      if (!more) break;
      const int hk = k.h / p.group;
      const MapSeq mk = map_kv(p, P.kv_rows, k.b, k.sv);
      PagedBox nb{-1, 0, 0, 0, 0, 0}; /* the next tile's boxes, looked up ahead */
      for_each_live(k.kt.n_end - k.kt.n_begin, su.tile_skip(k), [&](int kk) {
        const int n = k.kt.n_end - 1 - kk, st = i % ST, ph = (i / ST) & 1;
        ++i;
        if constexpr (PAGED) { /* a box per page-aligned run, each lane its own */
          fwd_load_boxes<NW>(P, c, k, n, st, ph, hk, warp, lane, nb);
          return;
        }
        if (tid != 0) return;
        mbar_wait(c.k_empty(st), ph ^ 1);
        mbar_expect_tx(c.k_full(st), L::TBYTES);
        tma_load_tile<BC, D>(c.sQ + L::K0 + st * L::TBYTES, &P.tk, c.k_full(st), mk.row + n * BC,
                             hk, mk.batch);
        mbar_wait(c.v_empty(st), ph ^ 1);
        mbar_expect_tx(c.v_full(st), L::TBYTES);
        tma_load_tile<BC, D>(c.sQ + L::V0 + st * L::TBYTES, &P.tv, c.v_full(st), mk.row + n * BC,
                             hk, mk.batch);
      });
    }
  }
}

/* The decode/split epilogue, and D = 256's (no staging tile): O and lse
 * from this thread's accumulator rows (rows wrow + g and + 8, columns 2 t
 * and 2 t + 1 of each 8). */
template <typename T, int D, int NWG, int KB, bool DECODE, bool PAGED>
__device__ __forceinline__ void fwd_store_rows(const FwdParams &P,
                                               const FwdCtx<D, NWG, KB, DECODE, PAGED> &c,
                                               const FwdBlock &k, const float (&o)[D / 8][4],
                                               const float (&m_run)[2], const float (&l_run)[2],
                                               int wrow, int g, int t) {
  const FwdArgs &p = P.a;
  const float mul = p.scale_log2;
  /* block row lr's head within the pack */
  auto head_of = [&](int lr) { return DECODE ? lr >> p.pack_log2 : 0; };
  float *lse_row = p.lse + k.sv.lse0 + k.h * k.sv.lse_hs + k.r0;
  T *o_blk = (T *)p.o + k.sv.qb * p.o_sb + (k.sv.q0 + k.r0) * p.o_ss + k.h * p.o_sh;
  /* normalise, write from registers: with a split, this split's O and
   * lse (float32) for the combine; else O and lse themselves (rows of
   * several heads when packed) */
  const bool part = DECODE && p.nsplit > 1;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float lse;
    const float inv = online_finish(m_run[rr] * mul, l_run[rr], &lse);
    const int lr = wrow + g + 8 * rr, hi = head_of(lr), qi = lr - hi * c.rq;
    if (hi >= c.pack || qi >= k.rows) continue;
    const int64_t li = hi * k.sv.lse_hs + qi; /* from lse_row */
    const int64_t prow = k.sp * p.part_rows + k.sv.lse0 + k.h * k.sv.lse_hs + k.r0 + li;
    if (t == 0) *(part ? p.part_lse + prow : lse_row + li) = lse;
#pragma unroll
    for (int jj = 0; jj < D / 8; ++jj) {
      const float x = o[jj][2 * rr] * inv, y = o[jj][2 * rr + 1] * inv;
      const int col = jj * 8 + 2 * t;
      if (part) {
        *reinterpret_cast<float2 *>(p.part_o + prow * D + col) = make_float2(x, y);
      } else { /* a pair, or the last column of an odd d */
        T *dst = o_blk + hi * p.o_sh + qi * p.o_ss + col;
        if (col + 2 <= p.d)
          *reinterpret_cast<uint32_t *>(dst) = pack2<T>(x, y);
        else if (col < p.d)
          *dst = T(x);
      }
    }
  }
}

/* The other epilogue (D <= 192, no split): O through its staging tile, in
 * boxes of ER rows (StagedO) that one thread hands to the copy engine where
 * O's tensor map exists (FwdParams::o_map), else every thread stores. */
template <int NWG>
struct StagedO {
  /* With two warpgroups each stages and stores its own 64 rows between
   * barriers of its own (4 + wg): one warpgroup's epilogue then runs under
   * the other's last products instead of waiting for them (D = 128: +2-4%
   * causal at 512-2048 keys). Three (D = 64) keep block-wide ones: their
   * own were 2.5% slower at 512 keys (docs/PERF.md). */
  static constexpr bool OWN = NWG == 2;
  static constexpr int ER = OWN ? 64 : 64 * NWG, ET = OWN ? 128 : 128 * NWG;
  int bar, er0, etid; /* the group's barrier, first row, this thread's index in it */
  __device__ __forceinline__ StagedO(int ctid)
      : bar(OWN ? 4 + (ctid >> 7) : 1),
        er0(OWN ? (ctid >> 7) * 64 : 0),
        etid(OWN ? ctid & 127 : ctid) {}
  /* the thread that issues the group's copies: the previous block's boxes
   * read out of the staging tile before the group writes it again */
  __device__ __forceinline__ void drained(const FwdParams &P) const {
    if (P.o_map && etid == 0) bulk_wait<0, true>();
  }
};
template <typename T, int D, int NWG, int KB, bool DECODE, bool PAGED>
__device__ __forceinline__ void fwd_store_staged(const FwdParams &P,
                                                 const FwdCtx<D, NWG, KB, DECODE, PAGED> &c,
                                                 const FwdBlock &k, const float (&o)[D / 8][4],
                                                 const float (&m_run)[2], const float (&l_run)[2],
                                                 int ctid, int wrow, int g, int t) {
  using L = typename FwdCtx<D, NWG, KB, DECODE, PAGED>::L;
  using E = StagedO<NWG>;
  const FwdArgs &p = P.a;
  const float mul = p.scale_log2;
  const E e(ctid);
  const uint32_t o_at = c.sQ + L::O0 + e.er0 * D * 2; /* the group's boxes */
  T *sO = smem_at<T>(o_at);
  float *lse_row = p.lse + k.sv.lse0 + k.h * k.sv.lse_hs + k.r0;
  /* Normalise, write lse, stage O, store it. The first barrier: the
   * group's previous rows are out of the staging tile. */
  e.drained(P);
  named_sync(e.bar, E::ET);
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float lse;
    const float inv = online_finish(m_run[rr] * mul, l_run[rr], &lse);
    const int lr = wrow + g + 8 * rr;
    if (t == 0 && lr < k.rows) lse_row[lr] = lse;
#pragma unroll
    for (int jj = 0; jj < D / 8; ++jj)
      *reinterpret_cast<uint32_t *>(sO + stage_box_at<E::ER>(lr - e.er0, jj) + 2 * t) =
          pack2<T>(o[jj][2 * rr] * inv, o[jj][2 * rr + 1] * inv);
  }
  if (P.o_map) { /* rows past the sequence fall outside the map: not written */
    fence_proxy_async();
    named_sync(e.bar, E::ET);
    if (e.etid == 0) {
      const MapSeq mo = map_seq(p.cu_q != nullptr, k.b, p.nq, k.sv.q0, k.sv.nq);
#pragma unroll
      for (int cc = 0; cc < D / 64; ++cc)
        tma_store_4d(&P.to, o_at + cc * E::ER * 128, cc * 64, mo.row + k.r0 + e.er0, k.h, mo.batch);
      bulk_commit();
    }
    return;
  }
  named_sync(e.bar, E::ET);
  T *o_blk = (T *)p.o + k.sv.qb * p.o_sb + (k.sv.q0 + k.r0) * p.o_ss + k.h * p.o_sh;
  store_tile<T, E::ER, D, E::ET, E::ER>(o_blk + e.er0 * p.o_ss, p.o_ss, sO, k.rows - e.er0, p.d,
                                        e.etid);
}

/* A consumer thread: ctid among the consumer threads, in warpgroup wg (64
 * query rows), at lane of its warp; wrow is the warp's first row in the
 * block, g and t the lane's accumulator rows (g, g + 8) and column pairs
 * (2 t, 2 t + 1 of each 8); mul scales the scores (log2 domain). */
struct FwdThread {
  int ctid, wg, lane, g, t, wrow;
  float mul;
};

/* A paged cache's last tile: its V rows past the keys hold what the page
 * holds there (anything, NaN included: 0 x NaN in P V) or an earlier
 * tile's rows. Warpgroup 0 zeroes them once V arrived, and the others
 * wait for it (named barrier 6), at the tile's start, where the fewest
 * registers are live (D = 256 spilled at P V). Maps of contiguous caches
 * end at the keys, and TMA fills with zeros. */
template <int D, int NWG, int KB, bool DECODE, bool PAGED>
__device__ __forceinline__ void fwd_v_tail(const FwdCtx<D, NWG, KB, DECODE, PAGED> &c, int st,
                                           int i, int keys, int wg, int ctid) {
  using C = FwdCtx<D, NWG, KB, DECODE, PAGED>;
  using L = typename C::L;
  constexpr int BC = C::BC, ST = C::ST, NC = C::NC;
  if (wg > 0) return named_sync(6, NC);
  mbar_wait(c.v_full(st), (i / ST) & 1);
  /* thread w: 16-byte chunk w % (D / 8) of rows keys + w / (D / 8), ... */
  constexpr int CPR = D / 8, RS = 128 / CPR;
  const int w = ctid & 127, ch = w % CPR;
  const uint32_t base = c.sQ + L::V0 + st * L::TBYTES + ch / 8 * BC * 128 + ch % 8 * 16;
  for (int r = keys + w / CPR; r < BC; r += RS) st_shared_zero16(base + r * 128);
  fence_proxy_async();
  named_arrive(6, NC);
}

/* Issue O += P V (V's tile at v_base, BC keys of D columns; P as A
 * fragments pa) and commit it */
template <typename T, int D, int BC>
__device__ __forceinline__ void fwd_pv(float (&o)[D / 8][4], const uint32_t (&pa)[BC / 16][4],
                                       uint32_t v_base) {
  /* columns [c, c + 128) per product, the last one [c, c + 64) at D =
   * 192 (the widths wgmma.cuh instantiates: 64, 128); column c's 64-column
   * block starts c / 64 * BC * 128 bytes into the tile */
  constexpr int PN = D >= 128 ? 128 : D, PL = D % PN ? D % PN : PN;
#pragma unroll
  for (int kk = 0; kk < BC / 16; ++kk) {
#pragma unroll
    for (int c = 0; c + PN <= D; c += PN)
      wgmma_rs<T, PN>(*reinterpret_cast<float(*)[PN / 8][4]>(&o[c / 8][0]), pa[kk],
                      sw128_mnmajor(v_base + c / 64 * BC * 128, kk, BC * 128), 1);
    if constexpr (PL != PN)
      wgmma_rs<T, PL>(*reinterpret_cast<float(*)[PL / 8][4]>(&o[(D - PL) / 8][0]), pa[kk],
                      sw128_mnmajor(v_base + (D - PL) / 64 * BC * 128, kk, BC * 128), 1);
  }
  wg_commit();
}

/* Tile n's scores s outside each row's visible keys -> -inf */
template <int D, int NWG, int KB, bool DECODE, bool PAGED>
__device__ __forceinline__ void fwd_mask(float (&s)[FwdCtx<D, NWG, KB, DECODE, PAGED>::BC / 8][4],
                                         const FwdCtx<D, NWG, KB, DECODE, PAGED> &c,
                                         const FwdBlock &k, int n, int wrow, int g, int t) {
  constexpr int BC = FwdCtx<D, NWG, KB, DECODE, PAGED>::BC;
  /* 64-bit at D = 256: its narrow kernels spill 8-16 bytes with 32-bit bands */
  using Band = std::conditional_t<D == 256, int64_t, int>;
  if constexpr (FwdShape<D, NWG, KB>::WIDE) { /* no band: the columns past the keys */
#pragma unroll
    for (int jj = 0; jj < BC / 8; ++jj)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (n * BC + jj * 8 + 2 * t + (e & 1) >= k.sv.nk) s[jj][e] = -INFINITY;
  } else {
    int64_t lo[2], hi[2];
    const int64_t c0 = (int64_t)n * BC + 2 * t; /* this thread's first column */
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int lr = wrow + g + 8 * rr;
      fa_mask_row_range(&k.mk, k.r0 + (DECODE ? lr & (c.rq - 1) : lr), &lo[rr], &hi[rr]);
    }
    /* A causal band's diagonal tile (every lane's rows see their keys from
     * the tile's start, and row g + 8's band ends 8 columns after row g's):
     * row g + 8 at column 8 (jj - 1) + e is masked where row g is at 8 jj + e,
     * so one compare serves both rows. In 32 bits: the CUDA backend's
     * sequences have 32-bit lengths. */
    const int b0 = (int)(hi[0] - c0);
    if (__all_sync(0xffffffffu, lo[0] <= c0 && lo[1] <= c0 && hi[1] - hi[0] == 8)) {
      bool past[2] = {-8 >= b0, -7 >= b0}; /* row g at jj - 1 */
#pragma unroll
      for (int jj = 0; jj < BC / 8; ++jj)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const bool now = jj * 8 + e >= b0;
          if (now) s[jj][e] = -INFINITY;
          if (past[e]) s[jj][2 + e] = -INFINITY;
          past[e] = now;
        }
      return;
    }
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      /* the row's band relative to c0, clamped to the tile: the
       * per-element compares are 32-bit (Band) */
      const Band a = (Band)min(max(lo[rr] - c0, (int64_t)0), (int64_t)BC);
      const Band b = (Band)min(max(hi[rr] - c0, (int64_t)0), (int64_t)BC);
#pragma unroll
      for (int jj = 0; jj < BC / 8; ++jj)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int off = jj * 8 + e;
          if (off < a || off >= b) s[jj][2 * rr + e] = -INFINITY;
        }
    }
  }
}

/* A consumer warpgroup's walk over block k's live key tiles: O, m and l
 * of its rows (accumulators o, m_run and l_run; Q's rows at q_base); i is
 * the K/V ring's position, carried from block to block. */
template <typename T, int D, int NWG, int KB, bool DECODE, bool PAGED>
__device__ __forceinline__ void fwd_tiles(const FwdParams &P,
                                          const FwdCtx<D, NWG, KB, DECODE, PAGED> &c,
                                          const FwdSetup<D, NWG, KB, DECODE, PAGED> &su,
                                          const FwdBlock &k, uint32_t q_base_, int &i,
                                          float (&o)[D / 8][4], float (&m_run)[2],
                                          float (&l_run)[2], const FwdThread &th) {
  using C = FwdCtx<D, NWG, KB, DECODE, PAGED>;
  using S = typename C::S;
  using L = typename C::L;
  constexpr int BR = C::BR, BC = C::BC, ST = C::ST, NC = C::NC;
  /* read once per block, here (the machine code depends on where they are read) */
  const int ctid = th.ctid, wg = th.wg, lane = th.lane, g = th.g, t = th.t, wrow = th.wrow;
  const float mul = th.mul;
  /* Per key tile j:
   *   S_j = Q K_j^T; mask, online softmax (m, l, P_j, alpha_j);
   *   O = alpha_j O; O += P_j V_j.
   * With OVERLAP, O += P_j V_j is issued with S_{j+1}, and the softmax of
   * S_{j+1} runs while the tensor cores do it (FlashAttention-3's
   * intra-warpgroup pipelining); a masked tile (its scores outside each
   * row's visible keys set to -inf) waits for both products first. */
  uint32_t pa[BC / 16][4];   /* P of the pending tile, A fragments */
  int pend = -1, pend_i = 0; /* its ring stage (-1: none) and position */
  /* issue O += P V from stage st's V (arrived) */
  auto pv = [&](int st) { fwd_pv<T, D, BC>(o, pa, c.sQ + L::V0 + st * L::TBYTES); };
  /* after its wait: stage st's V back to the producer */
  auto pv_done = [&](int st) {
    reg_fence(o);
    reg_fence(pa);
    if (lane == 0) mbar_arrive(c.v_empty(st));
  };
  /* O += P V of tile i (stage st), waited for */
  auto pv_now = [&](int st, int i) {
    mbar_wait(c.v_full(st), (i / ST) & 1);
    wg_fence();
    pv(st);
    wg_wait<0>();
    pv_done(st);
  };
  /* issue S = Q K^T of stage st */
  auto qk = [&](float(&s)[BC / 8][4], int st) {
    const uint32_t k_base = c.sQ + L::K0 + st * L::TBYTES;
    /* wide tiles: Q's descriptors made per tile, not hoisted out of the
     * kernel (a single Q stage makes them constant), where they would hold
     * 16 registers the tile's scores need */
    uint32_t q_base = q_base_;
    if constexpr (S::WIDE) opaque(q_base);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_ss<T, BC>(s, sw128_kmajor<BR>(q_base, kk), sw128_kmajor<BC>(k_base, kk), kk > 0);
    wg_commit();
  };
  /* S_j arrived: K's stage back, mask, softmax (alpha for O) */
  auto soft = [&](float(&s)[BC / 8][4], float(&alpha)[2], int n, int st, bool masked) {
    reg_fence(s);
    if (lane == 0) mbar_arrive(c.k_empty(st));
    if (masked) fwd_mask(s, c, k, n, wrow, g, t);
    softmax_tile<BC, D, S::OVERLAP>(s, o, m_run, l_run, alpha, mul);
  };
  /* P_j -> A fragments (OVERLAP: O rescaled first, no product in flight) */
  auto to_a = [&](float(&s)[BC / 8][4], const float(&alpha)[2]) {
    if (S::OVERLAP)
#pragma unroll
      for (int jj = 0; jj < D / 8; ++jj)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[jj][e] *= alpha[e >> 1];
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) c_to_a<T>(pa[kk], s[2 * kk], s[2 * kk + 1]);
  };
  /* Pingpong (OVERLAP): warpgroup w issues a tile's products after
   * barrier 2 + w saw the other's issue, then lets the other go (its first
   * turn is the other's arrival at kernel start, each later one that of
   * its last issue, also across blocks: both walk the same tiles). */
  auto turn_take = [&]() {
    if (S::PINGPONG) named_sync(2 + wg, NC);
  };
  auto turn_give = [&]() {
    if (S::PINGPONG) named_arrive(3 - wg, NC);
  };
  /* S of stage st and the pending tile's P V, in this warpgroup's turn */
  auto issue_both = [&](float(&s)[BC / 8][4], int st) {
    mbar_wait(c.v_full(pend), (pend_i / ST) & 1);
    turn_take();
    wg_fence();
    qk(s, st);
    pv(pend);
    turn_give();
  };
  /* Each branch leaves no product in flight: ptxas serialises every wgmma
   * of the kernel (warning C7520) when one stays in flight across a branch
   * or a spin wait. */
  for_each_live(k.kt.n_end - k.kt.n_begin, su.tile_skip(k), [&](int kk) {
    const int n = k.kt.n_end - 1 - kk, st = i % ST;
    /* wide tiles: no band, so only the last tile's columns past the keys */
    const bool masked = S::WIDE ? n * BC + BC > k.sv.nk : k.kt.masked(n * BC, BC, k.sv.nk);
    mbar_wait(c.k_full(st), (i / ST) & 1);
    if (PAGED && k.sv.nk - n * BC < BC) fwd_v_tail(c, st, i, k.sv.nk - n * BC, wg, ctid);
    float s[BC / 8][4], alpha[2];
    /* (wide tiles: only a block's first tile is masked) */
    if (S::OVERLAP && pend >= 0 && (S::WIDE || !masked)) { /* no branch while P V runs */
      issue_both(s, st);
      wg_wait<1>();
      soft(s, alpha, n, st, false);
      wg_wait<0>();
      pv_done(pend);
    } else if (S::OVERLAP && pend >= 0) { /* masked: both products, then the mask */
      issue_both(s, st);
      wg_wait<0>();
      pv_done(pend);
      soft(s, alpha, n, st, masked);
    } else { /* the block's first tile (OVERLAP), every tile (else) */
      turn_take();
      wg_fence();
      qk(s, st);
      turn_give();
      wg_wait<0>();
      soft(s, alpha, n, st, masked);
    }
    to_a(s, alpha);
    if (S::OVERLAP) {
      pend = st;
      pend_i = i;
    } else {
      pv_now(st, i);
    }
    ++i;
  });
  if (S::OVERLAP && pend >= 0) pv_now(pend, pend_i); /* the last tile's product */
}

/* The consumer warpgroups: block after block, Q's stage from the producer,
 * the key tiles' online softmax, then the epilogue. */
template <typename T, int D, int NWG, int KB, bool DECODE, bool PAGED>
__device__ __forceinline__ void fwd_consumer(const FwdParams &P,
                                             const FwdCtx<D, NWG, KB, DECODE, PAGED> &c,
                                             const FwdSetup<D, NWG, KB, DECODE, PAGED> &su,
                                             int tid) {
  using C = FwdCtx<D, NWG, KB, DECODE, PAGED>;
  using S = typename C::S;
  using L = typename C::L;
  constexpr int NC = C::NC, QST = C::QST;
  regs_alloc<S::CONSUMER_REGS>();
  const int ctid = tid - 128, wg = ctid >> 7, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int wrow = wg * 64 + ((ctid >> 5) & 3) * 16; /* this warp's first row in the block */
  const FwdThread th{ctid, wg, lane, g, t, wrow, P.a.scale_log2};

  FwdBlock k;
  int i = 0;                                       /* visited tiles so far: the ring's position */
  if (S::PINGPONG && wg == 1) named_arrive(2, NC); /* warpgroup 0 issues first */
  for (int j = 0;; ++j) {
    const int qs = j % QST;
    mbar_wait(c.q_full(qs), (j / QST) & 1);
    const int blk = c.slot[j & 1];
    if (blk < 0) break;
    k = c.block(j);
    const uint32_t q_base = c.sQ + qs * L::QBYTES + wg * 64 * 128; /* this warpgroup's Q rows */
    float o[D / 8][4];
#pragma unroll
    for (int jj = 0; jj < D / 8; ++jj)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[jj][e] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

    fwd_tiles<T>(P, c, su, k, q_base, i, o, m_run, l_run, th);
    mbar_arrive(c.q_empty(qs)); /* the producer may load Q and write the slot again */

    if constexpr (DECODE || !S::STAGE_O)
      fwd_store_rows<T>(P, c, k, o, m_run, l_run, wrow, g, t);
    else
      fwd_store_staged<T>(P, c, k, o, m_run, l_run, ctid, wrow, g, t);
  }
  if constexpr (!DECODE && S::STAGE_O) StagedO<NWG>(ctid).drained(P); /* before the CTA exits */
}

/* DECODE: the decode shapes' kernel (sm90_forward), with the query heads of
 * a K/V head packed into one block (FwdArgs::pack) and the keys split
 * (FwdArgs::nsplit), both at run time (the other kernels' registers have no
 * room for the row arithmetic: they spill). PAGED: K and V from a paged
 * cache's pools (FwdArgs::block_table), a TMA box per page-aligned run of a
 * tile's keys, issued by PW producer warps (fwd_launch). */
template <typename T, int D, int NWG, int KB, bool DECODE, bool PAGED, int PW>
__global__ void __launch_bounds__((NWG + 1) * 128, 1)
    fwd_kernel(const __grid_constant__ FwdParams P) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = FwdShape<D, NWG, KB>;
  using L = FwdSmem<D, NWG, KB>;
  constexpr int BR = S::BR, ST = S::ST, NC = S::NWG * 128; /* consumer threads */
  constexpr int QST = L::QST;
  const FwdArgs &p = P.a;
  const int pack = DECODE ? p.pack : 1, rq = DECODE ? 1 << p.pack_log2 : BR; /* rows per head */
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t sQ = (smem_addr(smem_raw) + 1023) & ~1023u;
  const uint32_t bars = sQ + L::BARS;
  const FwdCtx<D, NWG, KB, DECODE, PAGED> c{pack, rq, sQ, bars,
                                            smem_at<volatile int>(sQ + L::SLOTS)};

  const int tid = threadIdx.x;
  /* a split's combine kernel (launched as a programmatic dependent) may take
   * the SMs this grid's CTAs free; it waits for the whole grid's writes */
  if (DECODE) pdl_launch_dependents();
  if (tid == 0) {
    tma_prefetch_map(&P.tq);
    tma_prefetch_map(&P.tk);
    tma_prefetch_map(&P.tv);
    for (int qs = 0; qs < QST; ++qs) {
      mbar_init(c.q_full(qs), 1);
      mbar_init(c.q_empty(qs), NC); /* every consumer thread: each read its slot */
    }
    for (int st = 0; st < ST; ++st) {
      mbar_init(c.k_full(st), 1);
      mbar_init(c.v_full(st), 1);
      mbar_init(c.k_empty(st), NC / 32); /* one arrival per consumer warp */
      mbar_init(c.v_empty(st), NC / 32);
    }
    mbar_init_fence();
  }
  __syncthreads();
  /* launched as a programmatic dependent: the KV-cache call's preparation
   * (rotated q, appended rows) must be done */
  if (p.pdl) pdl_wait();

  const FwdSetup<D, NWG, KB, DECODE, PAGED> su{P, p, pack, rq};
  if (tid < 128) { /* ---- producer warpgroup ---- */
    fwd_producer<PW>(P, c, su, tid);
    return;
  }

  fwd_consumer<T>(P, c, su, tid);
#endif
}

/* O's rows start and end on 16-byte boundaries: its tensor map needs the
 * first (a packed tensor's batch stride is its row stride), and a store
 * writes whole 16-byte pieces, past the head dim up to the next boundary
 * (seen on an H100) */
static bool o_rows_aligned(const FwdArgs &a) {
  return a.d % 8 == 0 &&
         rows_aligned(a.o, a.cu_q ? 1 : a.batch, a.o_sb, a.nq, a.o_ss, a.heads_q, a.o_sh);
}

template <typename T, int D, int NWG, int KB, bool DECODE, bool PAGED, int PW>
fa_status fwd_launch_as(const FwdArgs &a, cudaStream_t stream) {
  using S = FwdShape<D, NWG, KB>;
  constexpr size_t smem = FwdSmem<D, NWG, KB>::BYTES;
  static_assert(smem <= 227 * 1024, "fits Hopper's shared memory");
  constexpr bool BF = std::is_same<T, __nv_bfloat16>::value;
  FwdParams prm;
  prm.a = a;
  /* varlen: packed maps of total rows (a.nq, a.nk are the tensors' seqlens) */
  const bool pk = a.cu_q != nullptr;
  const int64_t hk = a.heads_q / a.group;
  /* packed GQA: Q boxes of rq rows x pack heads (a decode block: pack rows) */
  const int pack = DECODE ? a.pack : 1;
  static_assert(!DECODE || (S::BR & (S::BR - 1)) == 0, "decode blocks of 2^k rows");
  prm.a.pack_log2 = pack_rows_log2(pack, a.max_seqlen_q, S::BR);
  const int rq = DECODE ? 1 << prm.a.pack_log2 : S::BR;
  fa_status st;
  if ((st = make_map(&prm.tq, BF, a.q, a.d, a.nq, a.heads_q, a.batch, a.q_ss, a.q_sh, a.q_sb, pk,
                     rq, pack)) != FA_OK)
    return st;
  prm.o_map = 0;
  if constexpr (!DECODE && S::STAGE_O) /* O's map where its rows are aligned, else thread stores */
    if (o_rows_aligned(a)) {
      if ((st = make_map(&prm.to, BF, a.o, a.d, a.nq, a.heads_q, a.batch, a.o_ss, a.o_sh, a.o_sb,
                         pk, StagedO<NWG>::ER, 1)) != FA_OK)
        return st;
      prm.o_map = 1;
    }
  if (a.block_table) { /* the pools, boxes of a page-aligned run of rows */
    int g = S::BC, r = a.page;
    while (r) g %= r, std::swap(g, r);
    prm.box = g;
    prm.tile_pages = S::BC / a.page, prm.tile_rest = S::BC % a.page;
    if ((st = make_map(&prm.tk, BF, a.k, a.d, a.page, hk, a.kv_batch, a.k_ss, a.k_sh, a.k_sb, false,
                       g)) != FA_OK ||
        (st = make_map(&prm.tv, BF, a.v, a.d, a.page, hk, a.kv_batch, a.v_ss, a.v_sh, a.v_sb, false,
                       g)) != FA_OK)
      return st;
  } else {
    const bool cache = a.used_k != nullptr && !pk;
    prm.kv_rows = cache ? (int)kv_map_rows(a) : a.nk;
    if ((st = make_kv_map(&prm.tk, BF, a.k, a.d, prm.kv_rows, hk, a.kv_batch, a.k_ss, a.k_sh,
                          a.k_sb, pk, cache, S::BC)) != FA_OK ||
        (st = make_kv_map(&prm.tv, BF, a.v, a.d, prm.kv_rows, hk, a.kv_batch, a.v_ss, a.v_sh,
                          a.v_sb, pk, cache, S::BC)) != FA_OK)
      return st;
  }
  auto kernel = fwd_kernel<T, D, NWG, KB, DECODE, PAGED, PW>;
  static bool attr_done = false;
  if ((st = smem_limit_once(kernel, smem, attr_done)) != FA_OK) return st;
  prm.sched.set((a.max_seqlen_q + rq - 1) / rq, a.heads_q / pack * (DECODE ? a.nsplit : 1), a.batch,
                a.sched);
  prm.by_nsplit = FastDiv::make(DECODE ? a.nsplit : 1);
  const int64_t blocks = (int64_t)prm.sched.nblk * prm.sched.heads * a.batch;
  const int ctas = persistent_ctas(blocks, a.sm_margin);
  if (blocks == 0) return FA_OK;
  if (ctas == 0)
    return fa_set_error(FA_ERR_UNSUPPORTED, "cuda: too many query blocks for one launch");
  if (!a.sched) return fa_set_error(FA_ERR_INTERNAL, "cuda: no workspace for the block counter");
  if (blocks > ctas) { /* the counter is read (Schedule::take) */
    const cudaError_t e = cudaMemsetAsync(a.sched, 0, sizeof(int), stream);
    if (e != cudaSuccess) return fa_set_error(FA_ERR_DEVICE, "cuda: %s", cudaGetErrorString(e));
  }
  fa_status ks;
  if (a.pdl) /* after the KV-cache call's preparation, which lets it start early */
    ks = launch_dependent_smem(kernel, dim3(ctas), dim3((S::NWG + 1) * 128), smem, stream, true,
                               prm);
  else
    kernel<<<ctas, (S::NWG + 1) * 128, smem, stream>>>(prm), ks = launch_status();
  if (!DECODE || a.nsplit == 1 || ks != FA_OK) return ks;
  /* as a programmatic dependent: this kernel let it launch at its start */
  return fwd_combine_launch<T, D>(a, stream, true);
}

/* The wide key tiles (fwd_bc) where sm90_forward asks for them. A paged
 * cache's boxes: four producer warps share them where a tile takes
 * four boxes or more for each 64 columns (pages of BC / 4 rows or fewer);
 * at fewer, one warp issues them, the other three idling beside the
 * consumers cost more (prefill chunk, pages of 256 on an H100: 1.032 against
 * 1.057 the contiguous cache's time with 8k keys, 1.019 against 1.034 with
 * 2k). Nor in a decode CTA that walks a single key tile (one split of one
 * tile), where their hand-over costs more than it saves (batch 1, 2k keys in
 * pages of 16: 11.4 against 10.6 us; 16.6 against 17.6 with 8k keys, four
 * tiles a split), nor in the D = 64 decode kernel, whose producer registers
 * spill with four. */
template <typename T, int D, int NWG, bool DECODE = false>
fa_status fwd_launch(const FwdArgs &a, cudaStream_t stream, bool wide = false) {
  constexpr int KB = fwd_bc(D, false), WB = fwd_bc(D, true);
  if constexpr (!DECODE && WB != KB) /* wide tiles: never paged (sm90_forward) */
    if (wide) return fwd_launch_as<T, D, NWG, WB, false, false, 1>(a, stream);
  if (!a.block_table) return fwd_launch_as<T, D, NWG, KB, DECODE, false, 1>(a, stream);
  constexpr int BC = KB;
  bool four = BC / std::gcd(a.page, BC) >= 4;
  if constexpr (DECODE) {
    const int64_t tiles = (a.max_seqlen_k + BC - 1) / BC;
    four = four && D > 64 && (tiles + a.nsplit - 1) / a.nsplit >= 2;
  }
  if constexpr (!DECODE || D > 64)
    if (four) return fwd_launch_as<T, D, NWG, KB, DECODE, true, 4>(a, stream);
  return fwd_launch_as<T, D, NWG, KB, DECODE, true, 1>(a, stream);
}

/* The decode kernel of a's head dim with NWG consumer warpgroups */
template <typename T, int NWG>
fa_status fwd_launch_decode(const FwdArgs &a, cudaStream_t stream) {
  return dispatch_headdim(
      a.d, [&](auto dd) { return fwd_launch<T, decltype(dd)::value, NWG, true>(a, stream); });
}

}  // namespace sm90

int64_t sm90::kv_map_rows(const AttnArgs &a) {
  if (a.kv_batch == 1) return a.nk;
  if (a.k_ss <= 0 || a.v_ss <= 0 || a.k_sb % a.k_ss != 0 || a.v_sb % a.v_ss != 0) return -1;
  const int64_t rows = a.k_sb / a.k_ss;
  /* the sequences' rows within the maps' 32-bit coordinates */
  if (rows < a.nk || a.v_sb / a.v_ss != rows || rows > INT_MAX / 2 / a.kv_batch) return -1;
  return rows;
}

bool sm90_forward_covers(const AttnArgs &a) {
  /* block masks whose blocks tile both kernels' tiles (128 x 128 forward,
   * 64 x 128 backward): a tile is then wholly visible or wholly skipped */
  const bool bm_fits = a.bmask == NULL || (a.bm_q % 128 == 0 && a.bm_k % 128 == 0);
  /* paged: boxes of gcd(page size, BC) rows, a multiple of the swizzle's 8 */
  const bool kv_ok =
      a.block_table ? a.page % 8 == 0 : !a.used_k || a.cu_q || sm90::kv_map_rows(a) > 0;
  /* the KV-cache call's left padding and batch indices: the sm_80 kernels */
  if (a.k_start || a.k_batch) return false;
  if (a.drop.keep_scale > 0.f || !bm_fits || a.cap_log2 > 0.f || a.alibi != NULL ||
      !(a.scale_log2 > 0.f) || !kv_ok)
    return false;
  /* head dims 33-256, padded to 64, 128, 192 or 256 (TMA fills the columns past d
   * with zeros; 65-96 padded to 128 still ran 1.3-1.5x the sm_80 kernel's
   * own D = 96 on an H100, docs/PERF.md) */
  return a.d > 32 && a.d <= 256;
}

bool sm90_device() {
  static int cached[64]; /* per device: 0 unknown, 1 yes, 2 no */
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  if (!cached[dev]) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    const char *env = getenv("FLASHATTN_CUDA_WGMMA");
    const bool off = env && strcmp(env, "0") == 0;
    cached[dev] = major == 9 && minor == 0 && !off ? 1 : 2;
  }
  return cached[dev] == 1;
}

bool sm90_strict() {
  const char *env = getenv("FLASHATTN_CUDA_WGMMA");
  return env && strcmp(env, "strict") == 0;
}

/* Whether every query row sees every key: no causal or window band, or one
 * that cuts no tile (a ring's shard of keys wholly before its queries) */
static bool band_free(const FwdArgs &a) {
  if (!a.causal && !a.window_enabled) return true;
  if (a.cu_q || a.used_k || a.nq < 1) return false; /* a band per sequence */
  const fa_mask m = attn_mask(a, a.nq, a.nk);
  int64_t lo0, hi0, lo1, hi1;
  fa_mask_row_range(&m, 0, &lo0, &hi0);
  fa_mask_row_range(&m, a.nq - 1, &lo1, &hi1);
  return lo0 == 0 && hi0 == a.nk && lo1 == 0 && hi1 == a.nk;
}
/* D = 64: 192-row blocks (three warpgroups) gain 4-19% per cell, except
 * under block masks (their 128-row blocks would be straddled) and where a
 * causal or window band leaves the rows under 4096 keys: a 192-row block's
 * diagonal tiles, computed whole though wholly masked for some of its
 * warpgroups, then cost more than the third warpgroup gains (causal
 * N = 512-2048: 3-18% slower; docs/PERF.md "CUDA forward"). Skipping those
 * tiles per warpgroup, a branch in the tile loop, cost 10% everywhere. */
static bool three_warpgroups(const FwdArgs &a) {
  int64_t band = a.cu_q ? a.max_seqlen_q : a.nk;
  if (a.window_enabled && a.window_left >= 0 && a.window_right >= 0)
    band = std::min(band, a.window_left + a.window_right + 1);
  return !a.bmask && (!(a.causal || a.window_enabled) || band >= 4096);
}

template <typename T>
fa_status sm90_forward(const FwdArgs &a, cudaStream_t s) {
  /* decode shapes: keys split (FwdArgs::nsplit), GQA heads packed
   * (FwdArgs::pack) */
  if (a.nsplit > 1 || a.pack > 1) {
    /* one consumer warpgroup where a 128-row block would hold 64 query rows
     * or fewer (a GQA group's heads at a decode step): the other's products
     * are all padding */
    const bool one = a.pack > 1 && a.pack << pack_rows_log2(a.pack, a.max_seqlen_q, 128) <= 64;
    return one ? sm90::fwd_launch_decode<T, 1>(a, s) : sm90::fwd_launch_decode<T, 2>(a, s);
  }
  /* wide key tiles (fwd_bc) where every tile but the last is wholly
   * visible and there are enough of them */
  const int64_t keys = a.cu_q ? a.max_seqlen_k : a.nk;
  const bool wide = band_free(a) && !a.bmask && !a.block_table && keys >= sm90::wide_min_keys(a.d);
  return sm90::dispatch_headdim(a.d, [&](auto dd) {
    constexpr int D = decltype(dd)::value;
    if constexpr (D == 64)
      return three_warpgroups(a) ? sm90::fwd_launch<T, 64, 3>(a, s)
                                 : sm90::fwd_launch<T, 64, 2>(a, s);
    else
      return sm90::fwd_launch<T, D, 2>(a, s, wide);
  });
}
template fa_status sm90_forward<__half>(const FwdArgs &, cudaStream_t);
template fa_status sm90_forward<__nv_bfloat16>(const FwdArgs &, cudaStream_t);

}  // namespace fa
