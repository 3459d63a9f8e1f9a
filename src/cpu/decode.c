/* CPU FlashAttention-2 forward for decode shapes: few query rows (Nq <=
 * CPU_DECODE_NQ) and few per K/V head (Nq * group <= CPU_DECODE_ROWS), where
 * the tile path's 8- and 16-wide query panels would sit mostly empty, its
 * per-tile overhead would hide the one job left, streaming K and V from
 * memory once, and its units, one per query head, would each stream them.
 *
 * The keys of each sequence are cut into a fixed number of splits chosen from
 * the problem alone (never from the thread count), so results are bitwise the
 * same on any number of threads. A work unit is one split of one sequence,
 * every K/V head, block by block (DEC_BK keys; rows_bk, about 256 KiB of K,
 * on the key-row path). With one query row per query head and 1, 2 or 4
 * query heads per K/V head (dec_rows_path), a block with nothing to apply
 * per element (no partial mask, softcap, ALiBi, block mask or dropout; f32,
 * f16 or bf16 rows, D a multiple of 8) runs every head at once in key-row
 * order (kern.h's dots_rows, softmax_step_cols, pv_rows): each K row, then
 * each V row, is read whole and in address order, which the hardware
 * prefetcher streams at the core's full DRAM bandwidth (head by head, 2 KiB
 * row stride, a head's 256 bytes at a time, it fetched half of that), and
 * each K or V vector serves the query heads of its group. Other blocks, and
 * other shapes (several query rows, larger GQA groups), go
 * head by head: S = Q K^T by dot products along D for every query row of the
 * head's GQA group, the online softmax along the rows, O += P V, with the
 * masks applied per element and software prefetches for the next block.
 * Each split leaves its unnormalised O and (m, l) for every row in the
 * workspace; a second pass combines the splits of each row in split order:
 * M = max m_s, L = sum e^(m_s - M) l_s, O = sum e^(m_s - M) O_s / L,
 * lse = M + log L.
 *
 * Rows of a head are head-major: row g*nq + i is query i of query head
 * hk*group + g, so softcap, ALiBi, block masks and dropout apply per query
 * head on row blocks as in the tile path; row hk*rows + g*nq + i of a split
 * is that row of K/V head hk.
 *
 * Workspace (floats, each buffer rounded up to 64 bytes), rows = Nq * group,
 * rall = Hk * rows, rall8 = rall rounded up to 8: per thread Q (rall x Dp),
 * K and V (DEC_BK x Dp), S (rows_bk x rall8), alpha (rall8), two int32 ranges
 * (rows), Hk head records and Hk x group units; per (sequence, split) O
 * (rall x Dp), m and l (rall8): O(rall * D) per split. */
#include <omp.h>

#include "cpu/cpu.h"

enum {
  DEC_BK = 32,         /* keys per block: K and V of one block stay in L1 */
  DEC_MIN_SPLIT = 512, /* keys per split at least, so the combine stays small */
  DEC_MAX_SPLITS = 16, /* splits per (sequence, K/V head) at most */
  DEC_PREFETCH = 16,   /* keys ahead that each row load prefetches (measured best) */
  DEC_PAGE_AHEAD = 64, /* key-row path: keys ahead whose K/V pages get a first prefetch */
  /* key-row path: a block's K rows (then its V rows) about this many bytes,
   * at least DEC_BK keys and at most DEC_ROWS_MAX. Reading K and V in
   * alternate 64 KiB runs (32 keys at H=8, D=128, f16) read 0.83-0.89 of
   * one stream's DRAM rate on a Zen 4 host in its fast-DRAM minutes, 256 KiB
   * runs 0.95-1.04 (with no arithmetic: tools/dev/kv_stream.c); the decode went
   * 4-7% faster with them, and 1-7% faster again with 512 KiB runs (Zen 4
   * host, alternating runs; docs/PERF.md, "CPU: decode and KV cache") */
  DEC_ROWS_BYTES = 512 << 10,
  DEC_ROWS_MAX = 256
};

int cpu_decode_applies(const fa_problem *pb) {
  return pb->algorithm == FA_ALGO_FLASH2 && pb->max_seqlen_q >= 1 &&
         pb->max_seqlen_q <= CPU_DECODE_NQ && pb->max_seqlen_q * pb->group <= CPU_DECODE_ROWS;
}

typedef struct dec_plan {
  int64_t nq, rows;    /* query rows per sequence (the longest) and per K/V head */
  int64_t rall, rall8; /* rows of every K/V head, and rounded up to whole vectors */
  int64_t split;       /* keys per split, a multiple of DEC_BK */
  int64_t nsplit;      /* splits per (sequence, K/V head) */
  int64_t rows_bk;     /* key-row path: keys per block (DEC_ROWS_BYTES) */
  int64_t units;
  int nt;
} dec_plan;

/* The key-row path's shapes: one query row per query head, 1, 2 or 4 query
 * heads per K/V head. Larger groups are compute-bound and go head by head,
 * whose register tiles keep O across keys (8 per K/V head: the same time on
 * either path, 16: 1.2x slower key-row, on a Zen 4 host), and so do
 * ratios such as 3. */
static int dec_rows_path(const fa_problem *pb, const dec_plan *p) {
  const int64_t g = pb->group;
  return p->nq == 1 && (g == 1 || g == 2 || g == 4);
}

static dec_plan dec_make_plan(const fa_problem *pb) {
  dec_plan p;
  p.nq = pb->max_seqlen_q;
  p.rows = p.nq * pb->group;
  p.rall = p.rows * pb->heads_k;
  p.rall8 = fa_round_up(p.rall, FA_VL);
  const int64_t nk = cpu_max(1, pb->max_seqlen_k);
  p.split = cpu_max(DEC_MIN_SPLIT, fa_round_up(cpu_cdiv(nk, DEC_MAX_SPLITS), DEC_BK));
  p.nsplit = cpu_cdiv(nk, p.split);
  const int64_t row = pb->heads_k * pb->headdim * (int64_t)fa_dtype_bytes(pb->dtype);
  p.rows_bk =
      dec_rows_path(pb, &p) ? cpu_min(DEC_ROWS_MAX, cpu_max(DEC_BK, DEC_ROWS_BYTES / row)) : DEC_BK;
  p.units = pb->batch * p.nsplit;
  /* memory-bound: each K/V byte counted as 4 FLOPs (~20 GB/s a core) */
  const int64_t kv_bytes =
      2 * pb->batch * pb->heads_k * nk * pb->headdim * (int64_t)fa_dtype_bytes(pb->dtype);
  p.nt = cpu_threads(pb, p.units, cpu_fwd_flops(pb) + 4.0 * (double)kv_bytes);
  return p;
}

typedef struct dec_state {
  float *O, *m, *l;
} dec_state;

/* One split's view of a K/V head: its query heads' units and rows. */
typedef struct dec_head {
  cpu_unit *u;    /* group of them */
  const float *Q; /* rows x Dp */
  dec_state st;
} dec_head;

typedef struct dec_bufs {
  float *Q, *K, *V, *S, *alpha;
  int32_t *klo, *khi;
  dec_head *heads;
} dec_bufs;

static size_t dec_thread_layout(const cpu_ctx *c, const dec_plan *p, char *base, dec_bufs *b) {
  cpu_carver cv = {base, 0};
  dec_bufs t;
  t.Q = cpu_take(&cv, c->pb->heads_k * p->rows * c->Dp);
  t.K = cpu_take(&cv, DEC_BK * c->Dp);
  t.V = cpu_take(&cv, DEC_BK * c->Dp);
  t.S = cpu_take(&cv, p->rall8 * p->rows_bk); /* rows x DEC_BK, or rows_bk x rall8 */
  t.alpha = cpu_take(&cv, p->rall8);
  t.klo = (int32_t *)cpu_take(&cv, p->rows);
  t.khi = (int32_t *)cpu_take(&cv, p->rows);
  const int64_t Hk = c->pb->heads_k, G = c->pb->group;
  t.heads = (dec_head *)cpu_take(&cv, cpu_cdiv(Hk * (int64_t)sizeof(dec_head), sizeof(float)));
  cpu_unit *units =
      (cpu_unit *)cpu_take(&cv, cpu_cdiv(Hk * G * (int64_t)sizeof(cpu_unit), sizeof(float)));
  if (base)
    for (int64_t hk = 0; hk < Hk; hk++) t.heads[hk].u = units + hk * G;
  if (b) *b = t;
  return cv.off;
}

static size_t dec_state_layout(const cpu_ctx *c, const dec_plan *p, char *base, dec_state *st) {
  cpu_carver cv = {base, 0};
  dec_state t;
  t.O = cpu_take(&cv, p->rall * c->Dp);
  t.m = cpu_take(&cv, p->rall8);
  t.l = cpu_take(&cv, p->rall8);
  if (st) *st = t;
  return cv.off;
}

static void dec_ctx(cpu_ctx *c, const fa_problem *pb) { cpu_ctx_init(c, pb, 2, 2, 1); }

size_t cpu_decode_workspace(const fa_problem *pb) {
  cpu_ctx c;
  dec_ctx(&c, pb);
  const dec_plan p = dec_make_plan(pb);
  return (size_t)p.nt * dec_thread_layout(&c, &p, NULL, NULL) +
         (size_t)p.units * dec_state_layout(&c, &p, NULL, NULL);
}

/* K and V rows read in place by the kernels (kern.h's load_kv8 dtypes, whole
 * vectors), not converted into float32 rows first. */
static int dec_direct(const cpu_ctx *c) {
  const fa_dtype dt = c->pb->dtype;
  return (dt == FA_DTYPE_F32 || dt == FA_DTYPE_F16 || dt == FA_DTYPE_BF16) && c->D == c->Dp;
}

/* Keys [c0, c0+nc) of K/V head hk into its rows' O, m, l. */
static void dec_block(const cpu_ctx *c, dec_bufs *b, dec_head *hd, int64_t hk, int64_t c0,
                      int64_t nc, int64_t kend) {
  const fa_problem *pb = c->pb;
  const int64_t Dp = c->Dp, G = pb->group;
  const fa_seq *sq = &hd->u[0].sq;
  const fa_mask *mk = &hd->u[0].mk;
  const int64_t nq = sq->nq, rows = nq * G;
  int blocks[CPU_DECODE_ROWS], needed = 0;
  for (int64_t g = 0; g < G; g++) {
    blocks[g] = cpu_block_tile(c, &hd->u[g], 0, nq, c0, nc);
    needed |= blocks[g] != CPU_BLOCKS_NONE;
  }
  if (!needed) return;
  /* K and V straight from storage (dec_direct), else converted to float32
   * rows in b->K, b->V first */
  const int direct = dec_direct(c);
  /* the block's rows are consecutive (dec_split cuts blocks at page ends);
   * prefetches run ahead to kend, the end of their run */
  const cpu_kv_cursor cu = cpu_kv_at(c, sq, hk, c0);
  const int64_t ks = cu.ks, vs = cu.vs;
  const char *k = cu.k, *v = cu.v;
  kend = cpu_min(kend, c0 + cu.left);
  const fa_dtype kdt = direct ? pb->dtype : FA_DTYPE_F32;
  const int64_t kvs = direct ? 0 : Dp * (int64_t)sizeof(float), npf = direct ? kend - c0 : 0;
  if (!direct)
    c->kn->load_kv(b->K, b->V, Dp, k, ks, v, vs, pb->dtype, nc, c->D, DEC_PREFETCH, kend - c0);
  c->kn->dots_kv(rows, nc, Dp, hd->Q, Dp, direct ? k : (const char *)b->K, direct ? ks : kvs, kdt,
                 b->S, DEC_BK, c->scale, DEC_PREFETCH, npf);
  const int partial = cpu_tile_partial(mk, 0, nq, c0, nc);
  if (partial) cpu_mask_ranges(mk, b->klo, b->khi, 0, nq, c0, nc);
  for (int64_t g = 0; g < G; g++) {
    float *Sg = b->S + g * nq * DEC_BK;
    if (c->cap > 0.0f) tile_softcap(Sg, DEC_BK, nq, nc, c->cap, NULL);
    if (hd->u[g].slope != 0.0f) tile_alibi(Sg, DEC_BK, nq, nc, hd->u[g].slope, mk->diag0, c0);
    if (blocks[g] == CPU_BLOCKS_SOME) cpu_block_fill(c, &hd->u[g], Sg, DEC_BK, 1, 0, nq, c0, nc);
    if (blocks[g] == CPU_BLOCKS_NONE) tile_fill(Sg, DEC_BK, nq, nc, -INFINITY);
    if (partial) {
      cpu_mask_fill(Sg, DEC_BK, nq, nc, b->klo, b->khi);
      if (g > 0) /* every head's rows see the same keys */
        for (int64_t i = 0; i < nq; i++) {
          b->klo[g * nq + i] = b->klo[i];
          b->khi[g * nq + i] = b->khi[i];
        }
    }
  }
  const int64_t ncp = fa_round_up(nc, FA_VL);
  if (ncp > nc) tile_fill(b->S + nc, DEC_BK, rows, ncp - nc, -INFINITY);
  c->kn->softmax_step_rows(b->S, DEC_BK, rows, ncp, hd->st.m, hd->st.l, b->alpha);
  /* dropout after l: the normaliser (and lse) is that of the undropped P */
  if (pb->dropout_p > 0.0f)
    for (int64_t g = 0; g < G; g++)
      cpu_dropout_apply(c, &hd->u[g], b->S + g * nq * DEC_BK, DEC_BK, 1, 0, nq, c0, nc);
  c->kn->pv_kv(rows, nc, Dp, b->S, DEC_BK, direct ? v : (const char *)b->V, direct ? vs : kvs, kdt,
               hd->st.O, Dp, b->alpha, partial ? b->klo : NULL, partial ? b->khi : NULL,
               DEC_PREFETCH, npf);
}

/* Keys [c0, c0+nc) for every K/V head at once (one query row per query
 * head), in key-row order (kern.h's dots_rows / pv_rows): the path of blocks
 * with nothing to apply per element, f32, f16 or bf16 rows read in place. */
static void dec_rows_block(const cpu_ctx *c, const dec_plan *p, const dec_bufs *b,
                           const dec_state *st, const fa_seq *sq, int64_t c0, int64_t nc,
                           int64_t khi) {
  const fa_problem *pb = c->pb;
  const int64_t es = c->esize;
  /* One line per 4 KiB page of the K and V rows DEC_PAGE_AHEAD keys on: the
   * hardware prefetcher streams within a page but starts each page over;
   * asked early, it streams every page from its start. One prefetch per two
   * keys at H=8, D=128, f16, not one per line (which was slower); from DRAM
   * +5-7% (f16/bf16/f32, alternating runs on a Zen 4 host). */
  int64_t j = c0 + DEC_PAGE_AHEAD;
  const int64_t jend = cpu_min(khi, c0 + DEC_PAGE_AHEAD + nc);
  const int64_t khs = pb->k.stride_head * es, vhs = pb->v.stride_head * es, G = pb->group;
  const int outer = pb->k.stride_head > pb->k.stride_seq; /* each head's keys contiguous */
  if (j < jend) /* in runs of consecutive rows (pages); every head's where heads are outer */
    for (cpu_kv_cursor pf = cpu_kv_at(c, sq, 0, j);;) {
      const int64_t n = cpu_min(pf.left, jend - j);
      for (int64_t h = 0; h < (outer ? pb->heads_k : 1); h++) {
        for (int64_t o = 0; o < n * pf.ks; o += 4096) __builtin_prefetch(pf.k + h * khs + o, 0, 2);
        for (int64_t o = 0; o < n * pf.vs; o += 4096) __builtin_prefetch(pf.v + h * vhs + o, 0, 2);
      }
      if ((j += n) >= jend) break;
      cpu_kv_step(&pf, n);
    }
  /* The block's K rows, run by run (a paged cache's pages), then its V
   * rows: long K and V streams, not one page's each in turn (alternating
   * 32 KiB runs, pages of 16 keys at H=8, D=128, f16, ran 1.35x slower).
   * Heads outside the rows ((B, H, N, D): each head's keys contiguous) go
   * a vector of query rows at a time, 8 / group K/V heads: each call then
   * streams those heads' runs rather than every head's 256 bytes of each
   * key in turn. */
  const int64_t step = outer ? FA_VL : p->rall;
  cpu_kv_cursor cu = cpu_kv_at(c, sq, 0, c0);
  for (int64_t j0 = 0;;) {
    const int64_t n = cpu_min(cu.left, nc - j0);
    for (int64_t r0 = 0; r0 < p->rall; r0 += step)
      c->kn->dots_rows(cpu_min(step, p->rall - r0), n, c->Dp, b->Q + r0 * c->Dp, c->Dp,
                       cu.k + r0 / p->rows * khs, cu.ks, khs, G, pb->dtype,
                       b->S + j0 * p->rall8 + r0, p->rall8, c->scale);
    if ((j0 += n) >= nc) break;
    cpu_kv_step(&cu, n);
  }
  c->kn->softmax_step_cols(b->S, p->rall8, nc, p->rall8, st->m, st->l, b->alpha);
  cu = cpu_kv_at(c, sq, 0, c0);
  for (int64_t j0 = 0;;) { /* O rescaled with the first run only: one pass over it, not a page's */
    const int64_t n = cpu_min(cu.left, nc - j0);
    for (int64_t r0 = 0; r0 < p->rall; r0 += step)
      c->kn->pv_rows(cpu_min(step, p->rall - r0), n, c->Dp, b->S + j0 * p->rall8 + r0, p->rall8,
                     cu.v + r0 / p->rows * vhs, cu.vs, vhs, G, pb->dtype, st->O + r0 * c->Dp, c->Dp,
                     j0 ? NULL : b->alpha + r0);
    if ((j0 += n) >= nc) break;
    cpu_kv_step(&cu, n);
  }
}

/* Split sp of sequence s, every K/V head: block by block, the heads of a
 * block in turn, so that in (B, N, H, D) storage the keys stream through
 * memory contiguously (one head at a time would read 1/H of each key row
 * and leave the rest of every DRAM page and prefetched line to waste). */
static void dec_split(const cpu_ctx *c, const dec_plan *p, dec_bufs *b, char *states, size_t sslice,
                      int64_t s, int64_t sp) {
  const fa_problem *pb = c->pb;
  const int64_t Dp = c->Dp, G = pb->group, Hk = pb->heads_k;
  const fa_seq sq = fa_problem_seq(pb, s);
  const int64_t nq = sq.nq, rows = p->rows;
  dec_head *hd = b->heads;
  dec_state st; /* every K/V head's rows of this split */
  dec_state_layout(c, p, states + (size_t)(s * p->nsplit + sp) * sslice, &st);
  tile_fill(st.O, Dp, p->rall, Dp, 0.0f);
  tile_fill(st.m, 1, p->rall8, 1, -INFINITY);
  tile_fill(st.l, 1, p->rall8, 1, 0.0f);
  for (int64_t hk = 0; hk < Hk; hk++)
    hd[hk].st = (dec_state){st.O + hk * rows * Dp, st.m + hk * rows, st.l + hk * rows};
  if (nq == 0) return;
  int64_t klo, khi;
  const fa_mask mk = fa_problem_mask(pb, &sq);
  fa_mask_block_range(&mk, 0, nq, &klo, &khi);
  klo = cpu_max(klo, sp * p->split);
  khi = cpu_min(khi, (sp + 1) * p->split);
  if (klo >= khi) return;
  /* blocks with nothing to apply per element take the key-row path */
  int rowwise = dec_rows_path(pb, p) && dec_direct(c) && c->cap == 0.0f && pb->dropout_p == 0.0f &&
                !pb->block_mask;
  for (int64_t hk = 0; hk < Hk; hk++) {
    float *Q = b->Q + hk * rows * Dp;
    hd[hk].Q = Q;
    for (int64_t g = 0; g < G; g++) {
      cpu_unit_init(&hd[hk].u[g], c, s, hk * G + g);
      rowwise &= hd[hk].u[g].slope == 0.0f;
      for (int64_t i = 0; i < nq; i++)
        c->kn->load_panels(Q + (g * nq + i) * Dp, (int)Dp, 0,
                           cpu_row(c, &pb->q, sq.qb, sq.q0 + i, hk * G + g),
                           pb->q.stride_seq * (int64_t)c->esize, pb->dtype, 1, c->D);
    }
  }
  /* Heads side by side in each key row (BNHD): while the heads of a block run,
   * the next block's K and V rows are prefetched whole into L2, a share per
   * head, in address order, so memory sees two sequential streams; each
   * head's kernel still prefetches its own row slices into L1. Measured (H=8,
   * D=128, Nk=16384, f16, 64 MiB of K/V, six alternating runs): 2.66 ms
   * against 2.86 without the L2 stream, 7% faster; the same stream into L1
   * in place of the per-head prefetches took 3.6 ms (128 KiB per block
   * evicts the block in use). Splitting each head's burst (K before its
   * block, V after): 3-20% faster over eight alternating rounds on a Zen 4
   * host. */
  const int64_t es = c->esize, D = c->D;
  const int whole = Hk > 1 && pb->k.stride_head == D && pb->v.stride_head == D;
  const int64_t span = Hk * D * es;
  for (int64_t c0 = klo; c0 < khi;) {
    const int64_t nr = cpu_min(p->rows_bk, khi - c0);
    if (rowwise && !cpu_tile_partial(&mk, 0, nq, c0, nr)) {
      dec_rows_block(c, p, b, &st, &sq, c0, nr, khi);
      c0 += nr;
      continue;
    }
    /* head-by-head blocks end where a page does: their rows are consecutive */
    const int64_t run = cpu_kv_at(c, &sq, 0, c0).left;
    const int64_t nc = cpu_min(cpu_min(DEC_BK, khi - c0), run);
    const int64_t n1 = cpu_min(DEC_BK, khi - c0 - nc); /* next block's keys, about */
    for (int64_t hk = 0; hk < Hk; hk++) {
      /* K's share before the head's block, V's after it: two bursts half
       * as long, which stall less on full fill buffers */
      cpu_kv_cursor pf;
      const int64_t j0 = hk * n1 / Hk, j1 = (hk + 1) * n1 / Hk;
      if (whole && j1 > j0) {
        pf = cpu_kv_at(c, &sq, 0, c0 + nc + j0);
        for (int64_t j = j0; j < j1; j++) {
          for (int64_t o = 0; o < span; o += 64) __builtin_prefetch(pf.k + o, 0, 2);
          if (j + 1 < j1) cpu_kv_step(&pf, 1);
        }
      }
      dec_block(c, b, &hd[hk], hk, c0, nc, khi);
      if (whole && j1 > j0) {
        pf = cpu_kv_at(c, &sq, 0, c0 + nc + j0);
        for (int64_t j = j0; j < j1; j++) {
          for (int64_t o = 0; o < span; o += 64) __builtin_prefetch(pf.v + o, 0, 2);
          if (j + 1 < j1) cpu_kv_step(&pf, 1);
        }
      }
    }
    c0 += nc;
  }
}

/* Rows of (sequence s, K/V head hk): the splits combined in split order, O
 * and lse stored. */
static void dec_combine(const cpu_ctx *c, const dec_plan *p, char *states, size_t sslice, int64_t s,
                        int64_t hk) {
  const fa_problem *pb = c->pb;
  const int64_t Dp = c->Dp, G = pb->group;
  float acc[FA_MAX_HEADDIM + FA_VL];
  const int64_t nq = fa_problem_seq(pb, s).nq, base = s * p->nsplit;
  for (int64_t g = 0; g < G && nq > 0; g++) {
    cpu_unit u;
    cpu_unit_init(&u, c, s, hk * G + g);
    for (int64_t i = 0; i < nq; i++) {
      const int64_t r = hk * p->rows + g * nq + i;
      float M = -INFINITY, L = 0.0f;
      for (int64_t sp = 0; sp < p->nsplit; sp++) {
        dec_state st;
        dec_state_layout(c, p, states + (size_t)(base + sp) * sslice, &st);
        if (st.l[r] != 0.0f && st.m[r] > M) M = st.m[r];
      }
      const float mref = M == -INFINITY ? 0.0f : M;
      for (int64_t d = 0; d < Dp; d++) acc[d] = 0.0f;
      for (int64_t sp = 0; sp < p->nsplit; sp++) {
        dec_state st;
        dec_state_layout(c, p, states + (size_t)(base + sp) * sslice, &st);
        if (st.l[r] == 0.0f) continue; /* saw no key (m may be -inf) */
        const float w = expf(st.m[r] - mref);
        L += w * st.l[r];
        const float *o = st.O + r * Dp;
        for (int64_t d = 0; d < Dp; d++) acc[d] += w * o[d];
      }
      void *dst = cpu_row(c, &pb->o, u.sq.qb, u.sq.q0 + i, u.h);
      c->kn->store_row(dst, acc, L == 0.0f ? 0.0f : 1.0f / L, pb->dtype, c->D);
      if (pb->lse) pb->lse[cpu_lse_index(&u, i)] = L == 0.0f ? -INFINITY : M + logf(L);
    }
  }
}

fa_status cpu_decode_forward(const fa_problem *pb) {
  cpu_ctx c;
  dec_ctx(&c, pb);
  const dec_plan p = dec_make_plan(pb);
  const size_t tslice = dec_thread_layout(&c, &p, NULL, NULL);
  const size_t sslice = dec_state_layout(&c, &p, NULL, NULL);
  char *states = (char *)pb->workspace + (size_t)p.nt * tslice;
#pragma omp parallel num_threads(p.nt)
  {
    dec_bufs b;
    dec_thread_layout(&c, &p, (char *)pb->workspace + (size_t)omp_get_thread_num() * tslice, &b);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < p.units; w++)
      dec_split(&c, &p, &b, states, sslice, w / p.nsplit, w % p.nsplit);
#pragma omp for schedule(static)
    for (int64_t sh = 0; sh < pb->batch * pb->heads_k; sh++)
      dec_combine(&c, &p, states, sslice, sh / pb->heads_k, sh % pb->heads_k);
  }
  return FA_OK;
}
