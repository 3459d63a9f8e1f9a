// The C++ signatures of flashattn::fwd, flashattn::bwd and flashattn::kvcache
// (python/csrc/torch_ops.cpp registers them; python/csrc/module.cpp calls them through the
// dispatcher).
#ifndef FLASHATTN_TORCH_OPS_H
#define FLASHATTN_TORCH_OPS_H

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <tuple>

namespace flashattn_torch {

using at::Tensor;
using std::optional;
using Tensors3 = std::tuple<Tensor, Tensor, Tensor>;

using FwdSignature = Tensors3(
    const Tensor &q, const Tensor &k, const Tensor &v, const optional<Tensor> &cu_seqlens_q,
    const optional<Tensor> &cu_seqlens_k, const optional<Tensor> &seqused_k,
    const optional<Tensor> &alibi_slopes, const optional<Tensor> &block_mask,
    optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    double softcap, double dropout_p, const optional<Tensor> &rng_state, bool deterministic,
    int64_t algorithm, int64_t block_size_q, int64_t block_size_k, bool bhnd, int64_t shard_q,
    int64_t shard_k, const optional<Tensor> &block_table, int64_t num_splits, int64_t sm_margin);

using BwdSignature = Tensors3(
    const Tensor &dout, const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &out,
    const Tensor &lse, const optional<Tensor> &cu_seqlens_q, const optional<Tensor> &cu_seqlens_k,
    const optional<Tensor> &seqused_k, const optional<Tensor> &alibi_slopes,
    const optional<Tensor> &block_mask, optional<double> softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, double softcap, double dropout_p,
    const optional<Tensor> &rng_state, bool deterministic, int64_t algorithm, int64_t block_size_q,
    int64_t block_size_k, bool bhnd, int64_t shard_q, int64_t shard_k,
    const optional<Tensor> &block_table, int64_t num_splits, int64_t sm_margin);

// flashattn::kvcache (flash_attn_with_kvcache): appends k, v (rotated) to the caches in
// place, then attends q (rotated) to them. Returns (out, lse).
using KvcacheSignature = std::tuple<Tensor, Tensor>(
    const Tensor &q, const Tensor &k_cache, const Tensor &v_cache, const Tensor &cache_seqlens,
    const optional<Tensor> &k, const optional<Tensor> &v, const optional<Tensor> &rotary_cos,
    const optional<Tensor> &rotary_sin, const optional<Tensor> &cache_batch_idx,
    const optional<Tensor> &cache_leftpad, const optional<Tensor> &block_table,
    const optional<Tensor> &alibi_slopes, optional<double> softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, double softcap, bool rotary_interleaved,
    int64_t num_splits, int64_t algorithm);

// The options both operators take after their tensors, in schema order.
struct Options {
  optional<Tensor> cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, block_mask;
  optional<double> softmax_scale;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  double softcap = 0, dropout_p = 0;
  optional<Tensor> rng_state;
  bool deterministic = false;
  int64_t algorithm = 0, block_size_q = 0, block_size_k = 0;
  bool bhnd = false;
  // a shard of one sequence: its queries and keys at these positions (-1: not a shard)
  int64_t shard_q = -1, shard_k = -1;
  // a paged KV cache: k and v are pools of pages (num_pages, page_size, heads_k, headdim)
  optional<Tensor> block_table;
  int64_t num_splits = 0;
  // CUDA: SMs the Hopper kernels leave to other work (a collective's kernels beside them)
  int64_t sm_margin = 0;
  // the KV-cache call: k and v are the caches (their batch may differ from q's)
  bool kvcache = false;
};

// The operators' handles (through the dispatcher: autograd, tracing and dispatch modes
// all apply).
const c10::TypedOperatorHandle<FwdSignature> &fwd_op();
const c10::TypedOperatorHandle<BwdSignature> &bwd_op();
const c10::TypedOperatorHandle<KvcacheSignature> &kvcache_op();

}  // namespace flashattn_torch

#endif
