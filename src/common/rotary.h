/* Rotary position embedding (RoPE) as flash-attn applies it in its KV-cache
 * call (plain C, usable from CUDA): the first rotary_dim columns of a head
 * row form rotary_dim / 2 pairs, each rotated by the angle of its position:
 * (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos). Pair c is columns (2c,
 * 2c + 1) when interleaved (GPT-J), else (c, c + rotary_dim / 2) (GPT-NeoX);
 * cos and sin are entry c of the tables' row of the position. */
#ifndef FA_COMMON_ROTARY_H
#define FA_COMMON_ROTARY_H

#include <stdint.h>

#ifdef __CUDACC__
#define FA_RHD __host__ __device__ __forceinline__
#else
#define FA_RHD static inline
#endif

/* The columns of pair c of a row rotated over rotary_dim columns. */
FA_RHD void fa_rotary_cols(int64_t c, int64_t rotary_dim, int interleaved, int64_t *c1,
                           int64_t *c2) {
  *c1 = interleaved ? 2 * c : c;
  *c2 = interleaved ? 2 * c + 1 : c + rotary_dim / 2;
}

/* Position of query row i of a batch entry whose cache holds cache_seqlen
 * rows: its own (cache_seqlen + i) under a causal mask or a bounded window,
 * else cache_seqlen for every row (flash-attn's rule: without a mask the
 * queries are taken to be one token). */
FA_RHD int64_t fa_rotary_qpos(int64_t cache_seqlen, int64_t i, int all_rows) {
  return cache_seqlen + (all_rows ? i : 0);
}

#endif
