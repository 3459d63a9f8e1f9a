/* Test helpers: a tiny runner, random numbers, float16/bfloat16 conversion,
 * guarded and poisoned buffers, strided test tensors and error norms.
 * Tests use only the public header; nothing from src/ is included. */
#ifndef FA_TESTS_UTIL_H
#define FA_TESTS_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "flashattn.h"

/* ---- runner ------------------------------------------------------------ */

typedef void (*tr_fn)(const void *arg);

/* Registers a case; arg (argsize bytes) is copied. slow cases are skipped by --quick. */
void tr_add(const char *name, tr_fn fn, const void *arg, size_t argsize, int slow);
/* Records a failure of the running case (the first one is printed with the case). */
void tr_fail(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;
/* Context appended to the case's failure line (e.g. the seed). */
void tr_context(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;
/* Failures recorded so far in the running case; and setting that count back
 * (meta tests that expect an inner check to fail). */
int tr_failures(void);
void tr_reset_failures(int n);
/* While silent, failures are counted but not recorded (meta tests that
 * check a deliberately broken run is caught). Returns the previous value. */
int tr_silent(int on);
/* Verbose (-v): print every failure and per-case details. */
int tr_verbose(void);
const char *tr_name(void); /* the running case */
/* Multiplier applied to the softmax scale of every tested (non-oracle) run,
 * from --mutate-scale=X (1 when not given): a deliberately broken library. */
double tr_mutate_scale(void);

void register_forward_tests(void);
void register_backward_tests(void);
void register_validation_tests(void);
void register_extension_tests(void); /* dropout, block-sparse */
void register_shard_tests(void);     /* fa_params.shard_enabled */
void register_ring_tests(void);      /* fa_ring_forward, fa_ring_backward */
void register_kvcache_tests(void);   /* paged KV caches, the KV-cache call */
/* Parses the command line, runs the registered cases, prints the summary;
 * the exit status (runner.c). */
int tr_main(int argc, char **argv);

/* ---- random numbers (splitmix64) ---------------------------------------- */

typedef struct tu_rng {
  uint64_t s;
} tu_rng;

void tu_rng_seed(tu_rng *r, uint64_t seed);
uint64_t tu_rng_next(tu_rng *r);
double tu_rng_uniform(tu_rng *r);    /* [0, 1) */
double tu_rng_normal(tu_rng *r);     /* N(0, 1) */
uint64_t tu_hash_str(const char *s); /* FNV-1a: per-case seeds from names */

/* ---- float16 / bfloat16 ------------------------------------------------ */

uint16_t tu_f32_to_f16(float f); /* round to nearest even */
float tu_f16_to_f32(uint16_t h);
uint16_t tu_f32_to_bf16(float f); /* round to nearest even */
float tu_bf16_to_f32(uint16_t h);

size_t tu_esize(fa_dtype dt);
/* The value x becomes when stored in dt. */
double tu_round(double x, fa_dtype dt);
double tu_load(const void *base, fa_dtype dt, size_t idx);
void tu_store(void *base, fa_dtype dt, size_t idx, double x);
const char *tu_dtype_name(fa_dtype dt);
/* Appends printf output to buf (n bytes, *used of them taken; truncates). */
void tu_appendf(char *buf, size_t n, size_t *used, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
const char *tu_algo_name(fa_algorithm a);

/* The variant of a test case as fa_params (the rest zero): masks, softcap,
 * ALiBi slopes (or NULL), dropout with seed and offset. */
typedef struct tu_variant {
  int causal, window;
  int64_t wl, wr;
  float softcap;
  const float *slopes;
  float p;
  uint64_t seed, offset;
} tu_variant;
fa_params tu_params(const tu_variant *v);

/* ---- guarded, poisoned buffers ------------------------------------------ */

#define TU_GUARD 64 /* poison elements before and after every allocation */

typedef struct tu_buf {
  unsigned char *raw; /* guard | data | guard */
  void *data;
  size_t n, esize, bytes; /* data elements, element size, data bytes */
  size_t guard_bytes;
} tu_buf;

/* Allocates n elements (n may be 0) with guards; everything is poisoned. */
void tu_buf_alloc(tu_buf *b, size_t n, size_t esize);
void tu_buf_free(tu_buf *b);
void tu_buf_poison(tu_buf *b); /* data bytes = 0xFF (NaN for every float type) */
int tu_buf_guards_ok(const tu_buf *b);
int tu_bytes_poisoned(const void *p, size_t n);

/* ---- test tensors -------------------------------------------------------- */

typedef enum tu_layout {
  TU_BNHD = 0,   /* contiguous (batch, seqlen, heads, headdim) */
  TU_BHND = 1,   /* contiguous (batch, heads, seqlen, headdim) via fa_tensor_bhnd */
  TU_PADDED = 2, /* stride_head = D+3, stride_seq = H*(D+3)+8, stride_batch = N*ss+5 */
  TU_PACKED = 3, /* as one third of a packed QKV buffer: stride_seq = 3*H*D */
  TU_HUGE = 4,   /* BNHD with 2^20 elements of gap between batches */
  TU_MIXED = 5   /* attn tests: a different one of the above for each tensor */
} tu_layout;

const char *tu_layout_name(tu_layout l);

typedef struct tu_tensor {
  fa_tensor t; /* descriptor into buf.data */
  tu_buf buf;
  unsigned char *inside; /* per element: 1 if it belongs to the tensor; NULL: all do */
  int64_t B, N, H, D;
} tu_tensor;

/* Allocates a poisoned tensor of the layout. */
void tu_tensor_make(tu_tensor *x, fa_dtype dt, tu_layout layout, int64_t B, int64_t N, int64_t H,
                    int64_t D);
/* The same with the given element strides (any order, gaps and broadcast
 * strides of 0 allowed); elements outside the tensor stay poisoned. */
void tu_tensor_make_strided(tu_tensor *x, fa_dtype dt, int64_t B, int64_t N, int64_t H, int64_t D,
                            int64_t stride_batch, int64_t stride_seq, int64_t stride_head);
void tu_tensor_free(tu_tensor *x);
size_t tu_tensor_index(const fa_tensor *t, int64_t b, int64_t n, int64_t h, int64_t d);
double tu_tensor_get(const tu_tensor *x, int64_t b, int64_t n, int64_t h, int64_t d);
/* Stores vals (canonical BNHD order, already representable) into the tensor. */
void tu_tensor_fill(tu_tensor *x, const double *vals);
/* Reads the tensor into canonical BNHD order. */
void tu_tensor_read(const tu_tensor *x, double *vals);
/* 1 if guards and every element outside the tensor (stride gaps) are still poisoned. */
int tu_tensor_untouched_outside(const tu_tensor *x);

/* A byte snapshot of a buffer (guards included) to prove inputs are not modified. */
typedef struct tu_snap {
  unsigned char *bytes;
  size_t n;
} tu_snap;
void tu_snap_take(tu_snap *s, const tu_buf *b);
int tu_snap_same(const tu_snap *s, const tu_buf *b);
void tu_snap_free(tu_snap *s);

/* ---- error norms --------------------------------------------------------- */

typedef struct tu_err {
  double rel_fro;    /* ||x - r|| / ||r|| (absolute ||x|| when ||r|| == 0) */
  double max_abs;    /* max |x - r| */
  double ref_norm;   /* ||r|| */
  int64_t nan_count; /* NaN or inf in x where r is finite */
  int64_t first_bad; /* index of the first NaN/inf, -1 if none */
} tu_err;

tu_err tu_compare(const double *x, const double *r, size_t n);

#endif
