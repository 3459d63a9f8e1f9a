/* The numerical attention test: one configuration, three runs.
 *
 *   oracle  FA_ALGO_STANDARD on float64 copies of the (storage-rounded) inputs
 *   naive   FA_ALGO_STANDARD in the storage dtype: the yardstick
 *   impl    the algorithm under test in the storage dtype, strided as asked,
 *           outputs poisoned (0xFF) with guard zones, inputs snapshotted
 *
 * and  err(impl) <= 2 * err(naive) + floor(dtype)  for O, dQ, dK, dV (relative
 * Frobenius error against the oracle), lse within a relative tolerance, exact
 * zeros / -inf on fully masked rows, exact zero dK/dV for keys nobody sees. */
#ifndef FA_TESTS_ATTN_H
#define FA_TESTS_ATTN_H

#include "util.h"

#define ACFG_MAX_SEQS 8

typedef struct acfg {
  fa_algorithm algo;
  fa_dtype dtype;
  int batch, hq, hk, nq, nk, d; /* nq/nk unused when nseq > 0 (varlen) */
  int causal, window;
  int64_t wl, wr;
  float softcap;
  int alibi;   /* 0: none, 1: per head (stride 0), 2: per batch (stride = hq) */
  float scale; /* 0: default 1/sqrt(d) */
  tu_layout layout;
  int nseq; /* > 0: varlen with lens_q/lens_k */
  int lens_q[ACFG_MAX_SEQS], lens_k[ACFG_MAX_SEQS];
  int threads;
  int backward;
  double qk_std; /* std of Q and K entries; 0: 1 */
  /* Deliberate breakage of the tested run (meta tests only). */
  double mut_scale; /* multiplier of its softmax scale; 0: none */
  int mut_window;   /* causal replaced by a window that lets one more key in */
  double mut_dout;  /* its backward sees dO * (1 + mut_dout); 0: none */
  int inject;       /* attn_check_nan_k: 1 NaN, 2 -inf in one K element, 3 NaN in V */
  int nan_seq;      /* attn_check_varlen_nan: the sequence whose Q, K, V, dO are all NaN */
  uint64_t seed;    /* set from the case name by attn_register */
} acfg;

/* A config with the defaults: flash2 f32, batch 1, 2 heads, 64x64, d 64. */
acfg acfg_default(void);
/* Name of the case: group + the features that differ from plain attention. */
void acfg_name(const acfg *c, const char *group, char *buf, size_t n);
/* Registers the numerical case (slow: skipped by --quick). */
void attn_register(const char *group, const acfg *c, int slow);

/* Registers fn(arg = a copy of c, seeded from the name) under a name built from c. */
void attn_register_fn(const char *group, tr_fn fn, const acfg *c, int slow);

/* Runs one configuration and records failures with tr_fail. Also usable from
 * meta tests (under tr_silent) to see whether a broken run is caught. */
void attn_check(const acfg *c);

/* Worst ratio err(impl) / (2 err(naive) + floor) seen by the last attn_check
 * (a value > 1 is a failure); and the largest relative errors it measured. */
typedef struct attn_stats {
  double worst_ratio;
  double ratio_o, ratio_dq, ratio_dk, ratio_dv; /* err / tol of each tensor */
  double err_o, err_naive_o, err_dq, err_dk, err_dv, err_lse;
} attn_stats;
attn_stats attn_last_stats(void);

/* Special cases (test_forward.c / test_backward.c register them). */
void attn_check_pack(const acfg *c);      /* packed copies or not: bitwise identical */
void attn_check_threads(const acfg *c);   /* threads 1, 2, 2, 0: bitwise identical */
void attn_check_workspace(const acfg *c); /* caller workspace of the queried size */
void attn_check_oracle(const acfg *c);    /* oracle vs an independent reference here */
void attn_check_nan_q(const acfg *c);     /* NaN in one Q row stays in that row */
void attn_check_nan_k(const acfg *c); /* NaN/-inf in K, NaN in V: rows not seeing it are clean */
void attn_check_varlen_nan(const acfg *c); /* a NaN sequence leaves the others bitwise unchanged */
void attn_check_rounding(const acfg *c);   /* O = (V0 + V1) / 2 exactly, rounded to nearest even */

double attn_floor(fa_dtype dt, int backward);
/* The largest error the naive storage-precision run may have (a sanity cap on
 * the yardstick), and the floor of the lse rule (relative to max(1, |lse|)). */
double attn_naive_cap(fa_dtype dt, int backward);
double attn_lse_floor(fa_dtype dt);

#endif
