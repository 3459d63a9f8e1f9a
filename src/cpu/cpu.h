/* What the CPU forward and backward passes share: block sizes, the per-call
 * context, tensor <-> tile transfers, workspace carving and the score tile
 * S = transform(scale * Q K^T) with softcap, ALiBi and masks. */
#ifndef FA_CPU_CPU_H
#define FA_CPU_CPU_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "common/convert.h"
#include "common/mask.h"
#include "common/problem.h"
#include "cpu/tile.h"

/* Tiles of one thread should stay in L2 (~512 KiB per core): we budget 384 KiB. */
#define CPU_TILE_BUDGET_FLOATS (384 * 1024 / 4)

/* Br x Bc from the cache budget: rt tiles of Br x D, ct tiles of Bc x D and st
 * tiles of Br x Bc must fit; start at 128 x 128 and halve (Bc first) down to 16. */
static inline void cpu_block_sizes(int64_t D, int64_t rt, int64_t ct, int64_t st, int64_t *br,
                                   int64_t *bc) {
  int64_t r = 128, c = 128;
  while (rt * r * D + ct * c * D + st * r * c > CPU_TILE_BUDGET_FLOATS && (r > 16 || c > 16)) {
    if (c >= r && c > 16)
      c /= 2;
    else
      r /= 2;
  }
  *br = r;
  *bc = c;
}

static inline int64_t cpu_cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static inline int64_t cpu_min(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t cpu_max(int64_t a, int64_t b) { return a > b ? a : b; }

/* Threads for `units` work units (at least 1, never more than units). */
static inline int cpu_threads(const fa_problem *pb, int64_t units) {
  return (int)cpu_max(1, cpu_min(pb->num_threads, units));
}

/* Workspace carving: each buffer starts on a 64-byte line, so per-thread
 * slices (whose sizes are multiples of 64) never share a cache line. With
 * base == NULL only the size is counted. */
typedef struct cpu_carver {
  char *base;
  size_t off;
} cpu_carver;

static inline float *cpu_take(cpu_carver *cv, int64_t nfloats) {
  float *p = cv->base ? (float *)(cv->base + cv->off) : NULL;
  cv->off += ((size_t)nfloats * sizeof(float) + 63) & ~(size_t)63;
  return p;
}

/* Per-call constants. */
typedef struct cpu_ctx {
  const fa_problem *pb;
  int64_t D, br, bc;
  size_t esize; /* bytes per stored element */
  float scale, cap;
} cpu_ctx;

static inline void cpu_ctx_init(cpu_ctx *c, const fa_problem *pb, int64_t rt, int64_t ct,
                                int64_t st) {
  c->pb = pb;
  c->D = pb->headdim;
  cpu_block_sizes(c->D, rt, ct, st, &c->br, &c->bc);
  c->esize = fa_dtype_size(pb->dtype);
  c->scale = pb->scale;
  c->cap = pb->params->softcap;
}

/* One (sequence, query head): its rows, mask and ALiBi slope. */
typedef struct cpu_unit {
  fa_seq sq;
  fa_mask mk;
  int64_t h, hk;
  float slope;
} cpu_unit;

static inline void cpu_unit_init(cpu_unit *u, const cpu_ctx *c, int64_t s, int64_t h) {
  const fa_problem *pb = c->pb;
  const fa_params *pr = pb->params;
  u->sq = fa_problem_seq(pb, s);
  u->mk = fa_mask_make(u->sq.nq, u->sq.nk, pr->causal, pr->window_enabled, pr->window_left,
                       pr->window_right);
  u->h = h;
  u->hk = h / pb->group;
  u->slope = pr->alibi_slopes ? pr->alibi_slopes[s * pr->alibi_stride_batch + h] : 0.0f;
}

/* Index of (this sequence, head h, row r) in lse-shaped arrays. */
static inline int64_t cpu_lse_index(const cpu_unit *u, int64_t r) {
  return u->sq.lse0 + u->h * u->sq.lse_head_stride + r;
}

static inline char *cpu_row(const cpu_ctx *c, const fa_tensor *t, int64_t b, int64_t n,
                            int64_t h) {
  return (char *)t->data + fa_tensor_offset(t, b, n, h) * (int64_t)c->esize;
}

/* dst (n x D, leading dim ld) = float32 of rows [n0, n0 + n) of head h. */
static inline void cpu_load_rows(const cpu_ctx *c, float *dst, int64_t ld, const fa_tensor *t,
                                 int64_t b, int64_t n0, int64_t n, int64_t h) {
  for (int64_t r = 0; r < n; r++)
    fa_load_row_f32(dst + r * ld, cpu_row(c, t, b, n0 + r, h), c->pb->dtype, c->D);
}

/* Rows [n0, n0 + n) of head h = src (n x D, leading dim ld), rounded to storage. */
static inline void cpu_store_rows(const cpu_ctx *c, const fa_tensor *t, int64_t b, int64_t n0,
                                  int64_t n, int64_t h, const float *src, int64_t ld) {
  for (int64_t r = 0; r < n; r++)
    fa_store_row_f32(cpu_row(c, t, b, n0 + r, h), src + r * ld, c->pb->dtype, c->D);
}

/* dst (D x n, leading dim ld) = transposed float32 rows, through a D-float row buffer. */
static inline void cpu_load_rows_t(const cpu_ctx *c, float *dst, int64_t ld, const fa_tensor *t,
                                   int64_t b, int64_t n0, int64_t n, int64_t h, float *row) {
  for (int64_t r = 0; r < n; r++) {
    fa_load_row_f32(row, cpu_row(c, t, b, n0 + r, h), c->pb->dtype, c->D);
    for (int64_t d = 0; d < c->D; d++) dst[d * ld + r] = row[d];
  }
}

/* 1 if some element of rows [r0, r0+nr) x keys [c0, c0+nc) is masked. Visible
 * ranges are non-decreasing in the row, so the corners decide. */
static inline int cpu_tile_partial(const fa_mask *mk, int64_t r0, int64_t nr, int64_t c0,
                                   int64_t nc) {
  int64_t lo_first, hi_first, lo_last, hi_last;
  fa_mask_row_range(mk, r0, &lo_first, &hi_first);
  fa_mask_row_range(mk, r0 + nr - 1, &lo_last, &hi_last);
  return lo_last > c0 || hi_first < c0 + nc;
}

/* S (nr x nc, ld bc) = the final scores of rows [r0, r0+nr) against keys
 * [c0, c0+nc): scale * Q K^T, softcap (tanh kept in T if non-NULL), ALiBi, and
 * -inf where masked (only computed per element for partially visible tiles). */
static inline void cpu_scores(const cpu_ctx *c, const cpu_unit *u, float *S, const float *Q,
                              int64_t r0, int64_t nr, const float *KT, int64_t c0, int64_t nc,
                              float *T) {
  const int64_t bc = c->bc;
  tile_abt(S, bc, Q, c->D, nr, KT, bc, nc, c->D, c->scale);
  if (c->cap > 0.0f) tile_softcap(S, bc, nr, nc, c->cap, T);
  if (u->slope != 0.0f) tile_alibi(S, bc, nr, nc, u->slope, r0 + u->sq.nk - u->sq.nq, c0);
  if (cpu_tile_partial(&u->mk, r0, nr, c0, nc)) {
    for (int64_t r = 0; r < nr; r++) {
      int64_t lo, hi;
      fa_mask_row_range(&u->mk, r0 + r, &lo, &hi);
      const int64_t a = cpu_min(nc, cpu_max(0, lo - c0)), b = cpu_max(a, cpu_min(nc, hi - c0));
      float *s = S + r * bc;
      for (int64_t j = 0; j < a; j++) s[j] = -INFINITY;
      for (int64_t j = b; j < nc; j++) s[j] = -INFINITY;
    }
  }
}

#endif
