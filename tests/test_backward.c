/* Backward-pass cases (each also checks its forward pass, whose O and lse the
 * backward consumes): dQ, dK, dV against the float64 oracle; thread counts and
 * repeated runs bitwise identical; caller-provided workspace; meta tests that
 * a wrong gradient is caught. */
#include <stdio.h>
#include <string.h>

#include "attn.h"

static const fa_algorithm k_flash[2] = {FA_ALGO_FLASH2, FA_ALGO_FLASH1};
static const fa_algorithm k_all_algos[3] = {FA_ALGO_FLASH2, FA_ALGO_FLASH1, FA_ALGO_STANDARD};
static const fa_dtype k_dtypes[3] = {FA_DTYPE_F32, FA_DTYPE_F16, FA_DTYPE_BF16};

static void reg(const char *group, acfg c) {
  c.backward = 1;
  attn_register(group, &c, 0);
}

static void reg_head_dims(void) {
  static const int dims[] = {8, 32, 40, 64, 72, 96, 128, 192, 256};
  for (int a = 0; a < 2; a++)
    for (int t = 0; t < 3; t++)
      for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++) {
        acfg c = acfg_default();
        c.algo = k_flash[a];
        c.dtype = k_dtypes[t];
        c.d = dims[i];
        c.nq = 33;
        c.nk = 47;
        c.causal = (int)((i + (size_t)t) & 1);
        reg("hdim", c);
      }
  static const int sdims[] = {8, 72, 256};
  for (int t = 0; t < 3; t++)
    for (int i = 0; i < 3; i++) {
      acfg c = acfg_default();
      c.algo = FA_ALGO_STANDARD;
      c.dtype = k_dtypes[t];
      c.d = sdims[i];
      c.nq = 40;
      c.nk = 29;
      c.causal = i == 1;
      reg("hdim", c);
    }
}

static void reg_seqlens(void) {
  static const int pairs[][2] = {{1, 1},    {2, 2},    {1, 129},   {129, 1},   {2, 17},
                                 {17, 129}, {129, 17}, {127, 127}, {128, 128}, {129, 129}};
  const int np = (int)(sizeof pairs / sizeof pairs[0]);
  for (int a = 0; a < 2; a++)
    for (int i = 0; i < np; i++)
      for (int causal = 0; causal < 2; causal++) {
        acfg c = acfg_default();
        c.algo = k_flash[a];
        c.nq = pairs[i][0];
        c.nk = pairs[i][1];
        c.causal = causal;
        c.d = 32;
        reg("seqlen", c);
        if ((i + causal) & 1) {
          c.dtype = a ? FA_DTYPE_F16 : FA_DTYPE_BF16;
          reg("seqlen", c);
        } else {
          c.dtype = a ? FA_DTYPE_BF16 : FA_DTYPE_F16;
          reg("seqlen", c);
        }
      }
  /* The standard algorithm: fully masked rows (causal, Nq > Nk) in every dtype,
   * one query row and one key (P's padding to 16 columns) in float32. */
  static const int spairs[][2] = {{1, 129}, {129, 1}, {1, 1}};
  for (int t = 0; t < 3; t++) {
    acfg c = acfg_default();
    c.algo = FA_ALGO_STANDARD;
    c.dtype = k_dtypes[t];
    c.nq = 129;
    c.nk = 17;
    c.causal = 1;
    reg("seqlen", c);
    c.dtype = FA_DTYPE_F32;
    c.nq = spairs[t][0];
    c.nk = spairs[t][1];
    c.causal = t == 1;
    c.d = 32;
    reg("seqlen", c);
  }
  acfg c = acfg_default();
  c.backward = 1;
  c.nq = c.nk = 1000;
  c.hq = c.hk = 1;
  c.causal = 1;
  attn_register("long", &c, 1);
  c.algo = FA_ALGO_FLASH1;
  c.dtype = FA_DTYPE_F16;
  c.causal = 0;
  c.nq = 300;
  attn_register("long", &c, 1);
}

static void reg_masks(void) {
  static const int64_t wins[][2] = {{16, 16}, {0, 0}, {32, -1}, {-1, 8}, {5, 0}, {0, 3}};
  const int nw = (int)(sizeof wins / sizeof wins[0]);
  int r = 0;
  for (int w = 0; w < nw; w++)
    for (int causal = 0; causal < 2; causal++)
      for (int a = 0; a < 2; a++) {
        acfg c = acfg_default();
        c.algo = k_flash[a];
        c.dtype = k_dtypes[r++ % 3];
        c.nq = (w + causal) & 1 ? 130 : 90;
        c.nk = (w + causal) & 1 ? 90 : 130;
        c.d = 32;
        c.causal = causal;
        c.window = 1;
        c.wl = wins[w][0];
        c.wr = wins[w][1];
        reg("window", c);
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
    reg("window", c);
  }
}

static void reg_features(void) {
  static const int heads[][2] = {{8, 1}, {4, 2}, {6, 3}};
  for (int g = 0; g < 3; g++)
    for (int a = 0; a < 3; a++)
      for (int t = 0; t < 3; t++) {
        if (a == 2 && t != g) continue;
        acfg c = acfg_default();
        c.algo = k_all_algos[a];
        c.dtype = k_dtypes[t];
        c.hq = heads[g][0];
        c.hk = heads[g][1];
        c.nq = 60;
        c.nk = 75;
        c.d = 64;
        c.causal = (g + t + 1) & 1;
        reg("gqa", c);
      }
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
        c.nq = 135;
        c.nk = 70;
        c.causal = (a + t + 1) & 1;
        reg("softcap", c);
      }
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
        c.nq = 135;
        c.nk = 85;
        c.causal = (a + t + 1) & 1;
        reg("alibi", c);
      }
  for (int a = 0; a < 3; a++) {
    acfg c = acfg_default();
    c.algo = k_all_algos[a];
    c.dtype = k_dtypes[(a + 2) % 3];
    c.batch = 2;
    c.hq = 4;
    c.hk = 1;
    c.nq = 100;
    c.nk = 70;
    c.d = 72;
    c.causal = 1;
    c.window = 1;
    c.wl = 20;
    c.wr = -1;
    c.softcap = 5;
    c.alibi = 2;
    c.layout = TU_PADDED;
    reg("combined", c);
  }
  for (int a = 0; a < 3; a++)
    for (int t = 0; t < 3; t++) {
      acfg c = acfg_default();
      c.algo = k_all_algos[a];
      c.dtype = k_dtypes[t];
      c.scale = 0.3f;
      c.nq = 60;
      c.nk = 50;
      reg("scale", c);
      c.scale = 0;
      c.qk_std = 6;
      c.causal = 1;
      reg("large-scores", c);
    }
}

static void reg_varlen(void) {
  static const int sets[][2][5] = {
      {{17, 0, 64, 1, 129}, {17, 5, 100, 1, 33}},
      {{3, 40, 0, 128, 9}, {0, 40, 7, 130, 9}},
      {{1, 2, 3, 150, 0}, {1, 2, 3, 100, 0}},
  };
  int r = 0;
  for (int s = 0; s < 3; s++)
    for (int causal = 0; causal < 2; causal++)
      for (int a = 0; a < 3; a++) {
        if (a == 2 && !causal) continue;
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
        reg("varlen", c);
      }
}

static void reg_layouts(void) {
  static const tu_layout lays[] = {TU_BHND, TU_PADDED, TU_PACKED, TU_HUGE, TU_MIXED};
  int r = 1;
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
      c.nk = 50;
      c.d = 48;
      c.causal = (l + 1) & 1;
      reg("layout", c);
    }
  acfg c = acfg_default();
  c.layout = TU_PADDED;
  c.dtype = FA_DTYPE_F16;
  c.nseq = 3;
  c.lens_q[0] = 30;
  c.lens_q[1] = 0;
  c.lens_q[2] = 70;
  c.lens_k[0] = 50;
  c.lens_k[1] = 9;
  c.lens_k[2] = 60;
  c.causal = 1;
  reg("layout", c);
  c.algo = FA_ALGO_FLASH1;
  c.dtype = FA_DTYPE_BF16;
  c.layout = TU_BHND;
  reg("layout", c);
}

static void threads_fn(const void *arg) { attn_check_threads((const acfg *)arg); }
static void workspace_fn(const void *arg) { attn_check_workspace((const acfg *)arg); }
static void pack_fn(const void *arg) { attn_check_pack((const acfg *)arg); }

static void reg_determinism(void) {
  for (int a = 0; a < 3; a++)
    for (int t = 0; t < 3; t++) {
      if (a == 2 && t) continue;
      acfg c = acfg_default();
      c.backward = 1;
      c.algo = k_all_algos[a];
      c.dtype = k_dtypes[t];
      c.batch = 2;
      c.hq = 4;
      c.hk = 2;
      c.nq = 150;
      c.nk = 130;
      c.causal = t != 1;
      attn_register_fn("threads", threads_fn, &c, 0);
      if (a == 0) attn_register_fn("pack", pack_fn, &c, 0); /* fused: 4 (sequence, K/V head) */
      c.batch = 1;
      c.nq = 90;
      c.nk = 110;
      c.layout = t == 1 ? TU_PADDED : TU_BNHD;
      attn_register_fn("workspace", workspace_fn, &c, 0);
      if (a == 0) { /* non-fused: 2 units; a window off the key-block grid */
        c.window = 1;
        c.wl = 40;
        c.wr = 7;
        attn_register_fn("pack", pack_fn, &c, 0);
      }
    }
  acfg c = acfg_default();
  c.backward = 1;
  c.dtype = FA_DTYPE_BF16;
  c.nseq = 4;
  c.hq = 8;
  c.hk = 2;
  static const int lq[4] = {100, 0, 37, 64}, lk[4] = {80, 20, 37, 200};
  for (int i = 0; i < 4; i++) {
    c.lens_q[i] = lq[i];
    c.lens_k[i] = lk[i];
  }
  c.causal = 1;
  attn_register_fn("threads", threads_fn, &c, 0);
  attn_register_fn("pack", pack_fn, &c, 0);
  c.algo = FA_ALGO_FLASH1;
  c.dtype = FA_DTYPE_F32;
  attn_register_fn("threads", threads_fn, &c, 0);
  attn_register_fn("workspace", workspace_fn, &c, 0);
  /* a library workspace of 8 MiB and more: 2 MiB aligned, huge pages
   * asked for (the forward's packed K/V: 16 heads x 1024 keys x 128 floats) */
  c = acfg_default();
  c.backward = 1;
  c.dtype = FA_DTYPE_F32;
  c.hq = c.hk = 16;
  c.nq = c.nk = 1024;
  c.d = 64;
  c.causal = 1;
  attn_register_fn("workspace", workspace_fn, &c, 1);
}

/* A varlen sequence whose Q, K, V and dO are all NaN leaves the other
 * sequences' O, lse, dQ, dK, dV bitwise unchanged: lengths off the tile sizes,
 * GQA, the NaN sequence between, before and after the others; and decode
 * shapes (at most 16 rows per K/V head: the CPU's split-K forward for FLASH2,
 * several splits per sequence). */
static void varlen_nan_fn(const void *arg) { attn_check_varlen_nan((const acfg *)arg); }

static void reg_varlen_nan_case(const char *group, acfg c, const int *lq, const int *lk) {
  static const char *pos[3] = {"first", "mid", "last"};
  char name[64];
  snprintf(name, sizeof name, "%s-%s", group, pos[c.nan_seq]);
  c.backward = 1;
  c.nseq = 3;
  for (int i = 0; i < 3; i++) {
    c.lens_q[i] = lq[i];
    c.lens_k[i] = lk[i];
  }
  attn_register_fn(name, varlen_nan_fn, &c, 0);
}

static void reg_varlen_nan(void) {
  static const int lq[3] = {70, 150, 93}, lk[3] = {130, 77, 190};
  for (int a = 0; a < 3; a++)
    for (int t = 0; t < 3; t++)
      for (int causal = 0; causal < 2; causal++) {
        acfg c = acfg_default();
        c.algo = k_all_algos[a];
        c.dtype = k_dtypes[t];
        c.hq = 4;
        c.hk = t == 2 ? 1 : 2;
        c.d = t == 1 ? 40 : 64;
        c.causal = causal; /* the 150:77 sequence's first 73 rows see no key */
        c.nan_seq = 1;
        reg_varlen_nan_case("varlen-nan", c, lq, lk);
      }
  for (int a = 0; a < 3; a++)
    for (int last = 0; last < 2; last++) {
      acfg c = acfg_default();
      c.algo = k_all_algos[a];
      c.dtype = k_dtypes[(a + 2 * last) % 3];
      c.hq = 6;
      c.hk = 2;
      c.causal = (a + last) & 1;
      c.layout = last ? TU_PADDED : TU_BNHD;
      c.nan_seq = last ? 2 : 0;
      reg_varlen_nan_case("varlen-nan", c, lq, lk);
    }
  static const int dq[3] = {1, 2, 1}, dk[3] = {700, 1300, 900};
  for (int a = 0; a < 3; a++)
    for (int t = 0; t < 3; t++)
      for (int causal = 0; causal < 2; causal++) {
        if (a > 0 && (t != a || !causal)) continue; /* flash1, standard: one case each */
        acfg c = acfg_default();
        c.algo = k_all_algos[a];
        c.dtype = k_dtypes[t];
        c.hq = 8;
        c.hk = 2;
        c.causal = causal;
        c.nan_seq = 1;
        reg_varlen_nan_case("decode-varlen-nan", c, dq, dk);
      }
  for (int last = 0; last < 2; last++) {
    acfg c = acfg_default();
    c.dtype = last ? FA_DTYPE_BF16 : FA_DTYPE_F16;
    c.hq = 8;
    c.hk = 2;
    c.causal = !last;
    c.nan_seq = last ? 2 : 0;
    reg_varlen_nan_case("decode-varlen-nan", c, dq, dk);
  }
}

typedef struct meta_arg {
  acfg c;
} meta_arg;

static void meta_wrap(const void *arg) {
  const meta_arg *m = (const meta_arg *)arg;
  int old = tr_silent(1);
  int before = tr_failures();
  attn_check(&m->c);
  int caught = tr_failures() > before;
  tr_silent(old);
  tr_reset_failures(before);
  attn_stats st = attn_last_stats();
  /* each gradient's own check must catch it */
  if (!caught || !(st.ratio_dq > 1) || !(st.ratio_dk > 1) || !(st.ratio_dv > 1))
    tr_fail("a deliberately broken gradient passed (err/tol: dQ %.3g dK %.3g dV %.3g)", st.ratio_dq,
            st.ratio_dk, st.ratio_dv);
  if (tr_verbose())
    printf("  meta: caught=%d err dQ %.3g dK %.3g dV %.3g, err/tol dQ %.3g dK %.3g dV %.3g\n",
           caught, st.err_dq, st.err_dk, st.err_dv, st.ratio_dq, st.ratio_dk, st.ratio_dv);
}

static void reg_meta(void) {
  /* dO scaled by (1 + x) in the tested backward only: every gradient is off by
   * x. The x here are about the smallest each dtype's tolerance catches. */
  static const double dout_mut[3] = {1e-5, 2e-3, 1.5e-2};
  for (int t = 0; t < 3; t++)
    for (int a = 0; a < 2; a++) {
      meta_arg m;
      memset(&m, 0, sizeof m);
      m.c = acfg_default();
      m.c.backward = 1;
      m.c.algo = k_flash[a];
      m.c.dtype = k_dtypes[t];
      m.c.nq = m.c.nk = 100;
      m.c.mut_dout = dout_mut[t];
      char name[256];
      acfg_name(&m.c, "meta-wrong-dout", name, sizeof name);
      m.c.seed = tu_hash_str(name);
      tr_add(name, meta_wrap, &m, sizeof m, 0);
    }
}

void register_backward_tests(void) {
  reg_head_dims();
  reg_seqlens();
  reg_masks();
  reg_features();
  reg_varlen();
  reg_layouts();
  reg_determinism();
  reg_varlen_nan();
  reg_meta();
}
