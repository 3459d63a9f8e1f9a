/* Forward-pass cases: every feature with each algorithm and each dtype at
 * least once (not the full cross product), plus NaN/-inf inputs, the oracle's
 * own check against an independent reference, and meta tests proving that the
 * tolerance catches a deliberately broken result. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"

static const fa_algorithm k_flash[2] = {FA_ALGO_FLASH2, FA_ALGO_FLASH1};
static const fa_algorithm k_all_algos[3] = {FA_ALGO_FLASH2, FA_ALGO_FLASH1, FA_ALGO_STANDARD};
static const fa_dtype k_dtypes[3] = {FA_DTYPE_F32, FA_DTYPE_F16, FA_DTYPE_BF16};

static void reg(const char *group, const acfg *c) { attn_register(group, c, 0); }

static void reg_head_dims(void) {
  static const int dims[] = {8, 32, 40, 64, 72, 96, 128, 192, 256};
  for (int a = 0; a < 2; a++)
    for (int t = 0; t < 3; t++)
      for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++) {
        acfg c = acfg_default();
        c.algo = k_flash[a];
        c.dtype = k_dtypes[t];
        c.d = dims[i];
        c.nq = 77;
        c.nk = 77;
        c.causal = (int)(i & 1);
        reg("hdim", &c);
      }
  /* The standard algorithm in every storage dtype. */
  static const int sdims[] = {8, 72, 256};
  for (int t = 0; t < 3; t++)
    for (int i = 0; i < 3; i++) {
      acfg c = acfg_default();
      c.algo = FA_ALGO_STANDARD;
      c.dtype = k_dtypes[t];
      c.d = sdims[i];
      c.nq = 50;
      c.nk = 61;
      c.causal = i == 1;
      reg("hdim", &c);
    }
}

static void reg_seqlens(void) {
  static const int pairs[][2] = {{1, 1},     {2, 2},    {1, 129},   {129, 1},   {2, 17},
                                 {17, 129},  {129, 17}, {127, 127}, {128, 128}, {129, 129},
                                 {127, 129}, {200, 64}, {64, 200}};
  const int np = (int)(sizeof pairs / sizeof pairs[0]);
  for (int a = 0; a < 2; a++)
    for (int i = 0; i < np; i++)
      for (int causal = 0; causal < 2; causal++) {
        acfg c = acfg_default();
        c.algo = k_flash[a];
        c.nq = pairs[i][0];
        c.nk = pairs[i][1];
        c.causal = causal;
        c.d = 64;
        reg("seqlen", &c);
        /* and one low-precision dtype per algorithm, alternating */
        c.dtype = ((i + causal + a) & 1) ? FA_DTYPE_F16 : FA_DTYPE_BF16;
        reg("seqlen", &c);
      }
  for (int t = 0; t < 3; t++) {
    acfg c = acfg_default();
    c.algo = FA_ALGO_STANDARD;
    c.dtype = k_dtypes[t];
    c.nq = 129;
    c.nk = 17;
    c.causal = 1;
    reg("seqlen", &c);
  }
  /* A few long ones. */
  acfg c = acfg_default();
  c.nq = c.nk = 1000;
  c.causal = 1;
  c.hq = c.hk = 2;
  attn_register("long", &c, 1);
  c = acfg_default();
  c.algo = FA_ALGO_FLASH1;
  c.dtype = FA_DTYPE_BF16;
  c.nq = c.nk = 1000;
  c.d = 128;
  c.hq = c.hk = 1;
  attn_register("long", &c, 1);
  c = acfg_default();
  c.dtype = FA_DTYPE_F16;
  c.nq = 1000;
  c.nk = 200;
  c.hq = 2;
  c.hk = 1;
  c.causal = 1;
  attn_register("long", &c, 1);
  c = acfg_default();
  c.algo = FA_ALGO_FLASH1;
  c.nq = 200;
  c.nk = 1000;
  c.hq = c.hk = 1;
  c.causal = 1;
  c.window = 1;
  c.wl = 300;
  c.wr = -1;
  attn_register("long", &c, 1);
}

static void reg_masks(void) {
  static const int64_t wins[][2] = {{16, 16}, {0, 0},   {32, -1},     {-1, 8},
                                    {5, 0},   {-1, -1}, {1000, 1000}, {0, 3}};
  const int nw = (int)(sizeof wins / sizeof wins[0]);
  int r = 0;
  for (int w = 0; w < nw; w++)
    for (int causal = 0; causal < 2; causal++)
      for (int shape = 0; shape < 2; shape++)
        for (int a = 0; a < 2; a++) {
          acfg c = acfg_default();
          c.algo = k_flash[a];
          c.dtype = k_dtypes[r++ % 3];
          c.nq = shape ? 150 : 100;
          c.nk = shape ? 100 : 150;
          c.d = 32;
          c.causal = causal;
          c.window = 1;
          c.wl = wins[w][0];
          c.wr = wins[w][1];
          reg("window", &c);
        }
  for (int t = 0; t < 3; t++) {
    acfg c = acfg_default();
    c.algo = FA_ALGO_STANDARD;
    c.dtype = k_dtypes[t];
    c.nq = 90;
    c.nk = 60;
    c.window = 1;
    c.wl = 7;
    c.wr = 2;
    c.causal = t == 1;
    reg("window", &c);
  }
}

static void reg_features(void) {
  /* GQA / MQA */
  static const int heads[][2] = {{8, 1}, {4, 2}, {6, 3}};
  for (int g = 0; g < 3; g++)
    for (int a = 0; a < 3; a++)
      for (int t = 0; t < 3; t++) {
        if (a == 2 && t != g) continue; /* standard: one dtype per head shape */
        acfg c = acfg_default();
        c.algo = k_all_algos[a];
        c.dtype = k_dtypes[t];
        c.hq = heads[g][0];
        c.hk = heads[g][1];
        c.nq = 70;
        c.nk = 150; /* more than one key tile of a 128-wide blocking */
        c.d = 64;
        c.causal = (g + t) & 1;
        reg("gqa", &c);
      }
  /* softcap */
  static const float caps[] = {30.0f, 2.0f};
  for (int i = 0; i < 2; i++)
    for (int a = 0; a < 3; a++)
      for (int t = 0; t < 3; t++) {
        if (a == 2 && t != i) continue;
        acfg c = acfg_default();
        c.algo = k_all_algos[a];
        c.dtype = k_dtypes[t];
        c.softcap = caps[i];
        c.qk_std = i ? 2.0 : 1.5;
        c.nq = 100;
        c.nk = 140;
        c.causal = (a + t) & 1;
        reg("softcap", &c);
      }
  /* ALiBi, one set of slopes (stride 0) and per batch (stride = heads) */
  for (int mode = 1; mode <= 2; mode++)
    for (int a = 0; a < 3; a++)
      for (int t = 0; t < 3; t++) {
        if (a == 2 && t != mode) continue;
        acfg c = acfg_default();
        c.algo = k_all_algos[a];
        c.dtype = k_dtypes[t];
        c.alibi = mode;
        c.batch = mode == 2 ? 2 : 1;
        c.hq = 4;
        c.hk = 2;
        c.nq = 90;
        c.nk = 170;
        c.causal = (a + t) & 1;
        reg("alibi", &c);
      }
  /* everything at once */
  for (int a = 0; a < 3; a++) {
    acfg c = acfg_default();
    c.algo = k_all_algos[a];
    c.dtype = k_dtypes[(a + 1) % 3];
    c.batch = 2;
    c.hq = 4;
    c.hk = 1;
    c.nq = 120;
    c.nk = 75;
    c.d = 72;
    c.causal = 1;
    c.window = 1;
    c.wl = 20;
    c.wr = -1;
    c.softcap = 5;
    c.alibi = 2;
    c.layout = TU_PADDED;
    reg("combined", &c);
  }
  /* explicit scale; large scores (softmax close to one-hot; needs max subtraction) */
  for (int a = 0; a < 3; a++)
    for (int t = 0; t < 3; t++) {
      acfg c = acfg_default();
      c.algo = k_all_algos[a];
      c.dtype = k_dtypes[t];
      c.scale = 0.3f;
      c.nq = 60;
      c.nk = 70;
      reg("scale", &c);
      c.scale = 0;
      c.qk_std = 6;
      c.causal = 1;
      reg("large-scores", &c);
    }
}

static void reg_varlen(void) {
  /* seq lengths: q:k; includes sequences with no queries and with no keys. */
  static const int sets[][2][5] = {
      {{17, 0, 64, 1, 129}, {17, 5, 100, 1, 33}},
      {{3, 40, 0, 128, 9}, {0, 40, 7, 130, 9}},
      {{1, 2, 3, 200, 0}, {1, 2, 3, 150, 0}},
  };
  int r = 0;
  for (int s = 0; s < 3; s++)
    for (int causal = 0; causal < 2; causal++)
      for (int a = 0; a < 3; a++) {
        if (a == 2 && causal) continue;
        acfg c = acfg_default();
        c.algo = k_all_algos[a];
        c.dtype = k_dtypes[r++ % 3];
        c.nseq = 5;
        for (int i = 0; i < 5; i++) {
          c.lens_q[i] = sets[s][0][i];
          c.lens_k[i] = sets[s][1][i];
        }
        c.causal = causal;
        c.d = 40;
        c.hq = 4;
        c.hk = s == 1 ? 1 : 2;
        if (s == 2) {
          c.window = 1;
          c.wl = 9;
          c.wr = 4;
        }
        if (s == 1) c.alibi = 2;
        if (s == 0 && causal) c.softcap = 10;
        reg("varlen", &c);
      }
}

static void reg_layouts(void) {
  static const tu_layout lays[] = {TU_BHND, TU_PADDED, TU_PACKED, TU_HUGE, TU_MIXED};
  int r = 0;
  for (int l = 0; l < 5; l++)
    for (int a = 0; a < 3; a++) {
      acfg c = acfg_default();
      c.algo = k_all_algos[a];
      c.dtype = k_dtypes[r++ % 3];
      c.layout = lays[l];
      c.batch = 2;
      c.hq = 4;
      c.hk = 2;
      c.nq = 65;
      c.nk = 80;
      c.d = 48;
      c.causal = l & 1;
      reg("layout", &c);
    }
  /* varlen on a padded layout */
  acfg c = acfg_default();
  c.layout = TU_PADDED;
  c.dtype = FA_DTYPE_BF16;
  c.nseq = 3;
  c.lens_q[0] = 30;
  c.lens_q[1] = 0;
  c.lens_q[2] = 70;
  c.lens_k[0] = 50;
  c.lens_k[1] = 9;
  c.lens_k[2] = 60;
  c.causal = 1;
  reg("layout", &c);
  c.algo = FA_ALGO_FLASH1;
  c.dtype = FA_DTYPE_F16;
  c.layout = TU_BHND;
  reg("layout", &c);
}

static void oracle_fn(const void *arg) { attn_check_oracle((const acfg *)arg); }
static void nan_q_fn(const void *arg) { attn_check_nan_q((const acfg *)arg); }
static void nan_k_fn(const void *arg) { attn_check_nan_k((const acfg *)arg); }

static void reg_special(const char *group, tr_fn fn, acfg c) { attn_register_fn(group, fn, &c, 0); }

static void pack_fn(const void *arg) { attn_check_pack((const acfg *)arg); }

/* K/V packed once per call (fwd_prepack) or converted per tile: the same bits.
 * GQA (every tile read by two query heads), BNHD and BHND, f16 and bf16. */
static void reg_pack(void) {
  for (int t = 0; t < 2; t++) {
    acfg c = acfg_default();
    c.dtype = t ? FA_DTYPE_BF16 : FA_DTYPE_F16;
    c.batch = 2;
    c.hq = 4;
    c.hk = 2;
    c.nq = 130;
    c.nk = 150;
    c.causal = t;
    c.layout = t ? TU_BHND : TU_BNHD;
    reg_special("pack", pack_fn, c);
  }
}

static void reg_nan(void) {
  for (int a = 0; a < 3; a++)
    for (int t = 0; t < 2; t++) {
      acfg c = acfg_default();
      c.algo = k_all_algos[a];
      c.dtype = t ? FA_DTYPE_BF16 : FA_DTYPE_F32;
      c.hq = 4;
      c.hk = 2;
      c.nq = c.nk = 100;
      c.causal = 1;
      reg_special("nan-q", nan_q_fn, c);
      c.dtype = t ? FA_DTYPE_F16 : FA_DTYPE_F32;
      c.inject = 1;
      reg_special("nan-k", nan_k_fn, c);
      c.inject = 3;
      c.dtype = t ? FA_DTYPE_BF16 : FA_DTYPE_F32;
      reg_special("nan-v", nan_k_fn, c);
      c.inject = 2;
      c.dtype = FA_DTYPE_F32;
      c.window = 1;
      c.wl = 30;
      c.wr = t ? 0 : 10;
      c.causal = t;
      reg_special("neginf-k", nan_k_fn, c);
    }
}

/* Decode shapes (Nq * group <= 16 rows per K/V head: the CPU's split-K
 * path): several splits (Nk > 512), every feature, and threads 1 vs 2. */
static void threads_fn(const void *arg) { attn_check_threads((const acfg *)arg); }

/* Decode case i: hq query heads over hk, nq rows, D=128; dtype and causality
 * cycle with i. */
static acfg decode_case(int i, int hq, int hk, int nq) {
  acfg c = acfg_default();
  c.dtype = k_dtypes[i % 3];
  c.hq = hq;
  c.hk = hk;
  c.nq = nq;
  c.d = 128;
  c.causal = i & 1;
  return c;
}

static void reg_decode(void) {
  static const int dims[4] = {128, 64, 40, 36}; /* 36: not whole vectors */
  for (int nq = 1; nq <= 4; nq++)
    for (int t = 0; t < 3; t++) {
      acfg c = acfg_default();
      c.dtype = k_dtypes[t];
      c.nq = nq;
      c.nk = 1000 + 37 * nq;
      c.d = dims[(nq + t) % 4];
      c.hq = c.hk = 2;
      reg("decode", &c);
      c.causal = 1; /* bottom-right: the last rows see (nearly) every key */
      reg("decode", &c);
    }
  static const int gqa[][3] = {{32, 8, 1}, {8, 1, 2}, {16, 4, 4}, {4, 4, 3}};
  for (int i = 0; i < 4; i++) {
    acfg c = decode_case(i, gqa[i][0], gqa[i][1], gqa[i][2]);
    c.nk = 700;
    reg("decode-gqa", &c);
    if (i < 2) attn_register_fn("decode-threads", threads_fn, &c, 0);
  }
  /* Many rows per K/V head (MQA, large groups, a few query rows: up to
   * CPU_DECODE_ROWS = 64 on the decode path, 66 past it on the tile path), with
   * a window and a softcap on some */
  static const int mqa[][3] = {{32, 1, 1}, {24, 1, 2}, {64, 2, 1}, {16, 1, 4}, {66, 1, 1}};
  for (int i = 0; i < 5; i++) {
    acfg c = decode_case(i, mqa[i][0], mqa[i][1], mqa[i][2]);
    c.nk = 900 + 11 * i;
    if (i == 1) c.d = 64;
    if (i == 2) {
      c.window = 1;
      c.wl = 200;
      c.wr = 0;
    }
    if (i == 3) {
      c.softcap = 2;
      c.qk_std = 2;
    }
    reg("decode-mqa", &c);
  }
  /* One query row per K/V head: whole K and V rows in key order
   * (dots_rows / pv_rows), across more heads than a vector has lanes, a
   * partial group of lanes, one head, every dtype, the strided layouts,
   * head dims that end in a part of the dots' 4-vector step (72, 40), and O
   * rows past 16 KiB (36 heads of 128: P V takes 4 keys a pass, Q K^T 2) */
  static const int rows_h[9] = {12, 20, 1, 8, 3, 9, 5, 16, 36},
                   rows_d[9] = {128, 64, 256, 128, 96, 64, 72, 40, 128};
  for (int i = 0; i < 9; i++) {
    acfg c = decode_case(i, rows_h[i], rows_h[i], 1);
    c.nk = 1100 + 13 * i;
    c.d = rows_d[i];
    c.layout = i == 4 ? TU_PADDED : i == 5 ? TU_BHND : TU_BNHD;
    reg("decode-rows", &c);
    if (i == 0) attn_register_fn("decode-threads", threads_fn, &c, 0);
  }
  /* The same under GQA: 2 and 4 query heads sharing each K/V part of a key
   * row, in every layout and with head dims that end in a partial step; 3
   * and 8 per K/V head go head by head. BHND caches go a vector of query
   * rows at a time: the next two end in a part of one (12 and 6 rows); the
   * last has Q and O rows past 16 KiB (64 rows of 128: 2 keys a pass). */
  static const int grp_h[9][2] = {{16, 8}, {8, 2},  {32, 8}, {8, 4},  {24, 8},
                                  {64, 8}, {12, 3}, {6, 3},  {64, 32}},
                   grp_d[9] = {128, 40, 64, 72, 128, 128, 128, 64, 128},
                   grp_l[9] = {TU_BNHD, TU_PADDED, TU_BHND, TU_BNHD, TU_PADDED,
                               TU_BHND, TU_BHND,   TU_BHND, TU_BNHD};
  for (int i = 0; i < 9; i++) {
    acfg c = decode_case(i, grp_h[i][0], grp_h[i][1], 1);
    c.nk = 1200 + 7 * i;
    c.d = grp_d[i];
    c.layout = grp_l[i];
    reg("decode-rows-gqa", &c);
    if (i == 0) attn_register_fn("decode-threads", threads_fn, &c, 0);
  }
  acfg c = acfg_default();
  c.nq = 1;
  c.nk = 2500;
  c.window = 1;
  c.wl = 300;
  c.wr = 0;
  reg("decode-window", &c);
  c.nq = 4;
  c.wl = 40;
  c.wr = 700; /* clipped by the sequence end */
  c.dtype = FA_DTYPE_F16;
  reg("decode-window", &c);
  c = acfg_default();
  c.nq = 2;
  c.nk = 900;
  c.hq = 4;
  c.hk = 2;
  c.softcap = 2;
  c.qk_std = 2;
  c.causal = 1;
  reg("decode-softcap", &c);
  c.softcap = 0;
  c.qk_std = 0;
  c.alibi = 2;
  c.batch = 2;
  c.dtype = FA_DTYPE_BF16;
  reg("decode-alibi", &c);
  c = acfg_default();
  c.hq = 8;
  c.hk = 2;
  c.d = 64;
  c.nseq = 5; /* one query row per sequence, and sequences with no keys or rows */
  static const int lq[5] = {1, 1, 0, 1, 1}, lk[5] = {700, 1, 5, 0, 1300};
  for (int i = 0; i < 5; i++) {
    c.lens_q[i] = lq[i];
    c.lens_k[i] = lk[i];
  }
  c.causal = 1;
  reg("decode-varlen", &c);
  c.dtype = FA_DTYPE_F16;
  c.layout = TU_PADDED;
  attn_register_fn("decode-threads", threads_fn, &c, 0);
  c = acfg_default();
  c.nq = 1;
  c.nk = 800;
  c.hq = 4;
  c.hk = 2;
  c.inject = 1;
  reg_special("decode-nan-k", nan_k_fn, c);
  c.inject = 3;
  c.dtype = FA_DTYPE_F16;
  reg_special("decode-nan-v", nan_k_fn, c);
  c.inject = 2;
  c.window = 1;
  c.wl = 200;
  c.wr = 0;
  reg_special("decode-neginf-k", nan_k_fn, c);
}

static void rounding_fn(const void *arg) { attn_check_rounding((const acfg *)arg); }

static void reg_rounding(void) {
  for (int a = 0; a < 3; a++)
    for (int t = 0; t < 3; t++) {
      acfg c = acfg_default();
      c.algo = k_all_algos[a];
      c.dtype = k_dtypes[t];
      c.nq = 37;
      c.nk = 2;
      c.hq = 4;
      c.hk = 2;
      c.d = 72;
      c.layout = t == 1 ? TU_PADDED : TU_BNHD;
      reg_special("rounding", rounding_fn, c);
    }
}

static void reg_oracle(void) {
  acfg c = acfg_default();
  c.nq = 23;
  c.nk = 31;
  c.d = 16;
  reg_special("oracle", oracle_fn, c); /* default scale */
  c.scale = 0.21f;
  reg_special("oracle", oracle_fn, c);
  c.causal = 1;
  reg_special("oracle", oracle_fn, c);
  c.nq = 31;
  c.nk = 23;
  reg_special("oracle", oracle_fn, c);
  c.causal = 0;
  c.window = 1;
  c.wl = 3;
  c.wr = 2;
  reg_special("oracle", oracle_fn, c);
  c.causal = 1;
  c.wr = -1;
  c.hq = 6;
  c.hk = 2;
  c.softcap = 1.5f;
  c.qk_std = 2;
  reg_special("oracle", oracle_fn, c);
  c = acfg_default();
  c.scale = 0.3f;
  c.d = 8;
  c.alibi = 1;
  c.hq = 3;
  c.hk = 1;
  c.nq = 12;
  c.nk = 19;
  c.causal = 1;
  reg_special("oracle", oracle_fn, c);
  c.alibi = 2;
  c.batch = 3;
  c.layout = TU_BHND;
  reg_special("oracle", oracle_fn, c);
  c = acfg_default();
  c.scale = 0.25f;
  c.d = 8;
  c.hq = 4;
  c.hk = 2;
  c.nseq = 5;
  static const int lq[5] = {5, 0, 9, 3, 1}, lk[5] = {7, 4, 6, 0, 1};
  for (int i = 0; i < 5; i++) {
    c.lens_q[i] = lq[i];
    c.lens_k[i] = lk[i];
  }
  reg_special("oracle", oracle_fn, c);
  c.causal = 1;
  c.alibi = 2;
  c.softcap = 3;
  c.layout = TU_PADDED;
  reg_special("oracle", oracle_fn, c);
}

/* ---- meta: a deliberately broken result must fail ----------------------------------- */

typedef struct meta_arg {
  acfg c;
} meta_arg;

/* Runs a deliberately broken configuration silently; passes when the O check
 * alone (not only lse or the mask checks) rejects it. */
static void meta_wrap(const void *arg) {
  const meta_arg *m = (const meta_arg *)arg;
  int old = tr_silent(1);
  int before = tr_failures();
  attn_check(&m->c);
  int caught = tr_failures() > before;
  tr_silent(old);
  tr_reset_failures(before);
  attn_stats st = attn_last_stats();
  if (!caught || !(st.ratio_o > 1))
    tr_fail("a deliberately broken run passed the O check (O err %.3g = %.3g x tol; naive %.3g)",
            st.err_o, st.ratio_o, st.err_naive_o);
  if (tr_verbose())
    printf("  meta: caught=%d O err %.3g = %.3g x tol (naive %.3g), worst err/tol %.3g\n", caught,
           st.err_o, st.ratio_o, st.err_naive_o, st.worst_ratio);
}

static void reg_meta(void) {
  /* The smallest scale errors the O check alone still catches (f32, f16, bf16);
   * the lse check catches 1e-4 in every dtype. */
  static const double scale_mut[3] = {1 + 3e-5, 1 + 2e-3, 1 + 1.5e-2};
  for (int t = 0; t < 3; t++)
    for (int a = 0; a < 2; a++) {
      meta_arg m;
      memset(&m, 0, sizeof m);
      m.c = acfg_default();
      m.c.algo = k_flash[a];
      m.c.dtype = k_dtypes[t];
      m.c.nq = m.c.nk = 100;
      m.c.mut_scale = scale_mut[t];
      char name[256];
      acfg_name(&m.c, "meta-wrong-scale", name, sizeof name);
      m.c.seed = tu_hash_str(name);
      tr_add(name, meta_wrap, &m, sizeof m, 0);
      /* causal off by one key */
      m.c.mut_scale = 0;
      m.c.causal = 1;
      m.c.mut_window = 1;
      acfg_name(&m.c, "meta-causal-off-by-one", name, sizeof name);
      m.c.seed = tu_hash_str(name);
      tr_add(name, meta_wrap, &m, sizeof m, 0);
    }
}

static void zero_params_fn(const void *arg) {
  (void)arg;
  /* A zero-initialised fa_params must mean plain softmax(QK^T/sqrt(D))V. */
  enum { B = 2, N = 37, H = 3, D = 24 };
  const size_t n = (size_t)B * N * H * D;
  float *q = malloc(n * 4), *k = malloc(n * 4), *v = malloc(n * 4), *o = malloc(n * 4);
  double *q64 = malloc(n * 8), *k64 = malloc(n * 8), *v64 = malloc(n * 8), *o64 = malloc(n * 8);
  float *lse = malloc(B * H * N * 4), *lse64 = malloc(B * H * N * 4);
  tu_rng r;
  tu_rng_seed(&r, 42);
  for (size_t i = 0; i < n; i++) {
    q64[i] = q[i] = (float)tu_rng_normal(&r);
    k64[i] = k[i] = (float)tu_rng_normal(&r);
    v64[i] = v[i] = (float)tu_rng_normal(&r);
  }
  fa_params p;
  memset(&p, 0, sizeof p);
  fa_tensor tq = fa_tensor_bnhd(q, FA_DTYPE_F32, B, N, H, D),
            tk = fa_tensor_bnhd(k, FA_DTYPE_F32, B, N, H, D),
            tv = fa_tensor_bnhd(v, FA_DTYPE_F32, B, N, H, D),
            to = fa_tensor_bnhd(o, FA_DTYPE_F32, B, N, H, D);
  fa_status st = fa_forward(&p, &tq, &tk, &tv, &to, lse);
  if (st != FA_OK) tr_fail("zero params: fa_forward returned %d: %s", (int)st, fa_last_error());
  fa_params p64;
  memset(&p64, 0, sizeof p64);
  p64.algorithm = FA_ALGO_STANDARD;
  fa_tensor xq = fa_tensor_bnhd(q64, FA_DTYPE_F64, B, N, H, D),
            xk = fa_tensor_bnhd(k64, FA_DTYPE_F64, B, N, H, D),
            xv = fa_tensor_bnhd(v64, FA_DTYPE_F64, B, N, H, D),
            xo = fa_tensor_bnhd(o64, FA_DTYPE_F64, B, N, H, D);
  fa_status st2 = fa_forward(&p64, &xq, &xk, &xv, &xo, lse64);
  if (st2 != FA_OK) tr_fail("zero params: oracle returned %d: %s", (int)st2, fa_last_error());
  if (st == FA_OK && st2 == FA_OK) {
    /* and the oracle itself against the plain formula */
    double num = 0, den = 0, num2 = 0;
    for (int b = 0; b < B; b++)
      for (int h = 0; h < H; h++)
        for (int i = 0; i < N; i++) {
          double s[N], m = -INFINITY, l = 0;
          for (int j = 0; j < N; j++) {
            double x = 0;
            for (int d = 0; d < D; d++)
              x += q64[((b * N + i) * H + h) * D + d] * k64[((b * N + j) * H + h) * D + d];
            s[j] = x / sqrt((double)D);
            if (s[j] > m) m = s[j];
          }
          for (int j = 0; j < N; j++) l += s[j] = exp(s[j] - m);
          for (int d = 0; d < D; d++) {
            double acc = 0;
            for (int j = 0; j < N; j++) acc += s[j] / l * v64[((b * N + j) * H + h) * D + d];
            size_t idx = (size_t)((b * N + i) * H + h) * D + (size_t)d;
            num += (o[idx] - acc) * (o[idx] - acc);
            num2 += (o64[idx] - acc) * (o64[idx] - acc);
            den += acc * acc;
          }
          double el = m + log(l), gl = lse[(b * H + h) * N + i];
          if (!(fabs(gl - el) <= 1e-5 * (fabs(el) > 1 ? fabs(el) : 1)))
            tr_fail("zero params: lse (b%d h%d n%d) = %.8g, expected %.8g", b, h, i, gl, el);
        }
    if (!(sqrt(num / den) <= 1e-6)) tr_fail("zero params: O rel err %.3g > 1e-6", sqrt(num / den));
    if (!(sqrt(num2 / den) <= 1e-6))
      tr_fail("zero params: oracle O rel err %.3g vs plain formula", sqrt(num2 / den));
  }
  free(q), free(k), free(v), free(o), free(q64), free(k64), free(v64), free(o64), free(lse),
      free(lse64);
}

void register_forward_tests(void) {
  tr_add("fwd/zero-params", zero_params_fn, NULL, 0, 0);
  reg_oracle();
  reg_head_dims();
  reg_seqlens();
  reg_masks();
  reg_features();
  reg_varlen();
  reg_layouts();
  reg_pack();
  reg_nan();
  reg_decode();
  reg_rounding();
  reg_meta();
}
