/* Dropout's random bits: Philox4x32-10 (Salmon et al., SC'11), a counter-based
 * generator, so any backend regenerates the keep/drop decision of any element
 * from its position alone, in any tile order, forward and backward alike.
 * The indexing is specified in docs/DROPOUT.md; plain C, usable from CUDA. */
#ifndef FA_COMMON_PHILOX_H
#define FA_COMMON_PHILOX_H

#include <stdint.h>

#include "common/mask.h" /* FA_HD */

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fa_u32x4 {
  uint32_t v[4];
} fa_u32x4;

FA_HD fa_u32x4 fa_philox4x32_10(fa_u32x4 ctr, uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; r++) {
    if (r) {
      k0 += 0x9E3779B9u; /* Weyl key schedule */
      k1 += 0xBB67AE85u;
    }
    uint64_t p0 = (uint64_t)0xD2511F53u * ctr.v[0], p1 = (uint64_t)0xCD9E8D57u * ctr.v[2];
    fa_u32x4 n;
    n.v[0] = (uint32_t)(p1 >> 32) ^ ctr.v[1] ^ k0;
    n.v[1] = (uint32_t)p1;
    n.v[2] = (uint32_t)(p0 >> 32) ^ ctr.v[3] ^ k1;
    n.v[3] = (uint32_t)p0;
    ctr = n;
  }
  return ctr;
}

/* Dropout of one call: seed, offset and the 32-bit threshold below which a
 * random word drops its element (keep probability 1 - threshold / 2^32). */
typedef struct fa_dropout {
  uint32_t k0, k1, offset_lo, threshold;
  float keep_scale;    /* 1 / (1 - p), applied to kept probabilities */
  uint32_t row0, col4; /* a shard's first row and first key / 4 (fa_dropout_at) */
} fa_dropout;

FA_HD fa_dropout fa_dropout_make(float p, uint64_t seed, uint64_t offset) {
  fa_dropout d;
  d.k0 = (uint32_t)seed;
  d.k1 = (uint32_t)(seed >> 32) ^ (uint32_t)(offset >> 32);
  d.offset_lo = (uint32_t)offset;
  double t = (double)p * 4294967296.0;
  d.threshold = t >= 4294967295.0 ? 0xFFFFFFFFu : (uint32_t)t;
  d.keep_scale = p > 0 ? 1.0f / (1.0f - p) : 1.0f;
  d.row0 = d.col4 = 0;
  return d;
}

/* Rows and keys of this call sit at positions row0 + i and col0 + j of the
 * sequence (fa_params.shard_enabled; col0 a multiple of 4). */
FA_HD void fa_dropout_at(fa_dropout *d, int64_t row0, int64_t col0) {
  d->row0 = (uint32_t)row0;
  d->col4 = (uint32_t)(col0 >> 2);
}

/* Random words of columns 4*(j/4) .. 4*(j/4)+3 of row i of attention matrix
 * `bh` (sequence index * heads_q + query head); rows and columns count from
 * the sequence's start (a shard's from its positions, d->row0 and 4 d->col4).
 * One call serves four neighbouring columns. */
FA_HD fa_u32x4 fa_dropout_bits(const fa_dropout *d, uint64_t bh, int64_t i, int64_t j) {
  fa_u32x4 c;
  c.v[0] = (uint32_t)((uint64_t)j >> 2) + d->col4;
  c.v[1] = (uint32_t)i + d->row0;
  c.v[2] = (uint32_t)bh;
  c.v[3] = d->offset_lo;
  return fa_philox4x32_10(c, d->k0, d->k1);
}

/* 1 if element (bh, i, j) is kept. Element-at-a-time; tiles should call
 * fa_dropout_bits once per four columns instead. */
FA_HD int fa_dropout_keep(const fa_dropout *d, uint64_t bh, int64_t i, int64_t j) {
  return fa_dropout_bits(d, bh, i, j).v[j & 3] >= d->threshold;
}

#ifdef __cplusplus
}
#endif

#endif
