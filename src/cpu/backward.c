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
 * Every product is one fa_gemm (register-blocked, common/kern.h), with the
 * same summation order as the forward's scores, so P = exp(S - lse) is
 * recomputed from bitwise the same S.
 *
 * Workspace: Di, heads_q * total_q floats (lse layout), then per thread
 *   Q, dO, dQ: 3*Br*Dp;  K, K^T, V^T, dK, dV: 5*Bc*Dp;  S, dS, T: 3*Br*Bc;
 *   row ranges: 2*max(Br, Bc) int32 (each buffer rounded up to 64 bytes);
 *   fused order: dQ accumulator group*Nq*Dp, and while three times that is
 *   at most BWD_FUSED_MAX_BYTES and all threads' packs at most 256 MiB, Q
 *   and dO packed (2*group*Nq*Dp);
 * non-fused order, while at most BWD_PACK_MAX_BYTES in all: the call's
 * packed Q and dO (2*B*Hq*Nq*Dp) and K, K^T, V^T (3*B*Hk*Nk*Dp, Nk rounded
 * up to 16). B=H=1, N=65536, D=64: 256 KiB + ~0.3 MiB per thread (no pack:
 * 80 MiB); B=1, H=2, N=8192, D=128: 40 MiB of packs; B=1, H=16, N=4096,
 * D=128: 6 MiB per thread. */
#include <omp.h>

#include "cpu/cpu.h"

/* Backward tiles: Q, dO, dQ (Br x D); K, K^T, V^T, dK, dV (Bc x D); S, dS, T (Br x Bc). */
static void bwd_ctx(cpu_ctx *c, const fa_problem *pb) { cpu_ctx_init(c, pb, 3, 5, 3); }

typedef struct bwd_bufs {
  float *Q, *dO, *dQ, *K, *KT, *VT, *dK, *dV, *S, *dS, *T;
  int32_t *lo, *hi;
  /* the step's tiles: the buffers above, or rows and panels of the packs */
  const float *Qt, *dOt, *Kt, *KTt, *VTt;
  /* Packed float32 copies, loaded once instead of a tile per step (NULL:
   * none). pq: Q then dO rows (ld Dp, max_seqlen_q rows per slot) of the
   * fused unit's group (slot h % group) or, with pq_all, of every (sequence,
   * query head) (slot s * Hq + h). pk: the non-fused order's K rows (ld Dp),
   * then K^T and V^T panels, max_seqlen_k rounded up to 16 keys per (sequence,
   * K/V head). */
  float *pq, *pk;
  int pq_all;
} bwd_bufs;

static size_t bwd_slice(const cpu_ctx *c, char *base, bwd_bufs *b) {
  const int64_t Dp = c->Dp, br = c->br, bc = c->bc, rows = cpu_max(br, bc);
  cpu_carver cv = {base, 0};
  bwd_bufs t;
  t.Q = cpu_take(&cv, br * Dp);
  t.dO = cpu_take(&cv, br * Dp);
  t.dQ = cpu_take(&cv, br * Dp);
  t.K = cpu_take(&cv, bc * Dp);
  t.KT = cpu_take(&cv, Dp * bc);
  t.VT = cpu_take(&cv, Dp * bc);
  t.dK = cpu_take(&cv, bc * Dp);
  t.dV = cpu_take(&cv, bc * Dp);
  t.S = cpu_take(&cv, br * bc);
  t.dS = cpu_take(&cv, br * bc);
  t.T = cpu_take(&cv, br * bc);
  t.lo = (int32_t *)cpu_take(&cv, rows);
  t.hi = (int32_t *)cpu_take(&cv, rows);
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
  int64_t q_units, kv_units; /* passes 1 and 3; pass 2 (fused: B*Hk) */
  int fused;
  size_t dq_bytes;           /* fused: per-thread dQ accumulator */
  size_t pack_bytes;         /* fused, when small enough: per-thread packed Q and dO */
  size_t pq_bytes, pk_bytes; /* otherwise, when small enough: the call's pq and pk */
  int nt;
} bwd_sched;

/* Fused order when there are enough (sequence, K/V head) units to share out
 * and their dQ accumulators are small. The choice depends on the problem
 * only, never on the thread count, so results stay bitwise thread-independent. */
#define BWD_FUSED_MIN_UNITS 4
#define BWD_FUSED_MAX_BYTES ((size_t)64 << 20)
/* Largest packed Q, dO, K, K^T, V^T copy of the non-fused order, and four
 * times that for the fused order's per-thread packs together (packing never
 * changes the results, so this may depend on the thread count). */
#define BWD_PACK_MAX_BYTES ((size_t)64 << 20)

static int64_t bwd_maxkp(const fa_problem *pb) { return fa_round_up(pb->max_seqlen_k, 16); }

static bwd_sched bwd_schedule(const cpu_ctx *c) {
  const fa_problem *pb = c->pb;
  bwd_sched s;
  s.nrb = cpu_cdiv(pb->max_seqlen_q, c->br);
  s.ncb = cpu_cdiv(pb->max_seqlen_k, c->bc);
  s.q_units = pb->batch * pb->heads_q * s.nrb;
  s.dq_bytes = (size_t)(pb->group * pb->max_seqlen_q * c->Dp) * sizeof(float);
  s.fused = pb->batch * pb->heads_k >= BWD_FUSED_MIN_UNITS && s.dq_bytes <= BWD_FUSED_MAX_BYTES;
  s.kv_units = pb->batch * pb->heads_k * (s.fused ? 1 : s.ncb);
  if (!s.fused) s.dq_bytes = 0;
  /* Packing Q and dO once per unit instead of converting a tile per step:
   * BNHD rows lie a head-stride apart, and each key block re-reading them
   * row by row stalled on every row (D=128 f32: ~19% of the backward). */
  s.nt = cpu_threads(pb, cpu_max(s.q_units, s.kv_units), cpu_fwd_flops(pb) * 2.5);
  const int pack = cpu_pack_enabled();
  s.pack_bytes = pack && s.fused && 3 * s.dq_bytes <= BWD_FUSED_MAX_BYTES &&
                         (size_t)s.nt * 2 * s.dq_bytes <= 4 * BWD_PACK_MAX_BYTES
                     ? 2 * s.dq_bytes
                     : 0;
  /* The non-fused order loads Q and dO per step in pass 2 and K, K^T, V^T
   * per step in pass 3 (B=1, H=2, N=8192, D=128 f32: 22% of the time):
   * packed once for the call, in parallel, while small enough. */
  const size_t fl = sizeof(float);
  s.pq_bytes = (size_t)(2 * pb->batch * pb->heads_q * pb->max_seqlen_q * c->Dp) * fl;
  s.pk_bytes = (size_t)(3 * pb->batch * pb->heads_k * bwd_maxkp(pb) * c->Dp) * fl;
  if (!pack || s.fused || s.pq_bytes + s.pk_bytes > BWD_PACK_MAX_BYTES) s.pq_bytes = s.pk_bytes = 0;
  return s;
}

/* Rows [r0, r0+nr) of query head u->h of Q and dO to float32 rows (ld Dp)
 * at Q and dO. */
static void bwd_load_rows(const cpu_ctx *c, const cpu_unit *u, float *Q, float *dO, int64_t r0,
                          int64_t nr) {
  const fa_problem *pb = c->pb;
  const int64_t n0 = u->sq.q0 + r0, bw = c->Dp;
  c->kn->load_panels(Q, (int)bw, 0, cpu_row(c, &pb->q, u->sq.qb, n0, u->h),
                     pb->q.stride_seq * (int64_t)c->esize, pb->dtype, nr, c->D);
  c->kn->load_panels(dO, (int)bw, 0, cpu_row(c, &pb->dout, u->sq.qb, n0, u->h),
                     pb->dout.stride_seq * (int64_t)c->esize, pb->dtype, nr, c->D);
}

/* Row r0 of query head u->h in pq, and the distance from Q to dO there. */
static float *bwd_pq_row(const cpu_ctx *c, const bwd_bufs *b, const cpu_unit *u, int64_t r0,
                         int64_t *to_do) {
  const fa_problem *pb = c->pb;
  const int64_t maxq = pb->max_seqlen_q;
  const int64_t slots = b->pq_all ? pb->batch * pb->heads_q : pb->group;
  const int64_t slot = b->pq_all ? u->s * pb->heads_q + u->h : u->h % pb->group;
  *to_do = slots * maxq * c->Dp;
  return b->pq + (slot * maxq + r0) * c->Dp;
}

/* Rows [r0, r0+nr) of query head u->h into pq. */
static void bwd_pack_q(const cpu_ctx *c, const bwd_bufs *b, const cpu_unit *u, int64_t r0,
                       int64_t nr) {
  int64_t to_do;
  float *Q = bwd_pq_row(c, b, u, r0, &to_do);
  bwd_load_rows(c, u, Q, Q + to_do, r0, nr);
}

/* The step's Q and dO tiles, rows [r0, r0+nr) of query head u->h: rows of
 * pq, or loaded. */
static void bwd_load_q(const cpu_ctx *c, const cpu_unit *u, bwd_bufs *b, int64_t r0, int64_t nr) {
  if (b->pq) {
    int64_t to_do;
    b->Qt = bwd_pq_row(c, b, u, r0, &to_do);
    b->dOt = b->Qt + to_do;
    return;
  }
  bwd_load_rows(c, u, b->Q, b->dO, r0, nr);
  b->Qt = b->Q;
  b->dOt = b->dO;
}

/* Keys [c0, c0+nc) of K/V head u->hk (c0 a multiple of 16) in pk: K rows,
 * K^T and V^T panels. */
static void bwd_pk_tile(const cpu_ctx *c, const bwd_bufs *b, const cpu_unit *u, int64_t c0,
                        float **K, float **KT, float **VT) {
  const fa_problem *pb = c->pb;
  const int64_t per = pb->batch * pb->heads_k * bwd_maxkp(pb) * c->Dp;
  const int64_t slot = (u->s * pb->heads_k + u->hk) * bwd_maxkp(pb);
  *K = b->pk + (slot + c0) * c->Dp;
  *KT = b->pk + per + slot * c->Dp + c0 * c->D; /* 16-key panels of 16 * D */
  *VT = *KT + per;
}

/* Keys [c0, c0+nc) of K/V head u->hk: K^T and V^T in 16-wide panels (and K
 * as rows if wanted) into K, KT, VT. */
static void bwd_load_kv_to(const cpu_ctx *c, const cpu_unit *u, float *K, float *KT, float *VT,
                           int64_t c0, int64_t nc) {
  const fa_problem *pb = c->pb;
  const int64_t n0 = u->sq.k0 + c0;
  const void *k = cpu_row(c, &pb->k, u->sq.kb, n0, u->hk);
  const int64_t ks = pb->k.stride_seq * (int64_t)c->esize;
  if (K) c->kn->load_panels(K, (int)c->Dp, 0, k, ks, pb->dtype, nc, c->D);
  c->kn->load_panels_t(KT, 16, 16 * c->D, k, ks, pb->dtype, nc, c->D);
  c->kn->load_panels_t(VT, 16, 16 * c->D, cpu_row(c, &pb->v, u->sq.kb, n0, u->hk),
                       pb->v.stride_seq * (int64_t)c->esize, pb->dtype, nc, c->D);
}

/* The step's K^T and V^T (and K rows if wanted) of keys [c0, c0+nc): panels
 * of pk, or loaded. */
static void bwd_load_kv(const cpu_ctx *c, const cpu_unit *u, bwd_bufs *b, int64_t c0, int64_t nc,
                        int want_rows) {
  if (b->pk) {
    float *K, *KT, *VT;
    bwd_pk_tile(c, b, u, c0, &K, &KT, &VT);
    b->Kt = K;
    b->KTt = KT;
    b->VTt = VT;
    return;
  }
  bwd_load_kv_to(c, u, want_rows ? b->K : NULL, b->KT, b->VT, c0, nc);
  b->Kt = b->K;
  b->KTt = b->KT;
  b->VTt = b->VT;
}

/* C (ld Dp) += A B over a tile: A(i, p) = a[i*rsa + p*csa] (m x k), B row-major
 * k x Dp; lo/hi: per-row ranges of p, or NULL. */
static void bwd_acc(const cpu_ctx *c, float *C, int64_t m, int64_t k, const float *a, int64_t rsa,
                    int64_t csa, const float *B, const int32_t *lo, const int32_t *hi) {
  const int bw = cpu_dbw(c);
  const fa_gemm g = {m, c->Dp, k, a, rsa, csa, B, c->Dp, bw, bw, C, c->Dp, 1.0f, 1, NULL, lo, hi};
  c->kn->gemm(&g);
}

/* One tile of the backward: with Q, dO of rows [r0, r0+nr) and K^T, V^T of
 * keys [c0, c0+nc) loaded, leaves P in S and dS (w.r.t. scale*QK^T, before
 * the factor scale) in dS. Returns 1 if the mask's edge crosses the tile. */
static int bwd_step(const cpu_ctx *c, const cpu_unit *u, bwd_bufs *b, const float *Di, int64_t r0,
                    int64_t nr, int64_t c0, int64_t nc) {
  const fa_problem *pb = c->pb;
  const int64_t bc = c->bc, ncp = fa_round_up(nc, FA_VL);
  float *T = c->cap > 0.0f ? b->T : NULL;
  fa_gemm g = {nr, ncp,  c->D, b->Qt,    c->Dp, 1,    b->KTt, 16,  16 * c->D,
               16, b->S, bc,   c->scale, 0,     NULL, NULL,   NULL};
  c->kn->gemm(&g);
  if (c->cap > 0.0f) tile_softcap(b->S, bc, nr, ncp, c->cap, T);
  if (u->slope != 0.0f) tile_alibi(b->S, bc, nr, ncp, u->slope, r0 + u->mk.diag0, c0);
  const int partial = cpu_tile_partial(&u->mk, r0, nr, c0, nc);
  if (partial) {
    cpu_mask_ranges(&u->mk, b->lo, b->hi, r0, nr, c0, nc);
    cpu_mask_fill(b->S, bc, nr, nc, b->lo, b->hi);
  }
  if (cpu_block_tile(c, u, r0, nr, c0, nc) == CPU_BLOCKS_SOME)
    cpu_block_fill(c, u, b->S, bc, 1, r0, nr, c0, nc);
  c->kn->exp_rows(b->S, bc, nr, ncp, pb->lse + cpu_lse_index(u, r0));
  g.a = b->dOt;
  g.b = b->VTt;
  g.c = b->dS;
  g.alpha = 1.0f;
  c->kn->gemm(&g);
  /* dropout (docs/DROPOUT.md): dS = P o (Z o dP - Di), and dV takes Z o P */
  if (c->pb->dropout_p > 0.0f) cpu_dropout_apply(c, u, b->dS, bc, 1, r0, nr, c0, nc);
  c->kn->dsoftmax(b->dS, b->S, bc, nr, ncp, Di + cpu_lse_index(u, r0), T);
  if (c->pb->dropout_p > 0.0f) cpu_dropout_apply(c, u, b->S, bc, 1, r0, nr, c0, nc);
  return partial;
}

/* Pass 1: Di of rows [r0, r1) of query head u->h. */
static void bwd_di(const cpu_ctx *c, const cpu_unit *u, bwd_bufs *b, float *Di, int64_t r0,
                   int64_t r1) {
  const fa_problem *pb = c->pb;
  for (int64_t r = r0; r < r1; r++) {
    fa_load_row_f32(b->Q, cpu_row(c, &pb->o, u->sq.qb, u->sq.q0 + r, u->h), pb->dtype, c->D);
    fa_load_row_f32(b->dO, cpu_row(c, &pb->dout, u->sq.qb, u->sq.q0 + r, u->h), pb->dtype, c->D);
    Di[cpu_lse_index(u, r)] = c->kn->rowdot(b->dO, b->Q, c->D);
  }
}

/* Pass 2: dK, dV of keys [c0, c0+nc) of K/V head hk of sequence s; with
 * dQacc (fused order), also dQacc[h - first head][row] += dS K. */
static void bwd_kv(const cpu_ctx *c, bwd_bufs *b, const float *Di, int64_t s, int64_t hk,
                   int64_t c0, int64_t nc, float *dQacc) {
  const fa_problem *pb = c->pb;
  const int64_t Dp = c->Dp, br = c->br;
  cpu_unit u;
  cpu_unit_init(&u, c, s, hk * pb->group);
  int64_t rlo, rhi, t0, t1;
  fa_mask_col_range(&u.mk, c0, &rlo, &t0);
  fa_mask_col_range(&u.mk, c0 + nc - 1, &t1, &rhi);
  tile_fill(b->dK, Dp, nc, Dp, 0.0f);
  tile_fill(b->dV, Dp, nc, Dp, 0.0f);
  if (rlo < rhi) bwd_load_kv(c, &u, b, c0, nc, dQacc != NULL);
  for (int64_t h = hk * pb->group; h < (hk + 1) * pb->group; h++) {
    cpu_unit_init(&u, c, s, h);
    for (int64_t r0 = rlo; r0 < rhi; r0 += br) {
      const int64_t nr = cpu_min(br, rhi - r0);
      if (cpu_block_tile(c, &u, r0, nr, c0, nc) == CPU_BLOCKS_NONE) continue;
      bwd_load_q(c, &u, b, r0, nr);
      const int partial = bwd_step(c, &u, b, Di, r0, nr, c0, nc);
      if (partial) cpu_mask_cols(&u.mk, b->lo, b->hi, r0, nr, c0, nc);
      const int32_t *lo = partial ? b->lo : NULL, *hi = partial ? b->hi : NULL;
      bwd_acc(c, b->dV, nc, nr, b->S, 1, c->bc, b->dOt, lo, hi);
      bwd_acc(c, b->dK, nc, nr, b->dS, 1, c->bc, b->Qt, lo, hi);
      if (!dQacc) continue;
      if (partial) cpu_mask_ranges(&u.mk, b->lo, b->hi, r0, nr, c0, nc);
      bwd_acc(c, dQacc + ((h - hk * pb->group) * pb->max_seqlen_q + r0) * Dp, nr, nc, b->dS, c->bc,
              1, b->Kt, lo, hi);
    }
  }
  for (int64_t j = 0; j < nc; j++) {
    c->kn->store_row(cpu_row(c, &pb->dk, u.sq.kb, u.sq.k0 + c0 + j, hk), b->dK + j * Dp, c->scale,
                     pb->dtype, c->D);
    c->kn->store_row(cpu_row(c, &pb->dv, u.sq.kb, u.sq.k0 + c0 + j, hk), b->dV + j * Dp, 1.0f,
                     pb->dtype, c->D);
  }
}

/* Pass 3: dQ of rows [r0, r1) of query head u->h. */
static void bwd_q(const cpu_ctx *c, const cpu_unit *u, bwd_bufs *b, const float *Di, int64_t r0,
                  int64_t r1) {
  const fa_problem *pb = c->pb;
  const int64_t Dp = c->Dp, nr = r1 - r0;
  int64_t klo, khi;
  tile_fill(b->dQ, Dp, nr, Dp, 0.0f);
  fa_mask_block_range(&u->mk, r0, r1, &klo, &khi);
  if (klo < khi) bwd_load_q(c, u, b, r0, nr);
  /* key tiles on the grid of Bc from key 0, where pk's panels start */
  for (int64_t c0 = klo / c->bc * c->bc; c0 < khi; c0 += c->bc) {
    const int64_t nc = cpu_min(c->bc, khi - c0);
    if (cpu_block_tile(c, u, r0, nr, c0, nc) == CPU_BLOCKS_NONE) continue;
    bwd_load_kv(c, u, b, c0, nc, 1);
    const int partial = bwd_step(c, u, b, Di, r0, nr, c0, nc);
    if (partial) cpu_mask_ranges(&u->mk, b->lo, b->hi, r0, nr, c0, nc);
    bwd_acc(c, b->dQ, nr, nc, b->dS, c->bc, 1, b->Kt, partial ? b->lo : NULL,
            partial ? b->hi : NULL);
  }
  for (int64_t r = 0; r < nr; r++)
    c->kn->store_row(cpu_row(c, &pb->dq, u->sq.qb, u->sq.q0 + r0 + r, u->h), b->dQ + r * Dp,
                     c->scale, pb->dtype, c->D);
}

size_t fa_cpu_backward_workspace(const fa_problem *pb) {
  cpu_ctx c;
  bwd_ctx(&c, pb);
  const bwd_sched s = bwd_schedule(&c);
  return bwd_di_bytes(pb) + s.pq_bytes + s.pk_bytes +
         (size_t)s.nt * (bwd_slice(&c, NULL, NULL) + s.dq_bytes + s.pack_bytes);
}

/* Fused order: every key block of (sequence s, K/V head hk) with dQ of the
 * group's query heads accumulated in dQacc, then stored. */
static void bwd_fused(const cpu_ctx *c, bwd_bufs *b, const float *Di, int64_t s, int64_t hk,
                      float *dQacc) {
  const fa_problem *pb = c->pb;
  const fa_seq sq = fa_problem_seq(pb, s);
  const int64_t Dp = c->Dp;
  tile_fill(dQacc, Dp, pb->group * pb->max_seqlen_q, Dp, 0.0f);
  for (int64_t g = 0; b->pq && g < pb->group; g++) {
    cpu_unit u;
    cpu_unit_init(&u, c, s, hk * pb->group + g);
    bwd_pack_q(c, b, &u, 0, sq.nq);
  }
  for (int64_t c0 = 0; c0 < sq.nk; c0 += c->bc)
    bwd_kv(c, b, Di, s, hk, c0, cpu_min(c->bc, sq.nk - c0), dQacc);
  for (int64_t g = 0; g < pb->group; g++)
    for (int64_t r = 0; r < sq.nq; r++)
      c->kn->store_row(cpu_row(c, &pb->dq, sq.qb, sq.q0 + r, hk * pb->group + g),
                       dQacc + (g * pb->max_seqlen_q + r) * Dp, c->scale, pb->dtype, c->D);
}

fa_status fa_cpu_backward(const fa_problem *pb) {
  cpu_ctx c;
  bwd_ctx(&c, pb);
  const bwd_sched s = bwd_schedule(&c);
  const size_t slice = bwd_slice(&c, NULL, NULL) + s.dq_bytes + s.pack_bytes;
  float *Di = (float *)pb->workspace;
  char *packs = (char *)pb->workspace + bwd_di_bytes(pb);
  char *slices = packs + s.pq_bytes + s.pk_bytes;
#pragma omp parallel num_threads(s.nt)
  {
    bwd_bufs b;
    bwd_slice(&c, slices + (size_t)omp_get_thread_num() * slice, &b);
    b.pq = s.pq_bytes ? (float *)packs : NULL;
    b.pk = s.pk_bytes ? (float *)(packs + s.pq_bytes) : NULL;
    b.pq_all = !s.fused;
    /* Query-side units (passes 1 and 3) are (sequence, head, row block). */
#pragma omp for schedule(static, 1)
    for (int64_t w = 0; w < s.q_units; w++) {
      const int64_t sh = w / s.nrb, r0 = (w % s.nrb) * c.br;
      cpu_unit u;
      cpu_unit_init(&u, &c, sh / pb->heads_q, sh % pb->heads_q);
      if (r0 >= u.sq.nq) continue;
      bwd_di(&c, &u, &b, Di, r0, cpu_min(u.sq.nq, r0 + c.br));
      if (b.pq) bwd_pack_q(&c, &b, &u, r0, cpu_min(c.br, u.sq.nq - r0));
    }
    if (s.fused) {
      char *mine = slices + (size_t)omp_get_thread_num() * slice + slice;
      float *dQacc = (float *)(mine - s.dq_bytes - s.pack_bytes);
      b.pq = s.pack_bytes ? (float *)(mine - s.pack_bytes) : NULL;
#pragma omp for schedule(dynamic, 1)
      for (int64_t w = 0; w < s.kv_units; w++)
        bwd_fused(&c, &b, Di, w / pb->heads_k, w % pb->heads_k, dQacc);
    } else {
      if (s.pk_bytes)
#pragma omp for schedule(static, 1)
        for (int64_t w = 0; w < s.kv_units; w++) {
          const int64_t sh = w / s.ncb, c0 = (w % s.ncb) * c.bc;
          cpu_unit u;
          cpu_unit_init(&u, &c, sh / pb->heads_k, sh % pb->heads_k * pb->group);
          float *K, *KT, *VT;
          bwd_pk_tile(&c, &b, &u, c0, &K, &KT, &VT);
          if (c0 < u.sq.nk) bwd_load_kv_to(&c, &u, K, KT, VT, c0, cpu_min(c.bc, u.sq.nk - c0));
        }
#pragma omp for schedule(static, 1)
      for (int64_t w = 0; w < s.kv_units; w++) {
        const int64_t sh = w / s.ncb, c0 = (w % s.ncb) * c.bc;
        const int64_t seq = sh / pb->heads_k, hk = sh % pb->heads_k;
        const fa_seq sq = fa_problem_seq(pb, seq);
        if (c0 < sq.nk) bwd_kv(&c, &b, Di, seq, hk, c0, cpu_min(c.bc, sq.nk - c0), NULL);
      }
#pragma omp for schedule(static, 1)
      for (int64_t w = 0; w < s.q_units; w++) {
        const int64_t sh = w / s.nrb, r0 = (w % s.nrb) * c.br;
        cpu_unit u;
        cpu_unit_init(&u, &c, sh / pb->heads_q, sh % pb->heads_q);
        if (r0 < u.sq.nq) bwd_q(&c, &u, &b, Di, r0, cpu_min(u.sq.nq, r0 + c.br));
      }
    }
  }
  return FA_OK;
}
