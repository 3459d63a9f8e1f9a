/* Ring attention (fa_ring_forward, fa_ring_backward): which blocks of the
 * sequence each step computes, where they travel, how the partial results
 * merge. Every block is a fa_forward / fa_backward call at the block's
 * positions (fa_params.shard_enabled), so masks, ALiBi and dropout are the
 * whole sequence's on every backend. docs/DISTRIBUTED.md has the schedule. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "common/dtype.h"

#define FA_INVALID(...) fa_set_error(FA_ERR_INVALID_ARGUMENT, __VA_ARGS__)
#define FA_TRY(expr)              \
  do {                            \
    fa_status st_ = (expr);       \
    if (st_ != FA_OK) return st_; \
  } while (0)

/* One chunk of a rank's shard: its first local row, rows, first position. */
typedef struct ring_chunk {
  int64_t row, n, pos;
} ring_chunk;

static int ring_chunks(const fa_ring *r, int64_t n, int rank, ring_chunk c[2]) {
  if (r->layout == FA_RING_CONTIGUOUS) {
    c[0] = (ring_chunk){0, n, (int64_t)rank * n};
    return 1;
  }
  const int64_t h = n / 2;
  c[0] = (ring_chunk){0, h, (int64_t)rank * h};
  c[1] = (ring_chunk){h, h, (int64_t)(2 * r->size - 1 - rank) * h};
  return 2;
}

/* Whether a query at positions [qp, qp + nq) sees a key at [kp, kp + nk). */
static int ring_visible(const fa_params *p, int64_t qp, int64_t nq, int64_t kp, int64_t nk) {
  int64_t left = p->window_enabled ? p->window_left : -1;
  int64_t right = p->window_enabled ? p->window_right : -1;
  if (p->causal && right != 0) right = 0;
  if (right >= 0 && right < kp - (qp + nq - 1)) return 0; /* no overflow at INT64_MAX */
  if (left >= 0 && qp - left > kp + nk - 1) return 0;
  return 1;
}

/* The call, resolved; the workspace's parts (byte offsets, 256-aligned). */
typedef struct ring_call {
  const fa_params *p;
  const fa_ring *ring;
  fa_params inner; /* the blocks' calls: shard_enabled, the inner workspace */
  int64_t B, n, H, Hk, D, chunk;
  fa_dtype dt;
  size_t es, kv_bytes, inner_bytes;
  int threads;
  size_t off_kv[2], off_o, off_l, off_acc, off_lacc, off_sum[2], off_in, off_inner, total;
} ring_call;

static size_t up256(size_t x) { return (x + 255) & ~(size_t)255; }

static fa_tensor rows_of(const fa_tensor *t, int64_t r0, int64_t m) {
  fa_tensor v = *t;
  v.data = (char *)t->data + r0 * t->stride_seq * (int64_t)fa_dtype_bytes(t->dtype);
  v.seqlen = m;
  return v;
}

/* Rows [r0, r0 + m) of a (B, H, ntot) float32 lse array, as a headdim-1 tensor. */
static fa_tensor lse_rows(const float *lse, int64_t B, int64_t H, int64_t ntot, int64_t r0,
                          int64_t m) {
  fa_tensor t = {(void *)(lse + r0), FA_DTYPE_F32, B, m, H, 1, H * ntot, 1, ntot};
  return t;
}

static fa_status r_add(const ring_call *c, const fa_tensor *dst, const fa_tensor *src, int acc,
                       float fill) {
  if (c->p->device == FA_DEVICE_CUDA) {
#ifdef FLASHATTN_CUDA
    return fa_cuda_ring_add(dst, src, acc, fill, c->p->stream);
#endif
  }
  return fa_cpu_ring_add(dst, src, acc, fill, c->threads);
}

static fa_status r_merge(const ring_call *c, const fa_tensor *acc, const fa_tensor *lacc,
                         const fa_tensor *o, const fa_tensor *l) {
  if (c->p->device == FA_DEVICE_CUDA) {
#ifdef FLASHATTN_CUDA
    return fa_cuda_ring_merge(acc, lacc, o, l, c->p->stream);
#endif
  }
  return fa_cpu_ring_merge(acc, lacc, o, l, c->threads);
}

static fa_status check_ring(const fa_ring *r) {
  if (!r) return FA_INVALID("ring is NULL");
  if (r->size < 1 || r->rank < 0 || r->rank >= r->size)
    return FA_INVALID("ring: rank %d and size %d must satisfy 0 <= rank < size", r->rank, r->size);
  if (r->layout != FA_RING_ZIGZAG && r->layout != FA_RING_CONTIGUOUS)
    return FA_INVALID("ring.layout: unknown layout %d", (int)r->layout);
  if (r->size > 1 && (!r->exchange || !r->wait))
    return FA_INVALID("ring.exchange and ring.wait must be set with more than one rank");
  return FA_OK;
}

/* Validates everything but the outputs and lays out the workspace. */
static fa_status ring_setup(ring_call *c, fa_pass pass, const fa_params *p, const fa_ring *r,
                            const fa_tensor *q, const fa_tensor *k, const fa_tensor *v) {
  memset(c, 0, sizeof *c);
  if (!p) return FA_INVALID("params is NULL");
  FA_TRY(check_ring(r));
  if (!q || !k || !v) return FA_INVALID("q, k and v must not be NULL");
  if (p->shard_enabled)
    return FA_INVALID("params.shard_enabled: the ring places each block itself (leave it 0)");
  if (p->cu_seqlens_q || p->cu_seqlens_k || p->seqused_k || p->block_mask)
    return fa_set_error(FA_ERR_UNSUPPORTED,
                        "ring attention takes no cu_seqlens, seqused_k or block_mask");
  if (k->seqlen != q->seqlen)
    return FA_INVALID(
        "k: seqlen %lld differs from q's %lld (each rank holds the same positions "
        "of q, k and v)",
        (long long)k->seqlen, (long long)q->seqlen);
  const int64_t n = q->seqlen;
  if (r->layout == FA_RING_ZIGZAG && n % 2)
    return FA_INVALID("q: seqlen %lld must be even for FA_RING_ZIGZAG (two chunks a rank)",
                      (long long)n);
  c->p = p;
  c->ring = r;
  c->n = n;
  c->chunk = r->layout == FA_RING_ZIGZAG ? n / 2 : n;
  if (p->dropout_p > 0 && c->chunk % 4)
    return FA_INVALID(
        "q: a chunk of %lld rows must be a multiple of 4 with dropout (one Philox "
        "call draws four neighbouring keys)",
        (long long)c->chunk);
  c->inner = *p;
  c->inner.shard_enabled = 1;
  c->inner.workspace = NULL;
  c->inner.workspace_bytes = 0;
  /* the blocks' shapes: validates params and tensors as the calls will */
  fa_tensor tq = rows_of(q, 0, c->chunk), tk = rows_of(k, 0, c->chunk),
            tv = rows_of(v, 0, c->chunk);
  FA_TRY(fa_workspace_size(pass, &c->inner, &tq, &tk, &tv, &c->inner_bytes));
  c->B = q->batch, c->H = q->heads, c->Hk = k->heads, c->D = q->headdim;
  c->dt = q->dtype;
  c->es = fa_dtype_bytes(q->dtype);
  c->threads = p->num_threads > 0 ? p->num_threads : omp_get_num_procs();
  if (c->threads < 1) c->threads = 1;
  const size_t kvel = (size_t)(c->B * n * c->Hk * c->D), qel = (size_t)(c->B * n * c->H * c->D);
  const size_t cq = (size_t)(c->B * c->chunk * c->H * c->D),
               ck = (size_t)(c->B * c->chunk * c->Hk * c->D);
  const size_t nl = (size_t)(c->B * c->H * n), cl = (size_t)(c->B * c->H * c->chunk);
  c->kv_bytes = 2 * kvel * c->es;
  size_t at = 0;
#define TAKE(off, bytes) (c->off = at, at += up256(bytes))
  TAKE(off_kv[0], c->kv_bytes);
  TAKE(off_kv[1], c->kv_bytes);
  TAKE(off_l, cl * 4);
  if (pass == FA_PASS_FORWARD) {
    TAKE(off_o, cq * c->es);
    TAKE(off_acc, qel * 4);
    TAKE(off_lacc, nl * 4);
  } else {
    TAKE(off_o, (cq + 2 * ck) * c->es); /* a block's dq, dk, dv */
    TAKE(off_acc, qel * 4);             /* dq's sum */
    TAKE(off_sum[0], 2 * kvel * 4);     /* dK, dV sums of the block held, float32 */
    TAKE(off_sum[1], 2 * kvel * 4);
    TAKE(off_in, 2 * kvel * 4);
  }
  TAKE(off_inner, c->inner_bytes);
#undef TAKE
  c->total = at;
  return FA_OK;
}

fa_status fa_ring_workspace_size(fa_pass pass, const fa_params *params, const fa_ring *ring,
                                 const fa_tensor *q, const fa_tensor *k, const fa_tensor *v,
                                 size_t *bytes) {
  ring_call c;
  if (pass != FA_PASS_FORWARD && pass != FA_PASS_BACKWARD)
    return FA_INVALID("pass: unknown pass %d", (int)pass);
  if (!bytes) return FA_INVALID("bytes is NULL");
  FA_TRY(ring_setup(&c, pass, params, ring, q, k, v));
  *bytes = c.total;
  return FA_OK;
}

/* The caller's workspace, or one allocated for the call (*own, to free). */
static fa_status ring_workspace(ring_call *c, char **ws, void **own) {
  const fa_params *p = c->p;
  *own = NULL;
  if (p->workspace) {
    if (p->workspace_bytes < c->total)
      return FA_INVALID(
          "params.workspace_bytes %zu is smaller than the %zu bytes needed "
          "(see fa_ring_workspace_size)",
          p->workspace_bytes, c->total);
    if ((uintptr_t)p->workspace % 256)
      return FA_INVALID("params.workspace must be 256-byte aligned for ring attention");
    *ws = p->workspace;
  } else if (p->device == FA_DEVICE_CUDA) {
#ifdef FLASHATTN_CUDA
    FA_TRY(fa_cuda_alloc(own, c->total, p->stream));
#else
    return fa_set_error(FA_ERR_UNSUPPORTED, "params.device: this build has no CUDA backend");
#endif
    *ws = *own;
  } else {
    *own = aligned_alloc(256, c->total);
    if (!*own)
      return fa_set_error(FA_ERR_OUT_OF_MEMORY, "cannot allocate %zu bytes of workspace", c->total);
    *ws = *own;
  }
  c->inner.workspace = c->inner_bytes ? *ws + c->off_inner : NULL;
  c->inner.workspace_bytes = c->inner_bytes;
  return FA_OK;
}

static void ring_release(const ring_call *c, void *own) {
  if (!own) return;
  if (c->p->device == FA_DEVICE_CUDA) {
#ifdef FLASHATTN_CUDA
    fa_cuda_free(own, c->p->stream);
#endif
    return;
  }
  free(own);
}

/* K and V of a ring buffer: (B, n, Hk, D) contiguous, V after K. */
static void kv_of(const ring_call *c, char *buf, fa_tensor *K, fa_tensor *V, fa_dtype dt,
                  size_t es) {
  *K = fa_tensor_bnhd(buf, dt, c->B, c->n, c->Hk, c->D);
  *V = fa_tensor_bnhd(buf + (size_t)(c->B * c->n * c->Hk * c->D) * es, dt, c->B, c->n, c->Hk, c->D);
}

static fa_status xchg(const ring_call *c, const void *send, int to, void *recv, int from,
                      size_t bytes) {
  const fa_ring *r = c->ring;
  to = (to + r->size) % r->size, from = (from + r->size) % r->size;
  fa_status st = r->exchange(r->ctx, send, to, recv, from, bytes, c->p->stream);
  if (st != FA_OK)
    return fa_set_error(st, "ring.exchange (to rank %d, from rank %d) failed: %s", to, from,
                        fa_status_string(st));
  return st;
}

static fa_status xwait(const ring_call *c) {
  fa_status st = c->ring->wait(c->ring->ctx, c->p->stream);
  if (st != FA_OK) return fa_set_error(st, "ring.wait failed: %s", fa_status_string(st));
  return st;
}

static fa_status ring_fwd(ring_call *c, char *ws, const fa_tensor *q, const fa_tensor *k,
                          const fa_tensor *v, fa_tensor *o, float *lse) {
  const fa_ring *r = c->ring;
  const int W = r->size, me = r->rank;
  fa_tensor KB[2], VB[2];
  for (int i = 0; i < 2; i++) kv_of(c, ws + c->off_kv[i], &KB[i], &VB[i], c->dt, c->es);
  fa_tensor acc = fa_tensor_bnhd(ws + c->off_acc, FA_DTYPE_F32, c->B, c->n, c->H, c->D);
  float *lacc = (float *)(ws + c->off_lacc), *lb = (float *)(ws + c->off_l);
  fa_tensor la = lse_rows(lacc, c->B, c->H, c->n, 0, c->n);
  FA_TRY(r_add(c, &acc, NULL, 0, 0.0f));
  FA_TRY(r_add(c, &la, NULL, 0, -INFINITY));
  if (W > 1) { /* this rank's own block, packed to travel */
    FA_TRY(r_add(c, &KB[0], k, 0, 0.0f));
    FA_TRY(r_add(c, &VB[0], v, 0, 0.0f));
  }
  ring_chunk mine[2], theirs[2];
  const int nm = ring_chunks(r, c->n, me, mine);
  const fa_tensor *K = k, *V = v; /* the block held: this rank's own first */
  int buf = 0;
  for (int t = 0; t < W; t++) {
    const int src = (me - t + W) % W;
    if (t + 1 < W) FA_TRY(xchg(c, KB[buf].data, me + 1, KB[1 - buf].data, me - 1, c->kv_bytes));
    c->inner.sm_margin = t + 1 < W ? c->p->sm_margin : 0; /* beside a transfer */
    const int nt = ring_chunks(r, c->n, src, theirs);
    for (int a = 0; a < nm; a++)
      for (int b = 0; b < nt; b++) {
        if (!ring_visible(c->p, mine[a].pos, mine[a].n, theirs[b].pos, theirs[b].n)) continue;
        c->inner.shard_q_offset = mine[a].pos;
        c->inner.shard_k_offset = theirs[b].pos;
        fa_tensor tq = rows_of(q, mine[a].row, mine[a].n);
        fa_tensor tk = rows_of(K, theirs[b].row, theirs[b].n);
        fa_tensor tv = rows_of(V, theirs[b].row, theirs[b].n);
        fa_tensor to = fa_tensor_bnhd(ws + c->off_o, c->dt, c->B, mine[a].n, c->H, c->D);
        FA_TRY(fa_forward(&c->inner, &tq, &tk, &tv, &to, lb));
        fa_tensor ra = rows_of(&acc, mine[a].row, mine[a].n);
        fa_tensor rl = lse_rows(lacc, c->B, c->H, c->n, mine[a].row, mine[a].n);
        fa_tensor bl = lse_rows(lb, c->B, c->H, mine[a].n, 0, mine[a].n);
        FA_TRY(r_merge(c, &ra, &rl, &to, &bl));
      }
    if (t + 1 < W) {
      FA_TRY(xwait(c));
      buf = 1 - buf;
      K = &KB[buf], V = &VB[buf];
    }
  }
  FA_TRY(r_add(c, o, &acc, 0, 0.0f));
  if (lse) {
    fa_tensor ul = lse_rows(lse, c->B, c->H, c->n, 0, c->n);
    FA_TRY(r_add(c, &ul, &la, 0, 0.0f));
  }
  return FA_OK;
}

fa_status fa_ring_forward(const fa_params *params, const fa_ring *ring, const fa_tensor *q,
                          const fa_tensor *k, const fa_tensor *v, fa_tensor *o, float *lse) {
  ring_call c;
  FA_TRY(ring_setup(&c, FA_PASS_FORWARD, params, ring, q, k, v));
  FA_TRY(fa_check_like(o, "o", 1, q, "q"));
  char *ws;
  void *own;
  FA_TRY(ring_workspace(&c, &ws, &own));
  fa_status st = ring_fwd(&c, ws, q, k, v, o, lse);
  ring_release(&c, own);
  return st;
}

/* The backward runs the ring the other way: step t holds the block of rank
 * r + 1 + t (this rank's own last), and each block's dK/dV sums travel with
 * it from rank r + 1 to r, so the last rank to add to them owns the block. */
static fa_status ring_bwd(ring_call *c, char *ws, const fa_tensor *q, const fa_tensor *k,
                          const fa_tensor *v, const fa_tensor *o, const fa_tensor *dout,
                          const float *lse, fa_tensor *dq, fa_tensor *dk, fa_tensor *dv) {
  const fa_ring *r = c->ring;
  const int W = r->size, me = r->rank;
  fa_tensor KB[2], VB[2], SK[2], SV[2], IK, IV;
  for (int i = 0; i < 2; i++) {
    kv_of(c, ws + c->off_kv[i], &KB[i], &VB[i], c->dt, c->es);
    kv_of(c, ws + c->off_sum[i], &SK[i], &SV[i], FA_DTYPE_F32, 4);
  }
  kv_of(c, ws + c->off_in, &IK, &IV, FA_DTYPE_F32, 4);
  const size_t sum_bytes = 2 * (size_t)(c->B * c->n * c->Hk * c->D) * 4;
  fa_tensor dqs = fa_tensor_bnhd(ws + c->off_acc, FA_DTYPE_F32, c->B, c->n, c->H, c->D);
  float *lb = (float *)(ws + c->off_l);
  char *gbuf = ws + c->off_o;
  FA_TRY(r_add(c, &dqs, NULL, 0, 0.0f));
  const fa_tensor *K = k, *V = v;
  int buf = 0, pending = 0;
  if (W > 1) { /* the first block is rank r + 1's */
    FA_TRY(r_add(c, &KB[0], k, 0, 0.0f));
    FA_TRY(r_add(c, &VB[0], v, 0, 0.0f));
    FA_TRY(xchg(c, KB[0].data, me - 1, KB[1].data, me + 1, c->kv_bytes));
    FA_TRY(xwait(c));
    buf = 1;
    K = &KB[1], V = &VB[1];
  }
  ring_chunk mine[2], theirs[2];
  const int nm = ring_chunks(r, c->n, me, mine);
  for (int t = 0; t < W; t++) {
    const int blk = (me + 1 + t) % W, s = t % 2;
    const int prefetch = t + 1 < W - 1;
    if (prefetch) {
      FA_TRY(xchg(c, KB[buf].data, me - 1, KB[1 - buf].data, me + 1, c->kv_bytes));
      pending = 1;
    }
    FA_TRY(r_add(c, &SK[s], NULL, 0, 0.0f));
    FA_TRY(r_add(c, &SV[s], NULL, 0, 0.0f));
    c->inner.sm_margin = pending ? c->p->sm_margin : 0; /* beside a transfer */
    const int nt = ring_chunks(r, c->n, blk, theirs);
    for (int a = 0; a < nm; a++) {
      const int64_t qr = mine[a].row, qn = mine[a].n;
      fa_tensor bl = lse_rows(lb, c->B, c->H, qn, 0, qn);
      fa_tensor ul = lse_rows(lse, c->B, c->H, c->n, qr, qn);
      int have_lse = 0;
      for (int b = 0; b < nt; b++) {
        const int64_t kr = theirs[b].row, kn = theirs[b].n;
        if (!ring_visible(c->p, mine[a].pos, qn, theirs[b].pos, kn)) continue;
        if (!have_lse) FA_TRY(r_add(c, &bl, &ul, 0, 0.0f)); /* the rows' lse, contiguous */
        have_lse = 1;
        c->inner.shard_q_offset = mine[a].pos;
        c->inner.shard_k_offset = theirs[b].pos;
        fa_tensor tq = rows_of(q, qr, qn), to = rows_of(o, qr, qn), tdo = rows_of(dout, qr, qn);
        fa_tensor tk = rows_of(K, kr, kn), tv = rows_of(V, kr, kn);
        const size_t gq = (size_t)(c->B * qn * c->H * c->D),
                     gk = (size_t)(c->B * kn * c->Hk * c->D);
        fa_tensor gdq = fa_tensor_bnhd(gbuf, c->dt, c->B, qn, c->H, c->D);
        fa_tensor gdk = fa_tensor_bnhd(gbuf + gq * c->es, c->dt, c->B, kn, c->Hk, c->D);
        fa_tensor gdv = fa_tensor_bnhd(gbuf + (gq + gk) * c->es, c->dt, c->B, kn, c->Hk, c->D);
        FA_TRY(fa_backward(&c->inner, &tq, &tk, &tv, &to, &tdo, lb, &gdq, &gdk, &gdv));
        fa_tensor rq = rows_of(&dqs, qr, qn), rk = rows_of(&SK[s], kr, kn),
                  rv = rows_of(&SV[s], kr, kn);
        FA_TRY(r_add(c, &rq, &gdq, 1, 0.0f));
        FA_TRY(r_add(c, &rk, &gdk, 1, 0.0f));
        FA_TRY(r_add(c, &rv, &gdv, 1, 0.0f));
      }
    }
    if (pending) FA_TRY(xwait(c)); /* this step's K/V for the next, the last step's sums */
    if (t > 0) {                   /* the sums of the ranks before */
      FA_TRY(r_add(c, &SK[s], &IK, 1, 0.0f));
      FA_TRY(r_add(c, &SV[s], &IV, 1, 0.0f));
    }
    pending = 0;
    if (t < W - 1) {
      FA_TRY(xchg(c, SK[s].data, me - 1, IK.data, me + 1, sum_bytes));
      pending = 1;
    }
    if (prefetch) buf = 1 - buf, K = &KB[buf], V = &VB[buf];
    if (t + 1 == W - 1) K = k, V = v; /* this rank's own block, last */
  }
  FA_TRY(r_add(c, dq, &dqs, 0, 0.0f));
  FA_TRY(r_add(c, dk, &SK[(W - 1) % 2], 0, 0.0f));
  FA_TRY(r_add(c, dv, &SV[(W - 1) % 2], 0, 0.0f));
  return FA_OK;
}

fa_status fa_ring_backward(const fa_params *params, const fa_ring *ring, const fa_tensor *q,
                           const fa_tensor *k, const fa_tensor *v, const fa_tensor *o,
                           const fa_tensor *dout, const float *lse, fa_tensor *dq, fa_tensor *dk,
                           fa_tensor *dv) {
  ring_call c;
  FA_TRY(ring_setup(&c, FA_PASS_BACKWARD, params, ring, q, k, v));
  FA_TRY(fa_check_like(o, "o", 1, q, "q"));
  const fa_tensor *outs[4] = {dout, dq, dk, dv}, *like[4] = {q, q, k, k};
  const char *names[4] = {"dout", "dq", "dk", "dv"};
  for (int i = 0; i < 4; i++)
    FA_TRY(fa_check_like(outs[i], names[i], i > 0, like[i], i < 2 ? "q" : "k"));
  if (!lse) return FA_INVALID("lse is NULL: the backward pass needs the forward's lse");
  char *ws;
  void *own;
  FA_TRY(ring_workspace(&c, &ws, &own));
  fa_status st = ring_bwd(&c, ws, q, k, v, o, dout, lse, dq, dk, dv);
  ring_release(&c, own);
  return st;
}
