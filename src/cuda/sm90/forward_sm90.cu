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
 * The producer gives its registers to the consumers (setmaxnreg). Key tiles
 * run from the last to the first, so a causal block's masked tiles come first
 * and the rest carry no masking arithmetic.
 *
 * Covers the plain score path (no softcap, ALiBi or dropout; block masks of
 * 128-multiple blocks, skipped a whole tile at a time) at padded head dims 64
 * and 128; forward.cu sends everything else to the sm_80
 * kernels. Built only for sm_90a; other targets compile an empty body. */
#include <stdlib.h>
#include <string.h>

#include "../forward_kernel.cuh"
#include "schedule.cuh"
#include "sm90.h"
#include "wgmma.cuh"

namespace fa {
namespace sm90 {

template <int D>
struct FwdShape {
  static constexpr int NWG = 2, BR = 64 * NWG, BC = 128, ST = 2;
  /* the producer walks the schedule too: 24 registers spill */
  static constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
  static_assert(regs_split_fits(NWG + 1, PRODUCER_REGS, CONSUMER_REGS), "registers fit");
};

struct FwdParams {
  FwdArgs a;
  CUtensorMap tq, tk, tv; /* (d, seqlen, heads, batch) boxes of 64 columns */
  Schedule sched;         /* query blocks per (sequence, head), in launch order */
};

template <int D>
struct FwdSmem {
  using S = FwdShape<D>;
  static constexpr uint32_t QBYTES = S::BR * D * 2, TBYTES = S::BC * D * 2;
  static constexpr uint32_t K0 = QBYTES, V0 = K0 + S::ST * TBYTES, O0 = V0 + S::ST * TBYTES;
  /* O is staged (row stride D + 8) apart from Q, so the next block's Q loads
   * during this block's epilogue */
  static constexpr uint32_t BARS = O0 + S::BR * (D + 8) * 2;
  /* barriers: q_full, q_empty, k_full[ST], v_full[ST], k_empty[ST],
   * v_empty[ST]; then the block index of Q's two phases; plus 1 KB to align
   * the base to 1024 bytes */
  static constexpr uint32_t SLOTS = BARS + 8 * (2 + 4 * S::ST);
  static constexpr size_t BYTES = SLOTS + 8 + 1024;
};

/* Online softmax over one S tile held as accumulators s (rows g and g + 8 of
 * the warp's 16; masked scores already -inf): folds the tile into m and l,
 * rescales o, leaves P in s. */
template <int BC, int D>
__device__ __forceinline__ void softmax_tile(float (&s)[BC / 8][4], float (&o)[D / 8][4],
                                             float (&m)[2], float (&l)[2], float mul) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < BC / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) mx = fmaxf(mx, s[j][2 * r + e]);
    float base;
    const float alpha = online_rescale(m[r], mx, mul, &base);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < BC / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pe = exp2f(fmaf(s[j][2 * r + e], mul, -base));
        s[j][2 * r + e] = pe;
        sum += pe;
      }
    l[r] = l[r] * alpha + sum;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      o[j][2 * r] *= alpha;
      o[j][2 * r + 1] *= alpha;
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__((FwdShape<D>::NWG + 1) * 128, 1)
    fwd_kernel(const __grid_constant__ FwdParams P) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = FwdShape<D>;
  using L = FwdSmem<D>;
  constexpr int BR = S::BR, BC = S::BC, ST = S::ST, NC = S::NWG * 128; /* consumer threads */
  const FwdArgs &p = P.a;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t sQ = (smem_addr(smem_raw) + 1023) & ~1023u;
  const uint32_t q_full = sQ + L::BARS, q_empty = q_full + 8;
  auto k_full = [&](int st) { return q_full + 8 * (2 + st); };
  auto v_full = [&](int st) { return q_full + 8 * (2 + ST + st); };
  auto k_empty = [&](int st) { return q_full + 8 * (2 + 2 * ST + st); };
  auto v_empty = [&](int st) { return q_full + 8 * (2 + 3 * ST + st); };

  const int tid = threadIdx.x;
  if (tid == 0) {
    mbar_init(q_full, 1);
    mbar_init(q_empty, NC); /* every consumer thread: each read its slot */
    for (int st = 0; st < ST; ++st) {
      mbar_init(k_full(st), 1);
      mbar_init(v_full(st), 1);
      mbar_init(k_empty(st), NC / 32); /* one arrival per consumer warp */
      mbar_init(v_empty(st), NC / 32);
    }
    mbar_init_fence();
  }
  __syncthreads();

  /* The producer takes the blocks (schedule.cuh) and hands each one's index
   * to the consumers in slot[j & 1] with its Q (q_full phase j); -1 ends the
   * walk. Both roles then walk the block's same live key tiles, so the K/V
   * ring's position i runs in step; a block's tiles run from the last to the
   * first, so a causal block's masked tiles come first. */
  volatile int *slot =
      reinterpret_cast<volatile int *>(smem_raw + (sQ + L::SLOTS - smem_addr(smem_raw)));
  struct Block {
    int b, h, r0, rows;
    SeqView sv;
    fa_mask mk;
    KeyTiles kt;
  };
  /* block t's rows and key tiles; false past a varlen sequence's end */
  auto setup = [&](int t, Block &k) {
    int x;
    P.sched.decode(t, x, k.h, k.b);
    k.sv = seq_view(p, k.b);
    k.r0 = (P.sched.nblk - 1 - x) * BR;
    if (k.r0 >= k.sv.nq) return false;
    k.rows = min(BR, k.sv.nq - k.r0);
    k.mk =
        fa_mask_make(k.sv.nq, k.sv.nk, p.causal, p.window_enabled, p.window_left, p.window_right);
    k.kt = key_tiles<BC>(k.mk, k.r0, k.rows);
    return true;
  };
  /* Key tiles a block mask (blocks a multiple of the tile, sm90_forward_covers)
   * skips: tile n_end - 1 - i, as the walk runs backwards */
  auto tile_skip = [&](const Block &k) {
    return [&](int i) {
      return p.bmask && !__ldg(bmask_head(p, k.b, k.h) + (int64_t)(k.r0 / p.bm_q) * p.bm_sr +
                               (k.kt.n_end - 1 - i) * BC / p.bm_k);
    };
  };

  if (tid < 128) { /* ---- producer warpgroup ---- */
    regs_dealloc<S::PRODUCER_REGS>();
    if (tid < 32) { /* one warp walks the tiles, its lane 0 issues the copies */
      /* lane 0 takes the next block, the warp learns it */
      auto take = [&]() {
        int t = 0;
        if (tid == 0) t = P.sched.take();
        return __shfl_sync(0xffffffffu, t, 0);
      };
      const int total = P.sched.total();
      Block k;
      int i = 0, t = blockIdx.x;
      for (int j = 0;; ++j, t = take()) {
        while (t < total && !setup(t, k)) t = take();
        const bool more = t < total;
        if (tid == 0) { /* Q once the consumers are done with the previous block's */
          mbar_wait(q_empty, (j & 1) ^ 1);
          slot[j & 1] = more ? t : -1;
          if (more) {
            mbar_expect_tx(q_full, L::QBYTES);
            const MapSeq mq = map_seq(p.cu_q != nullptr, k.b, p.nq, k.sv.q0, k.sv.nq);
            tma_load_tile<BR, D>(sQ, &P.tq, q_full, mq.row + k.r0, k.h, mq.batch);
          } else {
            mbar_arrive(q_full);
          }
        }
        if (!more) break;
        const int hk = k.h / p.group;
        const MapSeq mk = map_seq(p.cu_q != nullptr, k.b, p.nk, k.sv.k0, k.sv.nk);
        for_each_live(k.kt.n_end - k.kt.n_begin, tile_skip(k), [&](int kk) {
          const int n = k.kt.n_end - 1 - kk, st = i % ST, ph = (i / ST) & 1;
          ++i;
          if (tid != 0) return;
          mbar_wait(k_empty(st), ph ^ 1);
          mbar_expect_tx(k_full(st), L::TBYTES);
          tma_load_tile<BC, D>(sQ + L::K0 + st * L::TBYTES, &P.tk, k_full(st), mk.row + n * BC, hk,
                               mk.batch);
          mbar_wait(v_empty(st), ph ^ 1);
          mbar_expect_tx(v_full(st), L::TBYTES);
          tma_load_tile<BC, D>(sQ + L::V0 + st * L::TBYTES, &P.tv, v_full(st), mk.row + n * BC, hk,
                               mk.batch);
        });
      }
    }
    return;
  }

  /* ---- consumer warpgroups ---- */
  regs_alloc<S::CONSUMER_REGS>();
  const int ctid = tid - 128, wg = ctid >> 7, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int wrow = wg * 64 + ((ctid >> 5) & 3) * 16; /* this warp's first row in the block */
  const float mul = p.scale_log2;
  const uint32_t q_base = sQ + wg * 64 * 128; /* this warpgroup's 64 rows of Q */
  T *sO = reinterpret_cast<T *>(smem_raw + (sQ + L::O0 - smem_addr(smem_raw)));
  constexpr int LD = D + 8;

  Block k;
  int i = 0; /* visited tiles so far: the ring's position */
  for (int j = 0;; ++j) {
    mbar_wait(q_full, j & 1);
    const int blk = slot[j & 1];
    if (blk < 0) break;
    setup(blk, k);
    float o[D / 8][4];
#pragma unroll
    for (int jj = 0; jj < D / 8; ++jj)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[jj][e] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

    /* One body for masked and unmasked tiles; a masked tile first sets the
     * scores outside each row's visible keys to -inf */
    auto step = [&](const int n, const int i, const bool masked) {
      const int st = i % ST, ph = (i / ST) & 1;
      const int c0 = n * BC;
      float s[BC / 8][4];
      const uint32_t k_base = sQ + L::K0 + st * L::TBYTES;
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        wgmma_ss<T, BC>(s, sw128_kmajor<BR>(q_base, kk), sw128_kmajor<BC>(k_base, kk), kk > 0);
      wg_commit();
      wg_wait<0>();
      reg_fence(s);
      if (lane == 0) mbar_arrive(k_empty(st));

      if (masked) /* scores outside each row's visible keys -> -inf */
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          int64_t lo, hi;
          fa_mask_row_range(&k.mk, k.r0 + wrow + g + 8 * rr, &lo, &hi);
#pragma unroll
          for (int jj = 0; jj < BC / 8; ++jj)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int col = c0 + jj * 8 + 2 * t + e;
              if (col < lo || col >= hi) s[jj][2 * rr + e] = -INFINITY;
            }
        }
      softmax_tile<BC, D>(s, o, m_run, l_run, mul);

      uint32_t pa[BC / 16][4];
#pragma unroll
      for (int kk = 0; kk < BC / 16; ++kk) c_to_a<T>(pa[kk], s[2 * kk], s[2 * kk + 1]);
      const uint32_t v_base = sQ + L::V0 + st * L::TBYTES;
      mbar_wait(v_full(st), ph);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < BC / 16; ++kk)
        wgmma_rs<T, D>(o, pa[kk], sw128_mnmajor(v_base, kk, BC * 128), 1);
      wg_commit();
      wg_wait<0>();
      reg_fence(o);
      reg_fence(pa);
      if (lane == 0) mbar_arrive(v_empty(st));
    };
    for_each_live(k.kt.n_end - k.kt.n_begin, tile_skip(k), [&](int kk) {
      const int n = k.kt.n_end - 1 - kk;
      mbar_wait(k_full(i % ST), (i / ST) & 1);
      step(n, i++, k.kt.masked(n * BC, BC, k.sv.nk));
    });
    mbar_arrive(q_empty); /* the producer may load Q and write the slot again */

    /* Normalise, write lse, stage O (row stride D + 8) through shared memory;
     * the first barrier: every consumer is done storing the previous block's */
    named_sync(1, NC);
    float *lse_row = p.lse + k.sv.lse0 + k.h * k.sv.lse_hs + k.r0;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float lse;
      const float inv = online_finish(m_run[rr] * mul, l_run[rr], &lse);
      const int lr = wrow + g + 8 * rr;
      if (t == 0 && lr < k.rows) lse_row[lr] = lse;
#pragma unroll
      for (int jj = 0; jj < D / 8; ++jj)
        *reinterpret_cast<uint32_t *>(sO + lr * LD + jj * 8 + 2 * t) =
            pack2<T>(o[jj][2 * rr] * inv, o[jj][2 * rr + 1] * inv);
    }
    named_sync(1, NC);
    store_tile<T, BR, D, NC>((T *)p.o + k.sv.qb * p.o_sb + (k.sv.q0 + k.r0) * p.o_ss + k.h * p.o_sh,
                             p.o_ss, sO, k.rows, p.d, ctid);
  }
#endif
}

template <typename T, int D>
fa_status fwd_launch(const FwdArgs &a, cudaStream_t stream) {
  using S = FwdShape<D>;
  constexpr size_t smem = FwdSmem<D>::BYTES;
  static_assert(smem <= 227 * 1024, "fits Hopper's shared memory");
  constexpr bool BF = std::is_same<T, __nv_bfloat16>::value;
  FwdParams prm;
  prm.a = a;
  /* varlen: packed maps of total rows (a.nq, a.nk are the tensors' seqlens) */
  const bool pk = a.cu_q != nullptr;
  const int64_t hk = a.heads_q / a.group;
  fa_status st;
  if ((st = make_map(&prm.tq, BF, a.q, a.d, a.nq, a.heads_q, a.batch, a.q_ss, a.q_sh, a.q_sb, pk,
                     S::BR)) != FA_OK ||
      (st = make_map(&prm.tk, BF, a.k, a.d, a.nk, hk, a.batch, a.k_ss, a.k_sh, a.k_sb, pk,
                     S::BC)) != FA_OK ||
      (st = make_map(&prm.tv, BF, a.v, a.d, a.nk, hk, a.batch, a.v_ss, a.v_sh, a.v_sb, pk,
                     S::BC)) != FA_OK)
    return st;
  auto kernel = fwd_kernel<T, D>;
  static bool attr_done = false;
  if ((st = smem_limit_once(kernel, smem, attr_done)) != FA_OK) return st;
  prm.sched.nblk = (a.max_seqlen_q + S::BR - 1) / S::BR;
  prm.sched.heads = a.heads_q;
  prm.sched.batch = a.batch;
  prm.sched.next = a.sched;
  const int64_t blocks = (int64_t)prm.sched.nblk * a.heads_q * a.batch;
  const int ctas = persistent_ctas(blocks);
  if (blocks == 0) return FA_OK;
  if (ctas == 0)
    return fa_set_error(FA_ERR_UNSUPPORTED, "cuda: too many query blocks for one launch");
  if (!a.sched) return fa_set_error(FA_ERR_INTERNAL, "cuda: no workspace for the block counter");
  const cudaError_t e = cudaMemsetAsync(a.sched, 0, sizeof(int), stream);
  if (e != cudaSuccess) return fa_set_error(FA_ERR_DEVICE, "cuda: %s", cudaGetErrorString(e));
  kernel<<<ctas, (S::NWG + 1) * 128, smem, stream>>>(prm);
  return launch_status();
}

}  // namespace sm90

bool sm90_forward_covers(const AttnArgs &a) {
  /* block masks whose blocks tile both kernels' tiles (128 x 128 forward,
   * 64 x 128 backward): a tile is then wholly visible or wholly skipped */
  const bool bm_fits = a.bmask == NULL || (a.bm_q % 128 == 0 && a.bm_k % 128 == 0);
  if (a.drop.keep_scale > 0.f || !bm_fits || a.cap_log2 > 0.f || a.alibi != NULL ||
      !(a.scale_log2 > 0.f))
    return false;
  const int dp = a.d <= 64 ? 64 : a.d <= 128 ? 128 : 0;
  return a.d > 32 && dp != 0 && !(a.d > 64 && a.d <= 96);
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

template <typename T>
fa_status sm90_forward(const FwdArgs &a, cudaStream_t s) {
  return a.d <= 64 ? sm90::fwd_launch<T, 64>(a, s) : sm90::fwd_launch<T, 128>(a, s);
}
template fa_status sm90_forward<__half>(const FwdArgs &, cudaStream_t);
template fa_status sm90_forward<__nv_bfloat16>(const FwdArgs &, cudaStream_t);

}  // namespace fa
