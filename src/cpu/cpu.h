/* What the CPU forward and backward passes share: block sizes, the per-call
 * context, tensor <-> tile transfers, workspace carving and the score tile
 * S = transform(scale * Q K^T) with softcap, ALiBi and masks. */
#ifndef FA_CPU_CPU_H
#define FA_CPU_CPU_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "backend.h"
#include "common/convert.h"
#include "common/dtype.h"
#include "common/kern.h"
#include "common/mask.h"
#include "common/philox.h"
#include "common/problem.h"
#include "cpu/tile.h"

/* Cache sizes in bytes (sysconf where glibc has it, else typical x86 values). */
static inline void cpu_cache_sizes(int64_t *l1, int64_t *l2) {
  long a = -1, b = -1;
#if defined(_SC_LEVEL1_DCACHE_SIZE) && defined(_SC_LEVEL2_CACHE_SIZE)
  a = sysconf(_SC_LEVEL1_DCACHE_SIZE);
  b = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
  *l1 = a >= 16384 ? a : 32768;
  *l2 = b >= 131072 ? b : 524288;
}

/* Br x Bc (multiples of 16) such that rt tiles of Br x D, ct tiles of Bc x D
 * and st tiles of Br x Bc fit in half of L2 and one Br x Bc tile in half of
 * L1; start at 128 x 64 and halve the larger (Br first on ties) down to 16. */
static inline void cpu_block_sizes(int64_t D, int64_t rt, int64_t ct, int64_t st, int64_t *br,
                                   int64_t *bc) {
  int64_t l1, l2, r = 128, c = 64;
  cpu_cache_sizes(&l1, &l2);
  D = fa_round_up(D, FA_VL);
  while ((4 * (rt * r * D + ct * c * D + st * r * c) > l2 / 2 || 4 * r * c > l1 / 2) &&
         (r > 16 || c > 16)) {
    if (r >= c && r > 16)
      r /= 2;
    else
      c /= 2;
  }
  *br = r;
  *bc = c;
}

/* 0 when FLASHATTN_CPU_PACK=0: the forward's K/V and the backward's Q/dO (and
 * K, K^T, V^T) packed copies are then not made, each step converting its
 * tiles instead. Same results bit for bit (tests/attn.c, attn_check_pack);
 * read at every call, so a test can switch it. */
static inline int cpu_pack_enabled(void) {
  const char *e = getenv("FLASHATTN_CPU_PACK");
  return !(e && e[0] == '0' && e[1] == '\0');
}

static inline int64_t cpu_cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static inline int64_t cpu_min(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t cpu_max(int64_t a, int64_t b) { return a > b ? a : b; }

/* Work a thread must have before a parallel region wakes it: 2^24 FLOPs,
 * ~0.1-0.2 ms of one core. Waking an idle thread costs microseconds on a
 * quiet machine, but where other processes keep the cores busy, every
 * barrier waits until the scheduler runs each thread of the team (a time
 * slice, milliseconds): B=1, H=1, N=64, D=256 forward + backward on 2 threads
 * took 0.3 ms median but 8-48 ms at the 90th percentile then, against 0.25
 * ms on one (docs/PERF.md, CPU: small problems). */
#define CPU_THREAD_FLOPS ((int64_t)1 << 24)

/* The forward's FLOPs: 4 per head dim of every (query row, key) pair of
 * every query head, half the pairs under a causal mask (an estimate: other
 * masks and varlen batches count their longest sequences whole). */
static inline double cpu_fwd_flops(const fa_problem *pb) {
  const double nq = (double)pb->max_seqlen_q, nk = (double)pb->max_seqlen_k;
  double pairs = nq * nk;
  if (pb->causal) pairs = nq <= nk ? nq * nk - nq * (nq - 1) / 2 : nk * (nk + 1) / 2;
  return 4.0 * (double)pb->batch * (double)pb->heads_q * pairs * (double)pb->headdim;
}

/* Threads for `units` work units that hold `flops` of work between them: at
 * least 1, at most num_threads, one per unit and one per CPU_THREAD_FLOPS
 * (a tiny problem runs on the calling thread alone). FLOPs are counted in
 * double: a broadcast problem's count may pass 2^63. */
static inline int cpu_threads(const fa_problem *pb, int64_t units, double flops) {
  const double by_work = flops / (double)CPU_THREAD_FLOPS;
  const int64_t most = cpu_min(pb->num_threads, units);
  return (int)cpu_max(1, by_work < (double)most ? (int64_t)by_work : most);
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
  const fa_kern *kn;
  int64_t D, br, bc;
  int64_t Dp;   /* D rounded up to whole vectors: row length of every tile */
  int64_t brp;  /* Br rounded up to a 16-wide panel */
  size_t esize; /* bytes per stored element */
  float scale, cap;
  fa_dropout drop; /* used when dropout_p > 0 */
} cpu_ctx;

static inline void cpu_ctx_init(cpu_ctx *c, const fa_problem *pb, int64_t rt, int64_t ct,
                                int64_t st) {
  c->pb = pb;
  c->kn = fa_kern_get();
  c->D = pb->headdim;
  c->Dp = fa_round_up(c->D, FA_VL);
  cpu_block_sizes(c->D, rt, ct, st, &c->br, &c->bc);
  c->brp = fa_round_up(c->br, 16);
  c->esize = fa_dtype_bytes(pb->dtype);
  c->scale = pb->scale;
  c->cap = pb->softcap;
  c->drop = pb->dropout;
}

/* One (sequence, query head): its rows, mask and ALiBi slope. */
typedef struct cpu_unit {
  fa_seq sq;
  fa_mask mk;
  int64_t s, h, hk;
  float slope;
} cpu_unit;

static inline void cpu_unit_init(cpu_unit *u, const cpu_ctx *c, int64_t s, int64_t h) {
  const fa_problem *pb = c->pb;
  u->sq = fa_problem_seq(pb, s);
  u->mk = fa_problem_mask(pb, &u->sq);
  u->s = s;
  u->h = h;
  u->hk = h / pb->group;
  u->slope = pb->alibi_slopes ? pb->alibi_slopes[s * pb->alibi_stride_batch + h] : 0.0f;
}

/* Index of (this sequence, head h, row r) in lse-shaped arrays. */
static inline int64_t cpu_lse_index(const cpu_unit *u, int64_t r) {
  return u->sq.lse0 + u->h * u->sq.lse_head_stride + r;
}

static inline char *cpu_row(const cpu_ctx *c, const fa_tensor *t, int64_t b, int64_t n, int64_t h) {
  return (char *)t->data + fa_tensor_offset(t, b, n, h) * (int64_t)c->esize;
}

/* K and V rows of one K/V head of a sequence, key after key: k and v point
 * at key j's rows, which continue left - 1 more keys at the tensors' row
 * strides (to the end of a page when paged, else to the end of the
 * sequence); cpu_kv_step moves it on. */
typedef struct cpu_kv_cursor {
  const cpu_ctx *c;
  const fa_seq *sq;
  int64_t hk, j, left, ks, vs; /* ks, vs: the row strides in bytes */
  const char *k, *v;
} cpu_kv_cursor;

static inline void cpu_kv_seek(cpu_kv_cursor *cu, int64_t j) {
  const fa_problem *pb = cu->c->pb;
  int64_t b, n;
  cu->left = fa_problem_krow(pb, cu->sq, j, &b, &n);
  cu->j = j;
  cu->k = cpu_row(cu->c, &pb->k, b, n, cu->hk);
  cu->v = cpu_row(cu->c, &pb->v, b, n, cu->hk);
}

static inline cpu_kv_cursor cpu_kv_at(const cpu_ctx *c, const fa_seq *sq, int64_t hk, int64_t j) {
  cpu_kv_cursor cu;
  cu.c = c;
  cu.sq = sq;
  cu.hk = hk;
  cu.ks = c->pb->k.stride_seq * (int64_t)c->esize;
  cu.vs = c->pb->v.stride_seq * (int64_t)c->esize;
  cpu_kv_seek(&cu, j);
  return cu;
}

/* Steps n keys on. */
static inline void cpu_kv_step(cpu_kv_cursor *cu, int64_t n) {
  if (n < cu->left) {
    cu->left -= n;
    cu->k += n * cu->ks;
    cu->v += n * cu->vs;
    cu->j += n;
  } else {
    cpu_kv_seek(cu, cu->j + n);
  }
}

/* Panel width of a row-major Dp-column B operand: 2 or 3 vectors, whichever
 * divides D's vectors (the products then run 6x2 or 4x3 register tiles). */
static inline int cpu_dbw(const cpu_ctx *c) {
  const int64_t nv = c->Dp / FA_VL;
  /* not on 16-lane tiles: a row of a 24-column panel then takes a 512-bit
   * and a 256-bit FMA, which cores with full-width 512-bit units (Zen 5,
   * Intel's) run at the cost of two 512-bit ones (D = 72 on a Zen 5: 0.63 of
   * the peak with them, 0.76 with 16-column panels) */
  return c->kn->tile_lanes == FA_VL && nv % 2 != 0 && nv % 3 == 0 ? 3 * FA_VL : 2 * FA_VL;
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

/* For t < n: what index t0 + t of one side sees of the other, [lo, hi)
 * relative to o0 and clipped to [0, m) (range: fa_mask_row_range or
 * fa_mask_col_range). */
static inline void cpu_mask_spans(const fa_mask *mk,
                                  void (*range)(const fa_mask *, int64_t, int64_t *, int64_t *),
                                  int32_t *lo, int32_t *hi, int64_t t0, int64_t n, int64_t o0,
                                  int64_t m) {
  for (int64_t t = 0; t < n; t++) {
    int64_t a, b;
    range(mk, t0 + t, &a, &b);
    lo[t] = (int32_t)cpu_min(m, cpu_max(0, a - o0));
    hi[t] = (int32_t)cpu_max(lo[t], cpu_min(m, b - o0));
  }
}

/* Per query row i < nr of a tile: its visible keys relative to c0 in [0, nc). */
static inline void cpu_mask_ranges(const fa_mask *mk, int32_t *lo, int32_t *hi, int64_t r0,
                                   int64_t nr, int64_t c0, int64_t nc) {
  cpu_mask_spans(mk, fa_mask_row_range, lo, hi, r0, nr, c0, nc);
}

/* Per key j < nc of a tile: the query rows that see it, relative to r0 in [0, nr). */
static inline void cpu_mask_cols(const fa_mask *mk, int32_t *lo, int32_t *hi, int64_t r0,
                                 int64_t nr, int64_t c0, int64_t nc) {
  cpu_mask_spans(mk, fa_mask_col_range, lo, hi, c0, nc, r0, nr);
}

/* Row t < n of S (ld lds, m entries) = -inf outside [lo[t], hi[t]). */
static inline void cpu_mask_fill(float *S, int64_t lds, int64_t n, int64_t m, const int32_t *lo,
                                 const int32_t *hi) {
  for (int64_t t = 0; t < n; t++) {
    float *s = S + t * lds;
    for (int64_t i = 0; i < lo[t]; i++) s[i] = -INFINITY;
    for (int64_t i = hi[t]; i < m; i++) s[i] = -INFINITY;
  }
}

/* Block-sparse mask on the tile rows [r0, r0+nr) x keys [c0, c0+nc) of the
 * unit: CPU_BLOCKS_NONE (no visible block: skip the tile), CPU_BLOCKS_ALL
 * (every block visible, or no block mask) or CPU_BLOCKS_SOME (mask per element
 * with cpu_block_fill). */
enum { CPU_BLOCKS_NONE = 0, CPU_BLOCKS_ALL = 1, CPU_BLOCKS_SOME = 2 };

static inline int cpu_block_tile(const cpu_ctx *c, const cpu_unit *u, int64_t r0, int64_t nr,
                                 int64_t c0, int64_t nc) {
  if (!c->pb->block_mask) return CPU_BLOCKS_ALL;
  const int64_t bq = c->pb->block_size_q, bk = c->pb->block_size_k;
  int any = 0, all = 1;
  for (int64_t bi = r0 / bq; bi <= (r0 + nr - 1) / bq; bi++) {
    const uint8_t *row = fa_problem_block_row(c->pb, u->s, u->h, bi * bq);
    for (int64_t bj = c0 / bk; bj <= (c0 + nc - 1) / bk; bj++) {
      any |= row[bj] != 0;
      all &= row[bj] != 0;
    }
  }
  return all ? CPU_BLOCKS_ALL : any ? CPU_BLOCKS_SOME : CPU_BLOCKS_NONE;
}

/* S(t, jj) = S[t*rs + jj*cs] = -inf where the block mask hides (row r0+t, key c0+jj). */
static inline void cpu_block_fill(const cpu_ctx *c, const cpu_unit *u, float *S, int64_t rs,
                                  int64_t cs, int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
  const int64_t bk = c->pb->block_size_k;
  for (int64_t t = 0; t < nr; t++) {
    const uint8_t *row = fa_problem_block_row(c->pb, u->s, u->h, r0 + t);
    for (int64_t jj = 0; jj < nc; jj++)
      if (!row[(c0 + jj) / bk]) S[t * rs + jj * cs] = -INFINITY;
  }
}

/* X(t, jj) = X[t*rs + jj*cs] *= dropout's multiplier of (row r0+t, key c0+jj):
 * 0 or 1/(1-p) (docs/DROPOUT.md; the kernel draws eight Philox counters at once). */
static inline void cpu_dropout_apply(const cpu_ctx *c, const cpu_unit *u, float *X, int64_t rs,
                                     int64_t cs, int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
  const uint64_t bh = (uint64_t)(u->s * c->pb->heads_q + u->h);
  c->kn->dropout(X, rs, cs, nr, nc, bh, r0, c0, &c->drop);
}

/* Decode path (cpu/decode.c): FLASH2 forward when there are at most
 * CPU_DECODE_NQ query rows and every K/V head has at most CPU_DECODE_ROWS
 * (Nq * group); fa_cpu_forward dispatches to it. The tile path's units are
 * query heads, so with a few rows in many query heads per K/V head (MQA,
 * large GQA groups) each of them read all of K and V again: 2-8x slower than
 * the decode path, which reads them once per K/V head (Zen 4 host). */
#define CPU_DECODE_NQ 16
#define CPU_DECODE_ROWS 64
int cpu_decode_applies(const fa_problem *pb);
size_t cpu_decode_workspace(const fa_problem *pb);
fa_status cpu_decode_forward(const fa_problem *pb);

#endif
