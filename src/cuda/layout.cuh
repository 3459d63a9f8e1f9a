/* Layout rules shared by the forward and backward launch code. */
#ifndef FA_CUDA_LAYOUT_CUH
#define FA_CUDA_LAYOUT_CUH

#include <limits.h>

#include <type_traits>

#include "attn.cuh"
#include "common/problem.h"

namespace fa {

/* The flash kernels read and write 16-byte rows: a 16-bit tensor at data
 * whose strides (in elements) of dimensions with more than one entry are
 * multiples of 8. */
inline bool rows_aligned(const void *data, int64_t batch, int64_t sb, int64_t seqlen, int64_t ss,
                         int64_t heads, int64_t sh) {
  if ((uintptr_t)data % 16) return false;
  if (batch > 1 && sb % 8) return false;
  if (seqlen > 1 && ss % 8) return false;
  if (heads > 1 && sh % 8) return false;
  return true;
}
inline bool rows_aligned(const fa_tensor *t) {
  return rows_aligned(t->data, t->batch, t->stride_batch, t->seqlen, t->stride_seq, t->heads,
                      t->stride_head);
}

/* Head dims run the kernel of the next size, extra columns zero-filled. */
inline int padded_headdim(int64_t d) {
  return d <= 32 ? 32 : d <= 64 ? 64 : d <= 96 ? 96 : d <= 128 ? 128 : d <= 192 ? 192 : 256;
}

inline bool is_flash(const fa_problem *pb) { return pb->algorithm != FA_ALGO_STANDARD; }

/* Workspace parts start on 256-byte boundaries. */
inline size_t round256(size_t n) { return (n + 255) & ~(size_t)255; }

/* The fields FwdArgs and BwdArgs share: inputs, sizes, score transform, masks, varlen. */
inline void fill_common_args(AttnArgs &a, const fa_problem *pb) {
  a.q = pb->q.data;
  a.k = pb->k.data;
  a.v = pb->v.data;
  a.q_sb = pb->q.stride_batch, a.q_ss = pb->q.stride_seq, a.q_sh = pb->q.stride_head;
  a.k_sb = pb->k.stride_batch, a.k_ss = pb->k.stride_seq, a.k_sh = pb->k.stride_head;
  a.v_sb = pb->v.stride_batch, a.v_ss = pb->v.stride_seq, a.v_sh = pb->v.stride_head;
  a.nq = (int)pb->q.seqlen;
  a.nk = (int)pb->k_cap; /* k's seqlen, or a paged sequence's pages x page size */
  a.batch = (int)pb->batch;
  a.heads_q = (int)pb->heads_q;
  a.group = (int)pb->group;
  a.d = (int)pb->headdim;
  a.max_seqlen_q = (int)pb->max_seqlen_q;
  a.max_seqlen_k = (int)pb->max_seqlen_k;
  a.total_q = pb->total_q;
  const float log2e = FA_LOG2E;
  a.scale_log2 = pb->scale * log2e;
  a.cap_log2 = pb->softcap > 0 ? pb->softcap * log2e : 0.f;
  a.scale_over_cap = pb->softcap > 0 ? pb->scale / pb->softcap : 0.f;
  a.alibi = pb->alibi_slopes;
  a.alibi_sb = pb->alibi_stride_batch;
  a.cu_q = pb->varlen ? pb->cu_seqlens_q : NULL;
  a.cu_k = pb->varlen ? pb->cu_seqlens_k : NULL;
  a.used_k = pb->k_used; /* seqused_k, or the KV-cache call's cache_seqlens */
  a.used_add = (int)pb->k_used_add;
  a.k_start = pb->k_start;
  a.k_batch = pb->k_batch;
  a.kv_batch = (int)pb->k.batch;
  a.block_table = pb->block_table;
  a.bt_stride = pb->block_table_stride;
  a.page = (int)pb->page_size;
  a.causal = pb->causal;
  a.window_enabled = pb->window_enabled;
  a.window_left = pb->window_left;
  a.window_right = pb->window_right;
  /* api.c bounds a shard's positions and lengths by 2^31 - 1 */
  a.shard = pb->shard_enabled;
  a.diag_shift = a.shard ? (int)(pb->q_pos - pb->k_pos - (pb->k.seqlen - pb->q.seqlen)) : 0;
  a.drop = pb->dropout;
  if (!(pb->dropout_p > 0)) a.drop.keep_scale = 0.f;
  a.bmask = pb->block_mask;
  a.bm_sb = pb->block_mask_stride_batch;
  a.bm_sh = pb->block_mask_stride_head;
  a.bm_sr = pb->block_mask_stride_row;
  a.bm_q = (int)(pb->block_size_q < INT_MAX ? pb->block_size_q : INT_MAX);
  a.bm_k = (int)(pb->block_size_k < INT_MAX ? pb->block_size_k : INT_MAX);
  a.sm_margin = pb->sm_margin;
}

/* Calls f(std::integral_constant<int, D>()) for the D of the list equal to
 * dp (the last one where none is). */
template <int D, int... More, class F>
fa_status dispatch_dim(int dp, F &&f) {
  if constexpr (sizeof...(More) == 0)
    return f(std::integral_constant<int, D>());
  else
    return dp == D ? f(std::integral_constant<int, D>())
                   : dispatch_dim<More...>(dp, std::forward<F>(f));
}

/* Calls f(std::integral_constant<int, Dp>()) for the padded head dim Dp of d. */
template <class F>
fa_status dispatch_headdim(int64_t d, F &&f) {
  return dispatch_dim<32, 64, 96, 128, 192, 256>(padded_headdim(d), std::forward<F>(f));
}

}  // namespace fa

#endif
