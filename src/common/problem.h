/* The validated problem handed from src/api.c to a backend. Backends trust it:
 * every pointer, size, stride and value here has been checked once, in api.c. */
#ifndef FA_COMMON_PROBLEM_H
#define FA_COMMON_PROBLEM_H

#include <stdint.h>

#include "common/mask.h"
#include "common/philox.h"
#include "flashattn.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fa_problem {
  fa_tensor q, k, v, o;       /* o: forward output, or the forward's O in backward */
  fa_tensor dout, dq, dk, dv; /* backward only */
  float *lse;                 /* forward: written; backward: read (const) */
  float *probs;               /* fa_attention_probs: (seqs, heads_q, probs_rows, probs_cols) */
  int64_t probs_rows, probs_cols;

  fa_dtype dtype;                  /* storage dtype of every tensor */
  int64_t batch;                   /* number of sequences (num_seqs for varlen) */
  int64_t heads_q, heads_k, group; /* group = heads_q / heads_k */
  int64_t headdim;
  int64_t max_seqlen_q, max_seqlen_k; /* per sequence (varlen: the longest) */
  int64_t total_q;                    /* varlen: total query rows; else batch * seqlen_q */
  float scale;                        /* softmax scale (resolved from 0) */
  int varlen;
  int num_threads; /* resolved (>= 1) */

  /* The call's options, resolved from fa_params once (backends read these,
   * never fa_params). */
  fa_device device;
  void *stream; /* CUDA: the cudaStream_t */
  fa_algorithm algorithm;
  int causal, window_enabled;
  int64_t window_left, window_right; /* with window_enabled; < 0: unbounded */
  float softcap;                     /* 0: none */
  const float *alibi_slopes;         /* NULL: none; (s, h) at s * alibi_stride_batch + h */
  int64_t alibi_stride_batch;
  float dropout_p;                            /* 0: none */
  fa_dropout dropout;                         /* its state at a shard's positions */
  const int32_t *cu_seqlens_q, *cu_seqlens_k; /* varlen: the offsets */
  const int32_t *seqused_k;                   /* the caller's seqused_k (k_used below) */
  const uint8_t *block_mask;                  /* NULL: none */
  int64_t block_size_q, block_size_k;
  int64_t block_mask_stride_batch, block_mask_stride_head;
  int64_t block_mask_stride_row; /* resolved (> 0) when block_mask is set */
  int shard_enabled;             /* q_pos, k_pos below place the rows */
  int deterministic;
  int num_splits;
  int sm_margin;        /* CUDA: SMs left to other work (fa_params.sm_margin) */
  int64_t q_pos, k_pos; /* positions of query row 0 and key 0 (a shard's offsets, else 0) */

  /* Which K/V rows each sequence reads (fa_problem_seq). Fixed-length
   * batches: sequence s reads rows [k_start[s], k_start[s] + nk) of batch
   * entry k_batch[s] (NULL: 0 and s) of k/v, nk = k_used[s] + k_used_add -
   * k_start[s] (k_used NULL: k_cap - k_start[s]); varlen: its cu_seqlens_k
   * span (k_used when given). Paged (page_size > 0): the rows are those of
   * row s of block_table (fa_problem_krow). On the CPU every value has been
   * checked; on CUDA kernels clamp them (device memory). */
  const int32_t *k_used;  /* seqused_k, or the KV-cache call's cache_seqlens */
  int64_t k_used_add;     /* the KV-cache call's seqlen_new */
  const int32_t *k_start; /* cache_leftpad */
  const int32_t *k_batch; /* cache_batch_idx */
  int64_t k_cap;          /* rows of one sequence's K/V: k's seqlen, or pages x page_size */
  const int32_t *block_table;
  int64_t block_table_stride;
  int64_t page_size; /* 0: not paged */

  /* The KV-cache call (fa_forward_kvcache) when kv is set: q above is then
   * the rotated copy (in the workspace) when rotary, q_in the caller's. */
  const struct fa_kvcache *kv;
  fa_tensor q_in, k_new, v_new; /* k_new.data NULL: nothing appended */
  int rotary_all_rows;          /* rotary positions cache_seqlens + i (else cache_seqlens) */

  void *workspace; /* at least the backend's reported size */
  size_t workspace_bytes;
} fa_problem;

/* One sequence of the batch: where its rows start and how many there are.
 * Row r of query sequence s is tensor index (qb, q0 + r); likewise for keys. */
typedef struct fa_seq {
  int64_t qb, q0, nq;   /* batch index, first row, row count in q/o/dout/dq */
  int64_t kb, k0, nk;   /* in k/v/dk/dv (paged: kb unused, k0 0; fa_problem_krow) */
  const int32_t *pages; /* paged: the sequence's row of the block table, else NULL */
  int64_t kpack0;       /* index of key 0 in the sequence-after-sequence order of every key */
  int64_t lse0;         /* lse index of (this sequence, head 0, row 0) */
  int64_t lse_head_stride;
} fa_seq;

static inline fa_seq fa_problem_seq(const fa_problem *pb, int64_t s) {
  fa_seq r;
  r.pages = pb->page_size ? pb->block_table + s * pb->block_table_stride : NULL;
  if (pb->varlen) {
    const int32_t *cq = pb->cu_seqlens_q, *ck = pb->cu_seqlens_k;
    r.qb = 0;
    r.q0 = cq[s];
    r.nq = cq[s + 1] - cq[s];
    r.kb = 0;
    r.k0 = pb->page_size ? 0 : ck[s];
    r.nk = ck[s + 1] - ck[s];
    r.kpack0 = ck[s];
    r.lse0 = cq[s];
    r.lse_head_stride = pb->total_q;
  } else {
    r.qb = s;
    r.q0 = 0;
    r.nq = pb->q.seqlen;
    r.kb = pb->k_batch ? pb->k_batch[s] : s;
    r.k0 = pb->k_start ? pb->k_start[s] : 0;
    r.nk = pb->k_cap - r.k0;
    r.kpack0 = s * pb->k_cap;
    r.lse0 = s * pb->heads_q * pb->q.seqlen;
    r.lse_head_stride = pb->q.seqlen;
  }
  /* a KV cache's used keys (api.c checked them against the rows there are) */
  if (pb->k_used) r.nk = pb->k_used[s] + pb->k_used_add - (pb->k_start ? pb->k_start[s] : 0);
  return r;
}

/* The causal / sliding-window mask of one sequence, at a shard's positions. */
static inline fa_mask fa_problem_mask(const fa_problem *pb, const fa_seq *sq) {
  fa_mask m = fa_mask_make(sq->nq, sq->nk, pb->causal, pb->window_enabled, pb->window_left,
                           pb->window_right);
  if (pb->shard_enabled) fa_mask_shard(&m, pb->q_pos, pb->k_pos);
  return m;
}

/* Keys in the sequence-after-sequence order of fa_seq.kpack0. */
static inline int64_t fa_problem_kpack_rows(const fa_problem *pb) {
  return pb->varlen ? pb->cu_seqlens_k[pb->batch] : pb->batch * pb->k_cap;
}

/* Where key j of sequence sq lives in k/v: batch index *b and row *n; returns
 * how many keys from j on are rows n, n + 1, ... of that batch entry (to the
 * end of its page; unbounded when not paged). */
static inline int64_t fa_problem_krow(const fa_problem *pb, const fa_seq *sq, int64_t j, int64_t *b,
                                      int64_t *n) {
  const int64_t r = sq->k0 + j;
  if (!sq->pages) {
    *b = sq->kb;
    *n = r;
    return INT64_MAX / 4;
  }
  const int64_t P = pb->page_size;
  *b = sq->pages[r / P];
  *n = r % P;
  return P - *n;
}

/* Block-mask bytes for query row i (counted from the sequence's start) of
 * sequence s, query head h: key j is allowed iff row[j / block_size_k] != 0.
 * NULL when there is no block mask. */
static inline const uint8_t *fa_problem_block_row(const fa_problem *pb, int64_t s, int64_t h,
                                                  int64_t i) {
  if (!pb->block_mask) return NULL;
  return pb->block_mask + s * pb->block_mask_stride_batch + h * pb->block_mask_stride_head +
         (i / pb->block_size_q) * pb->block_mask_stride_row;
}

/* Element offset of (batch b, row n, head h) in a tensor. */
static inline int64_t fa_tensor_offset(const fa_tensor *t, int64_t b, int64_t n, int64_t h) {
  return b * t->stride_batch + n * t->stride_seq + h * t->stride_head;
}

#ifdef __cplusplus
}
#endif

#endif
