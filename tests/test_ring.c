/* Ring attention (fa_ring_forward / fa_ring_backward) with W ranks as threads
 * of this process and an in-memory transport, against the whole sequence's
 * attention: every rank's O, lse, dQ, dK, dV put back at their positions must
 * match the float64 oracle within twice the error of the naive run in the
 * same dtype (as tests/attn.c). The transport performs each exchange only in
 * wait(), so a ring that touched a buffer in flight would receive wrong data. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"
#include "ring_rows.h"
#include "util.h"

#define RT_MAXW 4
#define RT_MAXQ 8

/* The ranks meet at a barrier that a failing rank can break (abort), so the
 * others' wait() fails instead of waiting for it forever. */
typedef struct rt_hub {
  int W;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int arrived, generation, aborted;
  const void *post[RT_MAXW];
  int post_to[RT_MAXW];
  size_t post_bytes[RT_MAXW];
  int bad;
} rt_hub;

static int rt_meet(rt_hub *h) {
  pthread_mutex_lock(&h->mu);
  const int gen = h->generation;
  if (++h->arrived == h->W) {
    h->arrived = 0;
    h->generation++;
    pthread_cond_broadcast(&h->cv);
  } else {
    while (gen == h->generation && !h->aborted) pthread_cond_wait(&h->cv, &h->mu);
  }
  const int ok = !h->aborted;
  pthread_mutex_unlock(&h->mu);
  return ok;
}

static void rt_abort(rt_hub *h) {
  pthread_mutex_lock(&h->mu);
  h->aborted = 1;
  pthread_cond_broadcast(&h->cv);
  pthread_mutex_unlock(&h->mu);
}

typedef struct rt_xfer {
  const void *send;
  void *recv;
  int to, from;
  size_t bytes;
} rt_xfer;

typedef struct rt_port {
  rt_hub *hub;
  int rank;
  rt_xfer q[RT_MAXQ];
  int nq, exchanges;
} rt_port;

static fa_status rt_exchange(void *ctx, const void *send, int send_to, void *recv, int recv_from,
                             size_t bytes, void *stream) {
  rt_port *p = ctx;
  (void)stream;
  if (p->nq == RT_MAXQ) return FA_ERR_INTERNAL;
  p->q[p->nq++] = (rt_xfer){send, recv, send_to, recv_from, bytes};
  p->exchanges++;
  return FA_OK;
}

static fa_status rt_wait(void *ctx, void *stream) {
  rt_port *p = ctx;
  rt_hub *h = p->hub;
  (void)stream;
  for (int i = 0; i < p->nq; i++) { /* every rank has as many in flight */
    const rt_xfer *x = &p->q[i];
    h->post[p->rank] = x->send;
    h->post_to[p->rank] = x->to;
    h->post_bytes[p->rank] = x->bytes;
    if (!rt_meet(h)) return FA_ERR_INTERNAL; /* another rank failed */
    if (h->post_to[x->from] != p->rank || h->post_bytes[x->from] != x->bytes)
      h->bad = 1; /* sender and receiver disagree */
    else
      memcpy(x->recv, h->post[x->from], x->bytes);
    if (!rt_meet(h)) return FA_ERR_INTERNAL;
  }
  p->nq = 0;
  return FA_OK;
}

typedef struct rcfg {
  int W;
  fa_ring_layout layout;
  int B, H, Hk, n, D; /* n: rows a rank */
  int causal, window;
  int64_t wl, wr;
  float p, softcap;
  int alibi;
} rcfg;

typedef struct rt_job {
  const rcfg *c;
  rt_hub *hub;
  int rank;
  const float *q, *k, *v, *dout; /* whole sequence (B, N, H, D) */
  float *o, *lse, *dq, *dk, *dv; /* whole-sequence results, filled at this rank's rows */
  const float *slopes;
  uint64_t seed;
  fa_status st;
  char err[256];
  int exchanges;
} rt_job;

static fa_params rt_params(const rcfg *c, const float *slopes, uint64_t seed) {
  const tu_variant var = {c->causal, c->window,  c->wl,
                          c->wr,     c->softcap, c->alibi ? slopes : NULL,
                          c->p,      seed,       seed >> 9};
  fa_params p = tu_params(&var);
  p.num_threads = 1;
  return p;
}

static void *rt_rank(void *arg) {
  rt_job *j = arg;
  const rcfg *c = j->c;
  const int B = c->B, H = c->H, Hk = c->Hk, D = c->D, n = c->n, N = c->n * c->W;
  int64_t pos[256];
  ring_positions(c->layout, c->W, c->n, j->rank, pos);
  const size_t nq = (size_t)B * n * H * D, nk = (size_t)B * n * Hk * D;
  float *m = malloc(sizeof(float) * (5 * nq + 4 * nk + (size_t)B * H * n));
  float *q = m, *o = q + nq, *dout = o + nq, *dq = dout + nq, *scratch = dq + nq;
  float *k = scratch + nq, *v = k + nk, *dk = v + nk, *dv = dk + nk, *lse = dv + nk;
  ring_rows(q, (void *)j->q, pos, B, n, N, sizeof(float) * H * D, 1);
  ring_rows(dout, (void *)j->dout, pos, B, n, N, sizeof(float) * H * D, 1);
  ring_rows(k, (void *)j->k, pos, B, n, N, sizeof(float) * Hk * D, 1);
  ring_rows(v, (void *)j->v, pos, B, n, N, sizeof(float) * Hk * D, 1);
  /* o and the gradients poisoned: every element must be written */
  memset(o, 0xFF, sizeof(float) * nq), memset(dq, 0xFF, sizeof(float) * nq);
  memset(dk, 0xFF, sizeof(float) * nk), memset(dv, 0xFF, sizeof(float) * nk);
  rt_port port = {j->hub, j->rank, {{0}}, 0, 0};
  fa_ring ring = {j->rank, c->W, c->layout, &port, rt_exchange, rt_wait};
  fa_params p = rt_params(c, j->slopes, j->seed);
  void *const ptr[8] = {q, k, v, o, dout, dq, dk, dv};
  j->st = ring_run(&p, &ring, ptr, lse, FA_DTYPE_F32, B, n, H, Hk, D);
  if (j->st != FA_OK) {
    snprintf(j->err, sizeof j->err, "%s", fa_last_error());
    rt_abort(j->hub);
  }
  j->exchanges = port.exchanges;
  ring_rows(o, j->o, pos, B, n, N, sizeof(float) * H * D, 0);
  ring_rows(dq, j->dq, pos, B, n, N, sizeof(float) * H * D, 0);
  ring_rows(dk, j->dk, pos, B, n, N, sizeof(float) * Hk * D, 0);
  ring_rows(dv, j->dv, pos, B, n, N, sizeof(float) * Hk * D, 0);
  for (int b = 0; b < B; b++) /* lse (B, H, n) -> (B, H, N) */
    for (int h = 0; h < H; h++)
      for (int i = 0; i < n; i++)
        j->lse[((size_t)b * H + h) * N + pos[i]] = lse[((size_t)b * H + h) * n + i];
  free(m);
  return NULL;
}

/* The whole sequence in one call: dtype dt, algorithm a (into double arrays). */
static int rt_whole(const rcfg *c, fa_algorithm a, fa_dtype dt, const float *slopes, uint64_t seed,
                    const float *const in[4], double *out[5]) {
  const int B = c->B, H = c->H, Hk = c->Hk, D = c->D, N = c->n * c->W;
  const size_t nq = (size_t)B * N * H * D, nk = (size_t)B * N * Hk * D, es = tu_esize(dt);
  const size_t sz[9] = {nq, nk, nk, nq, nq, nq, nk, nk};
  void *b[8];
  for (int i = 0; i < 8; i++) b[i] = malloc(sz[i] * es);
  for (int i = 0; i < 4; i++)
    for (size_t e = 0; e < sz[i == 3 ? 3 : i]; e++) tu_store(b[i], dt, e, in[i][e]);
  float *lse = malloc(sizeof(float) * (size_t)B * H * N);
  fa_params p = rt_params(c, slopes, seed);
  p.algorithm = a;
  p.num_threads = 0;
  fa_tensor t[8];
  const int heads[8] = {H, Hk, Hk, H, H, H, Hk, Hk};
  for (int i = 0; i < 8; i++) t[i] = fa_tensor_bnhd(b[i], dt, B, N, heads[i], D);
  int ok = fa_forward(&p, &t[0], &t[1], &t[2], &t[4], lse) == FA_OK &&
           fa_backward(&p, &t[0], &t[1], &t[2], &t[4], &t[3], lse, &t[5], &t[6], &t[7]) == FA_OK;
  const int src[4] = {4, 5, 6, 7};
  for (int i = 0; ok && i < 4; i++)
    for (size_t e = 0; e < sz[src[i]]; e++) out[i][e] = tu_load(b[src[i]], dt, e);
  for (size_t e = 0; ok && e < (size_t)B * H * N; e++) out[4][e] = lse[e];
  for (int i = 0; i < 8; i++) free(b[i]);
  free(lse);
  return ok;
}

static void t_ring_case(const void *arg) {
  const rcfg *c = arg;
  const uint64_t seed = tu_hash_str(tr_name());
  tu_rng rng;
  tu_rng_seed(&rng, seed);
  const int B = c->B, H = c->H, Hk = c->Hk, D = c->D, N = c->n * c->W;
  const size_t nq = (size_t)B * N * H * D, nk = (size_t)B * N * Hk * D, nl = (size_t)B * H * N;
  float *in = malloc(sizeof(float) * (2 * nq + 2 * nk));
  float *q = in, *k = q + nq, *v = k + nk, *dout = v + nk;
  for (size_t e = 0; e < 2 * nq + 2 * nk; e++) in[e] = (float)tu_rng_normal(&rng);
  float slopes[8];
  for (int h = 0; h < H; h++) slopes[h] = 0.1f + 0.07f * (float)h;
  /* the ring: W threads */
  float *res = malloc(sizeof(float) * (2 * nq + 2 * nk + nl));
  float *o = res, *dq = o + nq, *dk = dq + nq, *dv = dk + nk, *lse = dv + nk;
  rt_hub hub = {0};
  hub.W = c->W;
  pthread_mutex_init(&hub.mu, NULL);
  pthread_cond_init(&hub.cv, NULL);
  rt_job jobs[RT_MAXW];
  pthread_t th[RT_MAXW];
  for (int r = 0; r < c->W; r++) {
    jobs[r] = (rt_job){c, &hub, r, q, k, v, dout, o, lse, dq, dk, dv, slopes, seed, FA_OK, "", 0};
    pthread_create(&th[r], NULL, rt_rank, &jobs[r]);
  }
  for (int r = 0; r < c->W; r++) pthread_join(th[r], NULL);
  pthread_mutex_destroy(&hub.mu);
  pthread_cond_destroy(&hub.cv);
  for (int r = 0; r < c->W; r++)
    if (jobs[r].st != FA_OK) {
      tr_fail("rank %d: %s: %s", r, fa_status_string(jobs[r].st), jobs[r].err);
      goto done;
    }
  if (hub.bad) tr_fail("an exchange's sender and receiver disagreed");
  /* forward W-1 exchanges; backward 1 + (W-2) K/V and W-1 sums */
  if (c->W > 1 && jobs[0].exchanges != (c->W - 1) + 1 + (c->W - 2 > 0 ? c->W - 2 : 0) + (c->W - 1))
    tr_fail("rank 0 made %d exchanges", jobs[0].exchanges);
  {
    double *ref[5], *nai[5];
    const size_t sz[5] = {nq, nq, nk, nk, nl};
    for (int i = 0; i < 5; i++) ref[i] = malloc(sizeof(double) * sz[i]);
    for (int i = 0; i < 5; i++) nai[i] = malloc(sizeof(double) * sz[i]);
    const float *const ins[4] = {q, k, v, dout};
    if (!rt_whole(c, FA_ALGO_STANDARD, FA_DTYPE_F64, slopes, seed, ins, ref) ||
        !rt_whole(c, FA_ALGO_STANDARD, FA_DTYPE_F32, slopes, seed, ins, nai)) {
      tr_fail("whole-sequence run: %s", fa_last_error());
    } else {
      const char *names[4] = {"O", "dQ", "dK", "dV"};
      const float *got[4] = {o, dq, dk, dv};
      double *x = malloc(sizeof(double) * nq);
      for (int i = 0; i < 4; i++) {
        for (size_t e = 0; e < sz[i]; e++) x[e] = got[i][e];
        const tu_err ei = tu_compare(x, ref[i], sz[i]), en = tu_compare(nai[i], ref[i], sz[i]);
        const double tol = 2 * en.rel_fro + attn_floor(FA_DTYPE_F32, i > 0);
        if (ei.nan_count || !(ei.rel_fro <= tol))
          tr_fail("%s: rel err %.3g > tol %.3g (%lld NaN)", names[i], ei.rel_fro, tol,
                  (long long)ei.nan_count);
      }
      for (size_t e = 0; e < nl; e++)
        if (isinf(ref[4][e]) != isinf(lse[e]) ||
            (!isinf(ref[4][e]) && fabs(lse[e] - ref[4][e]) > 1e-5 * (1 + fabs(ref[4][e])))) {
          tr_fail("lse[%zu] = %g, oracle %g", e, (double)lse[e], ref[4][e]);
          break;
        }
      free(x);
    }
    for (int i = 0; i < 5; i++) free(ref[i]), free(nai[i]);
  }
done:
  free(in);
  free(res);
}

static fa_status rt_fail_exchange(void *ctx, const void *s, int to, void *r, int from, size_t n,
                                  void *stream) {
  (void)ctx, (void)s, (void)to, (void)r, (void)from, (void)n, (void)stream;
  return FA_ERR_DEVICE;
}
static fa_status rt_nop_wait(void *ctx, void *stream) {
  (void)ctx, (void)stream;
  return FA_OK;
}

static void t_ring_validation(const void *arg) {
  (void)arg;
  float buf[6 * 2 * 8 * 2 * 8 + 64];
  float lse[2 * 8 * 2];
  memset(buf, 0, sizeof buf);
  fa_tensor q = fa_tensor_bnhd(buf, FA_DTYPE_F32, 2, 8, 2, 8);
  fa_tensor o = fa_tensor_bnhd(buf + 256, FA_DTYPE_F32, 2, 8, 2, 8);
  fa_tensor odd = fa_tensor_bnhd(buf, FA_DTYPE_F32, 2, 7, 2, 8);
  fa_tensor odd_o = fa_tensor_bnhd(buf + 256, FA_DTYPE_F32, 2, 7, 2, 8);
  fa_ring one = {0, 1, FA_RING_ZIGZAG, NULL, NULL, NULL};
  /* one case a line */
  /* clang-format off */
  struct {
    const char *what;
    fa_ring ring;
    int shard, varlen, odd;
    float p;
    fa_status want;
    const char *says;
  } cases[] = {
    {"size 0", {0, 0, FA_RING_ZIGZAG, NULL, NULL, NULL}, 0, 0, 0, 0, FA_ERR_INVALID_ARGUMENT, "rank"},
    {"rank past size", {2, 2, FA_RING_ZIGZAG, NULL, rt_fail_exchange, rt_nop_wait}, 0, 0, 0, 0, FA_ERR_INVALID_ARGUMENT, "rank"},
    {"unknown layout", {0, 1, (fa_ring_layout)7, NULL, NULL, NULL}, 0, 0, 0, 0, FA_ERR_INVALID_ARGUMENT, "layout"},
    {"no callbacks", {0, 2, FA_RING_ZIGZAG, NULL, NULL, NULL}, 0, 0, 0, 0, FA_ERR_INVALID_ARGUMENT, "exchange"},
    {"shard_enabled", {0, 1, FA_RING_ZIGZAG, NULL, NULL, NULL}, 1, 0, 0, 0, FA_ERR_INVALID_ARGUMENT, "shard"},
    {"varlen", {0, 1, FA_RING_ZIGZAG, NULL, NULL, NULL}, 0, 1, 0, 0, FA_ERR_UNSUPPORTED, "cu_seqlens"},
    {"odd zigzag", {0, 1, FA_RING_ZIGZAG, NULL, NULL, NULL}, 0, 0, 1, 0, FA_ERR_INVALID_ARGUMENT, "even"},
    {"dropout, chunks of 7 rows", {0, 1, FA_RING_CONTIGUOUS, NULL, NULL, NULL}, 0, 0, 1, 0.1f, FA_ERR_INVALID_ARGUMENT, "multiple of 4"},
    {"transport error", {0, 2, FA_RING_CONTIGUOUS, NULL, rt_fail_exchange, rt_nop_wait}, 0, 0, 0, 0, FA_ERR_DEVICE, "exchange"},
    {"one rank", {0, 1, FA_RING_ZIGZAG, NULL, NULL, NULL}, 0, 0, 0, 0.25f, FA_OK, ""},
  };
  /* clang-format on */
  int32_t cu[2] = {0, 8};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    fa_params p = {0};
    p.num_threads = 1;
    p.shard_enabled = cases[i].shard;
    p.dropout_p = cases[i].p;
    if (cases[i].varlen) p.cu_seqlens_q = p.cu_seqlens_k = cu, p.num_seqs = 1;
    const fa_tensor *t = cases[i].odd ? &odd : &q;
    fa_tensor *to = cases[i].odd ? &odd_o : &o;
    fa_status st = fa_ring_forward(&p, &cases[i].ring, t, t, t, to, lse);
    if (st != cases[i].want)
      tr_fail("%s: %s (%s), want %s", cases[i].what, fa_status_string(st), fa_last_error(),
              fa_status_string(cases[i].want));
    else if (st != FA_OK && !strstr(fa_last_error(), cases[i].says))
      tr_fail("%s: the message does not say '%s': %s", cases[i].what, cases[i].says,
              fa_last_error());
  }
  /* the workspace: queried size works, one byte less is refused */
  fa_params p = {0};
  p.num_threads = 1;
  size_t need = 0;
  if (fa_ring_workspace_size(FA_PASS_BACKWARD, &p, &one, &q, &q, &q, &need) != FA_OK || need == 0)
    return tr_fail("fa_ring_workspace_size: %s", fa_last_error());
  if (fa_ring_workspace_size(FA_PASS_FORWARD, &p, &one, &q, &q, &q, &need) != FA_OK)
    return tr_fail("fa_ring_workspace_size: %s", fa_last_error());
  void *ws = aligned_alloc(256, (need + 255) / 256 * 256);
  p.workspace = ws;
  p.workspace_bytes = need;
  if (fa_ring_forward(&p, &one, &q, &q, &q, &o, lse) != FA_OK)
    tr_fail("with the queried workspace: %s", fa_last_error());
  p.workspace_bytes = need - 1;
  if (fa_ring_forward(&p, &one, &q, &q, &q, &o, lse) != FA_ERR_INVALID_ARGUMENT ||
      !strstr(fa_last_error(), "workspace_bytes"))
    tr_fail("one byte short of the workspace was not refused: %s", fa_last_error());
  free(ws);
}

/* A configuration drawn from the case's name: ranks, layout, shape, mask, window,
 * ALiBi, softcap and dropout in combinations the tables above do not list. */
static rcfg rt_draw(const char *name) {
  tu_rng r;
  tu_rng_seed(&r, tu_hash_str(name));
#define PICK(k) ((int)(tu_rng_next(&r) % (uint64_t)(k)))
  rcfg c = {0};
  c.W = 1 + PICK(RT_MAXW);
  c.layout = PICK(2) ? FA_RING_CONTIGUOUS : FA_RING_ZIGZAG;
  c.B = 1 + PICK(2);
  c.H = 1 << PICK(3);                   /* 1, 2, 4 */
  c.Hk = c.H >> PICK(c.H == 1 ? 1 : 2); /* GQA at times */
  c.D = 8 * (1 + PICK(5));
  c.p = PICK(4) ? 0.0f : 0.1f + 0.2f * (float)tu_rng_uniform(&r);
  c.n = c.p > 0 ? 8 * (1 + PICK(5)) : 2 * (1 + PICK(24)); /* dropout: chunks of 4 rows */
  c.causal = PICK(2);
  if (PICK(5) < 2) {
    c.window = 1;
    c.wl = PICK(3) ? PICK(3 * c.n) : -1;
    c.wr = c.causal ? -1 : PICK(3) ? PICK(2 * c.n) : -1;
  }
  c.softcap = PICK(5) ? 0.0f : 1.0f + 4.0f * (float)tu_rng_uniform(&r);
  c.alibi = PICK(5) == 0;
#undef PICK
  return c;
}

void register_ring_tests(void) {
  tr_add("ring/validation", t_ring_validation, NULL, 0, 0);
  char name[160];
  for (int W = 1; W <= RT_MAXW; W++)
    for (int lay = 0; lay < 2; lay++) {
      const fa_ring_layout L = lay ? FA_RING_CONTIGUOUS : FA_RING_ZIGZAG;
      const char *ln = lay ? "contiguous" : "zigzag";
      rcfg c = {W, L, 2, 2, 2, 24, 16, 1, 0, 0, 0, 0, 0, 0};
      snprintf(name, sizeof name, "ring/w%d/%s/causal", W, ln);
      tr_add(name, t_ring_case, &c, sizeof c, 0);
      if (W == 1 || W == 3) continue; /* the variants at 2 and 4 ranks */
      rcfg f = c;
      f.causal = 0, f.Hk = 1;
      snprintf(name, sizeof name, "ring/w%d/%s/full/gqa", W, ln);
      tr_add(name, t_ring_case, &f, sizeof f, 0);
      rcfg w = c;
      w.window = 1, w.wl = 17, w.wr = 5, w.causal = 0;
      snprintf(name, sizeof name, "ring/w%d/%s/window17-5", W, ln);
      tr_add(name, t_ring_case, &w, sizeof w, 0);
      rcfg d = c;
      d.p = 0.25f, d.Hk = 1, d.window = 1, d.wl = 30, d.wr = -1;
      snprintf(name, sizeof name, "ring/w%d/%s/causal-window30/dropout/gqa", W, ln);
      tr_add(name, t_ring_case, &d, sizeof d, 0);
      rcfg a = c;
      a.alibi = 1, a.softcap = 2.0f;
      snprintf(name, sizeof name, "ring/w%d/%s/causal/alibi/softcap", W, ln);
      tr_add(name, t_ring_case, &a, sizeof a, 0);
    }
  for (int i = 0; i < 400; i++) {
    snprintf(name, sizeof name, "ring/drawn/%03d", i);
    const rcfg d = rt_draw(name);
    snprintf(name + strlen(name), sizeof name - strlen(name),
             "/w%d/%s/B%d/H%d/Hk%d/n%d/D%d%s%s%s%s%s", d.W,
             d.layout == FA_RING_ZIGZAG ? "zigzag" : "contiguous", d.B, d.H, d.Hk, d.n, d.D,
             d.causal ? "/causal" : "", d.window ? "/window" : "", d.softcap > 0 ? "/softcap" : "",
             d.alibi ? "/alibi" : "", d.p > 0 ? "/dropout" : "");
    tr_add(name, t_ring_case, &d, sizeof d, 0);
  }
}
