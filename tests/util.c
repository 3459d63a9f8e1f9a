/* Test helpers (see util.h). */
#include "util.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- random numbers ------------------------------------------------------ */

void tu_rng_seed(tu_rng *r, uint64_t seed) { r->s = seed ^ 0x9e3779b97f4a7c15ull; }

uint64_t tu_rng_next(tu_rng *r) {
  uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double tu_rng_uniform(tu_rng *r) { return (double)(tu_rng_next(r) >> 11) * 0x1.0p-53; }

double tu_rng_normal(tu_rng *r) {
  double u1 = tu_rng_uniform(r), u2 = tu_rng_uniform(r);
  if (u1 < 1e-300) u1 = 1e-300;
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

uint64_t tu_hash_str(const char *s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; s++) {
    h ^= (unsigned char)*s;
    h *= 1099511628211ull;
  }
  return h;
}

/* ---- float16 / bfloat16 ---------------------------------------------------- */

static uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static float float_of(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Written independently of src/common/convert.h, by arithmetic on doubles:
 * the value is scaled so that the f16 quantum is 1 and rounded with rint
 * (round half to even in the default rounding mode). */
uint16_t tu_f32_to_f16(float f) {
  uint16_t sign = (bits_of(f) >> 16) & 0x8000u;
  double a = fabs((double)f);
  if (isnan(f)) return (uint16_t)(sign | 0x7e00u);
  if (a >= 65520.0) return (uint16_t)(sign | 0x7c00u); /* overflow (and inf) */
  if (a < 0x1.0p-14) {                                 /* subnormal: quantum 2^-24 */
    double m = nearbyint(a * 0x1.0p24);
    return (uint16_t)(sign | (uint16_t)m); /* m == 1024 is the smallest normal: correct bits */
  }
  int e;
  (void)frexp(a, &e); /* a = f * 2^e, f in [0.5, 1) -> a in [2^(e-1), 2^e) */
  int ex = e - 1;     /* a in [2^ex, 2^(ex+1)), ex in [-14, 15] */
  double m = nearbyint(a * ldexp(1.0, 10 - ex)); /* in [1024, 2048] */
  if (m >= 2048.0) {
    m = 1024.0;
    ex++;
  }
  if (ex > 15) return (uint16_t)(sign | 0x7c00u);
  return (uint16_t)(sign | (uint16_t)((ex + 15) << 10) | (uint16_t)((int)m - 1024));
}

float tu_f16_to_f32(uint16_t h) {
  int sign = (h >> 15) & 1, ex = (h >> 10) & 0x1f, man = h & 0x3ff;
  double v;
  if (ex == 0x1f)
    v = man ? NAN : INFINITY;
  else if (ex == 0)
    v = ldexp((double)man, -24);
  else
    v = ldexp((double)(man + 1024), ex - 25);
  return (float)(sign ? -v : v);
}

uint16_t tu_f32_to_bf16(float f) {
  uint32_t x = bits_of(f);
  if (isnan(f)) return (uint16_t)((x >> 16) | 0x40u);
  uint32_t lower = x & 0xffffu, upper = x >> 16;
  if (lower > 0x8000u || (lower == 0x8000u && (upper & 1u))) upper++;
  return (uint16_t)upper;
}

float tu_bf16_to_f32(uint16_t h) { return float_of((uint32_t)h << 16); }

size_t tu_esize(fa_dtype dt) { return fa_dtype_size(dt); }

double tu_round(double x, fa_dtype dt) {
  switch (dt) {
    case FA_DTYPE_F32:
      return (double)(float)x;
    case FA_DTYPE_F16:
      return tu_f16_to_f32(tu_f32_to_f16((float)x));
    case FA_DTYPE_BF16:
      return tu_bf16_to_f32(tu_f32_to_bf16((float)x));
    case FA_DTYPE_F64:
      return x;
  }
  return x;
}

double tu_load(const void *base, fa_dtype dt, size_t idx) {
  switch (dt) {
    case FA_DTYPE_F32:
      return ((const float *)base)[idx];
    case FA_DTYPE_F16:
      return tu_f16_to_f32(((const uint16_t *)base)[idx]);
    case FA_DTYPE_BF16:
      return tu_bf16_to_f32(((const uint16_t *)base)[idx]);
    case FA_DTYPE_F64:
      return ((const double *)base)[idx];
  }
  return NAN;
}

void tu_store(void *base, fa_dtype dt, size_t idx, double x) {
  switch (dt) {
    case FA_DTYPE_F32:
      ((float *)base)[idx] = (float)x;
      break;
    case FA_DTYPE_F16:
      ((uint16_t *)base)[idx] = tu_f32_to_f16((float)x);
      break;
    case FA_DTYPE_BF16:
      ((uint16_t *)base)[idx] = tu_f32_to_bf16((float)x);
      break;
    case FA_DTYPE_F64:
      ((double *)base)[idx] = x;
      break;
  }
}

void tu_appendf(char *buf, size_t n, size_t *used, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  const int k = vsnprintf(buf + *used, *used < n ? n - *used : 0, fmt, ap);
  va_end(ap);
  if (k > 0) *used += (size_t)k;
}

const char *tu_dtype_name(fa_dtype dt) {
  switch (dt) {
    case FA_DTYPE_F32:
      return "f32";
    case FA_DTYPE_F16:
      return "f16";
    case FA_DTYPE_BF16:
      return "bf16";
    case FA_DTYPE_F64:
      return "f64";
  }
  return "?";
}

const char *tu_algo_name(fa_algorithm a) {
  switch (a) {
    case FA_ALGO_FLASH2:
      return "flash2";
    case FA_ALGO_FLASH1:
      return "flash1";
    case FA_ALGO_STANDARD:
      return "standard";
  }
  return "?";
}

fa_params tu_params(const tu_variant *v) {
  const fa_params p = {.causal = v->causal,
                       .window_enabled = v->window,
                       .window_left = v->wl,
                       .window_right = v->wr,
                       .softcap = v->softcap,
                       .alibi_slopes = v->slopes,
                       .dropout_p = v->p,
                       .dropout_seed = v->seed,
                       .dropout_offset = v->offset};
  return p;
}

/* ---- guarded buffers -------------------------------------------------------- */

void tu_buf_alloc(tu_buf *b, size_t n, size_t esize) {
  b->n = n;
  b->esize = esize;
  b->bytes = n * esize;
  b->guard_bytes = TU_GUARD * esize;
  /* 64-byte aligned data (the guards are a multiple of 64 bytes), as a caller
   * allocating a workspace or SIMD-friendly tensors would have it. */
  size_t total = (b->bytes + 2 * b->guard_bytes + 63) & ~(size_t)63;
  b->raw = (unsigned char *)aligned_alloc(64, total);
  if (!b->raw) {
    fprintf(stderr, "test: out of memory (%zu bytes)\n", b->bytes + 2 * b->guard_bytes);
    exit(2);
  }
  memset(b->raw, 0xFF, total);
  b->data = b->raw + b->guard_bytes;
}

void tu_buf_free(tu_buf *b) {
  free(b->raw);
  b->raw = NULL;
  b->data = NULL;
}

void tu_buf_poison(tu_buf *b) { memset(b->data, 0xFF, b->bytes); }

int tu_bytes_poisoned(const void *p, size_t n) {
  const unsigned char *c = (const unsigned char *)p;
  for (size_t i = 0; i < n; i++)
    if (c[i] != 0xFF) return 0;
  return 1;
}

int tu_buf_guards_ok(const tu_buf *b) {
  return tu_bytes_poisoned(b->raw, b->guard_bytes) &&
         tu_bytes_poisoned(b->raw + b->guard_bytes + b->bytes, b->guard_bytes);
}

/* ---- tensors ----------------------------------------------------------------- */

const char *tu_layout_name(tu_layout l) {
  switch (l) {
    case TU_BNHD:
      return "bnhd";
    case TU_BHND:
      return "bhnd";
    case TU_PADDED:
      return "padded";
    case TU_PACKED:
      return "packed";
    case TU_HUGE:
      return "huge";
    case TU_MIXED:
      return "mixed";
  }
  return "?";
}

size_t tu_tensor_index(const fa_tensor *t, int64_t b, int64_t n, int64_t h, int64_t d) {
  return (size_t)(b * t->stride_batch + n * t->stride_seq + h * t->stride_head + d);
}

void tu_tensor_make(tu_tensor *x, fa_dtype dt, tu_layout layout, int64_t B, int64_t N, int64_t H,
                    int64_t D) {
  fa_tensor t;
  switch (layout) {
    case TU_BHND:
      t = fa_tensor_bhnd(NULL, dt, B, N, H, D);
      break;
    case TU_PADDED:
      t = fa_tensor_bnhd(NULL, dt, B, N, H, D);
      t.stride_head = D + 3;
      t.stride_seq = H * (D + 3) + 8;
      t.stride_batch = N * t.stride_seq + 5;
      break;
    case TU_PACKED:
      t = fa_tensor_bnhd(NULL, dt, B, N, H, D);
      t.stride_seq = 3 * H * D;
      t.stride_batch = N * t.stride_seq;
      break;
    case TU_HUGE:
      t = fa_tensor_bnhd(NULL, dt, B, N, H, D);
      t.stride_batch = N * H * D + ((int64_t)1 << 20);
      break;
    case TU_BNHD:
    default:
      t = fa_tensor_bnhd(NULL, dt, B, N, H, D);
      break;
  }
  tu_tensor_make_strided(x, dt, B, N, H, D, t.stride_batch, t.stride_seq, t.stride_head);
}

void tu_tensor_make_strided(tu_tensor *x, fa_dtype dt, int64_t B, int64_t N, int64_t H, int64_t D,
                            int64_t stride_batch, int64_t stride_seq, int64_t stride_head) {
  fa_tensor t = fa_tensor_bnhd(NULL, dt, B, N, H, D);
  memset(x, 0, sizeof *x);
  x->B = B;
  x->N = N;
  x->H = H;
  x->D = D;
  t.stride_batch = stride_batch;
  t.stride_seq = stride_seq;
  t.stride_head = stride_head;
  /* Independent of the helpers' strides: the BNHD/BHND descriptors must be what
   * their names promise (checked in a validation-file case too). */
  size_t n = 0;
  if (B > 0 && N > 0 && H > 0 && D > 0) n = tu_tensor_index(&t, B - 1, N - 1, H - 1, D - 1) + 1;
  tu_buf_alloc(&x->buf, n, tu_esize(dt));
  t.data = x->buf.data;
  x->t = t;
  if (n != (size_t)(B * N * H * D)) {
    x->inside = (unsigned char *)calloc(n ? n : 1, 1);
    for (int64_t b = 0; b < B; b++)
      for (int64_t i = 0; i < N; i++)
        for (int64_t h = 0; h < H; h++)
          memset(x->inside + tu_tensor_index(&t, b, i, h, 0), 1, (size_t)D);
  }
}

void tu_tensor_free(tu_tensor *x) {
  tu_buf_free(&x->buf);
  free(x->inside);
  x->inside = NULL;
}

double tu_tensor_get(const tu_tensor *x, int64_t b, int64_t n, int64_t h, int64_t d) {
  return tu_load(x->t.data, x->t.dtype, tu_tensor_index(&x->t, b, n, h, d));
}

void tu_tensor_fill(tu_tensor *x, const double *vals) {
  size_t c = 0;
  for (int64_t b = 0; b < x->B; b++)
    for (int64_t i = 0; i < x->N; i++)
      for (int64_t h = 0; h < x->H; h++)
        for (int64_t d = 0; d < x->D; d++)
          tu_store(x->t.data, x->t.dtype, tu_tensor_index(&x->t, b, i, h, d), vals[c++]);
}

void tu_tensor_read(const tu_tensor *x, double *vals) {
  size_t c = 0;
  for (int64_t b = 0; b < x->B; b++)
    for (int64_t i = 0; i < x->N; i++)
      for (int64_t h = 0; h < x->H; h++)
        for (int64_t d = 0; d < x->D; d++) vals[c++] = tu_tensor_get(x, b, i, h, d);
}

int tu_tensor_untouched_outside(const tu_tensor *x) {
  if (!tu_buf_guards_ok(&x->buf)) return 0;
  if (!x->inside) return 1;
  const unsigned char *p = (const unsigned char *)x->buf.data;
  for (size_t e = 0; e < x->buf.n; e++)
    if (!x->inside[e] && !tu_bytes_poisoned(p + e * x->buf.esize, x->buf.esize)) return 0;
  return 1;
}

void tu_snap_take(tu_snap *s, const tu_buf *b) {
  s->n = b->bytes + 2 * b->guard_bytes;
  s->bytes = (unsigned char *)malloc(s->n ? s->n : 1);
  memcpy(s->bytes, b->raw, s->n);
}

int tu_snap_same(const tu_snap *s, const tu_buf *b) { return memcmp(s->bytes, b->raw, s->n) == 0; }

void tu_snap_free(tu_snap *s) {
  free(s->bytes);
  s->bytes = NULL;
}

/* ---- error norms ---------------------------------------------------------------- */

tu_err tu_compare(const double *x, const double *r, size_t n) {
  tu_err e;
  double num = 0, den = 0;
  e.max_abs = 0;
  e.nan_count = 0;
  e.first_bad = -1;
  for (size_t i = 0; i < n; i++) {
    if (!isfinite(x[i])) {
      if (e.first_bad < 0) e.first_bad = (int64_t)i;
      e.nan_count++;
      continue;
    }
    double d = x[i] - r[i];
    num += d * d;
    den += r[i] * r[i];
    if (fabs(d) > e.max_abs) e.max_abs = fabs(d);
  }
  e.ref_norm = sqrt(den);
  e.rel_fro = den > 0 ? sqrt(num / den) : sqrt(num);
  if (e.nan_count) e.rel_fro = INFINITY;
  return e;
}
