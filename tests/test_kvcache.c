/* Paged KV caches and the KV-cache call on the CPU (the checks: kvtest.h),
 * plus their argument validation: each bad argument gives its status, names
 * the field, and leaves the outputs and the caches untouched. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvtest.h"

/* fa_forward over a paged cache: decode (the CPU's split decode path, its
 * key-row and head-by-head variants), prefill (tile path, packed K/V), every
 * algorithm, page sizes from 1 to 256, masks, varlen. */
static void paged_cases(void) {
  static const fa_dtype dts[3] = {FA_DTYPE_F32, FA_DTYPE_F16, FA_DTYPE_BF16};
  static const fa_algorithm algos[3] = {FA_ALGO_FLASH2, FA_ALGO_FLASH1, FA_ALGO_STANDARD};
  for (int t = 0; t < 3; t++) {
    /* decode, GQA 4:1, one row: the key-row path; pages shared, lengths 0 and 1 */
    kvcfg c = kvcfg_default();
    c.dt = dts[t], c.hq = 8, c.hk = 2, c.d = 64, c.nq = 1, c.page = 16, c.cap = 320;
    c.seqused = 1, c.share = 1;
    const int u1[4] = {300, 1, 0, 177};
    kv_seqs(&c, 4, NULL, u1);
    kv_register("paged", c, 0);
    c.page = 256, c.cap = 512;
    const int u2[3] = {511, 256, 257};
    kv_seqs(&c, 3, NULL, u2);
    kv_register("paged", c, 0);
    /* decode, GQA 8:1, several rows, causal: head by head */
    c = kvcfg_default();
    c.dt = dts[t], c.hq = 8, c.hk = 1, c.d = 32, c.nq = 3, c.page = 7, c.cap = 70, c.seqused = 1;
    c.causal = 1, c.share = 1;
    const int u3[3] = {69, 2, 40};
    kv_seqs(&c, 3, NULL, u3);
    kv_register("paged", c, 0);
    /* prefill: every algorithm */
    for (int a = 0; a < 3; a++) {
      c = kvcfg_default();
      c.dt = dts[t], c.algo = algos[a], c.hq = 4, c.hk = 2, c.d = 48, c.nq = 70, c.page = 32;
      c.cap = 256, c.seqused = 1, c.causal = 1, c.alibi = 2, c.share = 1;
      const int u4[3] = {256, 130, 77};
      kv_seqs(&c, 3, NULL, u4);
      kv_register("paged", c, t != 0);
    }
  }
  /* odd page sizes, windows, softcap, head dims that are not whole vectors */
  static const int pages[4] = {1, 3, 5, 48};
  for (int i = 0; i < 4; i++) {
    kvcfg c = kvcfg_default();
    c.dt = i % 2 ? FA_DTYPE_F16 : FA_DTYPE_F32, c.hq = 3, c.hk = 1, c.d = 40, c.nq = 20;
    c.page = pages[i], c.cap = 240, c.seqused = 1, c.window = 1, c.wl = 30, c.wr = 2;
    c.softcap = 4;
    const int u[2] = {100, 239};
    kv_seqs(&c, 2, NULL, u);
    kv_register("paged", c, 0);
    c.nq = 1, c.window = 0, c.softcap = 0, c.d = 24;
    kv_register("paged", c, 0);
  }
  /* varlen: query rows packed, keys through the table; empty sequences */
  for (int a = 0; a < 3; a++) {
    kvcfg c = kvcfg_default();
    c.algo = algos[a], c.dt = a == 1 ? FA_DTYPE_BF16 : FA_DTYPE_F32, c.varlen = 1, c.hq = 4;
    c.hk = 2, c.d = 32, c.page = 8, c.cap = 160, c.causal = 1;
    const int lq[4] = {3, 0, 17, 1}, lk[4] = {50, 9, 0, 130};
    kv_seqs(&c, 4, lq, lk);
    kv_register("paged", c, 0);
    const int lq2[2] = {1, 1}, lk2[2] = {160, 33};
    kv_seqs(&c, 2, lq2, lk2);
    c.causal = 0, c.alibi = 1;
    kv_register("paged", c, 0);
  }
  /* every key of every page (no seqused_k); layouts; threads; a caller workspace */
  kvcfg c = kvcfg_default();
  c.page = 32, c.cap = 128, c.nq = 9, c.d = 16;
  kv_register("paged", c, 0);
  c.bhnd = 1, c.pad = 3, c.seqused = 1;
  const int u[2] = {127, 65};
  kv_seqs(&c, 2, NULL, u);
  kv_register("paged", c, 0);
  c.bhnd = 0, c.threads = 1, c.ws = 1, c.dt = FA_DTYPE_F16;
  kv_register("paged", c, 0);
  c.nq = 1, c.hq = 4, c.hk = 1;
  kv_register("paged", c, 0);
  /* the suite catches the last two pages swapped (their rows past the keys hold NaN) */
  c = kvcfg_default();
  c.page = 16, c.cap = 64, c.nq = 4, c.seqused = 1, c.alibi = 1;
  const int us[2] = {60, 40};
  kv_seqs(&c, 2, NULL, us);
  c.sabotage = 1;
  kv_register("meta", c, 0);
  c.nq = 1;
  kv_register("meta", c, 0);
  /* the GPU suite's: no ALiBi, a partly filled last page */
  c = kvcfg_default();
  c.dt = FA_DTYPE_F16, c.d = 128, c.nq = 16, c.page = 64, c.cap = 512, c.seqused = 1, c.causal = 1;
  c.sabotage = 1;
  const int u6[2] = {500, 300};
  kv_seqs(&c, 2, NULL, u6);
  kv_register("meta", c, 0);
}

/* fa_forward_kvcache: append, rotary (both pairings; causal, local and
 * neither), left padding, batch indices, contiguous and paged caches. */
static void call_cases(void) {
  static const fa_dtype dts[3] = {FA_DTYPE_F32, FA_DTYPE_F16, FA_DTYPE_BF16};
  for (int t = 0; t < 3; t++) {
    /* decode step: one new row, rotated, GQA */
    kvcfg c = kvcfg_default();
    c.api = KV_CALL, c.dt = dts[t], c.hq = 8, c.hk = 2, c.d = 64, c.nq = 1, c.nnew = 1;
    c.cap = 200, c.rotary = 64, c.causal = 1;
    const int sl[3] = {150, 0, 199};
    kv_seqs(&c, 3, NULL, sl);
    kv_register("call", c, 0);
    c.page = 16, c.share = 1, c.interleaved = 1, c.cap = 208;
    kv_register("call", c, 0);
    /* a prefill chunk against the cache: causal, rotary on part of the head */
    c = kvcfg_default();
    c.api = KV_CALL, c.dt = dts[t], c.hq = 4, c.hk = 2, c.d = 32, c.nq = 40, c.nnew = 40;
    c.cap = 192, c.rotary = 16, c.causal = 1, c.page = 32;
    const int sl2[2] = {100, 37};
    kv_seqs(&c, 2, NULL, sl2);
    kv_register("call", c, 0);
    c.algo = FA_ALGO_STANDARD;
    kv_register("call", c, t != 0);
    c.algo = FA_ALGO_FLASH1, c.page = 0, c.interleaved = 1;
    kv_register("call", c, t != 0);
  }
  /* no new rows: plain attention over each cache's first cache_seqlens rows */
  kvcfg c = kvcfg_default();
  c.api = KV_CALL, c.nq = 2, c.cap = 60;
  const int sl[3] = {5, 0, 60};
  kv_seqs(&c, 3, NULL, sl);
  kv_register("call", c, 0);
  /* rotary without a mask: every query row at position cache_seqlens */
  c = kvcfg_default();
  c.api = KV_CALL, c.nq = 3, c.nnew = 3, c.cap = 50, c.rotary = 32, c.d = 32, c.dt = FA_DTYPE_F16;
  const int sl3[2] = {20, 1};
  kv_seqs(&c, 2, NULL, sl3);
  kv_register("call", c, 0);
  c.window = 1, c.wl = 10, c.wr = 0; /* local: per row */
  kv_register("call", c, 0);
  c.window = 1, c.wl = -1, c.wr = -1; /* a window without bounds is no window */
  kv_register("call", c, 0);
  /* left padding */
  c = kvcfg_default();
  c.api = KV_CALL, c.nq = 2, c.nnew = 2, c.cap = 40, c.rotary = 8, c.d = 16, c.causal = 1;
  c.leftpad = 1, c.lp[0] = 2, c.lp[1] = 0, c.lp[2] = 5;
  const int sl4[3] = {10, 3, 5};
  kv_seqs(&c, 3, NULL, sl4);
  kv_register("call", c, 0);
  c.dt = FA_DTYPE_BF16, c.nnew = 0, c.rotary = 0;
  kv_register("call", c, 0);
  /* batch indices into a larger cache; shared rows read without appending */
  c = kvcfg_default();
  c.api = KV_CALL, c.nq = 3, c.nnew = 3, c.cap = 30, c.causal = 1, c.hq = 4, c.hk = 2;
  c.bidx = 1, c.cache_batch = 4, c.bi[0] = 2, c.bi[1] = 0, c.rotary = 32, c.interleaved = 1;
  const int sl5[2] = {7, 27};
  kv_seqs(&c, 2, NULL, sl5);
  kv_register("call", c, 0);
  c.nnew = 0, c.rotary = 0, c.bi[0] = 1, c.bi[1] = 1, c.cache_batch = 2;
  kv_register("call", c, 0);
  /* paged: appends that cross a page, pages of 1 and 3 rows, no append */
  static const int pg[3] = {16, 1, 3};
  for (int i = 0; i < 3; i++) {
    c = kvcfg_default();
    c.api = KV_CALL, c.nq = 2, c.nnew = 2, c.page = pg[i], c.cap = 48, c.d = 32, c.rotary = 32;
    c.causal = 1;
    const int sl6[3] = {15, 16, 0};
    kv_seqs(&c, 3, NULL, sl6);
    kv_register("call", c, 0);
  }
  c.nnew = 0, c.rotary = 0;
  kv_register("call", c, 0);
  /* softcap, ALiBi, num_splits (the CPU ignores it), a caller workspace */
  c = kvcfg_default();
  c.api = KV_CALL, c.nq = 1, c.nnew = 1, c.cap = 100, c.softcap = 3, c.alibi = 2;
  c.num_splits = 4, c.ws = 1, c.rotary = 32;
  const int sl7[2] = {99, 40};
  kv_seqs(&c, 2, NULL, sl7);
  kv_register("call", c, 0);
  c.page = 20;
  kv_register("call", c, 0);
  /* the float64 oracle's own path */
  c.dt = FA_DTYPE_F64, c.algo = FA_ALGO_STANDARD;
  kv_register("call", c, 0);
  /* the last two pages swapped under the call */
  c = kvcfg_default();
  c.api = KV_CALL, c.nq = 1, c.nnew = 1, c.cap = 64, c.page = 16, c.rotary = 32, c.alibi = 1;
  const int sl8[2] = {40, 63};
  kv_seqs(&c, 2, NULL, sl8);
  c.sabotage = 1;
  kv_register("meta", c, 0);
  c = kvcfg_default(); /* the GPU suite's */
  c.api = KV_CALL, c.dt = FA_DTYPE_BF16, c.d = 128, c.nq = 8, c.nnew = 8, c.cap = 512, c.page = 64;
  c.rotary = 128, c.causal = 1, c.sabotage = 1;
  const int sl9[2] = {300, 200};
  kv_seqs(&c, 2, NULL, sl9);
  kv_register("meta", c, 0);
}

/* ---- validation ---------------------------------------------------------------- */

enum { VB = 2, VQ = 3, VH = 2, VD = 8, VP = 4, VPAGES = 6, VPPS = 3, VNEW = 2 };

typedef struct kvv {
  float q[VB * VQ * VH * VD], o[VB * VQ * VH * VD], lse[VB * VH * VQ];
  float kp[VPAGES * VP * VH * VD], vp[VPAGES * VP * VH * VD];
  float kn[VB * VNEW * VH * VD], vn[VB * VNEW * VH * VD];
  float cs[VPPS * VP * 4], sn[VPPS * VP * 4];
  int32_t table[VB * VPPS], used[VB], lp[VB], bi[VB];
  fa_params p;
  fa_kvcache kv;
  fa_tensor tq, to, tk, tv, tkn, tvn;
} kvv;

/* A valid paged forward and KV-cache call (pages of 4 rows, 3 per sequence). */
static void kvv_init(kvv *s) {
  memset(s, 0, sizeof *s);
  tu_rng r;
  tu_rng_seed(&r, 7);
  float *all[] = {s->q, s->kp, s->vp, s->kn, s->vn, s->cs, s->sn};
  const size_t n[] = {sizeof s->q,  sizeof s->kp, sizeof s->vp, sizeof s->kn,
                      sizeof s->vn, sizeof s->cs, sizeof s->sn};
  for (int a = 0; a < 7; a++)
    for (size_t i = 0; i < n[a] / 4; i++) all[a][i] = (float)tu_rng_normal(&r);
  memset(s->o, 0xFF, sizeof s->o);
  memset(s->lse, 0xFF, sizeof s->lse);
  const int32_t tab[VB * VPPS] = {4, 0, 2, 1, 5, 3};
  memcpy(s->table, tab, sizeof tab);
  s->used[0] = 5, s->used[1] = 9;
  s->tq = fa_tensor_bnhd(s->q, FA_DTYPE_F32, VB, VQ, VH, VD);
  s->to = fa_tensor_bnhd(s->o, FA_DTYPE_F32, VB, VQ, VH, VD);
  s->tk = fa_tensor_bnhd(s->kp, FA_DTYPE_F32, VPAGES, VP, VH, VD);
  s->tv = fa_tensor_bnhd(s->vp, FA_DTYPE_F32, VPAGES, VP, VH, VD);
  s->tkn = fa_tensor_bnhd(s->kn, FA_DTYPE_F32, VB, VNEW, VH, VD);
  s->tvn = fa_tensor_bnhd(s->vn, FA_DTYPE_F32, VB, VNEW, VH, VD);
  s->p.block_table = s->table;
  s->p.max_pages_per_seq = VPPS;
  s->p.seqused_k = s->used;
  s->p.causal = 1;
  s->kv.cache_seqlens = s->used;
  s->kv.k_new = &s->tkn, s->kv.v_new = &s->tvn;
  s->kv.rotary_cos = s->cs, s->kv.rotary_sin = s->sn;
  s->kv.rotary_seqlen = VPPS * VP, s->kv.rotary_dim = 8;
}

typedef struct kvbad {
  const char *name, *field;
  int call; /* 1: fa_forward_kvcache, 2: fa_backward, 0: fa_forward */
  fa_status want;
  void (*mutate)(kvv *s);
} kvbad;

static void m_page_out(kvv *s) { s->table[1] = VPAGES; }
static void m_page_neg(kvv *s) { s->table[4] = -1; }
static void m_pages0(kvv *s) { s->p.max_pages_per_seq = 0; }
static void m_stride(kvv *s) { s->p.block_table_stride = 2; }
static void m_used_big(kvv *s) { s->used[1] = VPPS * VP + 1; }
static void m_splits(kvv *s) { s->p.num_splits = 129; }
static void m_no_seqlens(kvv *s) { s->kv.cache_seqlens = NULL; }
static void m_seqused_call(kvv *s) { (void)s; }
static void m_knew_only(kvv *s) { s->kv.v_new = NULL; }
static void m_knew_heads(kvv *s) { s->tkn.heads = 1, s->tvn.heads = 1; }
static void m_knew_batch(kvv *s) { s->tkn.batch = 1, s->tvn.batch = 1; }
static void m_seqlens_full(kvv *s) { s->used[0] = VPPS * VP - 1; }
static void m_seqlens_neg(kvv *s) { s->used[1] = -1; }
static void m_rot_no_new(kvv *s) { s->kv.k_new = s->kv.v_new = NULL; }
static void m_rot_odd(kvv *s) { s->kv.rotary_dim = 5; }
static void m_rot_wide(kvv *s) { s->kv.rotary_dim = VD + 2; }
static void m_rot_short(kvv *s) { s->kv.rotary_seqlen = VPPS * VP - 1; }
static void m_rot_qrows(kvv *s) { s->used[1] = VPPS * VP - VNEW; } /* q rows reach cap */
static void m_rot_stride(kvv *s) { s->kv.rotary_stride = 3; }
static void m_rot_sin(kvv *s) { s->kv.rotary_sin = NULL; }
static void m_leftpad_paged(kvv *s) { s->kv.cache_leftpad = s->lp; }
static void m_bidx_paged(kvv *s) { s->kv.cache_batch_idx = s->bi; }
static void m_varlen_call(kvv *s) {
  static int32_t cu[3] = {0, 3, 6};
  s->p.cu_seqlens_q = s->p.cu_seqlens_k = cu, s->p.num_seqs = 2;
}
static void m_dropout_call(kvv *s) { s->p.dropout_p = 0.1f; }
static void m_contig_leftpad(kvv *s) {
  s->p.block_table = NULL;
  s->tk = fa_tensor_bnhd(s->kp, FA_DTYPE_F32, VB, VPPS * VP, VH, VD);
  s->tv = fa_tensor_bnhd(s->vp, FA_DTYPE_F32, VB, VPPS * VP, VH, VD);
  s->kv.cache_leftpad = s->lp, s->lp[0] = 6; /* past cache_seqlens[0] = 5 */
}
static void m_contig_bidx(kvv *s) {
  s->p.block_table = NULL;
  s->tk = fa_tensor_bnhd(s->kp, FA_DTYPE_F32, VB, VPPS * VP, VH, VD);
  s->tv = fa_tensor_bnhd(s->vp, FA_DTYPE_F32, VB, VPPS * VP, VH, VD);
  s->kv.cache_batch_idx = s->bi, s->bi[1] = 2;
}
static void m_new_in_cache(kvv *s) { s->tkn.data = s->kp + 64; }
static void m_nothing(kvv *s) { (void)s; }

static void kvv_fn(const void *arg) {
  const kvbad *b = (const kvbad *)arg;
  kvv *s = (kvv *)malloc(sizeof *s);
  kvv_init(s);
  if (b->call == 1 || b->call == 3) s->p.seqused_k = NULL;
  if (b->mutate == m_seqused_call) s->p.seqused_k = s->used;
  b->mutate(s);
  kvv *before = (kvv *)malloc(sizeof *before);
  memcpy(before, s, sizeof *s);
  fa_status st;
  if (b->call == 1 || b->call == 3) {
    st = fa_forward_kvcache(&s->p, &s->kv, &s->tq, &s->tk, &s->tv, &s->to, s->lse);
  } else if (b->call == 2) {
    float g[3][VB * VQ * VH * VD];
    fa_tensor dq = fa_tensor_bnhd(g[0], FA_DTYPE_F32, VB, VQ, VH, VD);
    fa_tensor dk = fa_tensor_bnhd(g[1], FA_DTYPE_F32, VB, VQ, VH, VD);
    fa_tensor dv = fa_tensor_bnhd(g[2], FA_DTYPE_F32, VB, VQ, VH, VD);
    st = fa_backward(&s->p, &s->tq, &s->tk, &s->tv, &s->to, &s->tq, s->lse, &dq, &dk, &dv);
  } else {
    st = fa_forward(&s->p, &s->tq, &s->tk, &s->tv, &s->to, s->lse);
  }
  if (st != b->want)
    tr_fail("returned %s (%s), want %s", fa_status_string(st), fa_last_error(),
            fa_status_string(b->want));
  else if (st != FA_OK && !strstr(fa_last_error(), b->field))
    tr_fail("message \"%s\" does not name %s", fa_last_error(), b->field);
  if (st != FA_OK &&
      (memcmp(s->o, before->o, sizeof s->o) || memcmp(s->lse, before->lse, sizeof s->lse) ||
       memcmp(s->kp, before->kp, sizeof s->kp) || memcmp(s->vp, before->vp, sizeof s->vp)))
    tr_fail("a refused call wrote its outputs or the caches");
  if (st == FA_OK && b->call == 3 && !memcmp(s->kp, before->kp, sizeof s->kp))
    tr_fail("the valid call appended nothing");
  free(s);
  free(before);
}

static void validation_cases(void) {
  static const kvbad bad[] = {
      {"valid-forward", "", 0, FA_OK, m_nothing},
      {"valid-call", "", 3, FA_OK, m_nothing},
      {"page-out-of-range", "block_table[0][1]", 0, FA_ERR_INVALID_ARGUMENT, m_page_out},
      {"page-negative", "block_table[1][1]", 0, FA_ERR_INVALID_ARGUMENT, m_page_neg},
      {"page-out-of-range-call", "block_table[0][1]", 1, FA_ERR_INVALID_ARGUMENT, m_page_out},
      {"max-pages-0", "max_pages_per_seq", 0, FA_ERR_INVALID_ARGUMENT, m_pages0},
      {"table-stride", "block_table_stride", 0, FA_ERR_INVALID_ARGUMENT, m_stride},
      {"seqused-past-pages", "seqused_k[1]", 0, FA_ERR_INVALID_ARGUMENT, m_used_big},
      {"num-splits", "num_splits", 0, FA_ERR_INVALID_ARGUMENT, m_splits},
      {"backward-paged", "block_table", 2, FA_ERR_UNSUPPORTED, m_nothing},
      {"no-cache-seqlens", "cache_seqlens", 1, FA_ERR_INVALID_ARGUMENT, m_no_seqlens},
      {"seqused-in-call", "seqused_k", 1, FA_ERR_INVALID_ARGUMENT, m_seqused_call},
      {"k-new-alone", "k_new", 1, FA_ERR_INVALID_ARGUMENT, m_knew_only},
      {"k-new-heads", "k_new", 1, FA_ERR_INVALID_ARGUMENT, m_knew_heads},
      {"k-new-batch", "k_new", 1, FA_ERR_INVALID_ARGUMENT, m_knew_batch},
      {"seqlens-leave-no-room", "cache_seqlens[0]", 1, FA_ERR_INVALID_ARGUMENT, m_seqlens_full},
      {"seqlens-negative", "cache_seqlens[1]", 1, FA_ERR_INVALID_ARGUMENT, m_seqlens_neg},
      {"rotary-without-new", "rotary_cos", 1, FA_ERR_INVALID_ARGUMENT, m_rot_no_new},
      {"rotary-dim-odd", "rotary_dim", 1, FA_ERR_INVALID_ARGUMENT, m_rot_odd},
      {"rotary-dim-wide", "rotary_dim", 1, FA_ERR_INVALID_ARGUMENT, m_rot_wide},
      {"rotary-seqlen-short", "rotary_seqlen", 1, FA_ERR_INVALID_ARGUMENT, m_rot_short},
      {"rotary-seqlen-short-for-queries", "rotary_seqlen", 1, FA_ERR_INVALID_ARGUMENT, m_rot_qrows},
      {"rotary-stride", "rotary_stride", 1, FA_ERR_INVALID_ARGUMENT, m_rot_stride},
      {"rotary-sin-missing", "rotary_sin", 1, FA_ERR_INVALID_ARGUMENT, m_rot_sin},
      {"leftpad-with-table", "cache_leftpad", 1, FA_ERR_INVALID_ARGUMENT, m_leftpad_paged},
      {"batch-idx-with-table", "cache_batch_idx", 1, FA_ERR_INVALID_ARGUMENT, m_bidx_paged},
      {"varlen-call", "cu_seqlens", 1, FA_ERR_INVALID_ARGUMENT, m_varlen_call},
      {"dropout-call", "dropout_p", 1, FA_ERR_INVALID_ARGUMENT, m_dropout_call},
      {"leftpad-past-seqlens", "cache_seqlens[0]", 1, FA_ERR_INVALID_ARGUMENT, m_contig_leftpad},
      {"batch-idx-out-of-range", "cache_batch_idx[1]", 1, FA_ERR_INVALID_ARGUMENT, m_contig_bidx},
      {"k-new-inside-the-cache", "overlaps", 1, FA_ERR_INVALID_ARGUMENT, m_new_in_cache},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char name[128];
    snprintf(name, sizeof name, "kv/invalid/%s", bad[i].name);
    tr_add(name, kvv_fn, &bad[i], sizeof bad[i], 0);
  }
}

void register_kvcache_tests(void) {
  validation_cases();
  paged_cases();
  call_cases();
  kv_register_drawn(300, 300, &kv_host);
}
