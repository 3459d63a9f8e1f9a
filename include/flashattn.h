/* flashattn: exact attention softmax(scale * Q K^T) V computed tile by tile.
 *
 * The one public header. C11, usable from C++. Every entry point returns a
 * status; fa_last_error() gives a human-readable message for the last failure
 * on the calling thread. The library never aborts, prints or exits on bad input.
 */
#ifndef FLASHATTN_H
#define FLASHATTN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FA_VERSION_MAJOR 0
#define FA_VERSION_MINOR 1
#define FA_VERSION_PATCH 0

/* Largest head dimension any backend supports. */
#define FA_MAX_HEADDIM 256

typedef enum fa_status {
  FA_OK = 0,
  FA_ERR_INVALID_ARGUMENT = 1, /* a null pointer, a bad size, stride or value */
  FA_ERR_UNSUPPORTED = 2,      /* valid, but not available here (device, dtype, feature) */
  FA_ERR_OUT_OF_MEMORY = 3,    /* the library could not allocate its workspace */
  FA_ERR_DEVICE = 4,           /* the device runtime reported an error */
  FA_ERR_INTERNAL = 5
} fa_status;

typedef enum fa_dtype {
  FA_DTYPE_F32 = 0,
  FA_DTYPE_F16 = 1,
  FA_DTYPE_BF16 = 2,
  FA_DTYPE_F64 = 3 /* CPU standard algorithm only: the float64 oracle */
} fa_dtype;

typedef enum fa_device {
  FA_DEVICE_CPU = 0,
  FA_DEVICE_CUDA = 1
} fa_device;

typedef enum fa_algorithm {
  FA_ALGO_FLASH2 = 0,   /* queries outer, keys inner (FlashAttention-2): the default */
  FA_ALGO_FLASH1 = 1,   /* keys outer, queries inner, O/l/m rescaled in memory (Algorithm 1) */
  FA_ALGO_STANDARD = 2  /* Algorithm 0: S and P of the whole batch materialised, each step
                           one pass over the batch (the papers' baseline; the workspace holds
                           them: B*H*Nq*Nk floats each); in float64 the oracle */
} fa_algorithm;

/* A 4-D tensor (batch, seqlen, heads, headdim) described by element strides.
 * headdim is contiguous. (B,N,H,D) and (B,H,N,D) layouts are both just strides.
 * For variable-length batches (fa_params.cu_seqlens_q set) batch must be 1 and
 * seqlen is the total number of tokens of all sequences.
 * On CUDA the flash kernels move rows in 16-byte chunks. A tensor whose rows
 * do not all start on 16-byte boundaries (a head dim that is not a multiple
 * of 8 with rows back to back, an odd stride, a pointer into a row) goes
 * through a padded copy in the workspace; aligned tensors are used in place.
 * With a head dim that is not a multiple of 8, an aligned tensor's last chunk
 * runs past its last element: the memory up to the next 16-byte boundary
 * must be readable (cudaMalloc's and PyTorch's allocations are); those bytes
 * are never used. */
typedef struct fa_tensor {
  void *data;
  fa_dtype dtype;
  int64_t batch, seqlen, heads, headdim;
  int64_t stride_batch, stride_seq, stride_head; /* in elements */
} fa_tensor;

/* The attention variant. A zero-initialised struct means plain
 * softmax(Q K^T / sqrt(D)) V on the CPU with FlashAttention-2. */
typedef struct fa_params {
  fa_device device;
  fa_algorithm algorithm;
  float softmax_scale; /* 0: 1/sqrt(headdim) */

  /* Causal mask, aligned to the bottom-right corner when Nq != Nk: query row i
   * sees key j iff j <= i + Nk - Nq (flash-attn >= 2.1 convention). */
  int causal;

  /* Sliding window (when window_enabled): query row i sees key j iff
   * i + Nk - Nq - window_left <= j <= i + Nk - Nq + window_right.
   * A negative bound means unlimited on that side. */
  int window_enabled;
  int64_t window_left, window_right;

  /* Shards of one sequence (context parallelism): when shard_enabled, q holds
   * the query rows at positions [shard_q_offset, shard_q_offset + Nq) of one
   * self-attention sequence and k, v its keys at [shard_k_offset,
   * shard_k_offset + Nk). Masks, ALiBi and dropout then use positions: with
   * I = shard_q_offset + i and J = shard_k_offset + j, row i sees key j iff
   * I - window_left <= J <= I + window_right (causal: J <= I), ALiBi adds
   * -slope * |I - J| and dropout draws element (I, J) (docs/DROPOUT.md). So
   * the blocks of a sharded sequence, merged by their lse, give the whole
   * sequence's attention (ring attention: fa_ring_forward). Offsets >= 0 and
   * offset + seqlen <= 2^31 - 1; shard_k_offset a multiple of 4 with dropout
   * (one Philox call draws four neighbouring keys). Not with cu_seqlens,
   * seqused_k or block_mask. */
  int shard_enabled;
  int64_t shard_q_offset, shard_k_offset;

  /* Logit soft-capping: s = softcap * tanh(s / softcap), applied to the scaled
   * score before masks and ALiBi. 0 disables. */
  float softcap;

  /* ALiBi: score += -slope[h] * |i + Nk - Nq - j|. Slopes are float32 in the
   * device's memory; element (b, h) at alibi_slopes[b * alibi_stride_batch + h]
   * (stride 0: one set of slopes for every batch). NULL disables. */
  const float *alibi_slopes;
  int64_t alibi_stride_batch;

  /* Variable-length batches: when cu_seqlens_q is non-NULL, num_seqs sequences
   * are packed along seqlen; sequence s owns query rows [cu_seqlens_q[s],
   * cu_seqlens_q[s+1]) and key rows [cu_seqlens_k[s], cu_seqlens_k[s+1]).
   * Both arrays hold num_seqs + 1 non-decreasing int32 values starting at 0,
   * in the device's memory. The LSE layout becomes (heads, total_q).
   * cu_seqlens_q[num_seqs] may be less than q's seqlen (padded buffers): rows
   * past the last sequence are not read, and their O, lse, dQ (and, for K/V,
   * dK, dV) rows are left as they were. */
  const int32_t *cu_seqlens_q;
  const int32_t *cu_seqlens_k;
  int64_t num_seqs;

  /* KV cache: when seqused_k is non-NULL, sequence s (batch entry s, or
   * varlen sequence s) attends to only the first seqused_k[s] of its keys,
   * 0 <= seqused_k[s] <= its key count (k's seqlen, or its cu_seqlens_k
   * span). Keys past it are never read (they may hold anything, NaN
   * included), their dK, dV rows are left as they were, and the masks and
   * ALiBi take seqused_k[s] as the sequence's Nk (a causal mask stays aligned
   * to the last used key). int32, one per sequence, in the device's memory
   * (on CUDA, where the host does not read it, values outside the range are
   * clamped to it). */
  const int32_t *seqused_k;

  /* Dropout on the attention probabilities: each element of P is kept with
   * probability 1 - dropout_p (and scaled by 1 / (1 - dropout_p)) by a
   * Philox4x32-10 draw indexed by (sequence, query head, row, column),
   * dropout_seed and dropout_offset (docs/DROPOUT.md): the backward pass
   * regenerates the same mask, and so does every backend. 0 <= p < 1.
   * Advance dropout_offset (or change the seed) for a fresh mask. */
  float dropout_p;
  uint64_t dropout_seed, dropout_offset;

  /* Block-sparse attention: when block_mask is non-NULL, key j is visible to
   * query row i of sequence s, query head h only if
   *   block_mask[s * block_mask_stride_batch + h * block_mask_stride_head
   *              + (i / block_size_q) * block_mask_stride_row + j / block_size_k] != 0
   * (rows and keys counted from the sequence's start), besides the other masks.
   * Stride 0 broadcasts; stride_row 0 means ceil(k's seqlen / block_size_k),
   * k's seqlen being the tensor's (for variable-length batches: the total).
   * Bytes, in the device's memory. fa_block_mask_from_indices converts the
   * compressed form (count and key-block indices per query block). */
  const uint8_t *block_mask;
  int64_t block_size_q, block_size_k;
  int64_t block_mask_stride_batch, block_mask_stride_head, block_mask_stride_row;

  /* Bitwise-reproducible gradients where a backend would otherwise use atomics. */
  int deterministic;

  /* CPU: worker threads (0: all available cores). */
  int num_threads;

  /* CUDA: the cudaStream_t to run on (NULL: the legacy default stream). */
  void *stream;

  /* Scratch memory the call may use, of at least the size fa_workspace_size()
   * reports, 64-byte aligned, in the device's memory. NULL: the library
   * allocates it itself (and frees it before returning; on CUDA,
   * stream-ordered). */
  void *workspace;
  size_t workspace_bytes;

  /* Paged KV cache (flash-attn's and vLLM's block_table; forward only): when
   * block_table is non-NULL, k and v are pools of pages, each tensor's batch
   * the number of pages and its seqlen the page size (so (num_pages,
   * page_size, heads_k, D) in flash-attn's layout; any strides), and sequence
   * s reads its keys through row s of the table: its key j is row
   * j % page_size of page
   *   block_table[s * block_table_stride + j / page_size].
   * int32, one row of max_pages_per_seq entries per sequence (block_table_stride
   * 0: max_pages_per_seq), in the device's memory. A sequence holds at most
   * max_pages_per_seq * page_size keys: all of them in a fixed-length batch
   * (q's batch is the number of sequences; k's is not), cu_seqlens_k's span
   * in a varlen batch (whose offsets then count keys only, not rows of k), or
   * seqused_k[s] of them when seqused_k is given. Only the entries of pages
   * that hold keys read are used, and each must be in [0, num_pages) (on
   * CUDA, where the host does not read the table, others are clamped into
   * it); pages may come in any order and be shared between sequences. Any
   * page size on the CPU and on CUDA (the Hopper kernels take multiples of
   * 8; others run on the sm_80 kernels). fa_backward refuses it
   * (FA_ERR_UNSUPPORTED), as flash-attn's paged path is inference-only, and so
   * does CUDA with dropout, a block mask or FA_ALGO_STANDARD. */
  const int32_t *block_table;
  int64_t block_table_stride;
  int64_t max_pages_per_seq;

  /* CUDA forward: into how many ranges each sequence's keys are split, the
   * ranges' results combined afterwards (flash-attn's num_splits; faster for
   * decode shapes and prefill chunks over few sequences, which leave most of
   * the GPU idle otherwise): 0 lets the
   * library choose, 1 never splits, n in [2, 128] splits into n (at most one
   * per key tile). Any value gives the same result up to rounding. The CPU
   * ignores it (its results do not depend on how its work is split). */
  int num_splits;

  /* CUDA: streaming multiprocessors the call leaves to other work on the
   * device (flash-attn 3's sm_margin). The Hopper kernels keep one CTA per SM
   * for the whole call, so a kernel queued beside them on another stream (a
   * collective's, say: ring attention's K/V transfers) would otherwise wait
   * for the call to end; with a margin it runs beside it, on those SMs. The
   * call then launches that many fewer CTAs (at least one), which costs about
   * sm_margin / SMs of its speed. 0 takes every SM. In [0, 1024]; the CPU and
   * the other CUDA kernels ignore it. */
  int sm_margin;
} fa_params;

typedef enum fa_pass {
  FA_PASS_FORWARD = 0,
  FA_PASS_BACKWARD = 1,
  FA_PASS_PROBS = 2 /* fa_attention_probs */
} fa_pass;

/* Forward: O = softmax(scale * Q K^T + masks) V and the float32 log-sum-exp
 * lse (natural log) of every query row, laid out (batch, heads_q, seqlen_q)
 * contiguous, or (heads_q, total_q) for variable-length batches.
 * K and V have heads_k heads, heads_q a multiple of heads_k (GQA/MQA).
 * Fully masked rows give O = 0 and lse = -inf. lse may be NULL. */
fa_status fa_forward(const fa_params *params, const fa_tensor *q, const fa_tensor *k,
                     const fa_tensor *v, fa_tensor *o, float *lse);

/* Backward: from Q, K, V, O, dO and the forward's lse, writes dQ, dK, dV
 * (dK and dV summed over the query heads that share a K/V head). */
fa_status fa_backward(const fa_params *params, const fa_tensor *q, const fa_tensor *k,
                      const fa_tensor *v, const fa_tensor *o, const fa_tensor *dout,
                      const float *lse, fa_tensor *dq, fa_tensor *dk, fa_tensor *dv);

/* Bytes of scratch memory fa_forward (pass FORWARD), fa_backward (pass
 * BACKWARD) or fa_attention_probs (pass PROBS; v is not used) needs for these
 * arguments. Shapes, dtypes and params are validated as for the call; data
 * pointers are not read and may be NULL. The forward's size includes the
 * float32 lse scratch (4 * heads_q * total_q bytes) it uses when called with
 * lse == NULL. On CUDA it includes padded copies of the tensors whose rows do
 * not start on 16-byte boundaries (see fa_tensor); of the tensors this call
 * does not see (o, and the backward's dout, dq, dk, dv) it assumes rows back
 * to back at 16-byte aligned addresses, as a fresh allocation has them: for
 * outputs laid out otherwise (a head dim that is a multiple of 8 with odd
 * strides or pointers), pass a larger workspace or none. */
fa_status fa_workspace_size(fa_pass pass, const fa_params *params, const fa_tensor *q,
                            const fa_tensor *k, const fa_tensor *v, size_t *bytes);

/* Attention probabilities, for tests and debugging (slow: every Nq x Nk
 * matrix is materialised; meant for small shapes). For each sequence s and
 * query head h, P = softmax(scale * Q K^T + masks) with every variant params
 * sets (causal, window, softcap, ALiBi, block mask, varlen, seqused_k, GQA):
 *   probs[((s * heads_q + h) * rows + i) * cols + j] = P[i][j]   (float32)
 * with rows and keys counted from the sequence's start; entries past its
 * query rows or keys are 0. With dropout (params.dropout_p > 0) the pattern
 * is encoded as flash-attn's return_attn_probs encodes it: a dropped element
 * holds -P[i][j] (sign bit set, -0.0 where P[i][j] is 0), a kept one P[i][j]
 * (not rescaled by 1 / (1 - p)); the decisions are fa_dropout_mask's. rows
 * and cols must cover every sequence's query rows and (used) keys. probs is
 * in the device's memory. CUDA: standard attention through cuBLAS, f16 and
 * bf16; with varlen or seqused_k the call synchronises the stream (their
 * offsets are read on the host). Workspace: fa_workspace_size(FA_PASS_PROBS). */
fa_status fa_attention_probs(const fa_params *params, const fa_tensor *q, const fa_tensor *k,
                             int64_t rows, int64_t cols, float *probs);
/* The KV-cache call's inputs beyond fa_forward's (flash-attn's
 * flash_attn_with_kvcache). Batch entry b (of q's batch B) attends to its
 * cache's rows [leftpad_b, cache_seqlens[b] + seqlen_new) (leftpad_b =
 * cache_leftpad[b], or 0), after the new keys and values, when given, were
 * written into that cache at rows cache_seqlens[b] .. cache_seqlens[b] +
 * seqlen_new - 1. Its cache is row cache_batch_idx[b] (or b) of k_cache and
 * v_cache, or, with params.block_table, the pages of row b of the table.
 * The masks, ALiBi and seqlen_k of the attention are those of the rows
 * attended to: nk_b = cache_seqlens[b] + seqlen_new - leftpad_b keys. */
typedef struct fa_kvcache {
  /* Rows already in each batch entry's cache: int32, B of them, in the
   * device's memory; leftpad_b <= cache_seqlens[b] and cache_seqlens[b] +
   * seqlen_new <= the cache's rows (k_cache's seqlen, or max_pages_per_seq *
   * page_size when paged). Not updated by the call. */
  const int32_t *cache_seqlens;
  /* New keys and values, (B, seqlen_new, heads_k, D) in q's dtype, or both
   * NULL (nothing appended). Written in place into k_cache and v_cache (the
   * keys rotated first when rotary_cos is given). */
  const fa_tensor *k_new, *v_new;
  /* Which row of k_cache / v_cache each batch entry uses: int32, B values in
   * [0, k_cache's batch), device memory; NULL: entry b uses row b. Entries
   * that share a row and append to it write in an unspecified order. Not
   * with a block_table. */
  const int32_t *cache_batch_idx;
  /* First cache row each batch entry attends to (left padding): int32, B
   * values, device memory; NULL: 0. Not with a block_table. */
  const int32_t *cache_leftpad;
  /* Rotary embedding (RoPE), flash-attn's: NULL for none, else tables of
   * rotary_seqlen positions x rotary_dim / 2 values in q's dtype, in the
   * device's memory, position p's row at p * rotary_stride (0: rotary_dim /
   * 2). Applied to the first rotary_dim (even, <= D) columns of every head:
   * of the new keys, key i at position cache_seqlens[b] + i (k_new must be
   * given), and of q, query row i at position cache_seqlens[b] + i under a
   * causal mask or a window with a bound >= 0, else every row at
   * cache_seqlens[b]. Pairs (x1, x2) become (x1 cos - x2 sin, x1 sin +
   * x2 cos) with cos, sin = cos[p][c], sin[p][c] of pair c: pairs of
   * adjacent columns (2c, 2c + 1) when rotary_interleaved (GPT-J), else of
   * columns (c, c + rotary_dim / 2) (GPT-NeoX). The positions used must be
   * < rotary_seqlen: it is at least the cache's rows, and covers the query
   * rows' positions when they exceed them (more query rows than new keys; on
   * CUDA, where the host does not read cache_seqlens, such positions are
   * clamped to the table's last row). */
  const void *rotary_cos, *rotary_sin;
  int64_t rotary_seqlen, rotary_dim, rotary_stride;
  int rotary_interleaved;
} fa_kvcache;

/* flash-attn's flash_attn_with_kvcache: appends kv->k_new and kv->v_new (when
 * given, rotated) to each batch entry's cache in place, then writes O and lse
 * (as fa_forward: (B, heads_q, seqlen_q), may be NULL) of attention of q
 * (rotated when kv->rotary_cos is given; q itself is not written) over the
 * cache rows of fa_kvcache's comment, with params' scale, causal mask,
 * window, softcap, ALiBi, block_table (paged caches) and num_splits.
 * k_cache and v_cache are (batch, rows, heads_k, D), or page pools with a
 * block_table; q is (B, seqlen_q, heads_q, D). params must not set
 * cu_seqlens, seqused_k (cache_seqlens is its place) or dropout. On CUDA the
 * new rows are written and read in the call's stream order, like the rest
 * of it; there the call takes the flash algorithms (FA_ALGO_STANDARD:
 * FA_ERR_UNSUPPORTED). */
fa_status fa_forward_kvcache(const fa_params *params, const fa_kvcache *kv, const fa_tensor *q,
                             fa_tensor *k_cache, fa_tensor *v_cache, fa_tensor *o, float *lse);

/* Bytes of scratch memory fa_forward_kvcache needs for these arguments
 * (data pointers are not read), as fa_workspace_size for fa_forward. */
fa_status fa_kvcache_workspace_size(const fa_params *params, const fa_kvcache *kv,
                                    const fa_tensor *q, const fa_tensor *k_cache,
                                    const fa_tensor *v_cache, size_t *bytes);

/* The keep (1) / drop (0) decisions of dropout (params.dropout_p, seed,
 * offset) for the attention matrix of sequence `seq`, query head `head` (of
 * heads_q), rows [0, nq) and keys [0, nk) counted from the sequence's start,
 * row-major into mask (nq * nk bytes, host memory). Every backend draws
 * exactly these: tests and return_attn_probs-style debugging use them. */
fa_status fa_dropout_mask(const fa_params *params, int64_t heads_q, int64_t seq, int64_t head,
                          int64_t nq, int64_t nk, uint8_t *mask);

/* Block masks, compressed <-> dense (host memory). The compressed form is
 * FlexAttention's: for each of `rows` query blocks (batches, heads and query
 * blocks flattened), counts[r] key-block indices in indices[r * max_blocks ...].
 * The dense form is rows x key_blocks bytes, 1 where visible. to_indices
 * writes max_blocks = key_blocks indices per row, ascending. */
fa_status fa_block_mask_from_indices(const int32_t *counts, const int32_t *indices, int64_t rows,
                                     int64_t max_blocks, int64_t key_blocks, uint8_t *mask);
fa_status fa_block_mask_to_indices(const uint8_t *mask, int64_t rows, int64_t key_blocks,
                                   int32_t *counts, int32_t *indices);

/* ---- Context parallelism: ring attention ------------------------------------
 * W ranks (processes, GPUs) each hold a shard of one self-attention sequence:
 * q, k, v of seqlen n (every rank the same n and shapes), placed by the
 * layout. K/V shards travel around the ring while each rank attends its
 * queries to the block it holds (fa_params.shard_enabled, at the block's
 * positions) and merges the partial results by their lse; the backward pass
 * sends the dK/dV sums around behind their block. The result equals
 * fa_forward / fa_backward of the whole sequence, restricted to this rank's
 * rows: masks, ALiBi and dropout are the whole sequence's, fully masked
 * blocks are skipped. The transport is the caller's (fa_ring's callbacks:
 * NCCL through include/flashattn_nccl.h, MPI, shared memory, ...). */

typedef enum fa_ring_layout {
  FA_RING_ZIGZAG = 0,    /* 2W chunks of n/2: rank r holds chunks r and 2W-1-r (causal balance) */
  FA_RING_CONTIGUOUS = 1 /* rank r holds positions [r n, (r+1) n) */
} fa_ring_layout;

/* One rank's view of the ring. Every rank calls fa_ring_forward (or
 * fa_ring_backward) together, and the calls issue the same sequence of
 * exchanges on every rank. */
typedef struct fa_ring {
  int rank, size; /* 0 <= rank < size */
  fa_ring_layout layout;
  void *ctx; /* handed to the callbacks */
  /* Starts sending `bytes` bytes at send to rank send_to and receiving as
   * many from rank recv_from into recv (device memory on CUDA), and may
   * return before they arrive. On CUDA the transfer must follow the work
   * queued on stream so far (which wrote send). send is not modified and
   * recv not read until wait returns. */
  fa_status (*exchange)(void *ctx, const void *send, int send_to, void *recv, int recv_from,
                        size_t bytes, void *stream);
  /* Completes every exchange started: on the CPU it returns once they are
   * done; on CUDA, work queued on stream afterwards runs after them. */
  fa_status (*wait)(void *ctx, void *stream);
} fa_ring;

/* This rank's forward: o and lse (laid out as fa_forward's) of its rows.
 * params as for fa_forward (shard_enabled, cu_seqlens, seqused_k and
 * block_mask not taken; dropout needs n/2 (zigzag) or n (contiguous) a
 * multiple of 4). params.sm_margin applies to the blocks computed while a
 * transfer is in flight, the others take every SM: on Hopper GPUs, give the
 * transport's kernels room (docs/API.md). */
fa_status fa_ring_forward(const fa_params *params, const fa_ring *ring, const fa_tensor *q,
                          const fa_tensor *k, const fa_tensor *v, fa_tensor *o, float *lse);

/* This rank's backward: dq of its rows, dk and dv of its keys (summed over
 * every rank's queries), from the forward's o and lse. */
fa_status fa_ring_backward(const fa_params *params, const fa_ring *ring, const fa_tensor *q,
                           const fa_tensor *k, const fa_tensor *v, const fa_tensor *o,
                           const fa_tensor *dout, const float *lse, fa_tensor *dq, fa_tensor *dk,
                           fa_tensor *dv);

/* Scratch bytes fa_ring_forward / fa_ring_backward need (params.workspace,
 * or the call allocates them): O(n) for this rank's shard, the K/V blocks in
 * flight and float32 accumulators included. */
fa_status fa_ring_workspace_size(fa_pass pass, const fa_params *params, const fa_ring *ring,
                                 const fa_tensor *q, const fa_tensor *k, const fa_tensor *v,
                                 size_t *bytes);

/* 1 if this build and machine can run on the device, else 0. */
int fa_device_available(fa_device device);

/* Message for the last failing call on this thread ("" if none). */
const char *fa_last_error(void);
const char *fa_status_string(fa_status status);
const char *fa_version(void); /* "MAJOR.MINOR.PATCH" */

/* Convenience: a contiguous (B, N, H, D) tensor descriptor. */
fa_tensor fa_tensor_bnhd(void *data, fa_dtype dtype, int64_t batch, int64_t seqlen,
                         int64_t heads, int64_t headdim);
/* Convenience: a contiguous (B, H, N, D) tensor descriptor (PyTorch SDPA layout). */
fa_tensor fa_tensor_bhnd(void *data, fa_dtype dtype, int64_t batch, int64_t seqlen,
                         int64_t heads, int64_t headdim);

size_t fa_dtype_size(fa_dtype dtype);

#ifdef __cplusplus
}
#endif

#endif /* FLASHATTN_H */
