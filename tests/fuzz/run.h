/* One call's memory for the fuzz checks: the inputs of a case (fz_data) and
 * the buffers, descriptors and params of one run (fz_run), host or device. */
#ifndef FA_TESTS_FUZZ_RUN_H
#define FA_TESTS_FUZZ_RUN_H

#include "fuzz.h"

/* The case's inputs: canonical (b, n, h, d) arrays, exactly representable in
 * the dtype, NaN in the rows the library must never read (past a varlen
 * batch's last sequence, past a sequence's seqused_k); the params' arrays. */
typedef struct fz_data {
  double *q, *k, *v, *dout;
  size_t nq_el, nk_el, lse_n;
  float *slopes;
  size_t nslopes;
  uint8_t *bmask;
  size_t nbmask;
  int64_t bsr; /* the block mask's row stride as the library resolves it */
  /* a paged case: K and V as pools of npages pages (canonical (page, row, h, d), NaN in
   * the rows no sequence owns) and the block table, max_pages entries a sequence (-1
   * past the pages a sequence uses) */
  double *kpool, *vpool;
  int32_t *table;
  int64_t npages, max_pages;
} fz_data;

void fz_data_make(fz_data *d, const fz_case *c);
void fz_data_free(fz_data *d);

/* A sequence: rows [q0, q0+nq) of batch entry qb; its nk used keys start at
 * row k0 of batch entry kb (cap: its key rows in the tensors). */
typedef struct fz_seq {
  int64_t qb, q0, nq, kb, k0, nk, cap;
} fz_seq;
fz_seq fz_seq_of(const fz_case *c, int64_t s);
/* Tensor (batch, row) of key j of sequence s: where a paged KV cache would
 * look its page up. */
void fz_key_row(const fz_case *c, int64_t s, int64_t j, int64_t *b, int64_t *n);
/* Whether query row i of sequence s, query head h sees key j (the header's
 * masks written out again, block mask included). */
int fz_visible(const fz_case *c, const fz_data *d, int64_t s, int64_t h, int64_t i, int64_t j);
size_t fz_lse_index(const fz_case *c, int64_t s, int64_t h, int64_t i);

/* How a run calls the library. */
typedef struct fz_opt {
  fa_algorithm algo;
  fa_dtype dtype;
  int strided; /* the case's layouts (else contiguous (B, N, H, D)) */
  int threads, workspace, lse_null, backward, deterministic;
  int paged; /* K/V through the case's paged cache */
  const fz_dev *dev;
  const char *label;
  /* the backward's O (canonical order), in place of the forward's own: given
   * the oracle's, every backward sees the same rounding of O, whose effect on
   * Di = rowsum(dO o O) would otherwise dominate small, peaked problems */
  const double *o_in;
} fz_opt;

/* The options of the case's tested run, and of the oracle (float64) and
 * yardstick (storage dtype) runs. */
fz_opt fz_opt_tested(const fz_case *c, const fz_dev *dev);
fz_opt fz_opt_reference(const fz_case *c, fa_dtype dt);

typedef struct fz_run {
  const fz_case *c;
  const fz_data *d;
  fz_opt o;
  tu_tensor t[FZ_NT];
  int have[FZ_NT];
  tu_buf lse, ws[2]; /* workspaces of the forward and the backward */
  tu_snap snap[FZ_NT + 1];
  /* device mirrors of the buffers (the host ones on the CPU), raw (guards included) */
  unsigned char *mt[FZ_NT], *mlse, *mws[2];
  fa_tensor desc[FZ_NT]; /* data: in the mirrors */
  fa_params p;
  void *arrays[6]; /* cu_q, cu_k, seqused, block mask, slopes, block table on the device */
  fa_status st_wsf, st_wsb, st_fwd, st_bwd;
  int fwd_ok, bwd_ok;
  double *vals[FZ_NT];  /* outputs read back, canonical order (O: the forward's) */
  unsigned char *o_fwd; /* O's buffer as the forward left it, guards included */
} fz_run;

/* Allocates and fills everything the run needs (both passes' tensors when
 * o.backward), poisons the outputs and mirrors it all to the device. */
void fz_run_setup(fz_run *r, const fz_case *c, const fz_data *d, const fz_opt *o);
/* The calls: workspace sizes, forward (twice when lse_null), backward; then
 * reads back and checks guards, stride gaps and inputs. */
void fz_run_exec(fz_run *r, fz_ctx *x);
void fz_run_free(fz_run *r);
/* Copies the device mirrors back to the host buffers. */
void fz_run_download(fz_run *r);

#endif
