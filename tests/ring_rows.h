/* Shared by the ring attention tests (tests/test_ring.c on CPU threads,
 * tests/cuda/test_ring_nccl.c on GPUs): where a rank's rows sit in the whole
 * sequence, and copying them between a rank's shard and the whole arrays. */
#ifndef FA_TESTS_RING_ROWS_H
#define FA_TESTS_RING_ROWS_H

#include <stdint.h>
#include <string.h>

#include "flashattn.h"

/* Positions of the n rows of rank's shard (W ranks, layout). */
static inline void ring_positions(fa_ring_layout layout, int W, int n, int rank, int64_t *pos) {
  const int h = n / 2;
  for (int i = 0; i < n; i++)
    pos[i] = layout == FA_RING_CONTIGUOUS ? (int64_t)rank * n + i
             : i < h                      ? (int64_t)rank * h + i
                                          : (int64_t)(2 * W - 1 - rank) * h + (i - h);
}

/* Rows pos[] of a whole (B, N, row) array <-> a shard's (B, n, row) one. */
static inline void ring_rows(void *shard, void *whole, const int64_t *pos, int B, int n, int N,
                             size_t row_bytes, int to_shard) {
  for (int b = 0; b < B; b++)
    for (int i = 0; i < n; i++) {
      char *s = (char *)shard + ((size_t)b * n + i) * row_bytes;
      char *w = (char *)whole + ((size_t)b * N + pos[i]) * row_bytes;
      memcpy(to_shard ? s : w, to_shard ? w : s, row_bytes);
    }
}

/* fa_ring_forward, then fa_ring_backward, on (B, n, heads, D) contiguous
 * tensors at ptr: q, k, v, o, dout, dq, dk, dv (k, v, dk, dv with Hk heads). */
static inline fa_status ring_run(const fa_params *p, const fa_ring *ring, void *const ptr[8],
                                 float *lse, fa_dtype dt, int B, int n, int H, int Hk, int D) {
  fa_tensor t[8];
  for (int i = 0; i < 8; i++) {
    const int kv = i == 1 || i == 2 || i == 6 || i == 7;
    t[i] = fa_tensor_bnhd(ptr[i], dt, B, n, kv ? Hk : H, D);
  }
  fa_status st = fa_ring_forward(p, ring, &t[0], &t[1], &t[2], &t[3], lse);
  if (st == FA_OK)
    st = fa_ring_backward(p, ring, &t[0], &t[1], &t[2], &t[3], &t[4], lse, &t[5], &t[6], &t[7]);
  return st;
}

#endif
