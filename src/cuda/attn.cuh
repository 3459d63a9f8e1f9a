/* The attention problem as every CUDA kernel sees it, shared by the sm_80
 * kernels (forward_kernel.cuh, backward_kernel.cuh) and the Hopper ones
 * (sm90/): the launch arguments, the mask, where a sequence's rows live, the
 * key and query tiles a block walks, the output's staging tile, and the
 * launch helpers. */
#ifndef FA_CUDA_ATTN_CUH
#define FA_CUDA_ATTN_CUH

#include <cuda_runtime.h>
#include <limits.h>

#include <utility>

#include "backend.h"
#include "common/mask.h"
#include "common/philox.h"
#include "extension.cuh"
#include "tile.cuh"

namespace fa {

/* What the forward and backward launches share, by value (strides in elements). */
struct AttnArgs {
  const void *q, *k, *v;
  int64_t q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh;
  int nq, nk; /* per-sequence lengths when not varlen */
  int batch, heads_q, group, d;
  int max_seqlen_q;     /* grid size along queries */
  int max_seqlen_k;     /* ... and along keys */
  int64_t total_q;      /* lse head stride for varlen */
  float scale_log2;     /* softmax scale * log2(e) */
  float cap_log2;       /* softcap * log2(e) */
  float scale_over_cap; /* softcap, ALiBi or scale <= 0 select the transforming kernel */
  const float *alibi;
  int64_t alibi_sb;
  const int32_t *cu_q, *cu_k;
  const int32_t *used_k; /* KV cache: the keys each sequence uses (NULL: all) */
  /* The forward's KV caches (seq_view<KV>, load_tile_paged): the KV-cache call's
   * left padding and batch indices (NULL: 0 and b) and new rows (used_add,
   * added to used_k); a paged cache's table (NULL: not paged), row stride and
   * page size. nk is then a sequence's rows (pages x page size), kv_batch
   * k's batch (the pages). */
  const int32_t *k_start, *k_batch, *block_table;
  int used_add, kv_batch, page;
  int64_t bt_stride;
  int causal, window_enabled;
  int64_t window_left, window_right;
  /* A shard (fa_params.shard_enabled; never varlen): row i's diagonal key is
   * i + nk - nq + diag_shift (dropout's positions are in drop). */
  int shard, diag_shift;
  /* Dropout and block-sparse masks (docs/DROPOUT.md), read only by the EXT
   * kernels: keep_scale > 0 iff dropout; bmask (device bytes) NULL without a
   * block mask, bm_sb/bm_sh/bm_sr its batch/head/row strides, bm_q/bm_k the
   * block sizes (clamped to INT_MAX). */
  fa_dropout drop;
  const uint8_t *bmask;
  int64_t bm_sb, bm_sh, bm_sr;
  int bm_q, bm_k;
  int sm_margin; /* the launch's: SMs a persistent grid leaves free (persistent_ctas) */
};

/* The causal / window mask of a sequence of nq rows and nk keys. SHIFT: with
 * a shard's diagonal shift; the sm_80 kernels apply it in their EXT variants
 * only (the others sit at the register limit, and a shard's launch takes the
 * EXT kernels: ext_launch). */
template <bool SHIFT = true>
__host__ __device__ __forceinline__ fa_mask attn_mask(const AttnArgs &p, int nq, int nk) {
  fa_mask m = fa_mask_make(nq, nk, p.causal, p.window_enabled, p.window_left, p.window_right);
  if (SHIFT) m.diag0 += p.diag_shift;
  return m;
}

/* Row i's distance from key col, i + diag0 - col (ALiBi's |.|, the window's rel). */
template <bool SHIFT = true>
__device__ __forceinline__ int attn_rel(const AttnArgs &p, int nq, int nk, int i, int col) {
  return i + nk - nq + (SHIFT ? p.diag_shift : 0) - col;
}

/* Dropout or a block mask: the launch takes the EXT kernels. */
inline bool is_ext(const AttnArgs &a) { return a.drop.keep_scale > 0.f || a.bmask != NULL; }

/* The sm_80 kernels' choice: the EXT kernels also for a shard (its diagonal shift). */
inline bool ext_launch(const AttnArgs &a) { return is_ext(a) || a.shard; }

/* The forward's launch arguments. */
struct FwdArgs : AttnArgs {
  void *o;
  float *lse;
  int64_t o_sb, o_ss, o_sh;
  int *sched; /* the Hopper kernel's block counter: a word of the workspace */
  /* Split keys (decode shapes: forward.cu's fwd_splits):
   * nsplit > 1 cuts each sequence's own key tiles (a KV cache's used keys,
   * not the capacity; split_tiles) into nsplit ranges; the sm_80 EXT kernels
   * cut the longest sequence's, ext_split_tiles, set by the launch (computed
   * in the D=128 one, at its 255-register cap, it spilled 4 bytes on sm_80).
   * Range s leaves its normalised O (part_o, kernel-D floats per row) and lse
   * (part_lse) at row s * part_rows + the row's lse index, and a second
   * kernel combines them. nsplit = 1: no split. */
  int nsplit, ext_split_tiles;
  int64_t part_rows;
  float *part_o, *part_lse;
  /* GQA packing (the Hopper kernel; forward.cu's fwd_pack): pack > 1 query
   * heads of one K/V head share a block, 2^pack_log2 query rows of each (set
   * by the launch), so their K/V tiles are read once; block row r is query
   * row r % 2^pack_log2 of head r >> pack_log2. pack = 1: a block is one
   * head's. */
  int pack, pack_log2;
  /* 1: launched as a programmatic dependent of the KV-cache call's
   * preparation kernel (kvcache.cu), which the kernel then waits for */
  int pdl;
};

/* log2 of the query rows per head in a decode block of br rows (br a power
 * of two): the smallest power of two >= max_seqlen_q whose pack heads fit;
 * br when pack is 1. A power of two, so that a shift and a mask find a
 * block row's head and query row (a division's registers spill the D = 256
 * kernel). */
inline int pack_rows_log2(int pack, int max_seqlen_q, int br) {
  int lg = 0;
  while ((2 << lg) * pack <= br && (pack == 1 || (1 << lg) < max_seqlen_q)) ++lg;
  return lg;
}

/* The backward's launch arguments (AttnArgs: q, k, v, sizes, masks). */
struct BwdArgs : AttnArgs {
  const void *o, *dout;
  void *dq, *dk, *dv;
  const float *lse;
  float *dsum;   /* Di (lse layout) */
  float *lse2;   /* lse * log2(e); +inf for fully masked rows (lse layout) */
  float *dq_acc; /* float32 dQ, row = lse index, DP columns; NULL when deterministic */
  /* Per (sequence, K/V head): the kv kernel's blocks done with their dQ
   * reductions, zeroed by the prep kernel; the Hopper kernel counts them so
   * that its dQ conversion can start on finished heads while its last blocks
   * run (sm90::bwd_convert_kernel). NULL when deterministic. */
  int *kv_done;
  /* Deterministic mode (params.deterministic): on the Hopper kernels the dQ
   * reductions then go in a fixed order (common/dq_order.h): dq_sem counts,
   * per query tile (at the lse index of its first row), the key blocks that
   * have added theirs; kv_ticket numbers the key blocks as they start;
   * det_wave is a full mask's wave of blocks (at most the blocks resident at
   * once). The sm_80 kernels instead run flash_bwd_dq_kernel (dq_acc NULL). */
  int deterministic, det_wave;
  int *dq_sem, *kv_ticket;
  int64_t o_sb, o_ss, o_sh, do_sb, do_ss, do_sh, dq_sb, dq_ss, dq_sh, dk_sb, dk_ss, dk_sh;
  int64_t dv_sb, dv_ss, dv_sh;
  float scale;
};

/* Key tiles (BC keys) per split of a sequence of nk keys (FwdArgs::nsplit) */
template <int BC, typename Args>
__device__ __forceinline__ int split_tiles(const Args &p, int nk) {
  return ((nk + BC - 1) / BC + p.nsplit - 1) / p.nsplit;
}

/* Where one sequence's rows live (varlen: from the device-side offsets). */
struct SeqView {
  int64_t qb, q0, kb, k0, lse0, lse_hs;
  int nq, nk;
};
/* The forward's KV caches, what a kernel takes of AttnArgs' fields for them
 * (bits; the fewer, the fewer registers): the new rows (used_add), a paged
 * cache (varlen: keys from 0, at most nk), left padding and batch indices. */
enum { kSeqAdd = 1, kSeqPaged = 2, kSeqRows = 4, kSeqAll = 7 };
template <int KV = 0>
__device__ __forceinline__ SeqView seq_view(const AttnArgs &p, int b) {
  constexpr bool PAGED = KV & kSeqPaged, ROWS = KV & kSeqRows;
  SeqView v;
  int lp = 0; /* left padding */
  if (p.cu_q) {
    const int q0 = p.cu_q[b], k0 = p.cu_k[b];
    v.qb = v.kb = 0;
    v.q0 = q0;
    v.k0 = PAGED && p.block_table ? 0 : k0;
    v.nq = p.cu_q[b + 1] - q0;
    v.nk = p.cu_k[b + 1] - k0;
    if (PAGED && p.block_table) v.nk = min(v.nk, p.nk); /* a sequence's pages hold nk keys */
    v.lse0 = q0;
    v.lse_hs = p.total_q;
  } else {
    v.qb = v.kb = b;
    v.q0 = v.k0 = 0;
    v.nq = p.nq;
    v.nk = p.nk;
    if (ROWS) { /* clamped into range: device memory, so the host could not check it */
      if (p.k_batch) v.kb = min(max(p.k_batch[b], 0), p.kv_batch - 1);
      if (p.k_start) lp = min(max(p.k_start[b], 0), p.nk);
      v.k0 = lp;
      v.nk = p.nk - lp;
    }
    v.lse0 = (int64_t)b * p.heads_q * p.nq;
    v.lse_hs = p.nq;
  }
  /* clamped to [0, nk]: device memory, so the host could not check it */
  if (p.used_k) v.nk = min(v.nk, max(0, p.used_k[b] + (KV & kSeqAdd ? p.used_add - lp : 0)));
  return v;
}

/* Sequence b's row of a paged cache's table. */
__device__ __forceinline__ const int32_t *page_row(const AttnArgs &p, int b) {
  return p.block_table + (int64_t)b * p.bt_stride;
}
/* A table entry clamped to the pools' pages (device memory, which the host
 * could not check) */
__device__ __forceinline__ int page_clamp(const AttnArgs &p, int entry) {
  return min(max(entry, 0), p.kv_batch - 1);
}
/* The page holding key j of a sequence (pages: its table row), clamped */
__device__ __forceinline__ int page_of(const AttnArgs &p, const int32_t *pages, int j) {
  return page_clamp(p, __ldg(pages + j / p.page));
}

/* The key tiles (BC keys) of query rows [r0, r0 + rows): tiles [n_begin,
 * n_end) hold every key a row sees; keys [lo_max, hi_min) are seen by every
 * row, so a tile inside them (and inside nk) needs no element mask. */
struct KeyTiles {
  int n_begin, n_end, lo_max, hi_min;
  __device__ __forceinline__ bool masked(int c0, int bc, int nk) const {
    return c0 + bc > nk || c0 < lo_max || c0 + bc > hi_min;
  }
};
template <int BC>
__device__ __forceinline__ KeyTiles key_tiles(const fa_mask &mk, int r0, int rows) {
  int64_t lo, hi, a, z;
  KeyTiles t;
  fa_mask_block_range(&mk, r0, r0 + rows, &lo, &hi);
  t.n_begin = (int)(lo / BC);
  t.n_end = hi > lo ? (int)((hi + BC - 1) / BC) : t.n_begin;
  fa_mask_row_range(&mk, r0 + rows - 1, &a, &z);
  t.lo_max = (int)a;
  fa_mask_row_range(&mk, r0, &a, &z);
  t.hi_min = (int)z;
  return t;
}

/* The query tiles (BR rows) of keys [c0, c0 + cols): tiles [m_begin, m_begin
 * + nm) hold every row that sees one of the keys; rows [full_lo, full_hi) see
 * all of them, so a tile inside (with a full BC keys) needs no element mask. */
struct QueryTiles {
  int m_begin, nm, full_lo, full_hi;
  bool part; /* fewer than BC keys */
  __device__ __forceinline__ bool masked(int r, int br, int nq) const {
    return part || r < full_lo || min(r + br, nq) > full_hi;
  }
};
template <int BR, int BC>
__device__ __forceinline__ QueryTiles query_tiles(const fa_mask &mk, int c0, int cols) {
  int64_t rlo, rhi, t0, t1;
  QueryTiles t;
  fa_mask_col_range(&mk, c0, &rlo, &t0);            /* rows that see the first key */
  fa_mask_col_range(&mk, c0 + cols - 1, &t1, &rhi); /* ... and the last one */
  t.full_lo = (int)t1;
  t.full_hi = (int)t0;
  t.m_begin = (int)(rlo / BR);
  t.nm = rhi > rlo ? (int)((rhi + BR - 1) / BR) - t.m_begin : 0;
  t.part = cols < BC;
  return t;
}

/* f(k) for k = 0 .. count - 1 in order, except where skip(k) (a block mask's
 * zero tile): the warp tests 32 k at a time, one mask load per lane and a
 * ballot, instead of one dependent load per k. Every lane of the warp calls
 * it and every lane calls f with the same k. */
template <typename Skip, typename F>
__device__ __forceinline__ void for_each_live(int count, Skip skip, F f) {
  const int lane = threadIdx.x & 31;
  for (int k0 = 0; k0 < count; k0 += 32)
    for (uint32_t live = __ballot_sync(0xffffffffu, k0 + lane < count && !skip(k0 + lane)); live;
         live &= live - 1)
      f(k0 + __ffs(live) - 1);
}

/* Element offset of row r's 8-column chunk c in a staging tile of boxes of
 * ROWS rows x 64 columns, one after the other, each in the tensor copy
 * engine's 128-byte swizzle (chunk c of a row at c ^ (r % 8), the tile
 * 1024-byte aligned): a warp's fragment rows g = 0..7 then write 32
 * different banks, with no padding, and a box can be stored by TMA as it is. */
template <int ROWS>
__device__ __forceinline__ int stage_box_at(int r, int c) {
  return (c >> 3) * ROWS * 64 + r * 64 + (((c & 7) ^ (r & 7)) << 3);
}

/* Shared memory (BOX = 0: row stride D + 8; else stage_box_at<BOX>'s
 * layout) -> ROWS x d tile of a strided tensor, 16-byte stores; rows >=
 * valid_rows and columns >= d are not written. */
template <typename T, int ROWS, int D, int NT, int BOX = 0>
__device__ __forceinline__ void store_tile(T *g, int64_t stride, const T *s, int valid_rows, int d,
                                           int tid) {
  constexpr int CPR = D / 8, LD = D + 8;
#pragma unroll
  for (int it = 0; it < (ROWS * CPR + NT - 1) / NT; ++it) {
    const int idx = tid + it * NT;
    const int row = idx / CPR, ch = idx % CPR;
    if ((ROWS * CPR % NT == 0 || idx < ROWS * CPR) && row < valid_rows && ch * 8 < d) {
      const T *src = s + (BOX ? stage_box_at<BOX>(row, ch) : row * LD + ch * 8);
      T *dst = g + row * stride + ch * 8;
      if (ch * 8 + 8 <= d) {
        *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(src);
      } else {
        for (int e = 0; e < d - ch * 8; ++e) dst[e] = src[e];
      }
    }
  }
}

/* Block-mask bytes of (sequence b, query head h). */
__device__ __forceinline__ const uint8_t *bmask_head(const AttnArgs &p, int b, int h) {
  return p.bmask + (int64_t)b * p.bm_sb + (int64_t)h * p.bm_sh;
}

/* Element offset of row `row` of head h in a strided tensor of this sequence. */
__device__ __forceinline__ int64_t row_off(const SeqView &sv, bool keys, int64_t sb, int64_t ss,
                                           int64_t sh, int row, int h) {
  return (keys ? sv.kb : sv.qb) * sb + ((keys ? sv.k0 : sv.q0) + row) * ss + h * sh;
}

/* The kv_done counter of (sequence b, K/V head hk). */
__device__ __forceinline__ int *kv_done_of(const BwdArgs &p, int b, int hk) {
  return p.kv_done + b * (p.heads_q / p.group) + hk;
}

/* Sets a kernel's dynamic shared-memory limit once per instantiation (done
 * is that instantiation's flag; idempotent, so a race only repeats the call). */
template <typename K>
fa_status smem_limit_once(K kernel, size_t smem, bool &done) {
  if (done) return FA_OK;
  cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e != cudaSuccess) return fa_set_error(FA_ERR_DEVICE, "cuda: %s", cudaGetErrorString(e));
  done = true;
  return FA_OK;
}

/* The status of the launch just made. */
inline fa_status launch_status() {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return fa_set_error(FA_ERR_DEVICE, "cuda: %s", cudaGetErrorString(e));
  return FA_OK;
}

/* kernel<<<grid, block, 0, stream>>>(args), as a programmatic dependent
 * launch when pdl: its blocks may start once every block of the stream's
 * previous kernel has executed griddepcontrol.launch_dependents (or ended),
 * taking the SMs that kernel's last blocks free. */
template <typename... P, typename... A>
fa_status launch_dependent_smem(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
                                cudaStream_t stream, bool pdl, A &&...args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = pdl ? 1 : 0;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
  if (e != cudaSuccess) return fa_set_error(FA_ERR_DEVICE, "cuda: %s", cudaGetErrorString(e));
  return launch_status();
}
template <typename... P, typename... A>
fa_status launch_dependent(void (*kernel)(P...), dim3 grid, dim3 block, cudaStream_t stream,
                           bool pdl, A &&...args) {
  return launch_dependent_smem(kernel, grid, block, 0, stream, pdl, std::forward<A>(args)...);
}

}  // namespace fa

#endif
