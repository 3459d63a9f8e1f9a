/* flashattn-bench: what the bench's files share. The bench uses only the
 * public header (and the CUDA runtime when built with FLASHATTN_CUDA). */
#ifndef FLASHATTN_BENCH_H
#define FLASHATTN_BENCH_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "flashattn.h"

enum { BENCH_MAX_IMPLS = 3, BENCH_MAX_PASSES = 3 };

typedef enum bench_pass { BENCH_FWD = 0, BENCH_BWD = 1, BENCH_FWDBWD = 2 } bench_pass;
typedef enum bench_layout { BENCH_BNHD = 0, BENCH_BHND = 1 } bench_layout;
/* What standard attention materialises: S and P of the whole batch in one call (the
 * papers' baseline), or of one (batch, K/V head) per call. */
typedef enum bench_standard { BENCH_STD_BATCH = 0, BENCH_STD_HEAD = 1 } bench_standard;

/* Everything the command line sets; bench_parse_args fills every field. */
typedef struct bench_opts {
  fa_device device;
  fa_algorithm impls[BENCH_MAX_IMPLS];
  int n_impls;
  bench_pass passes[BENCH_MAX_PASSES];
  int n_passes;
  int64_t batch, heads, kv_heads, seqlen, seqlen_k, headdim;
  fa_dtype dtype;
  int causal;
  int window_enabled;
  int64_t window_left, window_right; /* negative: unlimited on that side */
  float softcap;
  float dropout;        /* dropout_p (0: off) */
  int block_sparse;     /* --block-sparse given: a block mask of block_density */
  double block_density; /* block-sparse: share of visible blocks (0: all hidden) */
  int64_t block_size;   /* block-sparse: rows and keys per block */
  int64_t kv_used;      /* --kv-used: keys each sequence uses of a seqlen_k KV cache (0: all) */
  int64_t page_size;    /* --paged: K/V in pages of this many rows through a block table (0: off) */
  int append;           /* --append: the KV-cache call, Nq new rows appended to each cache */
  int rotary;           /* --rotary: and rotated (rotary_dim = D; implies append) */
  bench_layout layout;
  bench_standard standard;
  int repeat, warmup;
  double max_time; /* seconds a case may spend in runs before it stops early; 0: no limit */
  int threads;     /* resolved: >= 1 on the CPU */
  uint64_t seed;
  int json, peak, peak_only;
} bench_opts;

/* ---- options.c ----------------------------------------------------------- */

/* Returns -1 to go on, else the exit status (0 after --help/--version, 2 on a bad flag). */
int bench_parse_args(int argc, char **argv, bench_opts *o);
const char *bench_impl_name(fa_algorithm a);
const char *bench_pass_name(bench_pass p);
const char *bench_dtype_name(fa_dtype d);
const char *bench_device_name(fa_device d);
const char *bench_layout_name(bench_layout l);
const char *bench_standard_name(bench_standard s);

/* ---- device.c: memory, random inputs and timing on either device ---------- */

/* Message of the last failing device helper (CUDA runtime errors). */
const char *bench_device_error(void);
/* 1 when the device can run, else 0 with the reason in *why. */
int bench_device_ready(fa_device d, const char **why);
/* A stream for the device (NULL on the CPU); 0 on success. */
int bench_stream_create(fa_device d, void **stream);
void bench_stream_destroy(fa_device d, void *stream);
/* Bytes a case may use on the device before it is reported as OOM. */
size_t bench_memory_limit(fa_device d);
/* 64-byte aligned device memory, or NULL when it cannot be had. */
void *bench_alloc(fa_device d, size_t bytes);
/* Copies host bytes to memory from bench_alloc; 0 on success. */
int bench_copy_to_device(fa_device d, void *dst, const void *src, size_t bytes);
void bench_free(fa_device d, void *p);
/* Writes every byte, so the first timed run does not pay for page faults. */
int bench_touch(fa_device d, void *stream, void *p, size_t bytes);
/* count elements of dtype, uniform in (-1, 1) and never zero; 0 on success. */
int bench_fill_random(fa_device d, void *stream, void *p, fa_dtype dtype, size_t count,
                      uint64_t seed);

typedef struct bench_timer {
  fa_device device;
  void *stream;
  void *start, *stop; /* cudaEvent_t on CUDA */
  double t0;
} bench_timer;
int bench_timer_init(bench_timer *t, fa_device d, void *stream);
int bench_timer_start(bench_timer *t);
/* Waits for the work since start and gives its milliseconds; negative on error. */
double bench_timer_stop(bench_timer *t);
void bench_timer_destroy(bench_timer *t);
double bench_now_seconds(void);

/* ---- peak.c: the machine's measured ceilings ------------------------------- */

typedef struct bench_peak {
  int measured;
  const char *isa;   /* the FMA kernel used: "avx512f", "avx2+fma" or "generic" */
  double fma_gflops; /* float32, all threads */
  double dram_gbps;  /* read bandwidth, all threads, 1e9 bytes/s */
  size_t dram_bytes; /* size of the array read */
} bench_peak;
void bench_measure_peak(int threads, bench_peak *p);

/* ---- report.c: table, JSON lines and the comparison summary --------------- */

typedef enum bench_status { BENCH_OK, BENCH_OOM, BENCH_UNSUPPORTED, BENCH_ERROR } bench_status;

typedef struct bench_result {
  fa_algorithm impl;
  bench_pass pass;
  bench_status status;
  char message[400];
  double ms, ms_min; /* median and fastest of the timed runs */
  int runs;          /* timed runs done: --repeat, or fewer when --max-time ran out */
  double flops, gflops;
  size_t extra_bytes;
  int extra_known; /* 0 when the case stopped before the workspace query */
} bench_result;

/* FLOPs of one case as the papers count them (causal halves, windows counted exactly). */
double bench_flops(const bench_opts *o, bench_pass pass);
void bench_print_header(const bench_opts *o, const bench_peak *peak);
void bench_print_peak(const bench_opts *o, const bench_peak *peak);
void bench_print_result(const bench_opts *o, const bench_peak *peak, const bench_result *r);
void bench_print_summary(const bench_opts *o, const bench_result *rs, int n);

#endif
