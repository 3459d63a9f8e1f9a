/* The KV-cache call's first step on CUDA (fa_forward_kvcache): q rotated into
 * its copy (fa_problem.q, in the workspace) when rotary, and the new keys
 * (rotated) and values written into each batch entry's cache rows
 * cache_seqlens[b] .. + seqlen_new - 1 (paged: through its row of the block
 * table). One warp per row, lanes over the row's rotary pairs and the other
 * columns; rotations in float32, as the CPU's (common/kvcache.c). The kernel
 * lets the attention launch at its start (griddepcontrol.launch_dependents),
 * which then waits for it (FwdArgs::pdl), so the two launches overlap.
 * Device-resident values the host could not check are clamped as in
 * seq_view: cache_seqlens into [left padding, rows - seqlen_new], batch
 * indices and pages into their tensors. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "attn.cuh"
#include "common/rotary.h"

namespace fa {
namespace {

struct KvPrep {
  const void *q_in;
  void *q; /* the rotated copy, contiguous (B, Nq, Hq, D); NULL: no rotary */
  int64_t q_sb, q_ss, q_sh;
  const void *k_new, *v_new; /* NULL: nothing appended */
  int64_t n_sb, n_ss, n_sh, vn_sb, vn_ss, vn_sh;
  void *k, *v; /* the caches */
  int64_t k_sb, k_ss, k_sh, v_sb, v_ss, v_sh;
  const void *cs, *sn; /* rotary tables; NULL: none */
  int64_t ro_stride;
  int ro_seqlen, ro_dim, interleaved, all_rows;
  const int32_t *seqlens, *leftpad, *batch_idx, *table;
  int64_t bt_stride;
  int page, kv_batch, cap; /* cap: rows of one cache */
  int B, nq, nnew, hq, hk, d;
  int64_t q_rows, rows; /* q rows to rotate; every row of the launch */
};

template <typename T>
__device__ __forceinline__ float ld(const void *p, int64_t i) {
  return (float)reinterpret_cast<const T *>(p)[i];
}

/* Row dst = row src (d elements), its first ro_dim columns rotated to
 * position pos (pos < 0: copied). Lanes share the work. */
template <typename T>
__device__ __forceinline__ void rotate_row(const KvPrep &a, T *dst, const T *src, int pos,
                                           int lane) {
  const int rd = pos >= 0 ? a.ro_dim : 0, half = rd / 2;
  for (int c = lane; c < half; c += 32) {
    int64_t c1, c2;
    fa_rotary_cols(c, rd, a.interleaved, &c1, &c2);
    const float x1 = (float)src[c1], x2 = (float)src[c2];
    const float co = ld<T>(a.cs, pos * a.ro_stride + c), si = ld<T>(a.sn, pos * a.ro_stride + c);
    dst[c1] = T(x1 * co - x2 * si);
    dst[c2] = T(x1 * si + x2 * co);
  }
  for (int c = rd + lane; c < a.d; c += 32) dst[c] = src[c];
}

template <typename T>
__global__ void __launch_bounds__(256) kv_prepare_kernel(const KvPrep a) {
  pdl_launch_dependents();
  const int64_t r = (int64_t)blockIdx.x * 8 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (r >= a.rows) return;
  if (r < a.q_rows) { /* query row (b, i, h) */
    const int h = (int)(r % a.hq), i = (int)(r / a.hq % a.nq), b = (int)(r / a.hq / a.nq);
    const int lp = a.leftpad ? min(max(a.leftpad[b], 0), a.cap) : 0;
    const int sl = min(max(a.seqlens[b], lp), a.cap - a.nnew);
    const int pos = min((int)fa_rotary_qpos(sl, i, a.all_rows), a.ro_seqlen - 1);
    const T *src = reinterpret_cast<const T *>(a.q_in) + b * a.q_sb + i * a.q_ss + h * a.q_sh;
    T *dst = reinterpret_cast<T *>(a.q) + (((int64_t)b * a.nq + i) * a.hq + h) * a.d;
    rotate_row<T>(a, dst, src, pos, lane);
    return;
  }
  /* new row (b, i, hk): into cache row seqlens[b] + i */
  const int64_t x = r - a.q_rows;
  const int h = (int)(x % a.hk), i = (int)(x / a.hk % a.nnew), b = (int)(x / a.hk / a.nnew);
  const int lp = a.leftpad ? min(max(a.leftpad[b], 0), a.cap) : 0;
  const int row = min(max(a.seqlens[b], lp), a.cap - a.nnew) + i;
  int64_t kb = b, kr = row;
  if (a.table) {
    const int32_t *pages = a.table + (int64_t)b * a.bt_stride;
    kb = min(max(pages[row / a.page], 0), a.kv_batch - 1);
    kr = row % a.page;
  } else if (a.batch_idx) {
    kb = min(max(a.batch_idx[b], 0), a.kv_batch - 1);
  }
  const T *kn = reinterpret_cast<const T *>(a.k_new) + b * a.n_sb + i * a.n_ss + h * a.n_sh;
  const T *vn = reinterpret_cast<const T *>(a.v_new) + b * a.vn_sb + i * a.vn_ss + h * a.vn_sh;
  T *kd = reinterpret_cast<T *>(a.k) + kb * a.k_sb + kr * a.k_ss + h * a.k_sh;
  T *vd = reinterpret_cast<T *>(a.v) + kb * a.v_sb + kr * a.v_ss + h * a.v_sh;
  rotate_row<T>(a, kd, kn, a.cs ? min(row, a.ro_seqlen - 1) : -1, lane);
  rotate_row<T>(a, vd, vn, -1, lane);
}

}  // namespace

fa_status kvcache_prepare(const fa_problem *pb, cudaStream_t stream) {
  const fa_kvcache *kv = pb->kv;
  KvPrep a;
  a.q_in = pb->q_in.data;
  a.q = kv->rotary_cos ? pb->q.data : nullptr;
  a.q_sb = pb->q_in.stride_batch, a.q_ss = pb->q_in.stride_seq, a.q_sh = pb->q_in.stride_head;
  a.k_new = pb->k_new.data, a.v_new = pb->v_new.data;
  a.n_sb = pb->k_new.stride_batch, a.n_ss = pb->k_new.stride_seq, a.n_sh = pb->k_new.stride_head;
  a.vn_sb = pb->v_new.stride_batch, a.vn_ss = pb->v_new.stride_seq;
  a.vn_sh = pb->v_new.stride_head;
  a.k = pb->k.data, a.v = pb->v.data;
  a.k_sb = pb->k.stride_batch, a.k_ss = pb->k.stride_seq, a.k_sh = pb->k.stride_head;
  a.v_sb = pb->v.stride_batch, a.v_ss = pb->v.stride_seq, a.v_sh = pb->v.stride_head;
  a.cs = kv->rotary_cos, a.sn = kv->rotary_sin;
  a.ro_stride = kv->rotary_stride ? kv->rotary_stride : kv->rotary_dim / 2;
  a.ro_seqlen = (int)(kv->rotary_seqlen < INT_MAX ? kv->rotary_seqlen : INT_MAX);
  a.ro_dim = (int)kv->rotary_dim;
  a.interleaved = kv->rotary_interleaved;
  a.all_rows = pb->rotary_all_rows;
  a.seqlens = kv->cache_seqlens, a.leftpad = kv->cache_leftpad, a.batch_idx = kv->cache_batch_idx;
  a.table = pb->block_table;
  a.bt_stride = pb->block_table_stride;
  a.page = (int)pb->page_size;
  a.kv_batch = (int)pb->k.batch;
  a.cap = (int)pb->k_cap;
  a.B = (int)pb->batch;
  a.nq = (int)pb->q_in.seqlen;
  a.nnew = pb->k_new.data ? (int)pb->k_new.seqlen : 0;
  a.hq = (int)pb->heads_q, a.hk = (int)pb->heads_k, a.d = (int)pb->headdim;
  a.q_rows = a.q ? (int64_t)a.B * a.nq * a.hq : 0;
  a.rows = a.q_rows + (int64_t)a.B * a.nnew * a.hk;
  if (a.rows == 0) return FA_OK;
  const dim3 grid((unsigned)((a.rows + 7) / 8));
  if (pb->dtype == FA_DTYPE_F16)
    kv_prepare_kernel<__half><<<grid, 256, 0, stream>>>(a);
  else
    kv_prepare_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(a);
  return launch_status();
}

}  // namespace fa
