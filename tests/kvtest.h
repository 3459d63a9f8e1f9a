/* KV-cache tests, on any device: paged KV caches through fa_forward, and the
 * KV-cache call fa_forward_kvcache (append, rotary, left padding, batch
 * indices) against a float64 reference written here from the header's rules.
 *
 * One configuration builds the cache (contiguous rows, or a pool of pages
 * with a random page table: pages in random order, some shared between
 * sequences, unused table entries invalid), NaN in every cache row no
 * sequence reads, and gathers each sequence's keys into contiguous tensors:
 *   oracle  FA_ALGO_STANDARD, float64, on the gathered keys and values, with
 *           q and the new keys rotated in float64;
 *   naive   FA_ALGO_STANDARD in the storage dtype on the same, q and the new
 *           keys rotated in float32 and rounded: the yardstick;
 *   impl    the call under test on the device, outputs and workspace poisoned,
 *           every device buffer between guard zones;
 * and  err(O) <= 2 err(naive O) + floor, lse likewise, rows that see no key
 * exactly O = 0 and lse = -inf, the cache afterwards bitwise what it was
 * except the appended rows, which hold the rotated, rounded new rows (to one
 * unit in the last place). */
#ifndef FA_TESTS_KVTEST_H
#define FA_TESTS_KVTEST_H

#include "util.h"

#define KV_MAX_SEQS 8

typedef enum kv_api {
  KV_FORWARD = 0, /* fa_forward over a (paged) cache: seqused_k or varlen */
  KV_CALL = 1     /* fa_forward_kvcache */
} kv_api;

typedef struct kvcfg {
  kv_api api;
  fa_dtype dt;
  fa_algorithm algo;
  int B, hq, hk, d;
  int nq;     /* query rows per batch entry (varlen: lq) */
  int page;   /* rows per page; 0: a contiguous cache */
  int cap;    /* rows of one sequence's cache (paged: a multiple of page) */
  int varlen; /* KV_FORWARD: cu_seqlens, query rows lq[s], keys used[s] */
  int lq[KV_MAX_SEQS];
  int used[KV_MAX_SEQS]; /* KV_FORWARD: keys of sequence s; KV_CALL: cache_seqlens */
  int seqused;           /* KV_FORWARD, fixed length: pass used[] as seqused_k (else cap keys) */
  int nnew;              /* KV_CALL: rows appended (0: none) */
  int leftpad, lp[KV_MAX_SEQS];           /* KV_CALL: cache_leftpad */
  int bidx, bi[KV_MAX_SEQS], cache_batch; /* KV_CALL: cache_batch_idx into cache_batch rows */
  int rotary, interleaved;                /* rotary_dim (0: none), GPT-J pairs */
  int causal, window, wl, wr;
  float softcap;
  int alibi;
  int num_splits;
  int share;    /* paged: sequence s > 0 shares its first pages with sequence 0 */
  int bhnd;     /* cache (and pool) in (batch, heads, rows, D) layout */
  int pad;      /* elements of gap after each cache head row */
  int threads;  /* CPU threads (0: all) */
  int ws;       /* pass a caller workspace of the queried size */
  int sabotage; /* meta: the library gets a table with sequence 0's last two pages swapped */
  uint64_t seed;
  const struct kvdev *dev; /* where kv_register's case runs the call under test */
} kvcfg;

/* Device memory for the run under test. */
typedef struct kvdev kvdev;
struct kvdev {
  fa_device device;
  void *stream;
  void *(*alloc)(size_t bytes);
  void (*upload)(void *dst, const void *src, size_t bytes);
  void (*download)(void *dst, const void *src, size_t bytes);
  void (*release)(void *p);
  void (*sync)(void *stream);
  double floor_f16, floor_bf16, floor_f32; /* err(O) floors */
  double lse_floor;                        /* |lse - ref| / max(1, |ref|) floor */
};

/* The host "device" of the CPU backend. */
extern const kvdev kv_host;

kvcfg kvcfg_default(void);
void kvcfg_name(const kvcfg *c, const char *group, char *buf, size_t n);
/* Runs one configuration on dev, recording failures with tr_fail. */
void kv_check(const kvcfg *c, const kvdev *dev);
/* Registers the case (seeded from its name) on c.dev; with c.sabotage, a
 * meta case that passes when kv_check catches the broken table. */
void kv_register(const char *group, kvcfg c, int slow);
/* A configuration drawn from r for dev: either API, every feature in a valid
 * combination (dtypes and algorithms the device takes). */
kvcfg kv_draw(tu_rng *r, const kvdev *dev);
/* Registers n drawn configurations on dev, each drawn from its name
 * "kv/drawn/i/..." (the same n cases on every run); those past the first
 * quick are slow (skipped by --quick, as the sanitizer runs are). */
void kv_register_drawn(int n, int quick, const kvdev *dev);
/* The batch: n sequences, query rows lq[s] (varlen; NULL: keep) and keys
 * (or cache lengths) used[s]. */
void kv_seqs(kvcfg *c, int n, const int *lq, const int *used);

#endif
