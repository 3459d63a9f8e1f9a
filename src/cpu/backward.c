/* CPU FlashAttention backward (shared by FLASH2 and FLASH1: both papers'
 * backward passes recompute P tile by tile from the forward's lse).
 *
 * Three passes in one parallel region, each a static schedule over small
 * independent units, so every output element has exactly one writer (no
 * atomics, no reductions) and the result is bitwise identical for any thread
 * count:
 *   1. Di = rowsum(dO o O)                      units (sequence, q head, Br rows)
 *   2. key-outer: dK_j, dV_j of one key block,  units (sequence, K/V head, Bc keys)
 *      summed over the group's query heads and every query block that sees it:
 *      P = exp(S - lse), dV_j += P^T dO_i, dP = dO_i V_j^T, dS = P o (dP - Di),
 *      dK_j += scale * dS^T Q_i
 *   3. query-outer: dQ_i = scale * sum_j dS_ij K_j, units (sequence, q head, Br rows)
 * Pass 3 recomputes S and dP (7 tile matmuls instead of 5) instead of keeping
 * per-thread dQ accumulators: O(N) extra memory and full parallelism even for
 * B = H = 1.
 *
 * Workspace: Di, heads_q * total_q floats (lse layout), then per thread
 *   Q, dO, dQ: 3*Br*D;  K, K^T, V^T, dK, dV: 5*Bc*D;  S, dS, T: 3*Br*Bc;  row: D
 * (each buffer rounded up to 64 bytes). B=H=1, N=65536, D=64: 256 KiB + ~0.3 MiB
 * per thread. */
#include <omp.h>

#include "cpu/cpu.h"

/* Backward tiles: Q, dO, dQ (Br x D); K, K^T, V^T, dK, dV (Bc x D); S, dS, T (Br x Bc). */
static void bwd_ctx(cpu_ctx *c, const fa_problem *pb) { cpu_ctx_init(c, pb, 3, 5, 3); }

typedef struct bwd_bufs {
  float *Q, *dO, *dQ, *K, *KT, *VT, *dK, *dV, *S, *dS, *T, *row;
} bwd_bufs;

static size_t bwd_slice(const cpu_ctx *c, char *base, bwd_bufs *b) {
  const int64_t D = c->D, br = c->br, bc = c->bc;
  cpu_carver cv = {base, 0};
  bwd_bufs t;
  t.Q = cpu_take(&cv, br * D);
  t.dO = cpu_take(&cv, br * D);
  t.dQ = cpu_take(&cv, br * D);
  t.K = cpu_take(&cv, bc * D);
  t.KT = cpu_take(&cv, D * bc);
  t.VT = cpu_take(&cv, D * bc);
  t.dK = cpu_take(&cv, bc * D);
  t.dV = cpu_take(&cv, bc * D);
  t.S = cpu_take(&cv, br * bc);
  t.dS = cpu_take(&cv, br * bc);
  t.T = cpu_take(&cv, br * bc);
  t.row = cpu_take(&cv, D);
  if (b) *b = t;
  return cv.off;
}

static size_t bwd_di_bytes(const fa_problem *pb) {
  cpu_carver cv = {NULL, 0};
  cpu_take(&cv, pb->heads_q * pb->total_q);
  return cv.off;
}

typedef struct bwd_sched {
  int64_t nrb, ncb;          /* row / key blocks per sequence (longest) */
  int64_t q_units, kv_units; /* passes 1 and 3; pass 2 */
  int nt;
} bwd_sched;

static bwd_sched bwd_schedule(const cpu_ctx *c) {
  const fa_problem *pb = c->pb;
  bwd_sched s;
  s.nrb = cpu_cdiv(pb->max_seqlen_q, c->br);
  s.ncb = cpu_cdiv(pb->max_seqlen_k, c->bc);
  s.q_units = pb->batch * pb->heads_q * s.nrb;
  s.kv_units = pb->batch * pb->heads_k * s.ncb;
  s.nt = cpu_threads(pb, cpu_max(s.q_units, s.kv_units));
  return s;
}

/* Rows [r0, r0+nr) of query head u->h: Q and dO tiles. */
static void bwd_load_q(const cpu_ctx *c, const cpu_unit *u, bwd_bufs *b, int64_t r0,
                       int64_t nr) {
  const fa_problem *pb = c->pb;
  cpu_load_rows(c, b->Q, c->D, &pb->q, u->sq.qb, u->sq.q0 + r0, nr, u->h);
  cpu_load_rows(c, b->dO, c->D, &pb->dout, u->sq.qb, u->sq.q0 + r0, nr, u->h);
}

/* Keys [c0, c0+nc) of K/V head u->hk: K^T and V^T (and K as rows if wanted). */
static void bwd_load_kv(const cpu_ctx *c, const cpu_unit *u, bwd_bufs *b, int64_t c0,
                        int64_t nc, int want_rows) {
  const fa_problem *pb = c->pb;
  if (want_rows) {
    cpu_load_rows(c, b->K, c->D, &pb->k, u->sq.kb, u->sq.k0 + c0, nc, u->hk);
    tile_transpose(b->KT, c->bc, b->K, c->D, nc, c->D);
  } else {
    cpu_load_rows_t(c, b->KT, c->bc, &pb->k, u->sq.kb, u->sq.k0 + c0, nc, u->hk, b->row);
  }
  cpu_load_rows_t(c, b->VT, c->bc, &pb->v, u->sq.kb, u->sq.k0 + c0, nc, u->hk, b->row);
}

/* One tile of the backward: with Q, dO of rows [r0, r0+nr) and K^T, V^T of
 * keys [c0, c0+nc) loaded, leaves P in S and dS (w.r.t. scale*QK^T, before
 * the factor scale) in dS. */
static void bwd_step(const cpu_ctx *c, const cpu_unit *u, bwd_bufs *b, const float *Di,
                     int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
  const fa_problem *pb = c->pb;
  float *T = c->cap > 0.0f ? b->T : NULL;
  cpu_scores(c, u, b->S, b->Q, r0, nr, b->KT, c0, nc, T);
  tile_exp_lse(b->S, c->bc, nr, nc, pb->lse + cpu_lse_index(u, r0));
  tile_abt(b->dS, c->bc, b->dO, c->D, nr, b->VT, c->bc, nc, c->D, 1.0f);
  tile_dsoftmax(b->dS, c->bc, b->S, nr, nc, Di + cpu_lse_index(u, r0), T);
}

/* Pass 1: Di of rows [r0, r1) of query head u->h. */
static void bwd_di(const cpu_ctx *c, const cpu_unit *u, bwd_bufs *b, float *Di, int64_t r0,
                   int64_t r1) {
  const fa_problem *pb = c->pb;
  for (int64_t r = r0; r < r1; r++) {
    fa_load_row_f32(b->Q, cpu_row(c, &pb->o, u->sq.qb, u->sq.q0 + r, u->h), pb->dtype, c->D);
    fa_load_row_f32(b->dO, cpu_row(c, &pb->dout, u->sq.qb, u->sq.q0 + r, u->h), pb->dtype,
                    c->D);
    float acc = 0.0f;
    for (int64_t d = 0; d < c->D; d++) acc += b->Q[d] * b->dO[d];
    Di[cpu_lse_index(u, r)] = acc;
  }
}

/* Pass 2: dK, dV of keys [c0, c0+nc) of K/V head hk of sequence s. */
static void bwd_kv(const cpu_ctx *c, bwd_bufs *b, const float *Di, int64_t s, int64_t hk,
                   int64_t c0, int64_t nc) {
  const fa_problem *pb = c->pb;
  const int64_t D = c->D, br = c->br;
  cpu_unit u;
  cpu_unit_init(&u, c, s, hk * pb->group);
  int64_t rlo, rhi, t0, t1;
  fa_mask_col_range(&u.mk, c0, &rlo, &t0);
  fa_mask_col_range(&u.mk, c0 + nc - 1, &t1, &rhi);
  tile_fill(b->dK, D, nc, D, 0.0f);
  tile_fill(b->dV, D, nc, D, 0.0f);
  if (rlo < rhi) bwd_load_kv(c, &u, b, c0, nc, 0);
  for (int64_t h = hk * pb->group; h < (hk + 1) * pb->group; h++) {
    cpu_unit_init(&u, c, s, h);
    for (int64_t r0 = rlo; r0 < rhi; r0 += br) {
      const int64_t nr = cpu_min(br, rhi - r0);
      bwd_load_q(c, &u, b, r0, nr);
      bwd_step(c, &u, b, Di, r0, nr, c0, nc);
      tile_atb_acc(b->dV, D, b->S, c->bc, nr, nc, b->dO, D, D);
      tile_atb_acc(b->dK, D, b->dS, c->bc, nr, nc, b->Q, D, D);
    }
  }
  tile_scale(b->dK, D, nc, D, c->scale);
  cpu_store_rows(c, &pb->dk, u.sq.kb, u.sq.k0 + c0, nc, hk, b->dK, D);
  cpu_store_rows(c, &pb->dv, u.sq.kb, u.sq.k0 + c0, nc, hk, b->dV, D);
}

/* Pass 3: dQ of rows [r0, r1) of query head u->h. */
static void bwd_q(const cpu_ctx *c, const cpu_unit *u, bwd_bufs *b, const float *Di, int64_t r0,
                  int64_t r1) {
  const fa_problem *pb = c->pb;
  const int64_t D = c->D, nr = r1 - r0;
  int64_t klo, khi;
  tile_fill(b->dQ, D, nr, D, 0.0f);
  fa_mask_block_range(&u->mk, r0, r1, &klo, &khi);
  if (klo < khi) bwd_load_q(c, u, b, r0, nr);
  for (int64_t c0 = klo; c0 < khi; c0 += c->bc) {
    const int64_t nc = cpu_min(c->bc, khi - c0);
    bwd_load_kv(c, u, b, c0, nc, 1);
    bwd_step(c, u, b, Di, r0, nr, c0, nc);
    tile_ab_acc(b->dQ, D, b->dS, c->bc, nr, nc, b->K, D, D);
  }
  tile_scale(b->dQ, D, nr, D, c->scale);
  cpu_store_rows(c, &pb->dq, u->sq.qb, u->sq.q0 + r0, nr, u->h, b->dQ, D);
}

size_t fa_cpu_backward_workspace(const fa_problem *pb) {
  cpu_ctx c;
  bwd_ctx(&c, pb);
  const bwd_sched s = bwd_schedule(&c);
  return bwd_di_bytes(pb) + (size_t)s.nt * bwd_slice(&c, NULL, NULL);
}

fa_status fa_cpu_backward(const fa_problem *pb) {
  cpu_ctx c;
  bwd_ctx(&c, pb);
  const bwd_sched s = bwd_schedule(&c);
  const size_t slice = bwd_slice(&c, NULL, NULL);
  float *Di = (float *)pb->workspace;
  char *slices = (char *)pb->workspace + bwd_di_bytes(pb);
#pragma omp parallel num_threads(s.nt)
  {
    bwd_bufs b;
    bwd_slice(&c, slices + (size_t)omp_get_thread_num() * slice, &b);
    /* Query-side units (passes 1 and 3) are (sequence, head, row block). */
#pragma omp for schedule(static, 1)
    for (int64_t w = 0; w < s.q_units; w++) {
      const int64_t sh = w / s.nrb, r0 = (w % s.nrb) * c.br;
      cpu_unit u;
      cpu_unit_init(&u, &c, sh / pb->heads_q, sh % pb->heads_q);
      if (r0 < u.sq.nq) bwd_di(&c, &u, &b, Di, r0, cpu_min(u.sq.nq, r0 + c.br));
    }
#pragma omp for schedule(static, 1)
    for (int64_t w = 0; w < s.kv_units; w++) {
      const int64_t sh = w / s.ncb, c0 = (w % s.ncb) * c.bc;
      const int64_t seq = sh / pb->heads_k, hk = sh % pb->heads_k;
      const fa_seq sq = fa_problem_seq(pb, seq);
      if (c0 < sq.nk) bwd_kv(&c, &b, Di, seq, hk, c0, cpu_min(c.bc, sq.nk - c0));
    }
#pragma omp for schedule(static, 1)
    for (int64_t w = 0; w < s.q_units; w++) {
      const int64_t sh = w / s.nrb, r0 = (w % s.nrb) * c.br;
      cpu_unit u;
      cpu_unit_init(&u, &c, sh / pb->heads_q, sh % pb->heads_q);
      if (r0 < u.sq.nq) bwd_q(&c, &u, &b, Di, r0, cpu_min(u.sq.nq, r0 + c.br));
    }
  }
  return FA_OK;
}
