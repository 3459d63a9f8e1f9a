/* flashattn-bench: times standard attention, FlashAttention-1 and
 * FlashAttention-2 through the public API on the CPU or a CUDA device and
 * reports time, FLOP/s and extra memory side by side. Run with --help. */
#define _POSIX_C_SOURCE 200809L
#include <omp.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

#define PROG "flashattn-bench"

/* The tensors of one case; a forward needs the first four. */
enum { T_Q, T_K, T_V, T_O, T_DO, T_DQ, T_DK, T_DV, N_TENSORS };
static const int KV_SHAPED[N_TENSORS] = {0, 1, 1, 0, 0, 0, 1, 1};
static const char *const TENSOR_NAMES[N_TENSORS] = {"q", "k", "v", "o", "dout", "dq", "dk", "dv"};

typedef struct bench_env {
  const bench_opts *o;
  uint8_t *block_mask;  /* device memory, (B, H, query blocks, key blocks); NULL: dense */
  int32_t *kv_used;     /* device memory, batch entries of --kv-used; NULL: no KV cache */
  int32_t *block_table; /* --paged: device memory, (batch, pages_per_seq) */
  int64_t pages_per_seq;
  fa_kvcache kv;          /* --append: the KV-cache call's arguments */
  fa_tensor k_new, v_new; /* --append: Nq new rows per sequence (device memory) */
  void *rotary;           /* --rotary: cos then sin tables (device memory) */
  void *stream;           /* CUDA stream, NULL on the CPU */
  size_t mem_limit;       /* bytes a case may allocate */
} bench_env;

/* Device memory of one case, made fresh for it. */
typedef struct case_mem {
  fa_tensor t[N_TENSORS];
  void *buf[N_TENSORS];
  float *lse;
  void *workspace;
  size_t bytes; /* tensors and lse */
} case_mem;

static int tensors_needed(bench_pass pass) { return pass == BENCH_FWD ? T_O + 1 : N_TENSORS; }

/* Pages of one sequence's K/V with --paged. */
static int64_t pages_per_seq(const bench_opts *o) {
  return (o->seqlen_k + o->page_size - 1) / o->page_size;
}

/* K/V with --paged: pools of batch x pages_per_seq pages of page_size rows. */
static fa_tensor describe(const bench_opts *o, int kv, void *data) {
  const int paged = kv && o->page_size;
  const int64_t b = paged ? o->batch * pages_per_seq(o) : o->batch;
  const int64_t n = paged ? o->page_size : kv ? o->seqlen_k : o->seqlen;
  const int64_t h = kv ? o->kv_heads : o->heads;
  return o->layout == BENCH_BHND ? fa_tensor_bhnd(data, o->dtype, b, n, h, o->headdim)
                                 : fa_tensor_bnhd(data, o->dtype, b, n, h, o->headdim);
}

static size_t tensor_elems(const bench_opts *o, int kv) {
  const fa_tensor t = describe(o, kv, NULL);
  return (size_t)t.batch * (size_t)t.seqlen * (size_t)t.heads * (size_t)t.headdim;
}

static size_t lse_elems(const bench_opts *o) {
  return (size_t)o->batch * (size_t)o->heads * (size_t)o->seqlen;
}

static double mib(size_t bytes) { return (double)bytes / (1024.0 * 1024.0); }

/* Records why a case did not run to the end; returns -1 for the caller to pass on. */
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static int
fail(bench_result *r, bench_status status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->message, sizeof r->message, fmt, ap);
  va_end(ap);
  r->status = status;
  return -1;
}

static int fail_fa(bench_result *r, const char *call, fa_status st) {
  const bench_status status = st == FA_ERR_OUT_OF_MEMORY ? BENCH_OOM
                              : st == FA_ERR_UNSUPPORTED ? BENCH_UNSUPPORTED
                                                         : BENCH_ERROR;
  return fail(r, status, "%s: %s: %s", call, fa_status_string(st), fa_last_error());
}

static fa_params make_params(const bench_env *e, fa_algorithm impl) {
  const bench_opts *o = e->o;
  fa_params p;
  memset(&p, 0, sizeof p);
  p.device = o->device;
  p.algorithm = impl;
  p.causal = o->causal;
  p.window_enabled = o->window_enabled;
  p.window_left = o->window_left;
  p.window_right = o->window_right;
  p.softcap = o->softcap;
  p.dropout_p = o->dropout;
  p.dropout_seed = o->seed;
  if (e->block_mask) {
    p.block_mask = e->block_mask;
    p.block_size_q = p.block_size_k = o->block_size;
    p.block_mask_stride_row = (o->seqlen_k + o->block_size - 1) / o->block_size;
    p.block_mask_stride_head =
        p.block_mask_stride_row * ((o->seqlen + o->block_size - 1) / o->block_size);
    p.block_mask_stride_batch = p.block_mask_stride_head * o->heads;
  }
  p.seqused_k = e->kv_used;
  if (o->append) p.seqused_k = NULL; /* kv.cache_seqlens is its place */
  if (e->block_table) {
    p.block_table = e->block_table;
    p.max_pages_per_seq = e->pages_per_seq;
  }
  p.num_threads = o->device == FA_DEVICE_CPU ? o->threads : 0;
  p.stream = e->stream;
  return p;
}

/* Allocates the case's tensors and lse and fills them with random numbers. */
static int alloc_tensors(const bench_env *e, bench_pass pass, uint64_t seed, case_mem *m,
                         bench_result *r) {
  const bench_opts *o = e->o;
  const fa_device d = o->device;
  const int n = tensors_needed(pass);
  const size_t es = fa_dtype_size(o->dtype);
  /* in double first: absurd shapes must not wrap around size_t */
  double total = (double)o->batch * (double)o->heads * (double)o->seqlen * sizeof(float);
  for (int i = 0; i < n; i++) {
    const fa_tensor t = describe(o, KV_SHAPED[i], NULL);
    total += (double)t.batch * (double)t.seqlen * (double)t.heads * (double)t.headdim * (double)es;
  }
  if (total > (double)e->mem_limit)
    return fail(r, BENCH_OOM, "tensors need %.1f MiB, more than the %.1f MiB limit",
                total / (1024.0 * 1024.0), mib(e->mem_limit));
  m->bytes = (size_t)total;
  for (int i = 0; i < n; i++) {
    const size_t count = tensor_elems(o, KV_SHAPED[i]);
    m->buf[i] = bench_alloc(d, count * es);
    if (!m->buf[i])
      return fail(r, BENCH_OOM, "cannot allocate %s (%.1f MiB)", TENSOR_NAMES[i], mib(count * es));
    if (bench_fill_random(d, e->stream, m->buf[i], o->dtype, count, seed * N_TENSORS + (uint64_t)i))
      return fail(r, BENCH_ERROR, "filling %s: %s", TENSOR_NAMES[i], bench_device_error());
    m->t[i] = describe(o, KV_SHAPED[i], m->buf[i]);
  }
  m->lse = bench_alloc(d, lse_elems(o) * sizeof(float));
  if (!m->lse) return fail(r, BENCH_OOM, "cannot allocate lse");
  if (bench_fill_random(d, e->stream, m->lse, FA_DTYPE_F32, lse_elems(o), seed * N_TENSORS + 99))
    return fail(r, BENCH_ERROR, "filling lse: %s", bench_device_error());
  return 0;
}

/* --standard head: standard attention called once per (sequence b, K/V head hk)
 * on views of the case's tensors (batch 1; the query heads of hk's group), so
 * each call materialises S and P of that head group only. On the CPU the calls
 * spread over the threads, one thread and one workspace slot each. */
static int per_head(const bench_env *e, const fa_params *p) {
  return p->algorithm == FA_ALGO_STANDARD && e->o->standard == BENCH_STD_HEAD;
}

/* Calls of --standard head that run at once, each with its own workspace slot. */
static int64_t head_slots(const bench_env *e) {
  const bench_opts *o = e->o;
  const int64_t units = o->batch * o->kv_heads;
  return o->device != FA_DEVICE_CPU ? 1 : units < o->threads ? units : o->threads;
}

static fa_tensor view(const fa_tensor *t, int64_t b, int64_t h0, int64_t heads) {
  fa_tensor v = *t;
  if (v.data)
    v.data = (char *)t->data +
             (b * t->stride_batch + h0 * t->stride_head) * (int64_t)fa_dtype_size(t->dtype);
  v.batch = 1;
  v.heads = heads;
  return v;
}

/* The views and params of call (b, hk) of --standard head. */
static void head_case(const bench_env *e, const case_mem *m, const fa_params *p, int64_t b,
                      int64_t hk, case_mem *v, fa_params *vp) {
  const bench_opts *o = e->o;
  const int64_t g = o->heads / o->kv_heads;
  *v = *m;
  for (int i = 0; i < N_TENSORS; i++)
    v->t[i] = KV_SHAPED[i] ? view(&m->t[i], b, hk, 1) : view(&m->t[i], b, hk * g, g);
  v->lse = m->lse ? m->lse + (b * o->heads + hk * g) * o->seqlen : NULL;
  *vp = *p;
  if (p->block_mask)
    vp->block_mask =
        p->block_mask + b * p->block_mask_stride_batch + hk * g * p->block_mask_stride_head;
  if (p->seqused_k) vp->seqused_k = p->seqused_k + b;
  if (o->device == FA_DEVICE_CPU) vp->num_threads = 1;
}

/* Asks the library what scratch memory the case needs and passes that in.
 * The backward pass runs after an untimed forward, so both are allocated;
 * r->extra_bytes counts what the timed pass itself asks for. */
static int alloc_workspace(const bench_env *e, bench_pass pass, fa_params *p, case_mem *m,
                           bench_result *r) {
  size_t fwd = 0, bwd = 0;
  case_mem v = *m; /* --standard head: every call needs what the first one does */
  fa_params vp = *p;
  if (per_head(e, p)) head_case(e, m, p, 0, 0, &v, &vp);
  fa_status st =
      e->o->append
          ? fa_kvcache_workspace_size(p, &e->kv, &m->t[T_Q], &m->t[T_K], &m->t[T_V], &fwd)
          : fa_workspace_size(FA_PASS_FORWARD, &vp, &v.t[T_Q], &v.t[T_K], &v.t[T_V], &fwd);
  if (st != FA_OK) return fail_fa(r, "fa_workspace_size(forward)", st);
  if (pass != BENCH_FWD) {
    st = fa_workspace_size(FA_PASS_BACKWARD, &vp, &v.t[T_Q], &v.t[T_K], &v.t[T_V], &bwd);
    if (st != FA_OK) return fail_fa(r, "fa_workspace_size(backward)", st);
  }
  if (per_head(e, p)) { /* a 64-byte aligned slot per call running at once */
    const size_t slots = (size_t)head_slots(e);
    fwd = (fwd + 63) / 64 * 64 * slots, bwd = (bwd + 63) / 64 * 64 * slots;
  }
  const size_t need = fwd > bwd ? fwd : bwd;
  r->extra_bytes = pass == BENCH_FWD ? fwd : pass == BENCH_BWD ? bwd : need;
  r->extra_known = 1;
  if (need == 0) return 0;
  if (need > e->mem_limit - m->bytes)
    return fail(r, BENCH_OOM, "workspace of %.1f MiB does not fit in the %.1f MiB limit", mib(need),
                mib(e->mem_limit));
  m->workspace = bench_alloc(e->o->device, need);
  if (!m->workspace)
    return fail(r, BENCH_OOM, "cannot allocate the workspace (%.1f MiB)", mib(need));
  if (bench_touch(e->o->device, e->stream, m->workspace, need))
    return fail(r, BENCH_ERROR, "touching the workspace: %s", bench_device_error());
  p->workspace = m->workspace;
  p->workspace_bytes = need;
  return 0;
}

static void free_case(const bench_env *e, case_mem *m) {
  for (int i = 0; i < N_TENSORS; i++) bench_free(e->o->device, m->buf[i]);
  bench_free(e->o->device, m->lse);
  bench_free(e->o->device, m->workspace);
}

/* One call of the pass: the forward (--append: the KV-cache call), the
 * backward, or both. */
static fa_status run_call(const bench_env *e, const fa_params *p, case_mem *m, bench_pass pass,
                          const char **call) {
  fa_tensor *t = m->t;
  fa_status st = FA_OK;
  if (pass != BENCH_BWD && e->o->append) {
    *call = "fa_forward_kvcache";
    st = fa_forward_kvcache(p, &e->kv, &t[T_Q], &t[T_K], &t[T_V], &t[T_O], m->lse);
  } else if (pass != BENCH_BWD) {
    *call = "fa_forward";
    st = fa_forward(p, &t[T_Q], &t[T_K], &t[T_V], &t[T_O], m->lse);
  }
  if (st == FA_OK && pass != BENCH_FWD) {
    *call = "fa_backward";
    st = fa_backward(p, &t[T_Q], &t[T_K], &t[T_V], &t[T_O], &t[T_DO], m->lse, &t[T_DQ], &t[T_DK],
                     &t[T_DV]);
  }
  return st;
}

/* One run of the pass: one call, or with --standard head one per (sequence, K/V head). */
static fa_status run_pass(const bench_env *e, const fa_params *p, case_mem *m, bench_pass pass,
                          const char **call) {
  if (!per_head(e, p)) return run_call(e, p, m, pass, call);
  const int64_t units = e->o->batch * e->o->kv_heads, slots = head_slots(e);
  const size_t slot = p->workspace_bytes / (size_t)slots;
  fa_status st = FA_OK;
#pragma omp parallel for num_threads((int)slots) schedule(dynamic, 1)
  for (int64_t u = 0; u < units; u++) {
    case_mem v;
    fa_params vp;
    const char *c = "";
    head_case(e, m, p, u / e->o->kv_heads, u % e->o->kv_heads, &v, &vp);
    vp.workspace = slot ? (char *)p->workspace + (size_t)omp_get_thread_num() * slot : NULL;
    vp.workspace_bytes = slot;
    const fa_status s = run_call(e, &vp, &v, pass, &c);
    if (s != FA_OK)
#pragma omp critical
    {
      st = s;
      *call = c;
    }
  }
  return st;
}

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Warmup runs, then --repeat timed runs, cut short by --max-time (see --help);
 * fills ms (median), ms_min and runs. */
static int time_pass(const bench_env *e, bench_pass pass, const fa_params *p, case_mem *m,
                     bench_result *r) {
  const bench_opts *o = e->o;
  const double budget_ms = 1e3 * o->max_time;
  double *ms = malloc((size_t)o->repeat * sizeof *ms);
  bench_timer tm;
  if (!ms) return fail(r, BENCH_ERROR, "cannot allocate the timing array");
  if (bench_timer_init(&tm, o->device, e->stream)) {
    free(ms);
    return fail(r, BENCH_ERROR, "timer: %s", bench_device_error());
  }
  int rc = 0, warm_left = o->warmup;
  double spent = 0;
  while (rc == 0 && r->runs < o->repeat) {
    const char *call = "";
    if (bench_timer_start(&tm)) {
      rc = fail(r, BENCH_ERROR, "timer: %s", bench_device_error());
      break;
    }
    const fa_status st = run_pass(e, p, m, pass, &call);
    const double t = bench_timer_stop(&tm); /* waits for the device */
    if (st != FA_OK)
      rc = fail_fa(r, call, st);
    else if (t < 0)
      rc = fail(r, BENCH_ERROR, "%s: %s", call, bench_device_error());
    if (rc) break;
    spent += t;
    if (warm_left > 0 && !(budget_ms > 0 && t >= budget_ms)) {
      warm_left--;
      continue;
    }
    warm_left = 0;
    ms[r->runs++] = t;
    if (budget_ms > 0 && spent >= budget_ms) break;
  }
  if (rc == 0) {
    const int n = r->runs, h = n / 2;
    qsort(ms, (size_t)n, sizeof *ms, cmp_double);
    r->ms = n % 2 ? ms[h] : 0.5 * (ms[h - 1] + ms[h]);
    r->ms_min = ms[0];
    r->gflops = r->flops / (r->ms * 1e-3) * 1e-9;
  }
  bench_timer_destroy(&tm);
  free(ms);
  return rc;
}

static void run_case(const bench_env *e, fa_algorithm impl, bench_pass pass, uint64_t seed,
                     bench_result *r) {
  case_mem m;
  memset(&m, 0, sizeof m);
  memset(r, 0, sizeof *r);
  r->impl = impl;
  r->pass = pass;
  r->status = BENCH_OK;
  r->flops = bench_flops(e->o, pass);
  fa_params p = make_params(e, impl);
  const char *call = "";
  if (alloc_tensors(e, pass, seed, &m, r) == 0 && alloc_workspace(e, pass, &p, &m, r) == 0) {
    /* the backward needs O and lse from a forward: untimed */
    const fa_status st = pass == BENCH_BWD ? run_pass(e, &p, &m, BENCH_FWD, &call) : FA_OK;
    if (st != FA_OK)
      fail_fa(r, call, st);
    else
      time_pass(e, pass, &p, &m, r);
  }
  free_case(e, &m);
}

static void report_failure(const bench_opts *o, const bench_result *r) {
  if (r->status == BENCH_OK || o->json) return; /* JSON carries it in "error" */
  fprintf(stderr, PROG ": %s %s: %s\n", bench_impl_name(r->impl), bench_pass_name(r->pass),
          r->message);
}

/* Every (batch, head, query block) row keeps round(S * key blocks) of its key
 * blocks (at least one unless S = 0), picked at random: each row does the same
 * work. S = 0 hides every block: the launch's cost without tile work. */
static int make_block_mask(const bench_opts *o, bench_env *e) {
  const int64_t nbq = (o->seqlen + o->block_size - 1) / o->block_size;
  const int64_t nbk = (o->seqlen_k + o->block_size - 1) / o->block_size;
  const int64_t rows = o->batch * o->heads * nbq;
  const size_t bytes = (size_t)(rows * nbk);
  uint8_t *host = calloc(bytes, 1);
  int64_t *perm = malloc(sizeof(int64_t) * (size_t)nbk);
  if (!host || !perm) {
    free(host), free(perm);
    return -1;
  }
  int64_t keep = (int64_t)(o->block_density * (double)nbk + 0.5);
  keep = keep < 1 && o->block_density > 0 ? 1 : keep > nbk ? nbk : keep;
  uint64_t x = o->seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t j = 0; j < nbk; j++) perm[j] = j;
    for (int64_t j = nbk - 1; j > 0; j--) { /* Fisher-Yates with xorshift64 */
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      const int64_t t = (int64_t)(x % (uint64_t)(j + 1)), v = perm[j];
      perm[j] = perm[t], perm[t] = v;
    }
    for (int64_t j = 0; j < keep; j++) host[r * nbk + perm[j]] = 1;
  }
  free(perm);
  e->block_mask = bench_alloc(o->device, bytes);
  const int rc = e->block_mask ? bench_copy_to_device(o->device, e->block_mask, host, bytes) : -1;
  free(host);
  return rc;
}

/* n int32 values into new device memory at *dst. */
static int device_ints(const bench_opts *o, int32_t **dst, const int32_t *host, size_t n) {
  *dst = bench_alloc(o->device, n * sizeof(int32_t));
  return *dst ? bench_copy_to_device(o->device, *dst, host, n * sizeof(int32_t)) : -1;
}

/* --kv-used (or --paged, --append): the keys every sequence attends to, N of
 * its cache (all Nk without --kv-used); with --append the cache holds all
 * but the Nq new rows before the call (kv.cache_seqlens). */
static int make_kv_used(const bench_opts *o, bench_env *e) {
  int32_t *host = malloc(sizeof(int32_t) * (size_t)o->batch);
  if (!host) return -1;
  const int64_t used = o->kv_used ? o->kv_used : o->seqlen_k;
  for (int64_t b = 0; b < o->batch; b++) host[b] = (int32_t)(used - (o->append ? o->seqlen : 0));
  const int rc = device_ints(o, &e->kv_used, host, (size_t)o->batch);
  free(host);
  return rc;
}

/* --paged: each sequence's pages, a random permutation of the pools' pages. */
static int make_block_table(const bench_opts *o, bench_env *e) {
  e->pages_per_seq = pages_per_seq(o);
  const size_t n = (size_t)(o->batch * e->pages_per_seq);
  int32_t *host = malloc(sizeof(int32_t) * n);
  if (!host) return -1;
  for (size_t i = 0; i < n; i++) host[i] = (int32_t)i;
  uint64_t x = o->seed * 0x9E3779B97F4A7C15ull + 7;
  for (size_t i = n - 1; i > 0; i--) { /* Fisher-Yates with xorshift64 */
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    const size_t t = (size_t)(x % (uint64_t)(i + 1));
    const int32_t v = host[i];
    host[i] = host[t], host[t] = v;
  }
  const int rc = device_ints(o, &e->block_table, host, n);
  free(host);
  return rc;
}

/* --append: the new rows and, with --rotary, tables of cos and sin (random
 * values: the time does not depend on them) of every cache position. */
static int make_kvcache_call(const bench_opts *o, bench_env *e) {
  const size_t es = fa_dtype_size(o->dtype);
  const size_t n = (size_t)(o->batch * o->seqlen * o->kv_heads * o->headdim);
  void *kn = bench_alloc(o->device, n * es), *vn = bench_alloc(o->device, n * es);
  e->k_new = fa_tensor_bnhd(kn, o->dtype, o->batch, o->seqlen, o->kv_heads, o->headdim);
  e->v_new = fa_tensor_bnhd(vn, o->dtype, o->batch, o->seqlen, o->kv_heads, o->headdim);
  if (!kn || !vn || bench_fill_random(o->device, e->stream, kn, o->dtype, n, o->seed + 11) ||
      bench_fill_random(o->device, e->stream, vn, o->dtype, n, o->seed + 12))
    return -1;
  memset(&e->kv, 0, sizeof e->kv);
  e->kv.cache_seqlens = e->kv_used;
  e->kv.k_new = &e->k_new, e->kv.v_new = &e->v_new;
  if (!o->rotary) return 0;
  const int64_t rows = e->block_table ? e->pages_per_seq * o->page_size : o->seqlen_k;
  const size_t nt = (size_t)(rows * (o->headdim / 2 * 2) / 2);
  e->rotary = bench_alloc(o->device, 2 * nt * es);
  if (!e->rotary || bench_fill_random(o->device, e->stream, e->rotary, o->dtype, 2 * nt, o->seed))
    return -1;
  e->kv.rotary_cos = e->rotary, e->kv.rotary_sin = (char *)e->rotary + nt * es;
  e->kv.rotary_seqlen = rows, e->kv.rotary_dim = o->headdim / 2 * 2;
  return 0;
}

/* The peak, when asked for: measured on the CPU only. */
static void peak_if_asked(const bench_opts *o, bench_peak *peak) {
  if (!o->peak) return;
  if (o->device != FA_DEVICE_CPU) {
    fprintf(stderr, PROG ": --peak measures the CPU; no peak%% is shown for --device cuda\n");
    return;
  }
  bench_measure_peak(o->threads, peak);
  bench_print_peak(o, peak);
}

int main(int argc, char **argv) {
  bench_opts o;
  const int rc = bench_parse_args(argc, argv, &o);
  if (rc >= 0) return rc;
  const char *why;
  if (!bench_device_ready(o.device, &why)) {
    fprintf(stderr, PROG ": --device %s: CUDA is not available: %s\n", bench_device_name(o.device),
            why);
    return 1;
  }
  bench_peak peak;
  memset(&peak, 0, sizeof peak);
  peak_if_asked(&o, &peak);
  if (o.peak_only) return 0;

  bench_env env;
  memset(&env, 0, sizeof env);
  env.o = &o;
  env.mem_limit = bench_memory_limit(o.device);
  if (bench_stream_create(o.device, &env.stream)) {
    fprintf(stderr, PROG ": cannot create a stream: %s\n", bench_device_error());
    return 1;
  }
  if (o.block_sparse && make_block_mask(&o, &env)) {
    fprintf(stderr, PROG ": cannot make the block mask: %s\n", bench_device_error());
    return 1;
  }
  if ((o.kv_used || o.page_size || o.append) && make_kv_used(&o, &env)) {
    fprintf(stderr, PROG ": cannot make the KV cache lengths: %s\n", bench_device_error());
    return 1;
  }
  if (o.page_size && make_block_table(&o, &env)) {
    fprintf(stderr, PROG ": cannot make the block table: %s\n", bench_device_error());
    return 1;
  }
  if (o.append && make_kvcache_call(&o, &env)) {
    fprintf(stderr, PROG ": cannot make the KV-cache call's inputs: %s\n", bench_device_error());
    return 1;
  }
  bench_result results[BENCH_MAX_PASSES * BENCH_MAX_IMPLS];
  int n = 0, failed = 0;
  bench_print_header(&o, &peak);
  for (int p = 0; p < o.n_passes; p++)
    for (int i = 0; i < o.n_impls; i++, n++) {
      /* fresh inputs for every case */
      run_case(&env, o.impls[i], o.passes[p], (o.seed << 8) + (uint64_t)n, &results[n]);
      bench_print_result(&o, &peak, &results[n]);
      report_failure(&o, &results[n]);
      failed |= results[n].status == BENCH_ERROR;
    }
  bench_print_summary(&o, results, n);
  bench_free(o.device, env.block_mask);
  bench_free(o.device, env.kv_used);
  bench_free(o.device, env.block_table);
  bench_free(o.device, env.k_new.data);
  bench_free(o.device, env.v_new.data);
  bench_free(o.device, env.rotary);
  bench_stream_destroy(o.device, env.stream);
  return failed ? 1 : 0;
}
