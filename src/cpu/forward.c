/* CPU FlashAttention forward, FlashAttention-2 and -1 orders.
 *
 * Work unit: (sequence, query head, chunk of query rows), handed out
 * dynamically (heaviest causal chunks first), so one long sequence still
 * spreads over every thread and a core slowed by other work takes less.
 * Within a chunk, key tiles are outer and Br-row sub-blocks inner, so each
 * K/V tile is loaded (converted, packed) once per chunk, or, when several
 * units read every tile and the copy stays small, once per call for all of
 * them (fwd_prepack: D=64 f32 forward +2%, D=256 GQA +4%). Key tiles lie on a
 * grid of Bc from key 0, so every row sees the same tiles in the same order
 * whatever the chunking: results depend on Br and Bc only, not on threads.
 *   FLASH2: chunks of up to 8 Br rows whose Q^T (packed once), O, m and l
 *   stay in the thread's tile memory (sized to L2) for the whole key loop.
 *   FLASH1 (Algorithm 1: keys outer, queries inner): chunks of
 *   ceil(Nq / ceil(threads / (B*H))) rows whose unnormalised O, m, l live in
 *   a float32 buffer ("memory") that every key block re-reads and rescales;
 *   Q^T is re-read per key block too.
 *
 * Scores are computed transposed, S^T = K Q^T (keys x queries): K rows are the
 * broadcast operand as they come (no per-tile transpose), Q^T is packed in
 * 16-wide panels, and the online softmax runs down the columns, 8 query rows
 * per vector, without horizontal reductions. O += P V then reads P^T with
 * swapped strides. Scores are kept in log2 units (the product's scale, the
 * softcap and the ALiBi slope times log2 e; softcap commutes with the factor:
 * k cap tanh(s / cap) = (k cap) tanh(k s / (k cap))), so the exponential
 * needs no multiply in its range reduction; m is in log2 units too and lse =
 * m ln 2 + log l.
 *
 * Workspace (floats, each buffer rounded up to 64 bytes; Dp = D rounded up to
 * 8, Brp = Br rounded up to 16), per thread:
 *   Q^T: FLASH2 chunk*D, FLASH1 Brp*D;  O, m, l: chunk*Dp + 2*(chunk + Brp);
 *   K, V: 2*Bc*Dp (V's last panel padded);  S^T: Bc*Brp;  alpha: Brp;
 *   mask ranges: 2*max(Brp, Bc) int32
 * total = min(threads, units) * slice, plus the packed K and V when
 * fwd_prepack runs (Hk * K rows * (Dp + V's padded width) floats, at most
 * FWD_PACK_MAX). B=H=1, N=65536, D=64: ~0.3 MiB per thread for FLASH2;
 * FLASH1's chunk state is N*(D+2)*4 bytes = 17 MiB over all threads. */
#include <omp.h>

#include "cpu/cpu.h"

/* Forward tiles: Q^T, O (Br x D); K, V (Bc x D); S^T (Br x Bc). */
static void fwd_ctx(cpu_ctx *c, const fa_problem *pb) { cpu_ctx_init(c, pb, 2, 2, 1); }

typedef struct fwd_sched {
  int64_t chunk;   /* query rows per unit, a multiple of Br */
  int64_t nchunks; /* units per (sequence, head) */
  int64_t units;
  int nt;
  int prepack; /* K and V packed once for the call (fwd_prepack) */
} fwd_sched;

/* Largest packed K/V copy (fwd_prepack) a call makes: 64 MiB, what issue
 * 5's shapes need (32-64 MiB); bigger problems convert each tile per chunk. */
#define FWD_PACK_MAX ((size_t)64 << 20)

/* The packed K and V of every K/V head (fwd_prepack): K rows of Dp floats,
 * V in panels of vbw columns over all rows, so a tile of either is a
 * pointer, not a copy. Rows are every sequence's keys, sequence after
 * sequence (fa_seq.kpack0), wherever they lie in K and V (a KV cache's rows,
 * pages). */
static int64_t fwd_pack_rows(const fa_problem *pb) { return fa_problem_kpack_rows(pb); }
static size_t fwd_pack_bytes(const cpu_ctx *c) {
  const int64_t vw = fa_round_up(c->Dp, cpu_dbw(c));
  return (size_t)(c->pb->heads_k * fwd_pack_rows(c->pb) * (c->Dp + vw)) * sizeof(float);
}
static float *fwd_pack_k(const cpu_ctx *c, float *pack, int64_t hk) {
  return pack + hk * fwd_pack_rows(c->pb) * c->Dp;
}
static float *fwd_pack_v(const cpu_ctx *c, float *pack, int64_t hk) {
  const int64_t rows = fwd_pack_rows(c->pb), vw = fa_round_up(c->Dp, cpu_dbw(c));
  return pack + c->pb->heads_k * rows * c->Dp + hk * rows * vw;
}

static fwd_sched fwd_schedule(const cpu_ctx *c) {
  const fa_problem *pb = c->pb;
  const int64_t bh = pb->batch * pb->heads_q, nq = pb->max_seqlen_q, br = c->br;
  /* the threads the work is worth (cpu_threads), before units are cut */
  const int64_t nt = cpu_threads(pb, INT64_MAX, cpu_fwd_flops(pb));
  fwd_sched s;
  if (pb->algorithm == FA_ALGO_FLASH1) {
    const int64_t per_bh = cpu_cdiv(nt, bh);
    s.chunk = cpu_max(br, cpu_cdiv(cpu_cdiv(nq, per_bh), br) * br);
  } else {
    /* Up to 8 sub-blocks share each K/V tile while Q^T and O stay within
     * half of L2 and there are at least 4 units per thread to balance
     * (8 against 4: D=64 forward +4-6%, the K/V loads and their prefetch
     * stalls being ~7% of the time at 4). */
    int64_t l1, l2, f = 8;
    cpu_cache_sizes(&l1, &l2);
    while (f > 1 && (f * br * (c->D + c->Dp) * 4 > l2 / 2 || bh * cpu_cdiv(nq, f * br) < 4 * nt))
      f--;
    /* at least one Br: a varlen batch whose query sequences are all empty
     * (nq = 0) then has no units, where a chunk of 0 rows divided by zero */
    s.chunk = cpu_max(br, cpu_min(f * br, cpu_cdiv(nq, br) * br));
  }
  s.nchunks = cpu_cdiv(nq, s.chunk);
  s.units = bh * s.nchunks;
  s.nt = cpu_threads(pb, s.units, cpu_fwd_flops(pb));
  /* every K/V tile is read by group * nchunks units: convert and pack it once
   * for all of them when there are two or more and the packed copy stays
   * small (it is O(Hk N D), not O(N) like the rest of the forward's memory) */
  s.prepack = pb->group * s.nchunks >= 2 && fwd_pack_bytes(c) <= FWD_PACK_MAX && cpu_pack_enabled();
  return s;
}

/* Converts and packs K and V once, in parallel over (sequence, block of its
 * keys) and, where a row's heads lie apart (head-major), K/V head. Within a
 * block the reads go in address order: with heads inner (BNHD) every row's
 * heads one after another, where packing head by head read rows a
 * head-stride apart, each on its own page (D=64 f32 causal forward: 2.6% of
 * the time). Only the keys a sequence reads are packed (a KV cache's used
 * rows). */
static void fwd_prepack(const cpu_ctx *c, float *pack, int nt) {
  const fa_problem *pb = c->pb;
  const int64_t rows = fwd_pack_rows(pb), blk = 512, Hk = pb->heads_k, B = pb->batch;
  const int heads_inner =
      pb->k.stride_head < pb->k.stride_seq && pb->v.stride_head < pb->v.stride_seq;
  const int64_t hu = heads_inner ? 1 : Hk; /* heads split over units */
  const int64_t nblk = cpu_cdiv(cpu_max(1, pb->max_seqlen_k), blk), units = hu * B * nblk;
  const int vbw = cpu_dbw(c);
  const int64_t khs = pb->k.stride_head * (int64_t)c->esize,
                vhs = pb->v.stride_head * (int64_t)c->esize;
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t w = 0; w < units; w++) {
    const int64_t s = w / nblk % B, r0 = w % nblk * blk;
    const fa_seq sq = fa_problem_seq(pb, s);
    const int64_t nr = cpu_min(blk, sq.nk - r0);
    if (nr <= 0) continue;
    const int64_t h0 = heads_inner ? 0 : w / (B * nblk), h1 = heads_inner ? Hk : h0 + 1;
    cpu_kv_cursor cu = cpu_kv_at(c, &sq, 0, r0); /* head 0's rows */
    for (int64_t r = r0; r < r0 + nr;) {
      /* rows per load: one row's heads, or a run of one head's rows */
      const int64_t step = heads_inner ? 1 : cpu_min(cu.left, r0 + nr - r), g = sq.kpack0 + r;
      for (int64_t hk = h0; hk < h1; hk++) {
        c->kn->load_panels(fwd_pack_k(c, pack, hk) + g * c->Dp, (int)c->Dp, 0, cu.k + hk * khs,
                           cu.ks, pb->dtype, step, c->D);
        c->kn->load_panels(fwd_pack_v(c, pack, hk) + g * vbw, vbw, rows * vbw, cu.v + hk * vhs,
                           cu.vs, pb->dtype, step, c->D);
      }
      r += step;
      if (r < r0 + nr) cpu_kv_step(&cu, step);
    }
  }
}

typedef struct fwd_bufs {
  float *QT, *O, *m, *l, *K, *V, *ST, *alpha;
  int32_t *klo, *khi;
  float *pack;          /* packed K and V (fwd_prepack), or NULL */
  const float *Ka, *Va; /* this tile's K rows (ld Dp) and V panels */
  int64_t va_ps;        /* the V panels' stride */
} fwd_bufs;

static size_t fwd_layout(const cpu_ctx *c, const fwd_sched *s, char *base, fwd_bufs *b) {
  const int64_t Dp = c->Dp, brp = c->brp, bc = c->bc;
  const int flash1 = c->pb->algorithm == FA_ALGO_FLASH1;
  cpu_carver cv = {base, 0};
  fwd_bufs t;
  t.QT = cpu_take(&cv, (flash1 ? brp : fa_round_up(s->chunk, 16)) * c->D);
  t.O = cpu_take(&cv, s->chunk * Dp);
  t.m = cpu_take(&cv, s->chunk + brp); /* softmax_cols reads whole vectors */
  t.l = cpu_take(&cv, s->chunk + brp);
  t.K = cpu_take(&cv, bc * Dp);
  t.V = cpu_take(&cv, bc * fa_round_up(Dp, cpu_dbw(c)));
  t.ST = cpu_take(&cv, bc * brp);
  t.alpha = cpu_take(&cv, brp);
  t.klo = (int32_t *)cpu_take(&cv, cpu_max(brp, bc));
  t.khi = (int32_t *)cpu_take(&cv, cpu_max(brp, bc));
  if (b) *b = t;
  return cv.off;
}

/* Keys [c0, c0+nc) of the unit's K/V head: K as rows, V in panels. Row j's
 * load first asks for row j of the next tile (up to key khi): K/V rows lie a
 * head-stride apart, too far for the hardware prefetcher, and prefetches
 * spread over the loads keep memory busy without a burst that the miss
 * queues would drop (decode, with little work per tile, is all loads). */
static void fwd_load_kv(const cpu_ctx *c, const cpu_unit *u, fwd_bufs *b, int64_t c0, int64_t nc,
                        int64_t khi) {
  const fa_problem *pb = c->pb;
  const int vbw = cpu_dbw(c);
  /* packed already (fwd_prepack): the tile is a pointer. Its rows are
   * contiguous, which the hardware prefetcher follows; software prefetches of
   * every line of the next tile cost D=256 GQA 2%. */
  if (b->pack) {
    const int64_t g = u->sq.kpack0 + c0;
    b->Ka = fwd_pack_k(c, b->pack, u->hk) + g * c->Dp;
    b->Va = fwd_pack_v(c, b->pack, u->hk) + g * vbw;
    b->va_ps = fwd_pack_rows(pb) * vbw;
    return;
  }
  const int64_t bytes = c->D * (int64_t)c->esize;
  b->Ka = b->K;
  b->Va = b->V;
  b->va_ps = c->bc * vbw;
  /* this tile's rows, and the next tile's (pages: each cursor crosses them) */
  cpu_kv_cursor cu = cpu_kv_at(c, &u->sq, u->hk, c0);
  cpu_kv_cursor pf = cu;
  const int ahead = c0 + c->bc < khi;
  if (ahead) cpu_kv_step(&pf, c->bc);
  for (int64_t j = 0; j < nc; j++) {
    if (ahead && c0 + c->bc + j < khi) {
      for (int64_t o = 0; o < bytes; o += 64) {
        __builtin_prefetch(pf.k + o);
        __builtin_prefetch(pf.v + o);
      }
      if (c0 + c->bc + j + 1 < khi) cpu_kv_step(&pf, 1);
    }
    c->kn->load_panels(b->K + j * c->Dp, (int)c->Dp, 0, cu.k, cu.ks, pb->dtype, 1, c->D);
    c->kn->load_panels(b->V + j * vbw, vbw, c->bc * vbw, cu.v, cu.vs, pb->dtype, 1, c->D);
    if (j + 1 < nc) cpu_kv_step(&cu, 1);
  }
}

/* Q^T of rows [r0, r0+nr) in 16-wide panels (rows past nr zero). */
static void fwd_load_q(const cpu_ctx *c, const cpu_unit *u, fwd_bufs *b, int64_t r0, int64_t nr) {
  const fa_problem *pb = c->pb;
  c->kn->load_panels_t(b->QT, 16, 16 * c->D, cpu_row(c, &pb->q, u->sq.qb, u->sq.q0 + r0, u->h),
                       pb->q.stride_seq * (int64_t)c->esize, pb->dtype, nr, c->D);
}

/* S^T of rows [r0, r0+nr) against keys [c0, c0+nc): softcap, ALiBi and, on
 * tiles the mask's edge crosses, -inf where masked, plus each row's visible
 * key range in klo/khi for O += P V (returns 1 then). */
static int fwd_scores(const cpu_ctx *c, const cpu_unit *u, fwd_bufs *b, const float *QT, int64_t r0,
                      int64_t nr, int64_t c0, int64_t nc) {
  const int64_t brp = c->brp, ncol = fa_round_up(nr, FA_VL);
  const fa_gemm g = {
      nc, ncol, c->D, b->Ka, c->Dp, 1, QT, 16, 16 * c->D, 16, b->ST, brp, c->scale * FA_LOG2E,
      0,  NULL, NULL, NULL};
  c->kn->gemm(&g);
  if (c->cap > 0.0f) tile_softcap(b->ST, brp, nc, ncol, c->cap * FA_LOG2E, NULL);
  if (u->slope != 0.0f)
    tile_alibi_t(b->ST, brp, nc, ncol, u->slope * FA_LOG2E, r0 + u->mk.diag0, c0);
  if (cpu_block_tile(c, u, r0, nr, c0, nc) == CPU_BLOCKS_SOME)
    cpu_block_fill(c, u, b->ST, 1, brp, r0, nr, c0, nc);
  if (!cpu_tile_partial(&u->mk, r0, nr, c0, nc)) return 0;
  cpu_mask_cols(&u->mk, b->klo, b->khi, r0, nr, c0, nc);
  cpu_mask_fill(b->ST, brp, nc, nr, b->klo, b->khi);
  cpu_mask_ranges(&u->mk, b->klo, b->khi, r0, nr, c0, nc);
  return 1;
}

/* One online-softmax step: rows [r0, r0+nr) (their Q^T panels at QT)
 * against keys [c0, c0+nc) (K, V loaded), updating O (ld Dp), m, l. */
static void fwd_step(const cpu_ctx *c, const cpu_unit *u, fwd_bufs *b, const float *QT, int64_t r0,
                     int64_t nr, int64_t c0, int64_t nc, float *O, float *m, float *l) {
  const int partial = fwd_scores(c, u, b, QT, r0, nr, c0, nc);
  c->kn->softmax_cols(b->ST, c->brp, nc, fa_round_up(nr, FA_VL), m, l, b->alpha);
  /* dropout after l: the normaliser (and lse) is that of the undropped P */
  if (c->pb->dropout_p > 0.0f) cpu_dropout_apply(c, u, b->ST, 1, c->brp, r0, nr, c0, nc);
  const int vbw = cpu_dbw(c);
  const fa_gemm g = {nr,
                     c->Dp,
                     nc,
                     b->ST,
                     1,
                     c->brp,
                     b->Va,
                     vbw,
                     b->va_ps,
                     vbw,
                     O,
                     c->Dp,
                     1.0f,
                     1,
                     b->alpha,
                     partial ? b->klo : NULL,
                     partial ? b->khi : NULL};
  c->kn->gemm(&g);
}

/* O /= l, store O rows and lse of rows [r0, r0+nr). */
static void fwd_finish(const cpu_ctx *c, const cpu_unit *u, int64_t r0, int64_t nr, const float *O,
                       const float *m, const float *l) {
  const fa_problem *pb = c->pb;
  for (int64_t r = 0; r < nr; r++) {
    void *dst = cpu_row(c, &pb->o, u->sq.qb, u->sq.q0 + r0 + r, u->h);
    /* a row with l = 0 saw no key: O = 0, lse = -inf; NaN l propagates */
    c->kn->store_row(dst, O + r * c->Dp, l[r] == 0.0f ? 0.0f : 1.0f / l[r], pb->dtype, c->D);
    if (pb->lse)
      pb->lse[cpu_lse_index(u, r0 + r)] = l[r] == 0.0f ? -INFINITY : m[r] * FA_LN2 + logf(l[r]);
  }
}

/* Rows [q0, q1): key tiles outer, Br sub-blocks inner (see the top). */
static void fwd_chunk(const cpu_ctx *c, const cpu_unit *u, fwd_bufs *b, int64_t q0, int64_t q1) {
  const int64_t Dp = c->Dp, br = c->br, bc = c->bc;
  const int flash1 = c->pb->algorithm == FA_ALGO_FLASH1;
  int64_t klo, khi;
  tile_fill(b->O, Dp, q1 - q0, Dp, 0.0f);
  tile_fill(b->m, 1, fa_round_up(q1 - q0, FA_VL), 1, -INFINITY);
  tile_fill(b->l, 1, fa_round_up(q1 - q0, FA_VL), 1, 0.0f);
  fa_mask_block_range(&u->mk, q0, q1, &klo, &khi);
  if (!flash1 && klo < khi) fwd_load_q(c, u, b, q0, q1 - q0);
  for (int64_t c0 = klo / bc * bc; c0 < khi; c0 += bc) {
    const int64_t nc = cpu_min(bc, khi - c0);
    int needed = 0; /* a block mask may hide the tile from every sub-block */
    for (int64_t r0 = q0; r0 < q1 && !needed; r0 += br)
      needed = cpu_block_tile(c, u, r0, cpu_min(br, q1 - r0), c0, nc) != CPU_BLOCKS_NONE;
    if (!needed) continue;
    fwd_load_kv(c, u, b, c0, nc, khi);
    for (int64_t r0 = q0; r0 < q1; r0 += br) {
      const int64_t nr = cpu_min(br, q1 - r0), i = r0 - q0;
      int64_t lo, hi;
      fa_mask_block_range(&u->mk, r0, r0 + nr, &lo, &hi);
      if (hi <= c0 || lo >= c0 + nc) continue;
      if (cpu_block_tile(c, u, r0, nr, c0, nc) == CPU_BLOCKS_NONE) continue;
      if (flash1) fwd_load_q(c, u, b, r0, nr);
      fwd_step(c, u, b, flash1 ? b->QT : b->QT + i * c->D, r0, nr, c0, nc, b->O + i * Dp, b->m + i,
               b->l + i);
    }
  }
  for (int64_t r0 = q0; r0 < q1; r0 += br) {
    const int64_t nr = cpu_min(br, q1 - r0), i = r0 - q0;
    fwd_finish(c, u, r0, nr, b->O + i * Dp, b->m + i, b->l + i);
  }
}

size_t fa_cpu_forward_workspace(const fa_problem *pb) {
  if (cpu_decode_applies(pb)) return cpu_decode_workspace(pb);
  cpu_ctx c;
  fwd_ctx(&c, pb);
  const fwd_sched s = fwd_schedule(&c);
  return (size_t)s.nt * fwd_layout(&c, &s, NULL, NULL) + (s.prepack ? fwd_pack_bytes(&c) : 0);
}

fa_status fa_cpu_forward(const fa_problem *pb) {
  if (cpu_decode_applies(pb)) return cpu_decode_forward(pb);
  cpu_ctx c;
  fwd_ctx(&c, pb);
  const fwd_sched s = fwd_schedule(&c);
  const size_t slice = fwd_layout(&c, &s, NULL, NULL);
  float *pack = s.prepack ? (float *)((char *)pb->workspace + (size_t)s.nt * slice) : NULL;
  if (pack) fwd_prepack(&c, pack, s.nt);
#pragma omp parallel for num_threads(s.nt) schedule(dynamic, 1)
  for (int64_t w = 0; w < s.units; w++) {
    /* last chunks first: under a causal mask they see the most keys */
    const int64_t sh = w / s.nchunks, k = s.nchunks - 1 - w % s.nchunks;
    cpu_unit u;
    cpu_unit_init(&u, &c, sh / pb->heads_q, sh % pb->heads_q);
    const int64_t r0 = k * s.chunk, r1 = cpu_min(u.sq.nq, r0 + s.chunk);
    if (r0 >= r1) continue;
    fwd_bufs b;
    fwd_layout(&c, &s, (char *)pb->workspace + (size_t)omp_get_thread_num() * slice, &b);
    b.pack = pack;
    fwd_chunk(&c, &u, &b, r0, r1);
  }
  return FA_OK;
}
