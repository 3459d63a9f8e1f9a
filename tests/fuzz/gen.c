/* Drawing a valid case from a seed (see fuzz.h). Sizes are kept small (about
 * 2^17 multiply-adds per pass) so that thousands of cases run in a minute,
 * with the lengths and head dims where tiles end drawn more often. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "fuzz.h"

uint64_t fz_mix(uint64_t a, uint64_t b) {
  tu_rng r;
  tu_rng_seed(&r, a ^ (b * 0xd1342543de82ef95ull));
  return tu_rng_next(&r);
}

static int64_t rint_(tu_rng *r, int64_t lo, int64_t hi) {
  return lo + (int64_t)(tu_rng_next(r) % (uint64_t)(hi - lo + 1));
}
static int chance(tu_rng *r, int pct) { return (int)(tu_rng_next(r) % 100) < pct; }
static int64_t pick(tu_rng *r, const int64_t *v, int n) { return v[tu_rng_next(r) % (uint64_t)n]; }

/* A sequence length: tile edges (16, 32, 64, 128 and one either side), 1, 2,
 * small odd ones, or anything up to 100. */
static int64_t draw_len(tu_rng *r) {
  static const int64_t edges[] = {1,  2,  3,  5,  7,  15, 16,  17,  31,  32,
                                  33, 63, 64, 65, 96, 97, 127, 128, 129, 200};
  return chance(r, 55) ? pick(r, edges, (int)(sizeof edges / sizeof edges[0])) : rint_(r, 1, 100);
}

static int64_t draw_headdim(tu_rng *r) {
  static const int64_t common[] = {8,   16,  32,  40,  59,  64,  72,  80, 96,
                                   111, 128, 141, 160, 192, 200, 255, 256};
  int k = (int)rint_(r, 0, 99);
  if (k < 35) return rint_(r, 1, 16);
  if (k < 65) return pick(r, common, (int)(sizeof common / sizeof common[0]));
  return rint_(r, 1, FA_MAX_HEADDIM);
}

/* A window bound: unlimited (-1 or another negative), 0, small, or past the keys. */
static int64_t draw_bound(tu_rng *r, int64_t nk) {
  int k = (int)rint_(r, 0, 9);
  if (k < 2) return -1;
  if (k < 3) return -rint_(r, 2, 1000);
  if (k < 5) return 0;
  if (k < 9) return rint_(r, 1, nk > 1 ? nk : 1);
  return nk + rint_(r, 0, 1000);
}

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* Strides of a layout for a (B, N, H, D) tensor: the innermost dimension's
 * stride is D plus a gap, each outer one spans the inner ones plus a gap. */
void fz_layout_strides(const fz_layout *l, int64_t B, int64_t N, int64_t H, int64_t D,
                       int64_t st[3]) {
  const int64_t n[3] = {B, N, H};
  int64_t span = D + l->gap[0];
  for (int k = 2; k >= 0; k--) {
    int dim = l->order[k];
    st[dim] = span;
    span = span * n[dim] + (k > 0 ? l->gap[3 - k] : 0);
  }
  if (l->bcast) st[0] = 0;
}

/* Rows on 16-byte boundaries, as the flash kernels use tensors in place (the
 * others go through padded copies): every stride a multiple of 8 elements. */
static void align_rows(fz_layout *l, int64_t D) {
  l->gap[0] = round_up(D + l->gap[0], 8) - D;
  l->gap[1] = round_up(l->gap[1], 8);
  l->gap[2] = round_up(l->gap[2], 8);
}

static void draw_layout(tu_rng *r, fz_layout *l, int input, int bcast_ok, int cuda, int64_t D) {
  static const int8_t orders[6][3] = {{0, 1, 2}, {0, 2, 1}, {1, 0, 2},
                                      {1, 2, 0}, {2, 0, 1}, {2, 1, 0}};
  memset(l, 0, sizeof *l);
  int k = (int)rint_(r, 0, 99);
  const int8_t *o = k < 45 ? orders[0] : k < 65 ? orders[1] : orders[rint_(r, 0, 5)];
  memcpy(l->order, o, 3);
  if (k >= 65)
    for (int g = 0; g < 3; g++) l->gap[g] = chance(r, 50) ? rint_(r, 0, 9) : 0;
  if (cuda && chance(r, 50)) align_rows(l, D);
  l->bcast = input && bcast_ok && chance(r, 8);
}

void fz_draw(fz_case *c, uint64_t seed, int cuda) {
  tu_rng r;
  tu_rng_seed(&r, seed);
  memset(c, 0, sizeof *c);
  c->seed = seed;
  c->cuda = cuda;
  if (cuda) {
    c->dtype = chance(&r, 50) ? FA_DTYPE_F16 : FA_DTYPE_BF16;
    int k = (int)rint_(&r, 0, 9);
    c->algo = k < 7 ? FA_ALGO_FLASH2 : k < 8 ? FA_ALGO_FLASH1 : FA_ALGO_STANDARD;
  } else {
    static const fa_dtype dts[3] = {FA_DTYPE_F32, FA_DTYPE_F16, FA_DTYPE_BF16};
    static const fa_algorithm als[3] = {FA_ALGO_FLASH2, FA_ALGO_FLASH1, FA_ALGO_STANDARD};
    c->dtype = dts[rint_(&r, 0, 2)];
    int k = (int)rint_(&r, 0, 9);
    c->algo = als[k < 5 ? 0 : k < 8 ? 1 : 2];
  }
  c->D = draw_headdim(&r);
  c->HK = chance(&r, 50) ? 1 : rint_(&r, 2, 3);
  static const int64_t groups[] = {1, 1, 1, 2, 2, 3, 4, 5, 8};
  c->HQ = c->HK * pick(&r, groups, 9);
  while (c->HQ > 8) c->HQ -= c->HK;

  /* sequences: a fixed-length batch or packed variable-length ones */
  int64_t lq[FZ_MAX_SEQS], lk[FZ_MAX_SEQS], padq = 0, padk = 0;
  c->varlen = chance(&r, 35);
  c->nseq = c->varlen ? (int)rint_(&r, 1, 5) : (int)rint_(&r, 1, 3);
  const int all_empty = c->varlen && chance(&r, 5);
  for (int s = 0; s < c->nseq; s++) {
    lq[s] = draw_len(&r);
    lk[s] = draw_len(&r);
    if (c->varlen && (all_empty || chance(&r, 15))) lq[s] = 0;
    if (c->varlen && chance(&r, 15)) lk[s] = 0;
  }
  if (!c->varlen)
    for (int s = 1; s < c->nseq; s++) lq[s] = lq[0], lk[s] = lk[0];
  /* about 2^17 multiply-adds: halve the longest lengths until within it */
  const int64_t budget = (int64_t)1 << rint_(&r, 14, 18);
  for (;;) {
    int64_t work = 0, s_max = 0;
    for (int s = 0; s < c->nseq; s++) {
      work += c->HQ * lq[s] * lk[s] * c->D;
      if (lq[s] + lk[s] > lq[s_max] + lk[s_max]) s_max = s;
    }
    if (work <= budget) break;
    for (int s = 0; s < c->nseq; s++) {
      if (!c->varlen || s == s_max) {
        if (lq[s] >= lk[s] && lq[s] > 1)
          lq[s] = (lq[s] + 1) / 2;
        else if (lk[s] > 1)
          lk[s] = (lk[s] + 1) / 2;
        else if (lq[s] > 1)
          lq[s] = (lq[s] + 1) / 2;
      }
    }
    if (c->D > 1 && work > 64 * budget) c->D = (c->D + 1) / 2;
  }
  if (c->varlen) {
    c->cu_q[0] = c->cu_k[0] = 0;
    for (int s = 0; s < c->nseq; s++) {
      c->cu_q[s + 1] = c->cu_q[s] + (int32_t)lq[s];
      c->cu_k[s + 1] = c->cu_k[s] + (int32_t)lk[s];
    }
    /* rows past the last sequence (a padded buffer), at least one row in all */
    padq = chance(&r, 40) ? rint_(&r, 1, 4) : 0;
    padk = chance(&r, 40) ? rint_(&r, 1, 4) : 0;
    if (c->cu_q[c->nseq] + padq == 0) padq = 1;
    if (c->cu_k[c->nseq] + padk == 0) padk = 1;
    c->B = 1;
    c->NQ = c->cu_q[c->nseq] + padq;
    c->NK = c->cu_k[c->nseq] + padk;
  } else {
    c->B = c->nseq;
    c->NQ = lq[0];
    c->NK = lk[0];
  }
  /* a KV cache: sequence s uses the first seqused[s] of its keys */
  if (chance(&r, 20)) {
    c->used = 1;
    for (int s = 0; s < c->nseq; s++) {
      int64_t cap = c->varlen ? lk[s] : c->NK;
      int k = (int)rint_(&r, 0, 9);
      c->seqused[s] = (int32_t)(k == 0 ? 0 : k == 1 ? cap : rint_(&r, 0, cap));
    }
  }

  c->causal = chance(&r, 35);
  if (chance(&r, 25)) {
    c->window = 1;
    c->wl = draw_bound(&r, c->NK);
    c->wr = draw_bound(&r, c->NK);
  }
  if (chance(&r, 15)) c->softcap = (float)(0.5 + 49.5 * tu_rng_uniform(&r));
  if (chance(&r, 25)) {
    c->scale = (float)(tu_rng_uniform(&r) * 1.5);
    if (chance(&r, 15)) c->scale = -c->scale;
  }
  if (chance(&r, 15)) {
    c->alibi = 1;
    int k = (int)rint_(&r, 0, 2);
    c->alibi_stride = k == 0 ? 0 : k == 1 ? c->HQ : c->HQ + rint_(&r, 1, 5);
  }
  if (chance(&r, 15)) {
    c->dropout = (float)(tu_rng_uniform(&r) * 0.9);
    c->dseed = tu_rng_next(&r);
    c->doff = chance(&r, 50) ? tu_rng_next(&r) : (uint64_t)rint_(&r, 0, 100);
  }
  if (chance(&r, 20)) {
    static const int64_t sizes[] = {1, 2, 3, 5, 8, 16, 17, 32, 64, 128};
    c->block = 1;
    c->bq = chance(&r, 70) ? pick(&r, sizes, 10) : rint_(&r, 1, 70);
    c->bk = chance(&r, 70) ? pick(&r, sizes, 10) : rint_(&r, 1, 70);
    static const int dens[] = {0, 30, 60, 90, 100};
    c->bdens = dens[rint_(&r, 0, 4)];
    const int64_t nbk = (c->NK + c->bk - 1) / c->bk;
    int64_t maxq = 0;
    for (int s = 0; s < c->nseq; s++) maxq = lq[s] > maxq ? lq[s] : maxq;
    const int64_t nbq = maxq > 0 ? (maxq + c->bq - 1) / c->bq : 1;
    c->bsr = chance(&r, 50) ? 0 : nbk + (chance(&r, 50) ? 0 : rint_(&r, 1, 3));
    const int64_t row = c->bsr ? c->bsr : nbk;
    int k = (int)rint_(&r, 0, 9);
    c->bsh = k < 3 ? 0 : k < 9 ? nbq * row + rint_(&r, 0, 2) : rint_(&r, 1, 5);
    const int64_t head = c->bsh ? c->bsh : nbq * row;
    k = (int)rint_(&r, 0, 9);
    c->bsb = k < 3 ? 0 : k < 9 ? c->HQ * head + rint_(&r, 0, 2) : rint_(&r, 1, 5);
  }

  const int bcast_ok = !c->varlen && !c->used && c->B > 1;
  for (int t = 0; t < FZ_NT; t++) {
    const int input = t == FZ_Q || t == FZ_K || t == FZ_V || t == FZ_DO;
    draw_layout(&r, &c->lay[t], input, bcast_ok, cuda, c->D);
  }
  c->backward = chance(&r, 60) && !(cuda && c->algo == FA_ALGO_STANDARD);
  int k = (int)rint_(&r, 0, 99);
  c->workspace = k < 25 ? 1 : k < 35 ? 2 : 0;
  c->lse_null = chance(&r, 15);
  static const int64_t threads[] = {0, 1, 2, 3};
  c->threads = (int)pick(&r, threads, 4);
  c->deterministic = chance(&r, 50);
  k = (int)rint_(&r, 0, 9);
  c->qk_std = k < 7 ? 1.0 : k < 9 ? 0.3 : 2.0;
  /* logits of typical size std^2 |scale| sqrt(D) up to 4 (scores of tens): past
   * that softmax rows are one-hot in float32 and their gradients, far below the
   * rounding of dO V^T, are noise in every implementation, the naive one too */
  const double typical = c->qk_std * c->qk_std * fabs((double)c->scale) * sqrt((double)c->D);
  if (c->scale != 0 && typical > 4) c->scale = (float)(c->scale * 4 / typical);
  /* a grid of one CTA up to all SMs but a few (drawn after the rest, as paged caches
   * below: a seed's earlier draws stay what they were) */
  static const int64_t margins[] = {1, 8, 131, 1024};
  c->sm_margin = cuda && chance(&r, 20) ? (int)pick(&r, margins, 4) : 0;
  /* the tested run's K/V in a paged cache: forward only (the backward refuses it), not
   * with a block mask (whose row stride follows the cache's capacity) or broadcast K/V,
   * and on CUDA neither with dropout nor the standard algorithm (refused there) */
  static const int64_t pages[] = {1, 3, 8, 16, 64};
  const int page_ok = !c->block && !c->lay[FZ_K].bcast && !c->lay[FZ_V].bcast &&
                      !(cuda && (c->dropout > 0 || c->algo == FA_ALGO_STANDARD));
  if (page_ok && chance(&r, 15)) {
    c->page = (int)pick(&r, pages, 5);
    c->backward = 0;
    if (cuda) /* CUDA reads a paged cache, and its q, in place: no padded copies */
      for (int t = FZ_Q; t <= FZ_V; t++) align_rows(&c->lay[t], c->D);
    /* a fixed-length batch's sequences hold whole pages: seqused_k keeps the keys past
     * NK unread */
    const int64_t np = (c->NK + c->page - 1) / c->page;
    if (!c->varlen && !c->used && (np > 0 ? np : 1) * c->page != c->NK) {
      c->used = 1;
      for (int s = 0; s < c->nseq; s++) c->seqused[s] = (int32_t)c->NK;
    }
  }
}

/* Appends to the description (truncated at its end). */
typedef struct fz_text {
  char *buf;
  size_t n, used;
} fz_text;

static void app(fz_text *t, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void app(fz_text *t, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  const int k = vsnprintf(t->buf + t->used, t->used < t->n ? t->n - t->used : 0, fmt, ap);
  va_end(ap);
  if (k > 0) t->used += (size_t)k;
}

void fz_describe(const fz_case *c, char *buf, size_t n) {
  fz_text text = {buf, n, 0}, *t = &text;
  if (n) buf[0] = 0;
  app(t, "%s %s%s d%lld h%lld:%lld", tu_algo_name(c->algo), tu_dtype_name(c->dtype),
      c->backward ? " fwd+bwd" : " fwd", (long long)c->D, (long long)c->HQ, (long long)c->HK);
  if (c->varlen) {
    app(t, " varlen q");
    for (int s = 0; s <= c->nseq; s++) app(t, "%s%d", s ? "," : "{", c->cu_q[s]);
    app(t, "}/%lld k", (long long)c->NQ);
    for (int s = 0; s <= c->nseq; s++) app(t, "%s%d", s ? "," : "{", c->cu_k[s]);
    app(t, "}/%lld", (long long)c->NK);
  } else {
    app(t, " b%lld n%lldx%lld", (long long)c->B, (long long)c->NQ, (long long)c->NK);
  }
  if (c->used) {
    app(t, " seqused");
    for (int s = 0; s < c->nseq; s++) app(t, "%s%d", s ? "," : "{", c->seqused[s]);
    app(t, "}");
  }
  if (c->causal) app(t, " causal");
  if (c->window) app(t, " window(%lld,%lld)", (long long)c->wl, (long long)c->wr);
  if (c->softcap > 0) app(t, " softcap %g", (double)c->softcap);
  if (c->scale != 0) app(t, " scale %g", (double)c->scale);
  if (c->alibi) app(t, " alibi(stride %lld)", (long long)c->alibi_stride);
  if (c->dropout > 0) app(t, " dropout %g", (double)c->dropout);
  if (c->block)
    app(t, " blocks %lldx%lld %d%% strides(%lld,%lld,%lld)", (long long)c->bq, (long long)c->bk,
        c->bdens, (long long)c->bsb, (long long)c->bsh, (long long)c->bsr);
  app(t, " layouts");
  for (int i = 0; i < FZ_NT; i++) {
    const fz_layout *l = &c->lay[i];
    if (i >= FZ_DO && !c->backward) break;
    app(t, " %c%c%c", "bnh"[l->order[0]], "bnh"[l->order[1]], "bnh"[l->order[2]]);
    if (l->gap[0] || l->gap[1] || l->gap[2])
      app(t, "+%lld,%lld,%lld", (long long)l->gap[0], (long long)l->gap[1], (long long)l->gap[2]);
    if (l->bcast) app(t, "*");
  }
  if (c->workspace) app(t, " workspace%s", c->workspace == 2 ? "+" : "");
  if (c->lse_null) app(t, " lse=NULL");
  app(t, " threads %d%s", c->threads, c->deterministic ? " deterministic" : "");
  if (c->qk_std != 1.0) app(t, " std %g", c->qk_std);
  if (c->sm_margin) app(t, " sm_margin %d", c->sm_margin);
  if (c->page) app(t, " paged %d", c->page);
}
