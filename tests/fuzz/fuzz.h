/* Randomized differential testing of the public API.
 *
 * A case is drawn from one 64-bit seed (fz_draw) and is everything a call
 * takes: dtype, algorithm, shapes, variable-length sequences (empty ones and
 * padded buffers too), seqused_k, masks, softcap, ALiBi, dropout, block
 * masks, one strided layout per tensor, paged K/V (the tested run's: a
 * shuffled pool of pages and its block table), workspace, lse = NULL, threads. The
 * valid check (fz_check_valid) runs it three times, as tests/attn.c does:
 *   oracle  FA_ALGO_STANDARD in float64 on the CPU
 *   naive   FA_ALGO_STANDARD in the storage dtype on the CPU (the yardstick)
 *   tested  the drawn algorithm, layouts and options, on the CPU or a device
 * and requires err(tested) <= 2 err(naive) + attn_floor() for O, dQ, dK, dV
 * plus attn.c's lse rule, exact zeros (and -inf) where the masks hide
 * everything, and nothing written outside the outputs' elements. The invalid
 * check (fz_check_invalid) breaks one argument of a valid case and requires a
 * refusal with a message that writes nothing.
 *
 * Adding an argument (e.g. paged KV's block table) is one more draw in
 * fz_draw, its arrays in fz_data, and fz_key_row mapping a sequence's key to
 * its K/V tensor row. */
#ifndef FA_TESTS_FUZZ_H
#define FA_TESTS_FUZZ_H

#include <stddef.h>
#include <stdint.h>

#include "../attn.h"

#define FZ_MAX_SEQS 6

/* The eight tensors of a forward and backward call. */
enum { FZ_Q, FZ_K, FZ_V, FZ_O, FZ_DO, FZ_DQ, FZ_DK, FZ_DV, FZ_NT };

/* A strided layout: the (batch, seq, head) dimensions from outermost to
 * innermost, with extra elements after each level (gap[0] after each head
 * row of D elements, gap[1] after the innermost dimension's run, gap[2]
 * after the middle one's). bcast: stride 0 along batch (inputs only). */
typedef struct fz_layout {
  int8_t order[3]; /* 0 batch, 1 seq, 2 head */
  int64_t gap[3];
  int bcast;
} fz_layout;

/* Element strides {batch, seq, head} of a layout for a (B, N, H, D) tensor. */
void fz_layout_strides(const fz_layout *l, int64_t B, int64_t N, int64_t H, int64_t D,
                       int64_t st[3]);

typedef struct fz_case {
  uint64_t seed;
  int cuda; /* drawn for the CUDA backend (its dtypes, algorithms, alignment) */
  fa_algorithm algo;
  fa_dtype dtype;
  int64_t B, HQ, HK, D, NQ, NK; /* tensor shapes (varlen: B = 1, N = rows incl. padding) */
  int varlen, nseq;             /* nseq: batch entries or varlen sequences */
  int32_t cu_q[FZ_MAX_SEQS + 1], cu_k[FZ_MAX_SEQS + 1];
  int used; /* seqused_k given */
  int32_t seqused[FZ_MAX_SEQS];
  int causal, window;
  int64_t wl, wr;
  float softcap, scale;
  int alibi; /* slopes given, alibi_stride between sequences */
  int64_t alibi_stride;
  float dropout;
  uint64_t dseed, doff;
  int block; /* block mask given */
  int64_t bq, bk, bsb, bsh, bsr;
  int bdens; /* percent of visible blocks */
  fz_layout lay[FZ_NT];
  int workspace; /* 0: library-allocated, 1: exactly the queried size, 2: more */
  int lse_null;  /* the forward is called with lse = NULL (then again with lse) */
  int backward;
  int threads, deterministic;
  double qk_std;
  int sm_margin; /* CUDA: SMs the persistent kernels leave free */
  int page;      /* the tested run reads K/V from a paged cache of these rows a page (0: not) */
} fz_case;

/* Draws the case of a seed; cuda: within what the CUDA backend supports. */
void fz_draw(fz_case *c, uint64_t seed, int cuda);
/* One line describing the case. */
void fz_describe(const fz_case *c, char *buf, size_t n);

/* ---- failure reports (one per case, so host threads can check at once) ---- */

typedef struct fz_ctx {
  int failures;
  char first[1024];
  int verbose;
} fz_ctx;

void fz_fail(fz_ctx *x, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* ---- where the tested call runs ------------------------------------------- */

/* Memory of the tested run: host memory for the CPU backend; for a device,
 * every buffer (with its guards) is mirrored there before the call and copied
 * back after it, so the same checks apply. */
typedef struct fz_dev {
  fa_device device;
  void *stream;
  void *(*alloc)(size_t bytes);
  void (*release)(void *p);
  void (*upload)(void *dst, const void *src, size_t bytes);
  void (*download)(void *dst, const void *src, size_t bytes);
  void (*sync)(void *stream);
  size_t (*mem_available)(void); /* bytes a large problem may take (0: unknown) */
  /* a stream of the calling host thread's own (NULL: share stream) */
  void *(*thread_stream)(void);
} fz_dev;

extern const fz_dev fz_cpu, fz_cpu_mirrored;

/* ---- the checks ------------------------------------------------------------ */

typedef struct fz_stats {
  double worst_ratio; /* err / tol, the largest over the case's tensors */
  int unsupported;    /* the device refused a case its documented limits exclude */
  int naive_over_cap; /* the yardstick's error was over its sanity cap (check.c) */
} fz_stats;

/* Valid case: oracle, yardstick and tested run as described at the top.
 * bitwise_threads: also run the tested algorithm with another thread count
 * and the other workspace mode and require the same bits. */
void fz_check_valid(const fz_case *c, const fz_dev *dev, int bitwise_threads, fz_ctx *x,
                    fz_stats *st);

/* Invalid case: a valid case with mutation m (fz_num_mutations()) applied, or
 * the next one that applies to the case; returns the one applied. */
int fz_num_mutations(void);
const char *fz_mutation_name(int m);
int fz_check_invalid(const fz_case *c, int m, const fz_dev *dev, fz_ctx *x);

/* Deterministic backward: two runs of the tested backward (deterministic = 1)
 * give the same bits (a device's; the CPU's always). */
void fz_check_repeat(const fz_case *c, const fz_dev *dev, fz_ctx *x);

/* A problem with more than 2^31 elements in one tensor (K/V, then Q/O),
 * checked against a float64 reference on the rows it samples; skipped where
 * the memory is short. Returns the number of failures. */
int fz_big(const fz_dev *dev, int verbose);

/* splitmix64 of (a, b): the seed of case b of a run seeded a. */
uint64_t fz_mix(uint64_t a, uint64_t b);

#endif
