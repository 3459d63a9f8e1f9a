/* The public entry points: every argument is validated here, once, then the
 * call is dispatched to exactly one backend with a filled fa_problem. */
#include <math.h>
#include <omp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "backend.h"
#include "common/dtype.h"
#include "common/philox.h"

#define FA_STR2(x) #x
#define FA_STR(x) FA_STR2(x)

static _Thread_local char fa_error_buf[512];

fa_status fa_set_error(fa_status status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(fa_error_buf, sizeof fa_error_buf, fmt, ap);
  va_end(ap);
  return status;
}

const char *fa_last_error(void) { return fa_error_buf; }

const char *fa_version(void) {
  return FA_STR(FA_VERSION_MAJOR) "." FA_STR(FA_VERSION_MINOR) "." FA_STR(FA_VERSION_PATCH);
}

const char *fa_status_string(fa_status status) {
  switch (status) {
    case FA_OK:
      return "ok";
    case FA_ERR_INVALID_ARGUMENT:
      return "invalid argument";
    case FA_ERR_UNSUPPORTED:
      return "unsupported";
    case FA_ERR_OUT_OF_MEMORY:
      return "out of memory";
    case FA_ERR_DEVICE:
      return "device error";
    case FA_ERR_INTERNAL:
      return "internal error";
  }
  return "unknown status";
}

size_t fa_dtype_size(fa_dtype dtype) { return fa_dtype_bytes(dtype); }

fa_tensor fa_tensor_bnhd(void *data, fa_dtype dtype, int64_t batch, int64_t seqlen, int64_t heads,
                         int64_t headdim) {
  fa_tensor t = {
      data,   dtype, batch, seqlen, heads, headdim, seqlen * heads * headdim, heads * headdim,
      headdim};
  return t;
}

fa_tensor fa_tensor_bhnd(void *data, fa_dtype dtype, int64_t batch, int64_t seqlen, int64_t heads,
                         int64_t headdim) {
  fa_tensor t = {data,    dtype,           batch, seqlen, heads, headdim, heads * seqlen * headdim,
                 headdim, seqlen * headdim};
  return t;
}

int fa_device_available(fa_device device) {
  if (device == FA_DEVICE_CPU) return 1;
#ifdef FLASHATTN_CUDA
  if (device == FA_DEVICE_CUDA) return fa_cuda_available();
#endif
  return 0;
}

/* ---- validation ---------------------------------------------------------- */

#define FA_INVALID(...) fa_set_error(FA_ERR_INVALID_ARGUMENT, __VA_ARGS__)

/* Half-open byte range [lo, hi) a tensor's elements lie in. */
typedef struct fa_span {
  uintptr_t lo, hi;
} fa_span;

static fa_status check_tensor(const fa_tensor *t, const char *name, int is_output, fa_span *span) {
  if (!t) return FA_INVALID("%s: tensor descriptor is NULL", name);
  if (fa_dtype_bytes(t->dtype) == 0) return FA_INVALID("%s: unknown dtype %d", name, (int)t->dtype);
  if (t->batch < 1)
    return FA_INVALID("%s: batch must be >= 1 (got %lld)", name, (long long)t->batch);
  if (t->seqlen < 1)
    return FA_INVALID("%s: seqlen must be >= 1 (got %lld)", name, (long long)t->seqlen);
  if (t->heads < 1)
    return FA_INVALID("%s: heads must be >= 1 (got %lld)", name, (long long)t->heads);
  if (t->headdim < 1 || t->headdim > FA_MAX_HEADDIM)
    return FA_INVALID("%s: headdim must be in [1, %d] (got %lld)", name, FA_MAX_HEADDIM,
                      (long long)t->headdim);
  if (t->stride_batch < 0 || t->stride_seq < 0 || t->stride_head < 0)
    return FA_INVALID("%s: strides must be >= 0", name);
  /* Largest element offset, with overflow checks; limit to 2^62 bytes. */
  const int64_t lim = (int64_t)1 << 58;
  if (t->batch > lim || t->seqlen > lim || t->heads > lim || t->stride_batch > lim ||
      t->stride_seq > lim || t->stride_head > lim)
    return FA_INVALID("%s: sizes or strides too large", name);
  double far = (double)(t->batch - 1) * (double)t->stride_batch +
               (double)(t->seqlen - 1) * (double)t->stride_seq +
               (double)(t->heads - 1) * (double)t->stride_head + (double)t->headdim;
  if (far * (double)fa_dtype_bytes(t->dtype) > (double)((int64_t)1 << 62))
    return FA_INVALID("%s: sizes and strides address more than 2^62 bytes", name);
  int64_t last = (t->batch - 1) * t->stride_batch + (t->seqlen - 1) * t->stride_seq +
                 (t->heads - 1) * t->stride_head + t->headdim;
  if (is_output) {
    /* An output may not write one element twice: each non-trivial dimension's
     * stride must step past everything the dimensions inside it cover. */
    struct {
      int64_t n, s;
    } dims[3] = {
        {t->batch, t->stride_batch}, {t->seqlen, t->stride_seq}, {t->heads, t->stride_head}};
    for (int a = 0; a < 3; a++)
      for (int b = a + 1; b < 3; b++)
        if (dims[b].s > dims[a].s) {
          int64_t n = dims[a].n, s = dims[a].s;
          dims[a] = dims[b];
          dims[b].n = n;
          dims[b].s = s;
        }
    int64_t extent = t->headdim;
    for (int a = 2; a >= 0; a--) {
      if (dims[a].n == 1) continue;
      if (dims[a].s < extent)
        return FA_INVALID("%s: strides make output elements overlap (stride %lld < extent %lld)",
                          name, (long long)dims[a].s, (long long)extent);
      extent = dims[a].s * (dims[a].n - 1) + extent;
    }
  }
  if (span) {
    /* only the calls read data; fa_workspace_size passes no span */
    if (!t->data) return FA_INVALID("%s: data pointer is NULL", name);
    span->lo = (uintptr_t)t->data;
    span->hi = span->lo + (uintptr_t)last * fa_dtype_bytes(t->dtype);
  }
  return FA_OK;
}

/* Exact test for the common packed case (same strides: e.g. q, k, v sliced out
 * of one (B, N, 3, H, D) buffer): are two tensors' element sets disjoint?
 * Returns 1 when provably disjoint, 0 otherwise. */
static int strided_disjoint(const fa_tensor *a, const fa_tensor *b) {
  if (a->dtype != b->dtype || a->stride_batch != b->stride_batch ||
      a->stride_seq != b->stride_seq || a->stride_head != b->stride_head || a->batch != b->batch ||
      a->seqlen != b->seqlen || a->heads != b->heads || a->headdim != b->headdim)
    return 0;
  intptr_t diff = (intptr_t)((const char *)b->data - (const char *)a->data);
  intptr_t es = (intptr_t)fa_dtype_bytes(a->dtype);
  if (diff % es) return 0;
  int64_t delta = (int64_t)(diff / es);
  int64_t n[4] = {a->batch, a->seqlen, a->heads, a->headdim};
  int64_t s[4] = {a->stride_batch, a->stride_seq, a->stride_head, 1};
  /* sort by stride, descending */
  for (int i = 0; i < 4; i++)
    for (int j = i + 1; j < 4; j++)
      if (s[j] > s[i]) {
        int64_t t = s[i];
        s[i] = s[j];
        s[j] = t;
        t = n[i];
        n[i] = n[j];
        n[j] = t;
      }
  /* With strictly gapped strides (each larger than the span of all inner
   * dimensions) every offset difference has one digit expansion. */
  int64_t inner[4];
  inner[3] = 0;
  for (int i = 2; i >= 0; i--) inner[i] = inner[i + 1] + (n[i + 1] - 1) * s[i + 1];
  for (int i = 0; i < 4; i++)
    if (n[i] > 1 && s[i] <= inner[i]) return 0;
  for (int i = 0; i < 4; i++) {
    if (n[i] == 1 || s[i] == 0) continue;
    int64_t c = delta / s[i], r = delta - c * s[i];
    if (r > inner[i])
      c++, r -= s[i];
    else if (r < -inner[i])
      c--, r += s[i];
    if (r > inner[i] || r < -inner[i]) return 1;
    if (c >= n[i] || c <= -n[i]) return 1;
    delta = r;
  }
  return delta != 0;
}

static int spans_overlap(fa_span x, fa_span y) { return x.lo < y.hi && y.lo < x.hi; }

typedef struct fa_named {
  const char *name;
  const fa_tensor *t; /* NULL for the lse vector */
  fa_span span;
  int output;
} fa_named;

static fa_status check_overlaps(const fa_named *v, int n) {
  for (int i = 0; i < n; i++)
    for (int j = i + 1; j < n; j++) {
      if (!v[i].output && !v[j].output) continue;
      if (!spans_overlap(v[i].span, v[j].span)) continue;
      if (v[i].t && v[j].t && strided_disjoint(v[i].t, v[j].t)) continue;
      return FA_INVALID("%s overlaps %s in memory: outputs must not alias inputs or each other",
                        v[i].output ? v[i].name : v[j].name, v[i].output ? v[j].name : v[i].name);
    }
  return FA_OK;
}

/* "dq: seqlen 17 differs from q's 16": names the first dimension that differs. */
static fa_status check_same_shape(const fa_tensor *a, const char *an, const fa_tensor *b,
                                  const char *bn) {
  const char *dim[4] = {"batch", "seqlen", "heads", "headdim"};
  int64_t x[4] = {a->batch, a->seqlen, a->heads, a->headdim};
  int64_t y[4] = {b->batch, b->seqlen, b->heads, b->headdim};
  for (int i = 0; i < 4; i++)
    if (x[i] != y[i])
      return fa_set_error(FA_ERR_INVALID_ARGUMENT,
                          "%s: %s %lld differs from %s's %lld (shapes must match)", an, dim[i],
                          (long long)x[i], bn, (long long)y[i]);
  return FA_OK;
}

#define FA_TRY(expr)              \
  do {                            \
    fa_status st_ = (expr);       \
    if (st_ != FA_OK) return st_; \
  } while (0)

fa_status fa_check_like(const fa_tensor *t, const char *name, int is_output, const fa_tensor *like,
                        const char *like_name) {
  fa_span span;
  FA_TRY(check_tensor(t, name, is_output, &span));
  if (t->dtype != like->dtype) return FA_INVALID("%s: dtype differs from %s's", name, like_name);
  return check_same_shape(t, name, like, like_name);
}

static fa_status check_shard(const fa_params *p, const fa_tensor *q, const fa_tensor *k) {
  const int64_t lim = INT32_MAX;
  if (p->shard_q_offset < 0 || p->shard_k_offset < 0)
    return FA_INVALID("params.shard_q_offset and shard_k_offset must be >= 0 (got %lld, %lld)",
                      (long long)p->shard_q_offset, (long long)p->shard_k_offset);
  if (p->shard_q_offset > lim - q->seqlen || p->shard_k_offset > lim - k->seqlen)
    return FA_INVALID(
        "params.shard_q_offset + q's seqlen and shard_k_offset + k's seqlen must be <= 2^31 - 1 "
        "(got %lld + %lld, %lld + %lld)",
        (long long)p->shard_q_offset, (long long)q->seqlen, (long long)p->shard_k_offset,
        (long long)k->seqlen);
  if (p->dropout_p > 0 && p->shard_k_offset % 4)
    return FA_INVALID(
        "params.shard_k_offset must be a multiple of 4 with dropout (got %lld): one Philox call "
        "draws four neighbouring keys",
        (long long)p->shard_k_offset);
  if (p->cu_seqlens_q)
    return fa_set_error(FA_ERR_UNSUPPORTED,
                        "params.shard_enabled with cu_seqlens: the offsets place one sequence");
  if (p->seqused_k) return fa_set_error(FA_ERR_UNSUPPORTED, "params.shard_enabled with seqused_k");
  if (p->block_mask)
    return fa_set_error(FA_ERR_UNSUPPORTED, "params.shard_enabled with a block_mask");
  return FA_OK;
}

/* Keys one sequence's K/V rows can hold: pages x page size when paged (k is
 * then a pool of pages), else k's seqlen. */
static int64_t kv_capacity(const fa_params *p, const fa_tensor *k) {
  return p->block_table ? p->max_pages_per_seq * k->seqlen : k->seqlen;
}

/* Key blocks in a row of the block mask: ceil(capacity / block_size_k), with
 * no overflow for block sizes up to INT64_MAX */
static int64_t mask_key_blocks(const fa_params *p, const fa_tensor *k) {
  const int64_t n = kv_capacity(p, k);
  return n / p->block_size_k + (n % p->block_size_k > 0);
}

/* Whether the KV-cache call rotates query row i to position cache_seqlens + i
 * (a causal mask or a window with a bound), else every row to cache_seqlens. */
static int kv_rotary_all_rows(const fa_params *p) {
  return p->causal || (p->window_enabled && (p->window_left >= 0 || p->window_right >= 0));
}

/* A paged KV cache's table shape (the entries are checked in make_problem,
 * once the keys each sequence reads are known). */
static fa_status check_paged(const fa_params *p, const fa_tensor *k) {
  if (!p->block_table) return FA_OK;
  if (p->max_pages_per_seq < 1)
    return FA_INVALID("params.max_pages_per_seq must be >= 1 with a block_table (got %lld)",
                      (long long)p->max_pages_per_seq);
  if (p->block_table_stride != 0 && p->block_table_stride < p->max_pages_per_seq)
    return FA_INVALID("params.block_table_stride %lld is less than max_pages_per_seq %lld",
                      (long long)p->block_table_stride, (long long)p->max_pages_per_seq);
  if ((double)p->max_pages_per_seq * (double)k->seqlen > (double)(INT32_MAX / 2))
    return FA_INVALID(
        "params.max_pages_per_seq x page size (k's seqlen %lld) must be < 2^30 keys per sequence",
        (long long)k->seqlen);
  if (p->block_table_stride > ((int64_t)1 << 40))
    return FA_INVALID("params.block_table_stride is too large");
  return FA_OK;
}

static fa_status check_params(const fa_params *p, const fa_tensor *q, const fa_tensor *k) {
  if (p->device != FA_DEVICE_CPU && p->device != FA_DEVICE_CUDA)
    return FA_INVALID("params.device: unknown device %d", (int)p->device);
  FA_TRY(check_paged(p, k));
  if (p->num_splits < 0 || p->num_splits > 128)
    return FA_INVALID("params.num_splits must be in [0, 128] (got %d)", p->num_splits);
  if (p->sm_margin < 0 || p->sm_margin > 1024)
    return FA_INVALID("params.sm_margin must be in [0, 1024] (got %d)", p->sm_margin);
  if (p->algorithm != FA_ALGO_FLASH2 && p->algorithm != FA_ALGO_FLASH1 &&
      p->algorithm != FA_ALGO_STANDARD)
    return FA_INVALID("params.algorithm: unknown algorithm %d", (int)p->algorithm);
  if (!isfinite(p->softmax_scale)) return FA_INVALID("params.softmax_scale must be finite");
  if (!isfinite(p->softcap) || p->softcap < 0)
    return FA_INVALID("params.softcap must be finite and >= 0");
  if (!(p->dropout_p >= 0 && p->dropout_p < 1))
    return FA_INVALID("params.dropout_p must be in [0, 1) (got %g)", (double)p->dropout_p);
  if (p->dropout_p > 0 &&
      (double)q->batch * (double)q->heads * (p->cu_seqlens_q ? (double)p->num_seqs : 1) >=
          4294967296.0)
    return FA_INVALID("params.dropout_p: sequences x heads_q must be < 2^32 (the mask index)");
  if (p->block_mask) {
    if (p->block_size_q < 1 || p->block_size_k < 1)
      return FA_INVALID(
          "params.block_size_q and block_size_k must be >= 1 with a block_mask "
          "(got %lld, %lld)",
          (long long)p->block_size_q, (long long)p->block_size_k);
    if (p->block_mask_stride_batch < 0 || p->block_mask_stride_head < 0 ||
        p->block_mask_stride_row < 0)
      return FA_INVALID("params.block_mask strides must be >= 0");
    int64_t nbk = mask_key_blocks(p, k);
    if (p->block_mask_stride_row != 0 && p->block_mask_stride_row < nbk)
      return FA_INVALID(
          "params.block_mask_stride_row %lld is less than the %lld key blocks of a row",
          (long long)p->block_mask_stride_row, (long long)nbk);
  }
  if (p->num_threads < 0) return FA_INVALID("params.num_threads must be >= 0");
  if (p->alibi_slopes && p->alibi_stride_batch < 0)
    return FA_INVALID("params.alibi_stride_batch must be >= 0");
  if ((p->cu_seqlens_q == NULL) != (p->cu_seqlens_k == NULL))
    return FA_INVALID("params.cu_seqlens_q and cu_seqlens_k must be given together");
  if (p->cu_seqlens_q) {
    if (p->num_seqs < 1) return FA_INVALID("params.num_seqs must be >= 1 with cu_seqlens");
    if (q->batch != 1 || (k->batch != 1 && !p->block_table))
      return FA_INVALID("q/k: batch must be 1 with cu_seqlens (sequences are packed along seqlen)");
    if (p->device == FA_DEVICE_CPU) {
      const int32_t *cs[2] = {p->cu_seqlens_q, p->cu_seqlens_k};
      const char *nm[2] = {"cu_seqlens_q", "cu_seqlens_k"};
      const int64_t tot[2] = {q->seqlen, k->seqlen};
      for (int a = 0; a < 2; a++) {
        if (cs[a][0] != 0) return FA_INVALID("params.%s[0] must be 0", nm[a]);
        for (int64_t i = 0; i < p->num_seqs; i++)
          if (cs[a][i + 1] < cs[a][i])
            return FA_INVALID("params.%s must be non-decreasing (entry %lld)", nm[a],
                              (long long)(i + 1));
        if (a == 1 &&
            p->block_table) { /* paged: the offsets count keys, each span in a table row */
          for (int64_t i = 0; i < p->num_seqs; i++)
            if (cs[a][i + 1] - cs[a][i] > kv_capacity(p, k))
              return FA_INVALID(
                  "params.cu_seqlens_k: sequence %lld has %d keys, more than its %lld pages of "
                  "%lld hold",
                  (long long)i, (int)(cs[a][i + 1] - cs[a][i]), (long long)p->max_pages_per_seq,
                  (long long)k->seqlen);
        } else if (cs[a][p->num_seqs] > tot[a]) {
          return FA_INVALID("params.%s[num_seqs] = %d exceeds the tensor's seqlen %lld", nm[a],
                            (int)cs[a][p->num_seqs], (long long)tot[a]);
        }
      }
    }
  }
  if (p->seqused_k && p->device == FA_DEVICE_CPU) { /* device memory is not read here */
    const int64_t ns = p->cu_seqlens_q ? p->num_seqs : q->batch;
    for (int64_t s = 0; s < ns; s++) {
      const int64_t len =
          p->cu_seqlens_k ? p->cu_seqlens_k[s + 1] - p->cu_seqlens_k[s] : kv_capacity(p, k);
      if (p->seqused_k[s] < 0 || p->seqused_k[s] > len)
        return FA_INVALID("params.seqused_k[%lld] = %d is outside [0, %lld], the sequence's keys",
                          (long long)s, (int)p->seqused_k[s], (long long)len);
    }
  }
  if (p->shard_enabled) FA_TRY(check_shard(p, q, k));
  if (p->workspace && p->workspace_bytes == 0)
    return FA_INVALID("params.workspace given with workspace_bytes 0");
  return FA_OK;
}

/* The KV-cache call's own arguments (fa_kvcache), q and the caches' shapes
 * being checked; on the CPU, its arrays too. */
static fa_status check_kvcache(const fa_params *p, const fa_kvcache *kv, const fa_tensor *q,
                               const fa_tensor *k) {
  if (!kv->cache_seqlens)
    return FA_INVALID("kv.cache_seqlens is NULL: the KV-cache call needs each cache's length");
  if (p->cu_seqlens_q || p->cu_seqlens_k)
    return FA_INVALID("params.cu_seqlens: the KV-cache call takes fixed-length batches only");
  if (p->seqused_k)
    return FA_INVALID(
        "params.seqused_k must be NULL in the KV-cache call (kv.cache_seqlens is "
        "its place)");
  if (p->dropout_p != 0)
    return FA_INVALID("params.dropout_p must be 0 in the KV-cache call (it is inference only)");
  if ((kv->k_new == NULL) != (kv->v_new == NULL))
    return FA_INVALID("kv.k_new and kv.v_new must be given together");
  const int64_t cap = kv_capacity(p, k), B = q->batch;
  int64_t nnew = 0;
  if (kv->k_new) {
    FA_TRY(check_tensor(kv->k_new, "kv.k_new", 0, NULL));
    FA_TRY(check_tensor(kv->v_new, "kv.v_new", 0, NULL));
    FA_TRY(check_same_shape(kv->v_new, "kv.v_new", kv->k_new, "kv.k_new"));
    if (kv->k_new->dtype != q->dtype || kv->v_new->dtype != q->dtype)
      return FA_INVALID("kv.k_new and kv.v_new must have q's dtype");
    const fa_tensor *kn = kv->k_new;
    if (kn->batch != B || kn->heads != k->heads || kn->headdim != q->headdim)
      return FA_INVALID(
          "kv.k_new: shape (%lld, %lld, %lld, %lld) must be (q's batch %lld, seqlen_new, the "
          "cache's heads %lld, headdim %lld)",
          (long long)kn->batch, (long long)kn->seqlen, (long long)kn->heads, (long long)kn->headdim,
          (long long)B, (long long)k->heads, (long long)q->headdim);
    nnew = kn->seqlen;
    if (nnew > cap)
      return FA_INVALID("kv.k_new: %lld new rows do not fit a cache of %lld rows", (long long)nnew,
                        (long long)cap);
  }
  if (p->block_table && (kv->cache_batch_idx || kv->cache_leftpad))
    return FA_INVALID(
        "kv.cache_batch_idx and kv.cache_leftpad are not supported with a block_table (each "
        "batch entry's pages are its row of the table)");
  if (!p->block_table && !kv->cache_batch_idx && k->batch != B)
    return FA_INVALID("k_cache: batch %lld differs from q's %lld (without kv.cache_batch_idx)",
                      (long long)k->batch, (long long)B);
  if ((kv->rotary_cos == NULL) != (kv->rotary_sin == NULL))
    return FA_INVALID("kv.rotary_cos and kv.rotary_sin must be given together");
  if (kv->rotary_cos) {
    if (!kv->k_new)
      return FA_INVALID("kv.rotary_cos: rotary embedding needs new keys (kv.k_new) to rotate");
    if (kv->rotary_dim < 2 || kv->rotary_dim % 2 || kv->rotary_dim > q->headdim)
      return FA_INVALID("kv.rotary_dim must be even and in [2, headdim %lld] (got %lld)",
                        (long long)q->headdim, (long long)kv->rotary_dim);
    if (kv->rotary_seqlen < cap || kv->rotary_seqlen > ((int64_t)1 << 40))
      return FA_INVALID(
          "kv.rotary_seqlen %lld must be at least the cache's %lld rows (every position a key "
          "can have)",
          (long long)kv->rotary_seqlen, (long long)cap);
    if (kv->rotary_stride != 0 &&
        (kv->rotary_stride < kv->rotary_dim / 2 || kv->rotary_stride > ((int64_t)1 << 40)))
      return FA_INVALID("kv.rotary_stride %lld is less than rotary_dim / 2 = %lld",
                        (long long)kv->rotary_stride, (long long)(kv->rotary_dim / 2));
  }
  if (p->device != FA_DEVICE_CPU) return FA_OK; /* device memory is not read here */
  for (int64_t b = 0; b < B; b++) {
    const int64_t lp = kv->cache_leftpad ? kv->cache_leftpad[b] : 0, sl = kv->cache_seqlens[b];
    if (kv->cache_batch_idx && (kv->cache_batch_idx[b] < 0 || kv->cache_batch_idx[b] >= k->batch))
      return FA_INVALID("kv.cache_batch_idx[%lld] = %d is outside [0, %lld), k_cache's batch",
                        (long long)b, (int)kv->cache_batch_idx[b], (long long)k->batch);
    if (lp < 0 || lp > cap)
      return FA_INVALID("kv.cache_leftpad[%lld] = %lld is outside [0, %lld], the cache's rows",
                        (long long)b, (long long)lp, (long long)cap);
    if (sl < lp || sl + nnew > cap)
      return FA_INVALID(
          "kv.cache_seqlens[%lld] = %lld is outside [%lld, %lld] (from its left padding to the "
          "cache's %lld rows less the %lld new ones)",
          (long long)b, (long long)sl, (long long)lp, (long long)(cap - nnew), (long long)cap,
          (long long)nnew);
    /* the new keys' positions end before cap; query rows may go further */
    if (kv->rotary_cos && kv_rotary_all_rows(p) && sl + q->seqlen > kv->rotary_seqlen)
      return FA_INVALID("kv.rotary_seqlen %lld is too short for the queries of batch entry %lld: "
                        "its last row takes position cache_seqlens[%lld] + %lld = %lld",
                        (long long)kv->rotary_seqlen, (long long)b, (long long)b,
                        (long long)(q->seqlen - 1), (long long)(sl + q->seqlen - 1));
  }
  return FA_OK;
}

/* A paged problem's table entries, on the CPU: those of every page holding a
 * key read must name a page of the pools. */
static fa_status check_block_table(const fa_problem *pb) {
  if (!pb->page_size || pb->device != FA_DEVICE_CPU) return FA_OK;
  for (int64_t s = 0; s < pb->batch; s++) {
    const fa_seq sq = fa_problem_seq(pb, s);
    const int64_t pages = (sq.k0 + sq.nk + pb->page_size - 1) / pb->page_size;
    for (int64_t i = 0; i < pages; i++)
      if (sq.pages[i] < 0 || sq.pages[i] >= pb->k.batch)
        return FA_INVALID(
            "params.block_table[%lld][%lld] = %d is outside [0, %lld), the pools' pages (page "
            "%lld holds keys of sequence %lld)",
            (long long)s, (long long)i, (int)sq.pages[i], (long long)pb->k.batch, (long long)i,
            (long long)s);
  }
  return FA_OK;
}

/* Everything but the data of the outputs: shapes, dtypes, params, support.
 * kv: the KV-cache call's arguments (k and v are then the caches), or NULL. */
static fa_status make_problem(fa_pass pass, const fa_params *p, const fa_tensor *q,
                              const fa_tensor *k, const fa_tensor *v, const fa_kvcache *kv,
                              fa_problem *pb) {
  if (!p) return FA_INVALID("params is NULL");
  const char *kn = kv ? "k_cache" : "k", *vn = kv ? "v_cache" : "v";
  FA_TRY(check_tensor(q, "q", 0, NULL));
  FA_TRY(check_tensor(k, kn, 0, NULL));
  FA_TRY(check_tensor(v, vn, 0, NULL));
  if (k->dtype != q->dtype || v->dtype != q->dtype)
    return FA_INVALID("q, %s and %s must have the same dtype", kn, vn);
  FA_TRY(check_same_shape(v, vn, k, kn));
  if (k->batch != q->batch && !p->block_table && !kv)
    return FA_INVALID("k: batch %lld differs from q's %lld", (long long)k->batch,
                      (long long)q->batch);
  if (k->headdim != q->headdim)
    return FA_INVALID("%s: headdim %lld differs from q's %lld", kn, (long long)k->headdim,
                      (long long)q->headdim);
  if (q->heads % k->heads)
    return FA_INVALID("q: heads (%lld) must be a multiple of %s's heads (%lld)",
                      (long long)q->heads, kn, (long long)k->heads);
  FA_TRY(check_params(p, q, k));
  if (kv) FA_TRY(check_kvcache(p, kv, q, k));
  if (p->block_table && pass == FA_PASS_BACKWARD)
    return fa_set_error(FA_ERR_UNSUPPORTED,
                        "params.block_table: the backward pass does not take a paged KV cache "
                        "(paged attention is inference-only)");
  if (q->dtype == FA_DTYPE_F64 && !(p->device == FA_DEVICE_CPU && p->algorithm == FA_ALGO_STANDARD))
    return fa_set_error(FA_ERR_UNSUPPORTED,
                        "dtype f64 is only supported by the standard algorithm on the CPU");

  memset(pb, 0, sizeof *pb);
  pb->device = p->device;
  pb->stream = p->stream;
  pb->algorithm = p->algorithm;
  pb->causal = p->causal != 0;
  pb->window_enabled = p->window_enabled != 0;
  /* A window wider than any sequence and shard offset (2^32) sees everything:
   * 2^61 keeps every sum the backends form with it (a row's diagonal plus or
   * minus the window, the two sides plus one) inside 64 bits, and the kernels'
   * mask ranges keep their plain arithmetic. */
  const int64_t wmax = (int64_t)1 << 61;
  pb->window_left = p->window_left > wmax ? wmax : p->window_left;
  pb->window_right = p->window_right > wmax ? wmax : p->window_right;
  pb->softcap = p->softcap;
  pb->alibi_slopes = p->alibi_slopes;
  pb->alibi_stride_batch = p->alibi_stride_batch;
  pb->dropout_p = p->dropout_p;
  pb->cu_seqlens_q = p->cu_seqlens_q;
  pb->cu_seqlens_k = p->cu_seqlens_k;
  pb->seqused_k = p->seqused_k;
  pb->block_mask = p->block_mask;
  pb->block_size_q = p->block_size_q;
  pb->block_size_k = p->block_size_k;
  pb->block_mask_stride_batch = p->block_mask_stride_batch;
  pb->block_mask_stride_head = p->block_mask_stride_head;
  pb->shard_enabled = p->shard_enabled != 0;
  pb->deterministic = p->deterministic != 0;
  pb->num_splits = p->num_splits;
  pb->sm_margin = p->sm_margin;
  pb->q = *q;
  pb->k = *k;
  pb->v = *v;
  pb->dtype = q->dtype;
  pb->heads_q = q->heads;
  pb->heads_k = k->heads;
  pb->group = q->heads / k->heads;
  pb->headdim = q->headdim;
  pb->scale = p->softmax_scale != 0 ? p->softmax_scale : (float)(1.0 / sqrt((double)q->headdim));
  pb->varlen = p->cu_seqlens_q != NULL;
  pb->k_cap = kv_capacity(p, k);
  if (p->block_table) {
    pb->block_table = p->block_table;
    pb->block_table_stride = p->block_table_stride ? p->block_table_stride : p->max_pages_per_seq;
    pb->page_size = k->seqlen;
  }
  pb->k_used = p->seqused_k;
  if (kv) {
    pb->kv = kv;
    pb->k_used = kv->cache_seqlens;
    pb->k_used_add = kv->k_new ? kv->k_new->seqlen : 0;
    pb->k_start = kv->cache_leftpad;
    pb->k_batch = kv->cache_batch_idx;
    pb->q_in = *q;
    if (kv->k_new) pb->k_new = *kv->k_new, pb->v_new = *kv->v_new;
    pb->rotary_all_rows = kv_rotary_all_rows(p);
  }
  if (pb->varlen) {
    pb->batch = p->num_seqs;
    pb->total_q = q->seqlen;
    if (p->device == FA_DEVICE_CPU) {
      for (int64_t s = 0; s < p->num_seqs; s++) {
        int64_t nq = p->cu_seqlens_q[s + 1] - p->cu_seqlens_q[s];
        int64_t nk = p->cu_seqlens_k[s + 1] - p->cu_seqlens_k[s];
        if (nq > pb->max_seqlen_q) pb->max_seqlen_q = nq;
        if (nk > pb->max_seqlen_k) pb->max_seqlen_k = nk;
      }
    } else {
      /* device-resident offsets are not read on the host: bound by the totals
       * (paged: by a sequence's pages) */
      pb->max_seqlen_q = q->seqlen;
      pb->max_seqlen_k = p->block_table ? pb->k_cap : k->seqlen;
    }
  } else {
    pb->batch = q->batch;
    pb->total_q = q->batch * q->seqlen;
    pb->max_seqlen_q = q->seqlen;
    pb->max_seqlen_k = pb->k_cap;
  }
  if (pb->k_used && p->device == FA_DEVICE_CPU) { /* the keys read (checked in range) */
    pb->max_seqlen_k = 0;
    for (int64_t s = 0; s < pb->batch; s++) {
      const int64_t nk = fa_problem_seq(pb, s).nk;
      if (nk > pb->max_seqlen_k) pb->max_seqlen_k = nk;
    }
  }
  /* Backends size their buffers by batch x longest sequence x heads x head
   * dim (padded); bounding those products keeps every size in 64 bits. */
  const int64_t longest = pb->max_seqlen_q > pb->max_seqlen_k ? pb->max_seqlen_q : pb->max_seqlen_k;
  if ((double)pb->batch * (double)longest * (double)pb->heads_q * (double)q->headdim >
      (double)((int64_t)1 << 48))
    return FA_INVALID(
        "the problem is too large: batch x longest sequence x query heads x "
        "headdim exceeds 2^48 elements");
  if (p->shard_enabled) {
    pb->q_pos = p->shard_q_offset;
    pb->k_pos = p->shard_k_offset;
  }
  /* dropout's state (docs/DROPOUT.md), at a shard's positions */
  pb->dropout = fa_dropout_make(p->dropout_p, p->dropout_seed, p->dropout_offset);
  fa_dropout_at(&pb->dropout, pb->q_pos, pb->k_pos);
  FA_TRY(check_block_table(pb));
  if (p->block_mask)
    pb->block_mask_stride_row =
        p->block_mask_stride_row ? p->block_mask_stride_row : mask_key_blocks(p, k);
  int nt = p->num_threads > 0 ? p->num_threads : omp_get_num_procs();
  pb->num_threads = nt > 0 ? nt : 1;

  if (p->device == FA_DEVICE_CUDA) {
#ifdef FLASHATTN_CUDA
    if (!fa_cuda_available())
      return fa_set_error(FA_ERR_UNSUPPORTED, "params.device: no CUDA device is available");
    FA_TRY(fa_cuda_check(pb, pass));
#else
    (void)pass;
    return fa_set_error(FA_ERR_UNSUPPORTED, "params.device: this build has no CUDA backend");
#endif
  }
  return FA_OK;
}

static size_t backend_workspace(fa_pass pass, const fa_problem *pb) {
  if (pb->device == FA_DEVICE_CUDA) {
#ifdef FLASHATTN_CUDA
    if (pass == FA_PASS_PROBS) return 0;
    return pass == FA_PASS_FORWARD ? fa_cuda_forward_workspace(pb) : fa_cuda_backward_workspace(pb);
#else
    return 0;
#endif
  }
  if (pass == FA_PASS_PROBS) return fa_ref_probs_workspace(pb);
  if (pb->algorithm == FA_ALGO_STANDARD)
    return pass == FA_PASS_FORWARD ? fa_ref_forward_workspace(pb) : fa_ref_backward_workspace(pb);
  return pass == FA_PASS_FORWARD ? fa_cpu_forward_workspace(pb) : fa_cpu_backward_workspace(pb);
}

static size_t align_up(size_t n) { return (n + 255) & ~(size_t)255; }

/* lse scratch for a forward called with lse == NULL lives after the backend's. */
static size_t lse_bytes(const fa_problem *pb) {
  return align_up((size_t)pb->heads_q * (size_t)pb->total_q * sizeof(float));
}

fa_status fa_workspace_size(fa_pass pass, const fa_params *params, const fa_tensor *q,
                            const fa_tensor *k, const fa_tensor *v, size_t *bytes) {
  fa_problem pb;
  if (pass != FA_PASS_FORWARD && pass != FA_PASS_BACKWARD && pass != FA_PASS_PROBS)
    return FA_INVALID("pass: unknown pass %d", (int)pass);
  if (!bytes) return FA_INVALID("bytes is NULL");
  FA_TRY(make_problem(pass, params, q, k, v, NULL, &pb));
  /* the forward may be called with lse == NULL: count its scratch too */
  *bytes = align_up(backend_workspace(pass, &pb)) + (pass == FA_PASS_FORWARD ? lse_bytes(&pb) : 0);
  return FA_OK;
}

/* The KV-cache call's rotated copy of q (contiguous (B, N, H, D)), when
 * rotary; it lives after the lse scratch. */
static size_t qcopy_bytes(const fa_problem *pb) {
  if (!pb->kv || !pb->kv->rotary_cos) return 0;
  const fa_tensor *q = &pb->q_in;
  return align_up((size_t)(q->batch * q->seqlen * q->heads * q->headdim) * fa_dtype_size(q->dtype));
}

/* A CPU workspace allocated for one call. A big one (the forward's packed
 * K/V: 32 MiB at H=16, N=4096, D=64, f32) comes as fresh pages (glibc maps
 * 32 MiB and more anew each time), and faulting them in 4 KiB at a time
 * cost the D=64 causal f32 forward 4% on the Zen 4 host (docs/PERF.md, CPU:
 * a call's workspace). From 8 MiB on it is 2 MiB aligned and asks for
 * transparent huge pages (a 32 MiB one then takes 16 faults, not 8192); a
 * failed madvise leaves 4 KiB pages. A caller's workspace, mapped once, saves
 * the faults and the clearing of fresh pages both. */
static void *host_workspace(size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const size_t huge = (size_t)2 << 20;
  if (bytes >= 4 * huge) {
    const size_t n = (bytes + huge - 1) / huge * huge;
    void *m = aligned_alloc(huge, n);
    if (m) madvise(m, n, MADV_HUGEPAGE);
    return m;
  }
#endif
  return aligned_alloc(64, align_up(bytes));
}

/* What fa_workspace_size (fa_kvcache_workspace_size) reports for the call's
 * arguments: it does not see the outputs, and assumes them laid out so that
 * the backend needs no copy of them. */
static size_t reported_bytes(fa_pass pass, const fa_problem *pb) {
  fa_problem w = *pb;
  memset(&w.o, 0, sizeof w.o);
  memset(&w.dout, 0, sizeof w.dout);
  memset(&w.dq, 0, sizeof w.dq);
  memset(&w.dk, 0, sizeof w.dk);
  memset(&w.dv, 0, sizeof w.dv);
  return align_up(backend_workspace(pass, &w)) + (pass == FA_PASS_FORWARD ? lse_bytes(&w) : 0) +
         qcopy_bytes(&w);
}

/* Runs the backend with the caller's workspace or one allocated for the call;
 * extra: the bytes of the lse scratch (lse_extra of them) and q's rotated copy
 * after the backend's. A caller's workspace holds at least what
 * fa_workspace_size reported (the documented contract, also where these
 * outputs' layout lets the call use less) and what the call uses. */
static fa_status run_backend(fa_pass pass, const fa_params *p, fa_problem *pb, size_t lse_extra) {
  const size_t qc = qcopy_bytes(pb), extra = lse_extra + qc;
  size_t need = align_up(backend_workspace(pass, pb)) + extra;
  void *mem = NULL;
  if (p->workspace) {
    const size_t reported = reported_bytes(pass, pb), least = need > reported ? need : reported;
    if (p->workspace_bytes < least)
      return FA_INVALID(
          "params.workspace_bytes %zu is smaller than the %zu bytes needed "
          "(see fa_workspace_size)",
          p->workspace_bytes, least);
    if ((uintptr_t)p->workspace % 64) return FA_INVALID("params.workspace must be 64-byte aligned");
    pb->workspace = p->workspace;
  } else if (need > 0) {
    if (p->device == FA_DEVICE_CPU) {
      mem = host_workspace(need);
      if (!mem)
        return fa_set_error(FA_ERR_OUT_OF_MEMORY, "cannot allocate %zu bytes of workspace", need);
    } else {
#ifdef FLASHATTN_CUDA
      FA_TRY(fa_cuda_alloc(&mem, need, p->stream));
#endif
    }
    pb->workspace = mem;
  }
  pb->workspace_bytes = need;
  if (lse_extra) pb->lse = (float *)((char *)pb->workspace + (need - extra));
  if (qc) {
    const fa_tensor *q = &pb->q_in;
    pb->q = fa_tensor_bnhd((char *)pb->workspace + (need - qc), q->dtype, q->batch, q->seqlen,
                           q->heads, q->headdim);
  }

  fa_status st;
  if (p->device == FA_DEVICE_CUDA) {
#ifdef FLASHATTN_CUDA
    st = pass == FA_PASS_PROBS     ? fa_cuda_probs(pb)
         : pass == FA_PASS_FORWARD ? fa_cuda_forward(pb)
                                   : fa_cuda_backward(pb);
    if (mem) fa_cuda_free(mem, p->stream);
#else
    st = FA_ERR_INTERNAL;
#endif
    return st;
  }
  if (pb->kv && (st = fa_host_kvcache_prepare(pb)) != FA_OK) {
    free(mem);
    return st;
  }
  if (pass == FA_PASS_PROBS)
    st = fa_ref_probs(pb);
  else if (p->algorithm == FA_ALGO_STANDARD)
    st = pass == FA_PASS_FORWARD ? fa_ref_forward(pb) : fa_ref_backward(pb);
  else
    st = pass == FA_PASS_FORWARD ? fa_cpu_forward(pb) : fa_cpu_backward(pb);
  free(mem);
  return st;
}

static fa_span lse_span(const fa_problem *pb, const float *lse) {
  fa_span s = {(uintptr_t)lse,
               (uintptr_t)lse + (uintptr_t)pb->heads_q * (uintptr_t)pb->total_q * 4};
  return s;
}

fa_status fa_forward(const fa_params *params, const fa_tensor *q, const fa_tensor *k,
                     const fa_tensor *v, fa_tensor *o, float *lse) {
  fa_problem pb;
  fa_named nm[5];
  FA_TRY(make_problem(FA_PASS_FORWARD, params, q, k, v, NULL, &pb));
  FA_TRY(check_tensor(o, "o", 1, &nm[3].span));
  if (o->dtype != q->dtype) return FA_INVALID("o: dtype differs from q's");
  FA_TRY(check_same_shape(o, "o", q, "q"));
  FA_TRY(check_tensor(q, "q", 0, &nm[0].span)); /* shapes checked: now data and spans */
  FA_TRY(check_tensor(k, "k", 0, &nm[1].span));
  FA_TRY(check_tensor(v, "v", 0, &nm[2].span));
  nm[0].name = "q", nm[0].t = q, nm[0].output = 0;
  nm[1].name = "k", nm[1].t = k, nm[1].output = 0;
  nm[2].name = "v", nm[2].t = v, nm[2].output = 0;
  nm[3].name = "o", nm[3].t = o, nm[3].output = 1;
  int n = 4;
  if (lse) {
    nm[4].name = "lse", nm[4].t = NULL, nm[4].output = 1, nm[4].span = lse_span(&pb, lse);
    n = 5;
  }
  FA_TRY(check_overlaps(nm, n));
  pb.o = *o;
  pb.lse = lse;
  return run_backend(FA_PASS_FORWARD, params, &pb, lse ? 0 : lse_bytes(&pb));
}

/* Bytes of a rotary table: positions x stride, the last row rotary_dim / 2. */
static fa_span rotary_span(const fa_kvcache *kv, const void *tab, fa_dtype dt) {
  const int64_t half = kv->rotary_dim / 2, st = kv->rotary_stride ? kv->rotary_stride : half;
  fa_span s = {(uintptr_t)tab, (uintptr_t)tab + (uintptr_t)(((kv->rotary_seqlen - 1) * st + half) *
                                                            (int64_t)fa_dtype_size(dt))};
  return s;
}

fa_status fa_kvcache_workspace_size(const fa_params *params, const fa_kvcache *kv,
                                    const fa_tensor *q, const fa_tensor *k_cache,
                                    const fa_tensor *v_cache, size_t *bytes) {
  fa_problem pb;
  if (!bytes) return FA_INVALID("bytes is NULL");
  if (!kv) return FA_INVALID("kv is NULL");
  FA_TRY(make_problem(FA_PASS_FORWARD, params, q, k_cache, v_cache, kv, &pb));
  *bytes = align_up(backend_workspace(FA_PASS_FORWARD, &pb)) + lse_bytes(&pb) + qcopy_bytes(&pb);
  return FA_OK;
}

fa_status fa_forward_kvcache(const fa_params *params, const fa_kvcache *kv, const fa_tensor *q,
                             fa_tensor *k_cache, fa_tensor *v_cache, fa_tensor *o, float *lse) {
  fa_problem pb;
  fa_named nm[10];
  if (!kv) return FA_INVALID("kv is NULL");
  FA_TRY(make_problem(FA_PASS_FORWARD, params, q, k_cache, v_cache, kv, &pb));
  const int append = kv->k_new != NULL;
  FA_TRY(check_tensor(o, "o", 1, &nm[0].span));
  if (o->dtype != q->dtype) return FA_INVALID("o: dtype differs from q's");
  FA_TRY(check_same_shape(o, "o", q, "q"));
  /* the caches are outputs when the new rows are written into them */
  FA_TRY(check_tensor(q, "q", 0, &nm[1].span));
  FA_TRY(check_tensor(k_cache, "k_cache", append, &nm[2].span));
  FA_TRY(check_tensor(v_cache, "v_cache", append, &nm[3].span));
  nm[0].name = "o", nm[0].t = o, nm[0].output = 1;
  nm[1].name = "q", nm[1].t = q, nm[1].output = 0;
  nm[2].name = "k_cache", nm[2].t = k_cache, nm[2].output = append;
  nm[3].name = "v_cache", nm[3].t = v_cache, nm[3].output = append;
  int n = 4;
  if (append) {
    FA_TRY(check_tensor(kv->k_new, "kv.k_new", 0, &nm[n].span));
    nm[n].name = "kv.k_new", nm[n].t = kv->k_new, nm[n].output = 0, n++;
    FA_TRY(check_tensor(kv->v_new, "kv.v_new", 0, &nm[n].span));
    nm[n].name = "kv.v_new", nm[n].t = kv->v_new, nm[n].output = 0, n++;
  }
  if (kv->rotary_cos) {
    nm[n].name = "kv.rotary_cos", nm[n].t = NULL, nm[n].output = 0;
    nm[n++].span = rotary_span(kv, kv->rotary_cos, q->dtype);
    nm[n].name = "kv.rotary_sin", nm[n].t = NULL, nm[n].output = 0;
    nm[n++].span = rotary_span(kv, kv->rotary_sin, q->dtype);
  }
  if (lse) {
    nm[n].name = "lse", nm[n].t = NULL, nm[n].output = 1, nm[n].span = lse_span(&pb, lse);
    n++;
  }
  FA_TRY(check_overlaps(nm, n));
  pb.o = *o;
  pb.lse = lse;
  return run_backend(FA_PASS_FORWARD, params, &pb, lse ? 0 : lse_bytes(&pb));
}

fa_status fa_backward(const fa_params *params, const fa_tensor *q, const fa_tensor *k,
                      const fa_tensor *v, const fa_tensor *o, const fa_tensor *dout,
                      const float *lse, fa_tensor *dq, fa_tensor *dk, fa_tensor *dv) {
  fa_problem pb;
  fa_named nm[10];
  FA_TRY(make_problem(FA_PASS_BACKWARD, params, q, k, v, NULL, &pb));
  const fa_tensor *ins[5] = {q, k, v, o, dout};
  const char *in_names[5] = {"q", "k", "v", "o", "dout"};
  fa_tensor *outs[3] = {dq, dk, dv};
  const char *out_names[3] = {"dq", "dk", "dv"};
  for (int i = 0; i < 5; i++) {
    FA_TRY(check_tensor(ins[i], in_names[i], 0, &nm[i].span));
    nm[i].name = in_names[i], nm[i].t = ins[i], nm[i].output = 0;
  }
  for (int i = 0; i < 3; i++) {
    FA_TRY(check_tensor(outs[i], out_names[i], 1, &nm[5 + i].span));
    nm[5 + i].name = out_names[i], nm[5 + i].t = outs[i], nm[5 + i].output = 1;
  }
  for (int i = 3; i < 5; i++)
    if (ins[i]->dtype != q->dtype) return FA_INVALID("%s: dtype differs from q's", in_names[i]);
  for (int i = 0; i < 3; i++)
    if (outs[i]->dtype != q->dtype) return FA_INVALID("%s: dtype differs from q's", out_names[i]);
  FA_TRY(check_same_shape(o, "o", q, "q"));
  FA_TRY(check_same_shape(dout, "dout", q, "q"));
  FA_TRY(check_same_shape(dq, "dq", q, "q"));
  FA_TRY(check_same_shape(dk, "dk", k, "k"));
  FA_TRY(check_same_shape(dv, "dv", v, "v"));
  if (!lse) return FA_INVALID("lse is NULL: the backward pass needs the forward's lse");
  nm[8].name = "lse", nm[8].t = NULL, nm[8].output = 0, nm[8].span = lse_span(&pb, lse);
  FA_TRY(check_overlaps(nm, 9));
  pb.o = *o;
  pb.dout = *dout;
  pb.dq = *dq;
  pb.dk = *dk;
  pb.dv = *dv;
  pb.lse = (float *)lse;
  return run_backend(FA_PASS_BACKWARD, params, &pb, 0);
}

fa_status fa_attention_probs(const fa_params *params, const fa_tensor *q, const fa_tensor *k,
                             int64_t rows, int64_t cols, float *probs) {
  fa_problem pb;
  fa_named nm[3];
  FA_TRY(make_problem(FA_PASS_PROBS, params, q, k, k, NULL, &pb));
  if (params->block_table)
    return fa_set_error(FA_ERR_UNSUPPORTED,
                        "fa_attention_probs: params.block_table (a paged KV cache) is not "
                        "supported; pass the keys as one tensor");
  FA_TRY(check_tensor(q, "q", 0, &nm[0].span));
  FA_TRY(check_tensor(k, "k", 0, &nm[1].span));
  if (rows < 1 || cols < 1)
    return FA_INVALID("rows and cols must be >= 1 (got %lld, %lld)", (long long)rows,
                      (long long)cols);
  if ((double)pb.batch * (double)pb.heads_q * (double)rows * (double)cols * 4.0 >
      (double)((int64_t)1 << 62))
    return FA_INVALID("rows and cols: the probabilities address more than 2^62 bytes");
  /* every sequence's matrix fits (on CUDA, varlen offsets in device memory
   * are checked where the backend reads them) */
  if (!pb.varlen || params->device == FA_DEVICE_CPU) {
    const int64_t mq = pb.max_seqlen_q, mk = pb.max_seqlen_k;
    if (mq > rows || mk > cols)
      return FA_INVALID(
          "rows %lld and cols %lld must be at least the longest sequence's %lld query rows and "
          "%lld keys",
          (long long)rows, (long long)cols, (long long)mq, (long long)mk);
  }
  if (!probs) return FA_INVALID("probs is NULL");
  nm[0].name = "q", nm[0].t = q, nm[0].output = 0;
  nm[1].name = "k", nm[1].t = k, nm[1].output = 0;
  nm[2].name = "probs", nm[2].t = NULL, nm[2].output = 1;
  nm[2].span.lo = (uintptr_t)probs;
  nm[2].span.hi = nm[2].span.lo + (uintptr_t)(pb.batch * pb.heads_q * rows * cols) * 4;
  FA_TRY(check_overlaps(nm, 3));
  pb.probs = probs;
  pb.probs_rows = rows;
  pb.probs_cols = cols;
  return run_backend(FA_PASS_PROBS, params, &pb, 0);
}

fa_status fa_dropout_mask(const fa_params *params, int64_t heads_q, int64_t seq, int64_t head,
                          int64_t nq, int64_t nk, uint8_t *mask) {
  if (!params) return FA_INVALID("params is NULL");
  if (!(params->dropout_p >= 0 && params->dropout_p < 1))
    return FA_INVALID("params.dropout_p must be in [0, 1) (got %g)", (double)params->dropout_p);
  if (heads_q < 1) return FA_INVALID("heads_q must be >= 1 (got %lld)", (long long)heads_q);
  if (seq < 0 || head < 0 || head >= heads_q)
    return FA_INVALID("seq must be >= 0 and head in [0, heads_q) (got %lld, %lld)", (long long)seq,
                      (long long)head);
  if ((double)(seq + 1) * (double)heads_q > 4294967296.0)
    return FA_INVALID("seq * heads_q + head must be < 2^32 (the mask index)");
  if (nq < 0 || nk < 0 || nq > ((int64_t)1 << 32) || nk > ((int64_t)1 << 34))
    return FA_INVALID("nq and nk must be >= 0 and within the mask index range");
  if (!mask && nq * nk > 0) return FA_INVALID("mask is NULL");
  const fa_dropout d =
      fa_dropout_make(params->dropout_p, params->dropout_seed, params->dropout_offset);
  const uint64_t bh = (uint64_t)(seq * heads_q + head);
  for (int64_t i = 0; i < nq; i++)
    for (int64_t j = 0; j < nk; j += 4) {
      fa_u32x4 r = fa_dropout_bits(&d, bh, i, j);
      for (int64_t c = j; c < j + 4 && c < nk; c++) mask[i * nk + c] = r.v[c & 3] >= d.threshold;
    }
  return FA_OK;
}

fa_status fa_block_mask_from_indices(const int32_t *counts, const int32_t *indices, int64_t rows,
                                     int64_t max_blocks, int64_t key_blocks, uint8_t *mask) {
  if (rows < 0 || max_blocks < 0 || key_blocks < 0)
    return FA_INVALID("rows, max_blocks and key_blocks must be >= 0");
  if (rows == 0 || key_blocks == 0) return FA_OK;
  if (!counts || !mask || (!indices && max_blocks > 0))
    return FA_INVALID("counts, indices and mask must not be NULL");
  for (int64_t r = 0; r < rows; r++) {
    if (counts[r] < 0 || counts[r] > max_blocks)
      return FA_INVALID("counts[%lld] = %d is outside [0, max_blocks = %lld]", (long long)r,
                        (int)counts[r], (long long)max_blocks);
    for (int64_t t = 0; t < counts[r]; t++)
      if (indices[r * max_blocks + t] < 0 || indices[r * max_blocks + t] >= key_blocks)
        return FA_INVALID("indices[%lld] = %d is outside [0, key_blocks = %lld)",
                          (long long)(r * max_blocks + t), (int)indices[r * max_blocks + t],
                          (long long)key_blocks);
  }
  memset(mask, 0, (size_t)(rows * key_blocks)); /* only after everything was checked */
  for (int64_t r = 0; r < rows; r++)
    for (int64_t t = 0; t < counts[r]; t++) mask[r * key_blocks + indices[r * max_blocks + t]] = 1;
  return FA_OK;
}

fa_status fa_block_mask_to_indices(const uint8_t *mask, int64_t rows, int64_t key_blocks,
                                   int32_t *counts, int32_t *indices) {
  if (rows < 0 || key_blocks < 0 || key_blocks > INT32_MAX)
    return FA_INVALID("rows must be >= 0 and key_blocks in [0, 2^31)");
  if (rows == 0) return FA_OK;
  if (!mask || !counts || (!indices && key_blocks > 0))
    return FA_INVALID("mask, counts and indices must not be NULL");
  for (int64_t r = 0; r < rows; r++) {
    int32_t n = 0;
    for (int64_t c = 0; c < key_blocks; c++)
      if (mask[r * key_blocks + c]) indices[r * key_blocks + n++] = (int32_t)c;
    counts[r] = n;
  }
  return FA_OK;
}
