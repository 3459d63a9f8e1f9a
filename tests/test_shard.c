/* Sequence shards (fa_params.shard_enabled): every (query block, key block)
 * pair of one sequence, computed as a shard at its positions and merged by
 * the lse, must give the whole sequence's attention, forward and backward:
 * the arithmetic of ring attention, in one process. The reference is the
 * float64 oracle on the whole sequence (no shard), the yardstick the naive
 * run of the same dtype (err <= 2 naive + floor, as in tests/attn.c). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"
#include "util.h"

#define SH_MAXBLK 5

typedef struct scfg {
  fa_algorithm algo;
  fa_dtype dt;
  int B, H, Hk, N, D;
  int causal, window;
  int64_t wl, wr;
  float softcap, p; /* p: dropout */
  int alibi;
  int nblk, cut[SH_MAXBLK + 1]; /* block b holds positions [cut[b], cut[b+1]) */
} scfg;

typedef struct sbufs {
  void *q, *k, *v, *o, *dout, *dq, *dk, *dv; /* (B, N, H or Hk, D) contiguous, dtype */
  float *lse;                                /* (B, H, N) */
} sbufs;

static fa_params sh_params(const scfg *c, fa_algorithm algo, const float *slopes, uint64_t seed) {
  const tu_variant var = {c->causal, c->window,  c->wl,
                          c->wr,     c->softcap, c->alibi ? slopes : NULL,
                          c->p,      seed,       seed >> 7};
  fa_params p = tu_params(&var);
  p.algorithm = algo;
  return p;
}

static void sh_alloc(sbufs *s, const scfg *c, fa_dtype dt) {
  const size_t nq = (size_t)c->B * c->N * c->H * c->D, nk = (size_t)c->B * c->N * c->Hk * c->D;
  const size_t es = tu_esize(dt);
  void **qs[5] = {&s->q, &s->o, &s->dout, &s->dq, NULL};
  void **ks[4] = {&s->k, &s->v, &s->dk, &s->dv};
  for (int i = 0; qs[i]; i++) *qs[i] = malloc(nq * es);
  for (int i = 0; i < 4; i++) *ks[i] = malloc(nk * es);
  s->lse = malloc(sizeof(float) * (size_t)c->B * c->H * c->N);
}

static void sh_free(sbufs *s) {
  void *all[9] = {s->q, s->k, s->v, s->o, s->dout, s->dq, s->dk, s->dv, s->lse};
  for (int i = 0; i < 9; i++) free(all[i]);
}

/* Rows [r0, r0 + n) of a contiguous (B, N, H, D) tensor. */
static fa_tensor sh_rows(void *base, fa_dtype dt, const scfg *c, int heads, int r0, int n) {
  fa_tensor t = fa_tensor_bnhd(base, dt, c->B, c->N, heads, c->D);
  t.data = (char *)base + (size_t)r0 * (size_t)t.stride_seq * tu_esize(dt);
  t.seqlen = n;
  return t;
}

/* The whole sequence (no shard): forward and backward into s. */
static int sh_full(const scfg *c, fa_params *p, fa_dtype dt, sbufs *s) {
  fa_tensor tq = sh_rows(s->q, dt, c, c->H, 0, c->N), tk = sh_rows(s->k, dt, c, c->Hk, 0, c->N);
  fa_tensor tv = sh_rows(s->v, dt, c, c->Hk, 0, c->N), to = sh_rows(s->o, dt, c, c->H, 0, c->N);
  fa_tensor tdo = sh_rows(s->dout, dt, c, c->H, 0, c->N);
  fa_tensor tdq = sh_rows(s->dq, dt, c, c->H, 0, c->N);
  fa_tensor tdk = sh_rows(s->dk, dt, c, c->Hk, 0, c->N);
  fa_tensor tdv = sh_rows(s->dv, dt, c, c->Hk, 0, c->N);
  if (fa_forward(p, &tq, &tk, &tv, &to, s->lse) != FA_OK) return 0;
  return fa_backward(p, &tq, &tk, &tv, &to, &tdo, s->lse, &tdq, &tdk, &tdv) == FA_OK;
}

static void sh_read(double *x, const void *m, size_t n, fa_dtype dt) {
  for (size_t e = 0; e < n; e++) x[e] = tu_load(m, dt, e);
}

static double sh_err(const double *x, const double *r, size_t n) {
  return tu_compare(x, r, n).rel_fro;
}

/* err <= 2 naive + floor; in float64 the floor is the float32 lse's, which
 * weighs each block in the merge and normalises each block's backward. */
static void sh_expect(const char *what, double err, double naive, int backward, fa_dtype dt) {
  const double floor = dt == FA_DTYPE_F64 ? 1e-6 : attn_floor(dt, backward);
  const double tol = 2 * naive + floor;
  if (!(err <= tol))
    tr_fail("%s: rel err %.3g > tol %.3g (2 x naive %.3g + floor)", what, err, tol, naive);
}

static void t_shard_case(const void *arg) {
  const scfg *c = arg;
  const uint64_t seed = tu_hash_str(tr_name());
  tu_rng rng;
  tu_rng_seed(&rng, seed);
  const int B = c->B, H = c->H, Hk = c->Hk, N = c->N, D = c->D;
  const size_t nq = (size_t)B * N * H * D, nk = (size_t)B * N * Hk * D, nl = (size_t)B * H * N;
  double *q = malloc(sizeof(double) * (2 * nq + 2 * nk)), *k = q + nq, *v = k + nk;
  double *dout = v + nk;
  for (size_t e = 0; e < nq; e++) q[e] = tu_round(tu_rng_normal(&rng), c->dt);
  for (size_t e = 0; e < nk; e++) k[e] = tu_round(tu_rng_normal(&rng), c->dt);
  for (size_t e = 0; e < nk; e++) v[e] = tu_round(tu_rng_normal(&rng), c->dt);
  for (size_t e = 0; e < nq; e++) dout[e] = tu_round(tu_rng_normal(&rng), c->dt);
  float slopes[16];
  for (int h = 0; h < H; h++) slopes[h] = 0.05f + 0.1f * (float)h;

  /* the oracle (float64) and the naive yardstick (storage dtype), whole sequence */
  sbufs ref, nai, sh;
  sh_alloc(&ref, c, FA_DTYPE_F64);
  sh_alloc(&nai, c, c->dt);
  sh_alloc(&sh, c, c->dt);
  for (int t = 0; t < 3; t++) {
    sbufs *s = t == 0 ? &ref : t == 1 ? &nai : &sh;
    const fa_dtype dt = t == 0 ? FA_DTYPE_F64 : c->dt;
    for (size_t e = 0; e < nq; e++) tu_store(s->q, dt, e, q[e]), tu_store(s->dout, dt, e, dout[e]);
    for (size_t e = 0; e < nk; e++) tu_store(s->k, dt, e, k[e]), tu_store(s->v, dt, e, v[e]);
  }
  fa_params pr = sh_params(c, FA_ALGO_STANDARD, slopes, seed);
  if (!sh_full(c, &pr, FA_DTYPE_F64, &ref) || !sh_full(c, &pr, c->dt, &nai)) {
    tr_fail("whole-sequence run: %s", fa_last_error());
    goto done;
  }

  /* the shards: O and lse merged over key blocks (float64 here) */
  double *acc = malloc(sizeof(double) * (2 * nq + 2 * nk + nl));
  double *m_lse = acc + nq, *gq = m_lse + nl, *gk = gq + nq, *gv = gk + nk;
  float *blse = malloc(sizeof(float) * nl);
  memset(acc, 0, sizeof(double) * nq);
  for (size_t e = 0; e < nl; e++) m_lse[e] = -INFINITY;
  fa_params p = sh_params(c, c->algo, slopes, seed);
  p.shard_enabled = 1;
  memset(sh.o, 0xFF, nq * tu_esize(c->dt));
  for (int a = 0; a < c->nblk; a++)
    for (int b = 0; b < c->nblk; b++) {
      const int qa = c->cut[a], na = c->cut[a + 1] - qa, kb = c->cut[b], nb = c->cut[b + 1] - kb;
      p.shard_q_offset = qa;
      p.shard_k_offset = kb;
      fa_tensor tq = sh_rows(sh.q, c->dt, c, H, qa, na), to = sh_rows(sh.o, c->dt, c, H, qa, na);
      fa_tensor tk = sh_rows(sh.k, c->dt, c, Hk, kb, nb), tv = sh_rows(sh.v, c->dt, c, Hk, kb, nb);
      memset(blse, 0xFF, sizeof(float) * nl);
      if (fa_forward(&p, &tq, &tk, &tv, &to, blse) != FA_OK) {
        tr_fail("forward of block (%d, %d): %s", a, b, fa_last_error());
        goto merged;
      }
      /* blse is (B, H, na); merge row (bb, i, h) */
      for (int bb = 0; bb < B; bb++)
        for (int h = 0; h < H; h++)
          for (int i = 0; i < na; i++) {
            const double l = blse[((size_t)bb * H + h) * na + i];
            double *ml = &m_lse[((size_t)bb * H + h) * N + qa + i];
            double *row = acc + (((size_t)bb * N + qa + i) * H + h) * D;
            const size_t src = (((size_t)bb * N + qa + i) * H + h) * D;
            if (l == -INFINITY) {
              for (int d = 0; d < D; d++)
                if (tu_load(sh.o, c->dt, src + d) != 0) {
                  tr_fail("block (%d, %d) row %d: fully masked, but O != 0", a, b, i);
                  goto merged;
                }
              continue;
            }
            const double nl2 = *ml > l ? *ml + log1p(exp(l - *ml)) : l + log1p(exp(*ml - l));
            const double wa = exp(*ml - nl2), wb = exp(l - nl2);
            for (int d = 0; d < D; d++) row[d] = wa * row[d] + wb * tu_load(sh.o, c->dt, src + d);
            *ml = nl2;
          }
    }
  {
    double *r = malloc(sizeof(double) * 2 * nq), *x = r + nq;
    sh_read(r, ref.o, nq, FA_DTYPE_F64);
    sh_read(x, nai.o, nq, c->dt);
    sh_expect("O merged", sh_err(acc, r, nq), sh_err(x, r, nq), 0, c->dt);
    double *rl = r; /* lse: -inf exactly where the oracle's is, else close */
    for (size_t e = 0; e < nl; e++) rl[e] = ref.lse[e];
    for (size_t e = 0; e < nl; e++)
      if (isinf(rl[e]) != isinf(m_lse[e]) ||
          (!isinf(rl[e]) && fabs(rl[e] - m_lse[e]) > 1e-4 * (1 + fabs(rl[e])))) {
        tr_fail("lse merged [%zu] = %g, oracle %g", e, m_lse[e], rl[e]);
        break;
      }
    free(r);
  }

  /* the backward of every block with the merged O and lse, as ring attention does */
  for (size_t e = 0; e < nq; e++) tu_store(sh.o, c->dt, e, acc[e]);
  for (size_t e = 0; e < nl; e++) sh.lse[e] = (float)m_lse[e];
  memset(gq, 0, sizeof(double) * (nq + 2 * nk));
  for (int a = 0; a < c->nblk; a++) {
    const int qa = c->cut[a], na = c->cut[a + 1] - qa;
    for (int bb = 0; bb < B; bb++) /* this block's lse, (B, H, na) contiguous */
      for (int h = 0; h < H; h++)
        for (int i = 0; i < na; i++)
          blse[((size_t)bb * H + h) * na + i] = sh.lse[((size_t)bb * H + h) * N + qa + i];
    for (int b = 0; b < c->nblk; b++) {
      const int kb = c->cut[b], nb = c->cut[b + 1] - kb;
      p.shard_q_offset = qa;
      p.shard_k_offset = kb;
      fa_tensor tq = sh_rows(sh.q, c->dt, c, H, qa, na), to = sh_rows(sh.o, c->dt, c, H, qa, na);
      fa_tensor tdo = sh_rows(sh.dout, c->dt, c, H, qa, na);
      fa_tensor tk = sh_rows(sh.k, c->dt, c, Hk, kb, nb), tv = sh_rows(sh.v, c->dt, c, Hk, kb, nb);
      fa_tensor tdq = sh_rows(sh.dq, c->dt, c, H, qa, na);
      fa_tensor tdk = sh_rows(sh.dk, c->dt, c, Hk, kb, nb),
                tdv = sh_rows(sh.dv, c->dt, c, Hk, kb, nb);
      if (fa_backward(&p, &tq, &tk, &tv, &to, &tdo, blse, &tdq, &tdk, &tdv) != FA_OK) {
        tr_fail("backward of block (%d, %d): %s", a, b, fa_last_error());
        goto merged;
      }
      for (int bb = 0; bb < B; bb++)
        for (int i = 0; i < na; i++)
          for (size_t e = 0; e < (size_t)H * D; e++) {
            const size_t x = ((size_t)bb * N + qa + i) * H * D + e;
            gq[x] += tu_load(sh.dq, c->dt, x);
          }
      for (int bb = 0; bb < B; bb++)
        for (int j = 0; j < nb; j++)
          for (size_t e = 0; e < (size_t)Hk * D; e++) {
            const size_t x = ((size_t)bb * N + kb + j) * Hk * D + e;
            gk[x] += tu_load(sh.dk, c->dt, x);
            gv[x] += tu_load(sh.dv, c->dt, x);
          }
    }
  }
  {
    double *r = malloc(sizeof(double) * 2 * nq), *x = r + nq;
    const char *names[3] = {"dQ summed", "dK summed", "dV summed"};
    void *rs[3] = {ref.dq, ref.dk, ref.dv}, *ns[3] = {nai.dq, nai.dk, nai.dv};
    double *gs[3] = {gq, gk, gv};
    for (int t = 0; t < 3; t++) {
      const size_t n = t == 0 ? nq : nk;
      sh_read(r, rs[t], n, FA_DTYPE_F64);
      sh_read(x, ns[t], n, c->dt);
      sh_expect(names[t], sh_err(gs[t], r, n), sh_err(x, r, n), 1, c->dt);
    }
    free(r);
  }
merged:
  free(acc);
  free(blse);
done:
  sh_free(&ref);
  sh_free(&nai);
  sh_free(&sh);
  free(q);
}

/* A shard at offset 0 of a square problem is the plain call, bit for bit; at
 * another offset the same rows and keys see the same relative mask but
 * draw other dropout bits. */
static void t_shard_identity(const void *arg) {
  (void)arg;
  const int N = 37, H = 2, D = 16;
  const size_t n = (size_t)N * H * D;
  float *q = malloc(sizeof(float) * 5 * n), *k = q + n, *v = k + n, *o1 = v + n, *o2 = o1 + n;
  float lse1[2 * 37], lse2[2 * 37];
  tu_rng rng;
  tu_rng_seed(&rng, 7);
  for (size_t e = 0; e < 3 * n; e++) q[e] = (float)tu_rng_normal(&rng);
  fa_tensor tq = fa_tensor_bnhd(q, FA_DTYPE_F32, 1, N, H, D),
            tk = fa_tensor_bnhd(k, FA_DTYPE_F32, 1, N, H, D);
  fa_tensor tv = fa_tensor_bnhd(v, FA_DTYPE_F32, 1, N, H, D);
  fa_tensor t1 = fa_tensor_bnhd(o1, FA_DTYPE_F32, 1, N, H, D),
            t2 = fa_tensor_bnhd(o2, FA_DTYPE_F32, 1, N, H, D);
  const tu_variant var = {1, 1, 9, -1, 0.0f, NULL, 0.25f, 99, 0};
  const fa_params p = tu_params(&var);
  fa_params s = p;
  s.shard_enabled = 1;
  if (fa_forward(&p, &tq, &tk, &tv, &t1, lse1) != FA_OK ||
      fa_forward(&s, &tq, &tk, &tv, &t2, lse2) != FA_OK)
    return tr_fail("%s", fa_last_error());
  if (memcmp(o1, o2, sizeof(float) * n) || memcmp(lse1, lse2, sizeof lse1))
    tr_fail("a shard at offsets (0, 0) differs from the plain call");
  s.shard_q_offset = s.shard_k_offset = 100; /* same mask, other dropout positions */
  if (fa_forward(&s, &tq, &tk, &tv, &t2, lse2) != FA_OK) return tr_fail("%s", fa_last_error());
  if (memcmp(lse1, lse2, sizeof lse1)) tr_fail("lse moved with the offsets (the mask should not)");
  if (!memcmp(o1, o2, sizeof(float) * n)) tr_fail("dropout did not move with the offsets");
  free(q);
}

static void t_shard_validation(const void *arg) {
  (void)arg;
  float buf[4 * 8 * 2 * 8];
  float lse[2 * 8];
  fa_tensor t = fa_tensor_bnhd(buf, FA_DTYPE_F32, 1, 8, 2, 8);
  fa_tensor o = fa_tensor_bnhd(buf + 3 * 128, FA_DTYPE_F32, 1, 8, 2, 8);
  memset(buf, 0, sizeof buf);
  struct {
    const char *what;
    int64_t qo, ko;
    float p;
    int extra; /* 1 varlen, 2 seqused_k, 3 block mask */
    fa_status want;
  } cases[] = {
      {"negative q offset", -1, 0, 0, 0, FA_ERR_INVALID_ARGUMENT},
      {"negative k offset", 0, -4, 0, 0, FA_ERR_INVALID_ARGUMENT},
      {"q position past 2^31 - 1", INT32_MAX - 7, 0, 0, 0, FA_ERR_INVALID_ARGUMENT},
      {"k position past 2^31 - 1", 0, INT32_MAX, 0, 0, FA_ERR_INVALID_ARGUMENT},
      {"dropout with k offset 6", 0, 6, 0.5f, 0, FA_ERR_INVALID_ARGUMENT},
      {"varlen", 8, 0, 0, 1, FA_ERR_UNSUPPORTED},
      {"seqused_k", 8, 0, 0, 2, FA_ERR_UNSUPPORTED},
      {"block mask", 8, 0, 0, 3, FA_ERR_UNSUPPORTED},
      {"largest positions", INT32_MAX - 8, INT32_MAX - 8, 0, 0, FA_OK},
      {"dropout with k offset 12", 3, 12, 0.5f, 0, FA_OK},
  };
  int32_t cu[2] = {0, 8}, used[1] = {8};
  uint8_t bm[1] = {1};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    fa_params p = {0};
    p.shard_enabled = 1;
    p.shard_q_offset = cases[i].qo;
    p.shard_k_offset = cases[i].ko;
    p.dropout_p = cases[i].p;
    if (cases[i].extra == 1) p.cu_seqlens_q = p.cu_seqlens_k = cu, p.num_seqs = 1;
    if (cases[i].extra == 2) p.seqused_k = used;
    if (cases[i].extra == 3) p.block_mask = bm, p.block_size_q = p.block_size_k = 8;
    fa_status st = fa_forward(&p, &t, &t, &t, &o, lse);
    if (st != cases[i].want)
      tr_fail("%s: status %s (%s), want %s", cases[i].what, fa_status_string(st), fa_last_error(),
              fa_status_string(cases[i].want));
    else if (st != FA_OK && !strstr(fa_last_error(), "shard"))
      tr_fail("%s: the message does not name the shard: %s", cases[i].what, fa_last_error());
  }
}

void register_shard_tests(void) {
  tr_add("shard/identity", t_shard_identity, NULL, 0, 0);
  tr_add("shard/validation", t_shard_validation, NULL, 0, 0);
  /* uneven blocks, the first of two rows (the CPU's decode path); every algorithm */
  const scfg base = {FA_ALGO_FLASH2,    FA_DTYPE_F32, 2, 4, 2, 70, 16, 1, 0, 0, 0, 0, 0, 0, 4,
                     {0, 2, 29, 48, 70}};
  const scfg drop = {FA_ALGO_FLASH2, FA_DTYPE_F32, 1, 3, 3, 64, 32, 1, 0, 0, 0, 0, 0.2f, 0, 3,
                     {0, 16, 40, 64}};
  struct {
    const char *name;
    scfg c;
  } v[6] = {{"f32/causal/gqa", base},
            {"f32/window11-5/gqa", base},
            {"f32/causal-window20/alibi/softcap", base},
            {"f32/causal/dropout", drop},
            {"f32/window7-12/dropout", drop},
            {"bf16/causal/dropout", drop}};
  v[1].c.causal = 0, v[1].c.window = 1, v[1].c.wl = 11, v[1].c.wr = 5;
  v[2].c.window = 1, v[2].c.wl = 20, v[2].c.alibi = 1, v[2].c.softcap = 3.0f;
  v[4].c.causal = 0, v[4].c.window = 1, v[4].c.wl = 7, v[4].c.wr = 12, v[4].c.nblk = 4;
  memcpy(v[4].c.cut, (int[]){0, 4, 20, 36, 64}, sizeof(int) * 5);
  v[5].c.dt = FA_DTYPE_BF16;
  const fa_algorithm algos[3] = {FA_ALGO_FLASH2, FA_ALGO_FLASH1, FA_ALGO_STANDARD};
  char name[160];
  for (int a = 0; a < 3; a++)
    for (int i = 0; i < 6; i++) {
      scfg c = v[i].c;
      c.algo = algos[a];
      snprintf(name, sizeof name, "shard/%s/%s", tu_algo_name(algos[a]), v[i].name);
      tr_add(name, t_shard_case, &c, sizeof c, 0);
    }
  /* the oracle's own shard path: float64, to rounding */
  const scfg f = {FA_ALGO_STANDARD, FA_DTYPE_F64, 1, 2, 1, 45, 8, 1, 1, 6, 3, 2.0f, 0.3f, 1, 3,
                  {0, 8, 20, 45}};
  tr_add("shard/standard/f64/causal-window6-3/alibi/softcap/dropout", t_shard_case, &f, sizeof f,
         0);
}
