/* The fuzz checks' runs: inputs, buffers, device mirrors, the calls and the
 * memory checks every run gets (see run.h). */
#include "run.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void fz_fail(fz_ctx *x, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (x->failures++ == 0) snprintf(x->first, sizeof x->first, "%s", msg);
  if (x->verbose) printf("  fail: %s\n", msg);
}

/* ---- the CPU: buffers used in place ----------------------------------------- */

static void *cpu_alloc(size_t n) {
  (void)n;
  return NULL;
}
static void cpu_release(void *p) { (void)p; }
static void cpu_copy(void *dst, const void *src, size_t n) { (void)dst, (void)src, (void)n; }
static void cpu_sync(void *s) { (void)s; }
static size_t cpu_mem_available(void) {
  FILE *f = fopen("/proc/meminfo", "r");
  char line[256];
  size_t kb = 0;
  if (!f) return 0;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "MemAvailable: %zu kB", &kb) == 1) break;
  fclose(f);
  return kb * 1024;
}
const fz_dev fz_cpu = {.device = FA_DEVICE_CPU,
                       .alloc = cpu_alloc,
                       .release = cpu_release,
                       .upload = cpu_copy,
                       .download = cpu_copy,
                       .sync = cpu_sync,
                       .mem_available = cpu_mem_available};

/* The call reads the buffers in place (else through mirrors: a device, or --mirror). */
static int on_host(const fz_dev *dev) { return dev->alloc == cpu_alloc; }

/* --mirror: the CPU backend through host copies, as a device is driven (the
 * device path of these checks, tested where no device is). */
static void *mirror_alloc(size_t n) { return aligned_alloc(256, (n + 255) / 256 * 256 + 256); }
static void mirror_copy(void *dst, const void *src, size_t n) { memcpy(dst, src, n); }
const fz_dev fz_cpu_mirrored = {.device = FA_DEVICE_CPU,
                                .alloc = mirror_alloc,
                                .release = free,
                                .upload = mirror_copy,
                                .download = mirror_copy,
                                .sync = cpu_sync,
                                .mem_available = cpu_mem_available};

/* ---- sequences and masks ---------------------------------------------------------- */

fz_seq fz_seq_of(const fz_case *c, int64_t s) {
  fz_seq q;
  if (c->varlen) {
    q.qb = q.kb = 0;
    q.q0 = c->cu_q[s];
    q.nq = c->cu_q[s + 1] - c->cu_q[s];
    q.k0 = c->cu_k[s];
    q.cap = c->cu_k[s + 1] - c->cu_k[s];
  } else {
    q.qb = q.kb = s;
    q.q0 = q.k0 = 0;
    q.nq = c->NQ;
    q.cap = c->NK;
  }
  q.nk = c->used ? c->seqused[s] : q.cap;
  return q;
}

void fz_key_row(const fz_case *c, int64_t s, int64_t j, int64_t *b, int64_t *n) {
  const fz_seq q = fz_seq_of(c, s);
  *b = q.kb;
  *n = q.k0 + j;
}

int fz_visible(const fz_case *c, const fz_data *d, int64_t s, int64_t h, int64_t i, int64_t j) {
  const fz_seq q = fz_seq_of(c, s);
  const int64_t diag = i + q.nk - q.nq;
  if (j < 0 || j >= q.nk) return 0;
  if (c->causal && j > diag) return 0;
  if (c->window && c->wl >= 0 && j < diag - c->wl) return 0;
  if (c->window && c->wr >= 0 && j > diag + c->wr) return 0;
  if (c->block) {
    const int64_t at = s * c->bsb + h * c->bsh + (i / c->bq) * d->bsr + j / c->bk;
    if (!d->bmask[at]) return 0;
  }
  return 1;
}

size_t fz_lse_index(const fz_case *c, int64_t s, int64_t h, int64_t i) {
  if (c->varlen) return (size_t)(h * c->NQ + c->cu_q[s] + i);
  return (size_t)((s * c->HQ + h) * c->NQ + i);
}

/* ---- inputs -------------------------------------------------------------------------- */

static double gen_value(tu_rng *r, double std, fa_dtype dt) {
  double x;
  do x = tu_round(std * tu_rng_normal(r), dt);
  while (x == 0 || !isfinite(x));
  return x;
}

static size_t cidx(int64_t N, int64_t H, int64_t D, int64_t b, int64_t n, int64_t h, int64_t d) {
  return (size_t)(((b * N + n) * H + h) * D + d);
}

/* NaN over rows [n0, n1) of batch entry b of a canonical array. */
static void nan_rows(double *a, int64_t N, int64_t H, int64_t D, int64_t b, int64_t n0,
                     int64_t n1) {
  for (int64_t n = n0; n < n1; n++)
    for (int64_t x = 0; x < H * D; x++) a[cidx(N, H, D, b, n, 0, 0) + (size_t)x] = NAN;
}

static void make_pool(fz_data *d, const fz_case *c, tu_rng *r);

void fz_data_make(fz_data *d, const fz_case *c) {
  memset(d, 0, sizeof *d);
  tu_rng r;
  tu_rng_seed(&r, c->seed ^ 0x6a09e667f3bcc909ull);
  d->nq_el = (size_t)(c->B * c->NQ * c->HQ * c->D);
  d->nk_el = (size_t)(c->B * c->NK * c->HK * c->D);
  d->lse_n = (size_t)(c->B * c->HQ * c->NQ);
  double *a[4];
  const size_t n[4] = {d->nq_el, d->nk_el, d->nk_el, d->nq_el};
  const double std[4] = {c->qk_std, c->qk_std, 1, 1};
  for (int t = 0; t < 4; t++) {
    a[t] = (double *)malloc(n[t] * sizeof(double));
    for (size_t e = 0; e < n[t]; e++) a[t][e] = gen_value(&r, std[t], c->dtype);
  }
  d->q = a[0], d->k = a[1], d->v = a[2], d->dout = a[3];
  /* a batch-broadcast input holds batch 0's values in every batch entry */
  const int lay_of[4] = {FZ_Q, FZ_K, FZ_V, FZ_DO};
  for (int t = 0; t < 4; t++)
    if (c->lay[lay_of[t]].bcast) {
      const size_t per = n[t] / (size_t)c->B;
      for (int64_t b = 1; b < c->B; b++) memcpy(a[t] + (size_t)b * per, a[t], per * sizeof(double));
    }
  /* rows the library must never read */
  if (c->varlen) {
    nan_rows(d->q, c->NQ, c->HQ, c->D, 0, c->cu_q[c->nseq], c->NQ);
    nan_rows(d->dout, c->NQ, c->HQ, c->D, 0, c->cu_q[c->nseq], c->NQ);
    nan_rows(d->k, c->NK, c->HK, c->D, 0, c->cu_k[c->nseq], c->NK);
    nan_rows(d->v, c->NK, c->HK, c->D, 0, c->cu_k[c->nseq], c->NK);
  }
  if (c->used)
    for (int s = 0; s < c->nseq; s++) {
      const fz_seq q = fz_seq_of(c, s);
      nan_rows(d->k, c->NK, c->HK, c->D, q.kb, q.k0 + q.nk, q.k0 + q.cap);
      nan_rows(d->v, c->NK, c->HK, c->D, q.kb, q.k0 + q.nk, q.k0 + q.cap);
    }
  if (c->alibi) {
    d->nslopes = (size_t)((c->nseq - 1) * c->alibi_stride + c->HQ);
    d->slopes = (float *)malloc(d->nslopes * sizeof(float));
    for (size_t e = 0; e < d->nslopes; e++) {
      double u = tu_rng_uniform(&r);
      d->slopes[e] = (float)(u < 0.8 ? pow(2.0, -8.0 * tu_rng_uniform(&r)) : 1.5 * u - 1.35);
    }
  }
  if (c->block) {
    int64_t maxq = 0;
    for (int s = 0; s < c->nseq; s++) {
      const fz_seq q = fz_seq_of(c, s);
      if (q.nq > maxq) maxq = q.nq;
    }
    const int64_t nbk = (c->NK + c->bk - 1) / c->bk,
                  nbq = maxq > 0 ? (maxq + c->bq - 1) / c->bq : 1;
    d->bsr = c->bsr ? c->bsr : nbk;
    d->nbmask = (size_t)((c->nseq - 1) * c->bsb + (c->HQ - 1) * c->bsh + (nbq - 1) * d->bsr + nbk);
    d->bmask = (uint8_t *)malloc(d->nbmask); /* exactly what may be read: ASan sees overreads */
    for (size_t e = 0; e < d->nbmask; e++)
      d->bmask[e] =
          (int)(tu_rng_next(&r) % 100) < c->bdens ? (uint8_t)(1 + tu_rng_next(&r) % 255) : 0;
  }
  if (c->page) make_pool(d, c, &r);
}

/* The paged case's pools: each sequence's key rows scattered over its pages, the
 * pages shuffled through the pool (a few spare ones too), every other row NaN. */
static void make_pool(fz_data *d, const fz_case *c, tu_rng *r) {
  const int64_t P = c->page, row = c->HK * c->D;
  int64_t need = 0;
  d->max_pages = 1;
  for (int s = 0; s < c->nseq; s++) {
    const int64_t np = (fz_seq_of(c, s).cap + P - 1) / P;
    need += np;
    if (np > d->max_pages) d->max_pages = np;
  }
  d->npages = need + 1 + (int64_t)(tu_rng_next(r) % 3); /* a spare page at least */
  int64_t *perm = (int64_t *)malloc((size_t)d->npages * sizeof(int64_t));
  for (int64_t i = 0; i < d->npages; i++) perm[i] = i;
  for (int64_t i = d->npages - 1; i > 0; i--) { /* Fisher-Yates */
    const int64_t j = (int64_t)(tu_rng_next(r) % (uint64_t)(i + 1)), t = perm[i];
    perm[i] = perm[j], perm[j] = t;
  }
  const size_t n = (size_t)(d->npages * P * row);
  d->table = (int32_t *)malloc((size_t)(c->nseq * d->max_pages) * sizeof(int32_t));
  d->kpool = (double *)malloc(n * sizeof(double));
  d->vpool = (double *)malloc(n * sizeof(double));
  for (size_t e = 0; e < n; e++) d->kpool[e] = d->vpool[e] = NAN;
  int64_t next = 0;
  for (int s = 0; s < c->nseq; s++) {
    const fz_seq q = fz_seq_of(c, s);
    for (int64_t e = 0; e < d->max_pages; e++)
      d->table[s * d->max_pages + e] = e * P < q.cap ? (int32_t)perm[next++] : -1;
    for (int64_t j = 0; j < q.cap; j++) {
      const size_t src = cidx(c->NK, c->HK, c->D, q.kb, q.k0 + j, 0, 0);
      const size_t dst = (size_t)((d->table[s * d->max_pages + j / P] * P + j % P) * row);
      memcpy(d->kpool + dst, d->k + src, (size_t)row * sizeof(double));
      memcpy(d->vpool + dst, d->v + src, (size_t)row * sizeof(double));
    }
  }
  free(perm);
}

void fz_data_free(fz_data *d) {
  free(d->kpool);
  free(d->vpool);
  free(d->table);
  free(d->q);
  free(d->k);
  free(d->v);
  free(d->dout);
  free(d->slopes);
  free(d->bmask);
  memset(d, 0, sizeof *d);
}

/* ---- options -------------------------------------------------------------------------- */

fz_opt fz_opt_tested(const fz_case *c, const fz_dev *dev) {
  fz_opt o;
  memset(&o, 0, sizeof o);
  o.algo = c->algo;
  o.dtype = c->dtype;
  o.strided = 1;
  o.threads = c->threads;
  o.workspace = c->workspace;
  o.lse_null = c->lse_null;
  o.backward = c->backward;
  o.deterministic = c->deterministic;
  o.paged = c->page > 0;
  o.dev = dev;
  o.label = "tested";
  return o;
}

fz_opt fz_opt_reference(const fz_case *c, fa_dtype dt) {
  fz_opt o;
  memset(&o, 0, sizeof o);
  o.algo = FA_ALGO_STANDARD;
  o.dtype = dt;
  o.backward = c->backward;
  o.dev = &fz_cpu;
  o.label = dt == FA_DTYPE_F64 ? "oracle (standard f64)" : "naive (standard in storage dtype)";
  return o;
}

/* ---- one run ---------------------------------------------------------------------------- */

static size_t raw_bytes(const tu_buf *b) { return b->bytes + 2 * b->guard_bytes; }

/* The device copy of a host buffer (guards included); on the CPU the buffer itself. */
static unsigned char *mirror(const fz_dev *dev, tu_buf *b) {
  if (on_host(dev)) return b->raw;
  unsigned char *m = (unsigned char *)dev->alloc(raw_bytes(b));
  dev->upload(m, b->raw, raw_bytes(b));
  return m;
}

static void *array_to_dev(const fz_dev *dev, const void *host, size_t bytes) {
  if (!host) return NULL;
  void *m;
  if (on_host(dev)) {
    m = malloc(bytes ? bytes : 1); /* exactly its size: an overread is ASan's */
    memcpy(m, host, bytes);
  } else {
    m = dev->alloc(bytes ? bytes : 1);
    dev->upload(m, host, bytes);
  }
  return m;
}

static const int64_t *shape_of(const fz_case *c, int t, int64_t sh[4]) {
  const int kside = t == FZ_K || t == FZ_V || t == FZ_DK || t == FZ_DV;
  sh[0] = c->B;
  sh[1] = kside ? c->NK : c->NQ;
  sh[2] = kside ? c->HK : c->HQ;
  sh[3] = c->D;
  return sh;
}

static const double *input_vals(const fz_data *d, int t) {
  switch (t) {
    case FZ_Q:
      return d->q;
    case FZ_K:
      return d->k;
    case FZ_V:
      return d->v;
    case FZ_DO:
      return d->dout;
  }
  return NULL;
}

void fz_run_setup(fz_run *r, const fz_case *c, const fz_data *d, const fz_opt *o) {
  memset(r, 0, sizeof *r);
  r->c = c;
  r->d = d;
  r->o = *o;
  const fz_dev *dev = o->dev;
  for (int t = 0; t < FZ_NT; t++) {
    if (t >= FZ_DO && !o->backward) continue;
    int64_t sh[4], st[3];
    shape_of(c, t, sh);
    const int pool = o->paged && (t == FZ_K || t == FZ_V);
    if (pool) sh[0] = d->npages, sh[1] = c->page; /* (pages, page rows, heads, d) */
    if (o->strided) {
      fz_layout_strides(&c->lay[t], sh[0], sh[1], sh[2], sh[3], st);
    } else {
      st[2] = sh[3];
      st[1] = sh[2] * sh[3];
      st[0] = sh[1] * st[1];
    }
    tu_tensor_make_strided(&r->t[t], o->dtype, sh[0], sh[1], sh[2], sh[3], st[0], st[1], st[2]);
    r->have[t] = 1;
    const double *in = pool ? (t == FZ_K ? d->kpool : d->vpool) : input_vals(d, t);
    if (in) tu_tensor_fill(&r->t[t], in);
    r->mt[t] = mirror(dev, &r->t[t].buf);
    r->desc[t] = r->t[t].t;
    r->desc[t].data = r->mt[t] + r->t[t].buf.guard_bytes;
    tu_snap_take(&r->snap[t], &r->t[t].buf);
  }
  tu_buf_alloc(&r->lse, d->lse_n, sizeof(float));
  r->mlse = mirror(dev, &r->lse);

  fa_params *p = &r->p;
  memset(p, 0, sizeof *p);
  p->device = dev->device;
  p->stream = dev->stream;
  p->algorithm = o->algo;
  p->softmax_scale = c->scale;
  p->causal = c->causal;
  p->window_enabled = c->window;
  p->window_left = c->wl;
  p->window_right = c->wr;
  p->softcap = c->softcap;
  p->num_threads = o->threads;
  p->deterministic = o->deterministic;
  p->sm_margin = c->sm_margin;
  if (c->varlen) {
    r->arrays[0] = array_to_dev(dev, c->cu_q, (size_t)(c->nseq + 1) * sizeof(int32_t));
    r->arrays[1] = array_to_dev(dev, c->cu_k, (size_t)(c->nseq + 1) * sizeof(int32_t));
    p->cu_seqlens_q = (const int32_t *)r->arrays[0];
    p->cu_seqlens_k = (const int32_t *)r->arrays[1];
    p->num_seqs = c->nseq;
  }
  if (c->used) {
    r->arrays[2] = array_to_dev(dev, c->seqused, (size_t)c->nseq * sizeof(int32_t));
    p->seqused_k = (const int32_t *)r->arrays[2];
  }
  if (c->block) {
    r->arrays[3] = array_to_dev(dev, d->bmask, d->nbmask);
    p->block_mask = (const uint8_t *)r->arrays[3];
    p->block_size_q = c->bq;
    p->block_size_k = c->bk;
    p->block_mask_stride_batch = c->bsb;
    p->block_mask_stride_head = c->bsh;
    p->block_mask_stride_row = c->bsr;
  }
  if (o->paged) {
    r->arrays[5] = array_to_dev(dev, d->table, (size_t)(c->nseq * d->max_pages) * sizeof(int32_t));
    p->block_table = (const int32_t *)r->arrays[5];
    p->block_table_stride = d->max_pages;
    p->max_pages_per_seq = d->max_pages;
  }
  if (c->alibi) {
    r->arrays[4] = array_to_dev(dev, d->slopes, d->nslopes * sizeof(float));
    p->alibi_slopes = (const float *)r->arrays[4];
    p->alibi_stride_batch = c->alibi_stride;
  }
  if (c->dropout > 0) {
    p->dropout_p = c->dropout;
    p->dropout_seed = c->dseed;
    p->dropout_offset = c->doff;
  }
}

void fz_run_download(fz_run *r) {
  const fz_dev *dev = r->o.dev;
  if (on_host(dev)) return;
  dev->sync(dev->stream);
  for (int t = 0; t < FZ_NT; t++)
    if (r->have[t]) dev->download(r->t[t].buf.raw, r->mt[t], raw_bytes(&r->t[t].buf));
  dev->download(r->lse.raw, r->mlse, raw_bytes(&r->lse));
  for (int w = 0; w < 2; w++)
    if (r->mws[w]) dev->download(r->ws[w].raw, r->mws[w], raw_bytes(&r->ws[w]));
}

void fz_run_free(fz_run *r) {
  const fz_dev *dev = r->o.dev;
  if (!on_host(dev)) dev->sync(dev->stream);
  for (int t = 0; t < FZ_NT; t++) {
    if (!r->have[t]) continue;
    if (!on_host(dev)) dev->release(r->mt[t]);
    tu_tensor_free(&r->t[t]);
    tu_snap_free(&r->snap[t]);
    free(r->vals[t]);
  }
  free(r->o_fwd);
  if (!on_host(dev)) dev->release(r->mlse);
  tu_buf_free(&r->lse);
  for (int w = 0; w < 2; w++)
    if (r->ws[w].raw) {
      if (!on_host(dev)) dev->release(r->mws[w]);
      tu_buf_free(&r->ws[w]);
    }
  for (size_t a = 0; a < sizeof r->arrays / sizeof r->arrays[0]; a++) {
    if (!r->arrays[a]) continue;
    if (on_host(dev))
      free(r->arrays[a]);
    else
      dev->release(r->arrays[a]);
  }
  memset(r, 0, sizeof *r);
}

static const char *const tname[FZ_NT] = {"q", "k", "v", "o", "dout", "dq", "dk", "dv"};

/* Caller workspace of the queried size (workspace 2: up to 4 KiB more). On a
 * device the size assumes the outputs (which fa_workspace_size does not see)
 * have rows on 16-byte boundaries; ours may not: room for their padded copies. */
static void take_workspace(fz_run *r, int w, size_t bytes) {
  const fz_dev *dev = r->o.dev;
  size_t extra = r->o.workspace == 2 ? (size_t)(r->c->seed % 4096) : 0;
  if (!on_host(dev))
    for (int t = FZ_O; t < FZ_NT; t++)
      if (r->have[t])
        extra += (size_t)(r->t[t].B * r->t[t].N * r->t[t].H * ((r->t[t].D + 7) / 8 * 8)) * 2 + 256;
  tu_buf_alloc(&r->ws[w], bytes + extra + 1, 1); /* never 0 bytes */
  r->mws[w] = mirror(dev, &r->ws[w]);
}

static void check_memory(fz_run *r, fz_ctx *x, const char *call, const int *outs, int nouts) {
  const char *lb = r->o.label;
  for (int i = 0; i < nouts; i++) {
    const tu_tensor *t = &r->t[outs[i]];
    if (!tu_buf_guards_ok(&t->buf))
      fz_fail(x, "%s %s wrote into the guard zone around %s", lb, call, tname[outs[i]]);
    else if (!tu_tensor_untouched_outside(t))
      fz_fail(x, "%s %s wrote into a stride gap of %s", lb, call, tname[outs[i]]);
  }
  for (int t = 0; t < FZ_NT; t++) {
    int is_out = 0;
    for (int i = 0; i < nouts; i++) is_out |= outs[i] == t;
    if (r->have[t] && !is_out && !tu_snap_same(&r->snap[t], &r->t[t].buf))
      fz_fail(x, "%s %s modified %s, which it only reads", lb, call, tname[t]);
  }
  if (!tu_buf_guards_ok(&r->lse)) fz_fail(x, "%s %s wrote into the guard zone of lse", lb, call);
  for (int w = 0; w < 2; w++)
    if (r->ws[w].raw && !tu_buf_guards_ok(&r->ws[w]))
      fz_fail(x, "%s %s wrote past its workspace (%zu bytes)", lb, call, r->ws[w].bytes);
}

static void read_vals(fz_run *r, int t) {
  const size_t n = (size_t)(r->t[t].B * r->t[t].N * r->t[t].H * r->t[t].D);
  r->vals[t] = (double *)malloc((n ? n : 1) * sizeof(double));
  tu_tensor_read(&r->t[t], r->vals[t]);
}

void fz_run_exec(fz_run *r, fz_ctx *x) {
  const fz_dev *dev = r->o.dev;
  const char *lb = r->o.label;
  fa_params pf = r->p, pb = r->p;
  size_t need[2] = {0, 0};
  r->st_wsf = fa_workspace_size(FA_PASS_FORWARD, &r->p, &r->desc[FZ_Q], &r->desc[FZ_K],
                                &r->desc[FZ_V], &need[0]);
  if (r->st_wsf != FA_OK)
    fz_fail(x, "%s fa_workspace_size(FORWARD) returned %s: %s", lb, fa_status_string(r->st_wsf),
            fa_last_error());
  if (r->o.backward) {
    r->st_wsb = fa_workspace_size(FA_PASS_BACKWARD, &r->p, &r->desc[FZ_Q], &r->desc[FZ_K],
                                  &r->desc[FZ_V], &need[1]);
    if (r->st_wsb != FA_OK)
      fz_fail(x, "%s fa_workspace_size(BACKWARD) returned %s: %s", lb, fa_status_string(r->st_wsb),
              fa_last_error());
  }
  for (int w = 0; w < 2; w++)
    if (need[w] > ((size_t)1 << 32))
      fz_fail(x, "%s fa_workspace_size(%s) = %zu bytes for a small problem", lb,
              w ? "BACKWARD" : "FORWARD", need[w]);
  if (x->failures) return;
  if (r->o.workspace) {
    take_workspace(r, 0, need[0]);
    pf.workspace = r->mws[0] + r->ws[0].guard_bytes;
    pf.workspace_bytes = r->ws[0].bytes;
  }

  float *lse = (float *)(r->mlse + r->lse.guard_bytes);
  unsigned char *o_null = NULL; /* O of the call with lse = NULL */
  if (r->o.lse_null) {
    r->st_fwd =
        fa_forward(&pf, &r->desc[FZ_Q], &r->desc[FZ_K], &r->desc[FZ_V], &r->desc[FZ_O], NULL);
    if (r->st_fwd != FA_OK) {
      fz_fail(x, "%s fa_forward(lse = NULL) returned %s: %s", lb, fa_status_string(r->st_fwd),
              fa_last_error());
      return;
    }
    fz_run_download(r);
    if (!tu_bytes_poisoned(r->lse.raw, raw_bytes(&r->lse)))
      fz_fail(x, "%s fa_forward(lse = NULL) wrote into the lse buffer of another call", lb);
    const tu_buf *ob = &r->t[FZ_O].buf;
    o_null = (unsigned char *)malloc(raw_bytes(ob));
    memcpy(o_null, ob->raw, raw_bytes(ob));
    tu_buf_poison(&r->t[FZ_O].buf); /* and again, with lse */
    if (!on_host(dev)) dev->upload(r->mt[FZ_O], ob->raw, raw_bytes(ob));
  }
  r->st_fwd = fa_forward(&pf, &r->desc[FZ_Q], &r->desc[FZ_K], &r->desc[FZ_V], &r->desc[FZ_O], lse);
  if (r->st_fwd != FA_OK) {
    fz_fail(x, "%s fa_forward returned %s: %s", lb, fa_status_string(r->st_fwd), fa_last_error());
    free(o_null);
    return;
  }
  r->fwd_ok = 1;
  fz_run_download(r);
  if (o_null && memcmp(o_null, r->t[FZ_O].buf.raw, raw_bytes(&r->t[FZ_O].buf)) != 0)
    fz_fail(x, "%s O of fa_forward with lse = NULL differs from O with lse", lb);
  free(o_null);
  static const int fwd_outs[1] = {FZ_O}, bwd_outs[3] = {FZ_DQ, FZ_DK, FZ_DV};
  check_memory(r, x, "fa_forward", fwd_outs, 1);
  read_vals(r, FZ_O);
  const tu_buf *ob = &r->t[FZ_O].buf;
  r->o_fwd = (unsigned char *)malloc(raw_bytes(ob));
  memcpy(r->o_fwd, ob->raw, raw_bytes(ob));
  if (r->o.backward && r->o.o_in) {
    const fz_case *c = r->c;
    for (int64_t s = 0; s < c->nseq; s++) {
      const fz_seq q = fz_seq_of(c, s);
      for (int64_t i = 0; i < q.nq; i++)
        for (int64_t h = 0; h < c->HQ; h++)
          for (int64_t e = 0; e < c->D; e++)
            tu_store(r->t[FZ_O].t.data, r->o.dtype,
                     tu_tensor_index(&r->t[FZ_O].t, q.qb, q.q0 + i, h, e),
                     r->o.o_in[cidx(c->NQ, c->HQ, c->D, q.qb, q.q0 + i, h, e)]);
    }
    if (!on_host(dev)) dev->upload(r->mt[FZ_O], ob->raw, raw_bytes(ob));
  }
  if (r->o.backward) {
    if (r->o.workspace) {
      take_workspace(r, 1, need[1]);
      pb.workspace = r->mws[1] + r->ws[1].guard_bytes;
      pb.workspace_bytes = r->ws[1].bytes;
    }
    /* the forward's outputs are the backward's inputs */
    tu_snap_free(&r->snap[FZ_O]);
    tu_snap_take(&r->snap[FZ_O], &r->t[FZ_O].buf);
    tu_snap_take(&r->snap[FZ_NT], &r->lse);
    r->st_bwd =
        fa_backward(&pb, &r->desc[FZ_Q], &r->desc[FZ_K], &r->desc[FZ_V], &r->desc[FZ_O],
                    &r->desc[FZ_DO], lse, &r->desc[FZ_DQ], &r->desc[FZ_DK], &r->desc[FZ_DV]);
    if (r->st_bwd != FA_OK) {
      fz_fail(x, "%s fa_backward returned %s: %s", lb, fa_status_string(r->st_bwd),
              fa_last_error());
    } else {
      r->bwd_ok = 1;
      fz_run_download(r);
      check_memory(r, x, "fa_backward", bwd_outs, 3);
      if (!tu_snap_same(&r->snap[FZ_NT], &r->lse)) fz_fail(x, "%s fa_backward modified lse", lb);
    }
    tu_snap_free(&r->snap[FZ_NT]);
  }
  if (r->bwd_ok)
    for (int t = FZ_DQ; t <= FZ_DV; t++) read_vals(r, t);
}
