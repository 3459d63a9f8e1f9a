/* The fixed order in which a key-outer backward's key blocks add their dQ
 * contributions into each query tile, so that the sum is bitwise the same on
 * every run (params.deterministic on the Hopper kernels; docs/ALGORITHM.md,
 * "Deterministic dQ"). Plain C, usable from CUDA; tests/test_extensions.c
 * checks it against brute force and simulates its waits.
 *
 * One (sequence, K/V head) has nblocks key blocks of bc keys and mtiles query
 * tiles of br rows. Key block x visits the query tiles its keys are seen from
 * (fa_dq_block_tiles: the kernel's own query_tiles range), head after head of
 * its group, and at query tile m it waits until fa_dq_turn(x, m) blocks have
 * added theirs. Blocks start in launch order (fa_dq_block_of: a ticket taken
 * as each block starts, not blockIdx, which the hardware may start in any
 * order).
 *  - Banded masks (causal, windows): the tiles a block sees start later the
 *    later its keys, so block x + 1 reaches tile m before block x does. The
 *    order at every tile is descending x, blocks start in descending x, and a
 *    block only ever waits for blocks started before it.
 *  - Full masks: every block visits every tile. Block x starts its walk at
 *    tile x mod mtiles (a rotation), so blocks started together reach a tile
 *    one step apart; the order at a tile is the order of arrival. Blocks start
 *    in ascending x, in waves of `wave` blocks; a block waits for blocks of
 *    earlier waves and for blocks of its own wave, which must therefore be
 *    resident together (the launch sets wave to at most the blocks that fit
 *    on the GPU at once). */
#ifndef FA_COMMON_DQ_ORDER_H
#define FA_COMMON_DQ_ORDER_H

#include "common/mask.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fa_dq_order {
  fa_mask mk;      /* the sequence's mask (nq, nk: its lengths) */
  int nblocks;     /* key blocks: ceil(nk / bc) */
  int mtiles;      /* query tiles: ceil(nq / br) */
  int bc, br;
  int wave;        /* full masks: blocks per wave (> 0); banded: 0 */
} fa_dq_order;

/* Whether the mask (of any sequence: only the window counts) is banded. */
FA_HD int fa_dq_banded(const fa_mask *mk) { return mk->left >= 0 || mk->right >= 0; }

FA_HD fa_dq_order fa_dq_order_make(const fa_mask *mk, int bc, int br, int wave) {
  fa_dq_order o;
  o.mk = *mk;
  o.nblocks = (int)((mk->nk + bc - 1) / bc);
  o.mtiles = (int)((mk->nq + br - 1) / br);
  o.bc = bc;
  o.br = br;
  o.wave = fa_dq_banded(mk) ? 0 : (wave > 0 ? wave : 1);
  return o;
}

/* Key block x's query tiles [*m_begin, *m_begin + *nm): the tiles holding a
 * row that sees one of its keys (none: *nm = 0). */
FA_HD void fa_dq_block_tiles(const fa_mask *mk, int x, int bc, int br, int *m_begin, int *nm) {
  const int64_t c0 = (int64_t)x * bc, cols = mk->nk - c0 < bc ? mk->nk - c0 : bc;
  int64_t rlo, t0, t1, rhi;
  fa_mask_col_range(mk, c0, &rlo, &t0);            /* rows that see the first key */
  fa_mask_col_range(mk, c0 + cols - 1, &t1, &rhi); /* ... and the last one */
  *m_begin = (int)(rlo / br);
  *nm = rhi > rlo ? (int)((rhi + br - 1) / br) - *m_begin : 0;
}

/* The key block of launch position t (0 .. nblocks - 1) of a sequence. */
FA_HD int fa_dq_block_of(int banded, int nblocks, int t) { return banded ? nblocks - 1 - t : t; }

/* Where block x's walk over its nm tiles starts: tile m_begin + rot first. */
FA_HD int fa_dq_rot(const fa_dq_order *o, int x, int nm) {
  return o->wave && nm > 0 ? (x % o->wave) % nm : 0;
}

/* Blocks that add into query tile m before block x (which visits it). */
FA_HD int fa_dq_turn(const fa_dq_order *o, int x, int m) {
  if (!o->wave) {
    /* descending: the blocks after x that still see tile m form [x + 1, last] */
    int lo = x, hi = o->nblocks - 1; /* the last block that sees m is in [lo, hi] */
    while (lo < hi) {
      const int mid = lo + (hi - lo + 1) / 2;
      int mb, nm;
      fa_dq_block_tiles(&o->mk, mid, o->bc, o->br, &mb, &nm);
      if (mb <= m && m < mb + nm)
        lo = mid;
      else
        hi = mid - 1;
    }
    return lo - x;
  }
  /* full mask: all blocks of earlier waves, then this wave's in order of
   * arrival at m (block l of the wave reaches it at step (m - l) mod M; equal
   * steps in ascending l) */
  const int M = o->mtiles, base = x / o->wave * o->wave, l = x - base;
  const int aw = o->nblocks - base < o->wave ? o->nblocks - base : o->wave;
  const int j = ((m - l) % M + M) % M; /* x's step */
  const int q = aw / M, r = aw % M;    /* whole cycles of M blocks, and the rest */
  int before = q * j;                  /* each cycle has one block at every step */
  if (r <= m + 1) { /* the rest reach m at steps m - r + 1 .. m */
    const int c = j - (m - r + 1);
    before += c < 0 ? 0 : (c > r ? r : c);
  } else { /* ... at steps 0 .. m and M - (r - m - 1) .. M - 1 */
    const int w0 = M - (r - m - 1);
    before += (j < m + 1 ? j : m + 1) + (j > w0 ? j - w0 : 0);
  }
  return base + before + l / M; /* ties: the blocks l - M, l - 2M, ... */
}

#ifdef __cplusplus
}
#endif

#endif
