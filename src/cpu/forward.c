/* CPU FlashAttention forward, FlashAttention-2 and -1 orders.
 *
 * Work unit: (sequence, query head, chunk of query rows), static schedule, so
 * one long sequence still spreads over every thread. FLASH2 uses chunks of one
 * Br block and keeps m, l and the O accumulator in the thread's tile memory
 * across the key loop. FLASH1 (Algorithm 1: keys outer, queries inner) uses
 * chunks of ceil(Nq / ceil(threads / (B*H))) rows whose unnormalised O, m, l
 * live in a float32 buffer ("memory") that every key block re-reads and
 * rescales; its Q tiles are re-read per key block too. Both share fwd_step.
 *
 * Workspace (floats, each buffer rounded up to 64 bytes), per thread:
 *   Q, O: 2*Br*D;  K^T, V: 2*Bc*D;  S: Br*Bc;  m, l, alpha: 3*Br;  row: D
 *   FLASH1 adds the chunk's O, m, l: chunk*(D + 2)
 * total = min(threads, units) * slice. B=H=1, N=65536, D=64: ~0.2 MiB per
 * thread for FLASH2; FLASH1 adds N*(D+2)*4 bytes = 17 MiB over all threads. */
#include <omp.h>

#include "cpu/cpu.h"

/* Forward tiles: Q, O (Br x D); K^T, V (Bc x D); S (Br x Bc). */
static void fwd_ctx(cpu_ctx *c, const fa_problem *pb) { cpu_ctx_init(c, pb, 2, 2, 1); }

typedef struct fwd_sched {
  int64_t chunk;   /* query rows per unit */
  int64_t nchunks; /* units per (sequence, head) */
  int64_t units;
  int nt;
} fwd_sched;

static fwd_sched fwd_schedule(const cpu_ctx *c) {
  const fa_problem *pb = c->pb;
  const int64_t bh = pb->batch * pb->heads_q, nq = pb->max_seqlen_q;
  fwd_sched s;
  s.chunk = c->br;
  if (pb->params->algorithm == FA_ALGO_FLASH1) {
    const int64_t per_bh = cpu_cdiv(pb->num_threads, bh);
    s.chunk = cpu_max(c->br, cpu_cdiv(cpu_cdiv(nq, per_bh), c->br) * c->br);
  }
  s.nchunks = cpu_cdiv(nq, s.chunk);
  s.units = bh * s.nchunks;
  s.nt = cpu_threads(pb, s.units);
  return s;
}

typedef struct fwd_bufs {
  float *Q, *O, *KT, *V, *S, *m, *l, *alpha, *row;
  float *cO, *cm, *cl; /* FLASH1 chunk state */
} fwd_bufs;

static size_t fwd_layout(const cpu_ctx *c, const fwd_sched *s, char *base, fwd_bufs *b) {
  const int64_t D = c->D, br = c->br, bc = c->bc;
  cpu_carver cv = {base, 0};
  fwd_bufs t;
  t.Q = cpu_take(&cv, br * D);
  t.O = cpu_take(&cv, br * D);
  t.KT = cpu_take(&cv, D * bc);
  t.V = cpu_take(&cv, bc * D);
  t.S = cpu_take(&cv, br * bc);
  t.m = cpu_take(&cv, br);
  t.l = cpu_take(&cv, br);
  t.alpha = cpu_take(&cv, br);
  t.row = cpu_take(&cv, D);
  t.cO = t.cm = t.cl = NULL;
  if (c->pb->params->algorithm == FA_ALGO_FLASH1) {
    t.cO = cpu_take(&cv, s->chunk * D);
    t.cm = cpu_take(&cv, s->chunk);
    t.cl = cpu_take(&cv, s->chunk);
  }
  if (b) *b = t;
  return cv.off;
}

/* Loads keys [c0, c0+nc) of the unit's K/V head: K transposed, V as rows. */
static void fwd_load_kv(const cpu_ctx *c, const cpu_unit *u, fwd_bufs *b, int64_t c0,
                        int64_t nc) {
  const fa_problem *pb = c->pb;
  cpu_load_rows_t(c, b->KT, c->bc, &pb->k, u->sq.kb, u->sq.k0 + c0, nc, u->hk, b->row);
  cpu_load_rows(c, b->V, c->D, &pb->v, u->sq.kb, u->sq.k0 + c0, nc, u->hk);
}

static void fwd_load_q(const cpu_ctx *c, const cpu_unit *u, fwd_bufs *b, int64_t r0,
                       int64_t nr) {
  cpu_load_rows(c, b->Q, c->D, &c->pb->q, u->sq.qb, u->sq.q0 + r0, nr, u->h);
}

static void fwd_init_state(int64_t nr, int64_t D, float *O, float *m, float *l) {
  tile_fill(O, D, nr, D, 0.0f);
  tile_fill(m, 1, nr, 1, -INFINITY);
  tile_fill(l, 1, nr, 1, 0.0f);
}

/* One online-softmax step: rows [r0, r0+nr) (Q tile loaded) against keys
 * [c0, c0+nc) (K^T, V loaded), updating O, m, l. */
static void fwd_step(const cpu_ctx *c, const cpu_unit *u, fwd_bufs *b, int64_t r0, int64_t nr,
                     int64_t c0, int64_t nc, float *O, float *m, float *l) {
  cpu_scores(c, u, b->S, b->Q, r0, nr, b->KT, c0, nc, NULL);
  tile_softmax_update(b->S, c->bc, nr, nc, m, l, b->alpha);
  tile_scale_rows(O, c->D, nr, c->D, b->alpha);
  tile_ab_acc(O, c->D, b->S, c->bc, nr, nc, b->V, c->D, c->D);
}

/* O /= l, store O rows and lse of rows [r0, r0+nr) (lse staged in alpha). */
static void fwd_finish(const cpu_ctx *c, const cpu_unit *u, fwd_bufs *b, int64_t r0, int64_t nr,
                       float *O, const float *m, const float *l) {
  const fa_problem *pb = c->pb;
  tile_softmax_finish(O, c->D, nr, c->D, m, l, b->alpha);
  cpu_store_rows(c, &pb->o, u->sq.qb, u->sq.q0 + r0, nr, u->h, O, c->D);
  if (pb->lse) memcpy(pb->lse + cpu_lse_index(u, r0), b->alpha, (size_t)nr * sizeof(float));
}

/* FlashAttention-2: one Br block of rows, keys inner. */
static void fwd_flash2(const cpu_ctx *c, const cpu_unit *u, fwd_bufs *b, int64_t r0,
                       int64_t r1) {
  const int64_t nr = r1 - r0;
  int64_t klo, khi;
  fwd_load_q(c, u, b, r0, nr);
  fwd_init_state(nr, c->D, b->O, b->m, b->l);
  fa_mask_block_range(&u->mk, r0, r1, &klo, &khi);
  for (int64_t c0 = klo; c0 < khi; c0 += c->bc) {
    const int64_t nc = cpu_min(c->bc, khi - c0);
    fwd_load_kv(c, u, b, c0, nc);
    fwd_step(c, u, b, r0, nr, c0, nc, b->O, b->m, b->l);
  }
  fwd_finish(c, u, b, r0, nr, b->O, b->m, b->l);
}

/* FlashAttention-1 (Algorithm 1): rows [q0, q1) with O, m, l in memory; keys
 * outer, Br row blocks inner. */
static void fwd_flash1(const cpu_ctx *c, const cpu_unit *u, fwd_bufs *b, int64_t q0,
                       int64_t q1) {
  const int64_t D = c->D, br = c->br;
  int64_t klo, khi;
  fwd_init_state(q1 - q0, D, b->cO, b->cm, b->cl);
  fa_mask_block_range(&u->mk, q0, q1, &klo, &khi);
  for (int64_t c0 = klo; c0 < khi; c0 += c->bc) {
    const int64_t nc = cpu_min(c->bc, khi - c0);
    fwd_load_kv(c, u, b, c0, nc);
    for (int64_t r0 = q0; r0 < q1; r0 += br) {
      const int64_t nr = cpu_min(br, q1 - r0), i = r0 - q0;
      int64_t lo, hi;
      fa_mask_block_range(&u->mk, r0, r0 + nr, &lo, &hi);
      if (hi <= c0 || lo >= c0 + nc) continue;
      fwd_load_q(c, u, b, r0, nr);
      fwd_step(c, u, b, r0, nr, c0, nc, b->cO + i * D, b->cm + i, b->cl + i);
    }
  }
  for (int64_t r0 = q0; r0 < q1; r0 += br) {
    const int64_t nr = cpu_min(br, q1 - r0), i = r0 - q0;
    fwd_finish(c, u, b, r0, nr, b->cO + i * D, b->cm + i, b->cl + i);
  }
}

size_t fa_cpu_forward_workspace(const fa_problem *pb) {
  cpu_ctx c;
  fwd_ctx(&c, pb);
  const fwd_sched s = fwd_schedule(&c);
  return (size_t)s.nt * fwd_layout(&c, &s, NULL, NULL);
}

fa_status fa_cpu_forward(const fa_problem *pb) {
  cpu_ctx c;
  fwd_ctx(&c, pb);
  const fwd_sched s = fwd_schedule(&c);
  const size_t slice = fwd_layout(&c, &s, NULL, NULL);
  const int flash1 = pb->params->algorithm == FA_ALGO_FLASH1;
#pragma omp parallel for num_threads(s.nt) schedule(static, 1)
  for (int64_t w = 0; w < s.units; w++) {
    const int64_t sh = w / s.nchunks, k = w % s.nchunks;
    cpu_unit u;
    cpu_unit_init(&u, &c, sh / pb->heads_q, sh % pb->heads_q);
    const int64_t r0 = k * s.chunk, r1 = cpu_min(u.sq.nq, r0 + s.chunk);
    if (r0 >= r1) continue;
    fwd_bufs b;
    fwd_layout(&c, &s, (char *)pb->workspace + (size_t)omp_get_thread_num() * slice, &b);
    if (flash1)
      fwd_flash1(&c, &u, &b, r0, r1);
    else
      fwd_flash2(&c, &u, &b, r0, r1);
  }
  return FA_OK;
}
