/* The invalid-case check: a valid case with one argument broken. Every call
 * the broken argument reaches must return a non-OK status, leave a message
 * in fa_last_error() (set by this call: a different one is left there
 * before), write none of its outputs (each still poisoned, guards included)
 * and leave its inputs as they were. */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "run.h"

enum { CF = 1, CB = 2, CWF = 4, CWB = 8, CW = CWF | CWB, CFB = CF | CB, CALL = CF | CB | CW };

/* Everything a mutation may change, the calls' arguments. */
typedef struct fz_call {
  const fz_case *c;
  fz_run *r;
  tu_rng *rng;
  int host_arrays;  /* the params' arrays are in host memory: their contents may be broken */
  int device_build; /* a CUDA device is present (params.device = CUDA is valid there) */
  fa_params p;
  const fa_params *pp;
  fa_tensor t[FZ_NT];
  const fa_tensor *pt[FZ_NT];
  float *lse_out;
  const float *lse_in;
  fa_pass pass_f, pass_b;
  size_t bytes, *pbytes;
  size_t need[2]; /* the valid call's workspace sizes */
  void *extra;    /* memory a mutation allocated (freed after the calls) */
} fz_call;

static int64_t rint_(tu_rng *r, int64_t lo, int64_t hi) {
  return lo + (int64_t)(tu_rng_next(r) % (uint64_t)(hi - lo + 1));
}

/* A tensor of the forward (q k v o) or backward (all eight) call, and the
 * calls it takes part in. */
static int pick_tensor(fz_call *k, int with_workspace, int *calls) {
  int t = (int)rint_(k->rng, 0, FZ_NT - 1);
  switch (t) {
    case FZ_Q:
    case FZ_K:
    case FZ_V:
      *calls = with_workspace ? CALL : CFB;
      break;
    case FZ_O:
      *calls = CFB;
      break;
    default:
      *calls = CB;
  }
  return t;
}

/* Past 2^62: no tensor of 2-byte elements (or larger) that large is addressable.
 * (A large stride the library can address, 2^48 say, is valid: only the caller
 * knows whether the memory is there.) */
static int64_t huge(tu_rng *r) { return ((int64_t)1 << 62) + rint_(r, 0, ((int64_t)1 << 62) - 1); }

/* Each returns the calls it breaks (0: does not apply to this case). */
typedef int (*fz_mut)(fz_call *k);

static int m_params_null(fz_call *k) {
  k->pp = NULL;
  return CALL;
}
static int m_tensor_null(fz_call *k) {
  int calls, t = pick_tensor(k, 1, &calls);
  k->pt[t] = NULL;
  return calls;
}
static int m_data_null(fz_call *k) {
  int calls, t = pick_tensor(k, 0, &calls);
  k->t[t].data = NULL;
  return calls;
}
static int m_dim_nonpositive(fz_call *k) {
  int calls, t = pick_tensor(k, 1, &calls);
  const int64_t v = rint_(k->rng, 0, 1) ? 0 : -rint_(k->rng, 1, 1 << 20);
  switch (rint_(k->rng, 0, 3)) {
    case 0:
      k->t[t].batch = v;
      break;
    case 1:
      k->t[t].seqlen = v;
      break;
    case 2:
      k->t[t].heads = v;
      break;
    default:
      k->t[t].headdim = v;
  }
  return calls;
}
static int m_headdim_too_big(fz_call *k) {
  const int64_t d = rint_(k->rng, 0, 1) ? FA_MAX_HEADDIM + rint_(k->rng, 1, 8) : huge(k->rng);
  for (int t = 0; t < FZ_NT; t++) k->t[t].headdim = d;
  return CALL;
}
static int m_stride_negative(fz_call *k) {
  int calls, t = pick_tensor(k, 1, &calls);
  int64_t *s[3] = {&k->t[t].stride_batch, &k->t[t].stride_seq, &k->t[t].stride_head};
  *s[rint_(k->rng, 0, 2)] = -rint_(k->rng, 1, 1000);
  return calls;
}
static int m_huge(fz_call *k) {
  int calls, t = pick_tensor(k, 1, &calls);
  fa_tensor *x = &k->t[t];
  int64_t *f[6] = {&x->batch,        &x->seqlen,     &x->heads,
                   &x->stride_batch, &x->stride_seq, &x->stride_head};
  int a = (int)rint_(k->rng, 0, 5);
  *f[a] = huge(k->rng);
  if (a >= 3) {
    /* a stride only counts where its dimension has more than one element */
    int64_t *n[3] = {&x->batch, &x->seqlen, &x->heads};
    if (*n[a - 3] < 2) *n[a - 3] = 2;
  }
  return calls;
}
static int m_shape_mismatch(fz_call *k) {
  /* one tensor's dimension off by one against the tensors it must match */
  static const int ts[7] = {FZ_K, FZ_V, FZ_O, FZ_DO, FZ_DQ, FZ_DK, FZ_DV};
  const int t = ts[rint_(k->rng, 0, 6)];
  fa_tensor *x = &k->t[t];
  int64_t *f[4] = {&x->batch, &x->seqlen, &x->heads, &x->headdim};
  int a = (int)rint_(k->rng, 0, 3);
  if (t == FZ_K && a == 2) a = 1; /* k's heads alone may still divide q's */
  if (t == FZ_K && a == 0 && k->c->varlen) a = 1;
  *f[a] += *f[a] > 1 && rint_(k->rng, 0, 1) ? -1 : 1;
  if (a == 3 && *f[a] > FA_MAX_HEADDIM) *f[a] -= 2;
  return t == FZ_K || t == FZ_V ? CALL : t == FZ_O ? CFB : CB;
}
static int m_heads_not_multiple(fz_call *k) {
  const int64_t hq = k->c->HQ;
  if (k->c->HK > 1 && (hq + 1) % k->c->HK) {
    const int ts[4] = {FZ_Q, FZ_O, FZ_DO, FZ_DQ};
    for (int i = 0; i < 4; i++) k->t[ts[i]].heads = hq + 1;
  } else {
    const int ts[4] = {FZ_K, FZ_V, FZ_DK, FZ_DV};
    for (int i = 0; i < 4; i++) k->t[ts[i]].heads = hq + 1;
  }
  return CALL;
}
static int m_dtype(fz_call *k) {
  int calls, t = pick_tensor(k, 1, &calls);
  if (t == FZ_Q) calls = CALL;
  if (rint_(k->rng, 0, 2) == 0) {
    static const int bad[5] = {-1, 4, 5, 17, 1000};
    k->t[t].dtype = (fa_dtype)bad[rint_(k->rng, 0, 4)];
  } else {
    k->t[t].dtype = (fa_dtype)((k->t[t].dtype + rint_(k->rng, 1, 3)) % 4);
  }
  return calls;
}
static int m_f64_flash(fz_call *k) {
  for (int t = 0; t < FZ_NT; t++) k->t[t].dtype = FA_DTYPE_F64;
  if (k->p.algorithm == FA_ALGO_STANDARD)
    k->p.algorithm = rint_(k->rng, 0, 1) ? FA_ALGO_FLASH1 : FA_ALGO_FLASH2;
  return CALL;
}
static int m_output_overlaps_itself(fz_call *k) {
  static const int ts[4] = {FZ_O, FZ_DQ, FZ_DK, FZ_DV};
  const int t = ts[rint_(k->rng, 0, 3)];
  fa_tensor *x = &k->t[t];
  int64_t *n[3] = {&x->batch, &x->seqlen, &x->heads};
  int64_t *s[3] = {&x->stride_batch, &x->stride_seq, &x->stride_head};
  int a = (int)rint_(k->rng, 0, 2);
  for (int i = 0; i < 3 && *n[a] < 2; i++) a = (a + 1) % 3;
  if (*n[a] < 2) return 0;
  *s[a] = rint_(k->rng, 0, 1) ? 0 : rint_(k->rng, 0, x->headdim - 1);
  return t == FZ_O ? CF : CB;
}
static int m_output_aliases(fz_call *k) {
  switch (rint_(k->rng, 0, 3)) {
    case 0: /* o on an input */
      k->t[FZ_O].data = k->t[rint_(k->rng, FZ_Q, FZ_V)].data;
      return CF;
    case 1: /* lse inside an input or o */
      k->lse_out = (float *)k->t[rint_(k->rng, FZ_Q, FZ_O)].data;
      return CF;
    case 2: { /* a gradient on an input or another gradient */
      const int t = (int)rint_(k->rng, FZ_DQ, FZ_DV);
      int u = (int)rint_(k->rng, FZ_Q, FZ_DV);
      if (u == t) u = FZ_Q;
      k->t[t].data = k->t[u].data;
      return CB;
    }
    default: /* a gradient over the lse the backward reads */
      k->t[rint_(k->rng, FZ_DQ, FZ_DV)].data = (void *)k->lse_in;
      return CB;
  }
}
static int m_varlen(fz_call *k) {
  const fz_case *c = k->c;
  if (!c->varlen) {
    /* offsets on a fixed-length batch: only one array, or batch > 1 */
    static int32_t zeros[2] = {0, 0};
    if (c->B > 1 && rint_(k->rng, 0, 1)) {
      k->p.cu_seqlens_q = k->p.cu_seqlens_k = zeros;
      k->p.num_seqs = 1;
    } else if (rint_(k->rng, 0, 1)) {
      k->p.cu_seqlens_q = zeros;
    } else {
      k->p.cu_seqlens_k = zeros;
    }
    return CALL;
  }
  const int which = (int)rint_(k->rng, 0, 5);
  if (which == 0) {
    k->p.num_seqs = rint_(k->rng, 0, 1) ? 0 : -rint_(k->rng, 1, 100);
    return CALL;
  }
  if (which == 1) {
    if (rint_(k->rng, 0, 1))
      k->p.cu_seqlens_q = NULL;
    else
      k->p.cu_seqlens_k = NULL;
    return CALL;
  }
  if (which == 2) {
    for (int t = 0; t < FZ_NT; t++) k->t[t].batch = 2;
    return CALL;
  }
  if (!k->host_arrays) return 0; /* device-resident offsets are not read on the host */
  int32_t *cu = (int32_t *)(rint_(k->rng, 0, 1) ? k->r->arrays[0] : k->r->arrays[1]);
  const int64_t total = cu == k->r->arrays[0] ? c->NQ : c->NK;
  if (which == 3) {
    cu[0] = (int32_t)rint_(k->rng, 1, 5) * (rint_(k->rng, 0, 1) ? 1 : -1);
  } else if (which == 4) {
    cu[c->nseq] = (int32_t)(total + rint_(k->rng, 1, 1000));
  } else {
    /* one offset below its predecessor */
    const int s = (int)rint_(k->rng, 1, c->nseq);
    cu[s] = cu[s - 1] - (int32_t)rint_(k->rng, 1, 3);
  }
  return CALL;
}
static int m_seqused(fz_call *k) {
  if (!k->host_arrays) return 0;
  const fz_case *c = k->c;
  int32_t *u = (int32_t *)k->r->arrays[2];
  if (!u) {
    u = (int32_t *)malloc((size_t)c->nseq * sizeof(int32_t));
    k->extra = u;
    for (int s = 0; s < c->nseq; s++) u[s] = 0;
    k->p.seqused_k = u;
  }
  const int s = (int)rint_(k->rng, 0, c->nseq - 1);
  const fz_seq q = fz_seq_of(c, s);
  u[s] = rint_(k->rng, 0, 1) ? (int32_t)-rint_(k->rng, 1, 100)
                             : (int32_t)(q.cap + rint_(k->rng, 1, 100));
  return CALL;
}
static int m_block_mask(fz_call *k) {
  static const uint8_t one[1] = {1};
  if (!k->p.block_mask) {
    k->p.block_mask = one;
    k->p.block_size_q = k->p.block_size_k = 1;
    k->p.block_mask_stride_batch = k->p.block_mask_stride_head = k->p.block_mask_stride_row = 0;
  }
  switch (rint_(k->rng, 0, 2)) {
    case 0:
      if (rint_(k->rng, 0, 1))
        k->p.block_size_q = -rint_(k->rng, 0, 5);
      else
        k->p.block_size_k = -rint_(k->rng, 0, 5);
      break;
    case 1: {
      int64_t *s[3] = {&k->p.block_mask_stride_batch, &k->p.block_mask_stride_head,
                       &k->p.block_mask_stride_row};
      *s[rint_(k->rng, 0, 2)] = -rint_(k->rng, 1, 100);
      break;
    }
    default: {
      /* a row stride shorter than a row of key blocks */
      const int64_t nbk = (k->c->NK + k->p.block_size_k - 1) / k->p.block_size_k;
      if (nbk < 2) return 0;
      k->p.block_mask_stride_row = rint_(k->rng, 1, nbk - 1);
    }
  }
  return CALL;
}
static int m_dropout(fz_call *k) {
  const float bad[6] = {-0.5f, -1e-7f, 1.0f, 1.5f, NAN, INFINITY};
  const int which = (int)rint_(k->rng, 0, 6);
  if (which < 6) {
    k->p.dropout_p = bad[which];
    return CALL;
  }
  /* sequences x heads past the mask index's 2^32 */
  if (k->c->varlen) return 0;
  for (int t = 0; t < FZ_NT; t++) k->t[t].batch = 65536;
  const int q_side[4] = {FZ_Q, FZ_O, FZ_DO, FZ_DQ}, k_side[4] = {FZ_K, FZ_V, FZ_DK, FZ_DV};
  for (int i = 0; i < 4; i++) k->t[q_side[i]].heads = 65536, k->t[k_side[i]].heads = 1;
  k->p.dropout_p = 0.25f;
  k->p.seqused_k = NULL;
  k->p.alibi_slopes = NULL;
  k->p.block_mask = NULL;
  return CALL;
}
static int m_float_params(fz_call *k) {
  const float bad[3] = {NAN, INFINITY, -INFINITY};
  if (rint_(k->rng, 0, 1))
    k->p.softmax_scale = bad[rint_(k->rng, 0, 2)];
  else
    k->p.softcap =
        rint_(k->rng, 0, 2) ? bad[rint_(k->rng, 0, 1)] : -(float)rint_(k->rng, 1, 100) / 10.0f;
  return CALL;
}
static int m_enums(fz_call *k) {
  static const int bad[4] = {-1, 3, 7, 1000}, bad_device[4] = {-1, 2, 7, 1000};
  static const int bad_margin[4] = {-1, 1025, INT_MIN, INT_MAX};
  switch (rint_(k->rng, 0, 4)) {
    case 0:
      k->p.algorithm = (fa_algorithm)bad[rint_(k->rng, 0, 3)];
      return CALL;
    case 1:
      k->p.device = (fa_device)bad_device[rint_(k->rng, 0, 3)];
      return CALL;
    case 2:
      k->p.num_threads = -(int)rint_(k->rng, 1, 64);
      return CALL;
    case 3:
      k->p.sm_margin = bad_margin[rint_(k->rng, 0, 3)];
      return CALL;
    default:
      if (k->device_build) return 0; /* host pointers on a CUDA device would be the caller's bug */
      k->p.device = FA_DEVICE_CUDA;  /* a build without the CUDA backend: unsupported */
      return CALL;
  }
}
static int m_alibi_stride(fz_call *k) {
  static const float slopes[1] = {0.5f};
  if (!k->p.alibi_slopes) k->p.alibi_slopes = slopes;
  k->p.alibi_stride_batch = -rint_(k->rng, 1, 64);
  return CALL;
}
static int m_workspace(fz_call *k) {
  static _Alignas(64) unsigned char dummy[64];
  if (rint_(k->rng, 0, 1)) {
    k->p.workspace = dummy;
    k->p.workspace_bytes = 0;
    return CALL;
  }
  /* smaller than asked for (the forward with lse = NULL asks for its lse scratch too) */
  const int bwd = (int)rint_(k->rng, 0, 1);
  const size_t need = k->need[bwd];
  if (need == 0) return 0;
  k->p.workspace = dummy;
  k->p.workspace_bytes = need - 1 - (size_t)rint_(k->rng, 0, (int64_t)(need - 1));
  if (!bwd) k->lse_out = NULL;
  return bwd ? CB : CF;
}
static int m_null_args(fz_call *k) {
  switch (rint_(k->rng, 0, 2)) {
    case 0:
      k->lse_in = NULL;
      return CB;
    case 1:
      k->pbytes = NULL;
      return CW;
    default:
      /* past the last pass (FA_PASS_PROBS), or negative */
      k->pass_f = (fa_pass)(rint_(k->rng, 0, 1) ? -1 : FA_PASS_PROBS + 1 + rint_(k->rng, 0, 100));
      k->pass_b = k->pass_f;
      return CW;
  }
}
static int m_batch_mismatch(fz_call *k) {
  if (k->c->varlen) return 0;
  const int ts[4] = {FZ_K, FZ_V, FZ_DK, FZ_DV};
  for (int i = 0; i < 4; i++) k->t[ts[i]].batch = k->c->B + 1;
  return CALL;
}

static const struct {
  const char *name;
  fz_mut fn;
} k_muts[] = {
    {"params-null", m_params_null},
    {"tensor-null", m_tensor_null},
    {"data-null", m_data_null},
    {"dim-nonpositive", m_dim_nonpositive},
    {"headdim-too-big", m_headdim_too_big},
    {"stride-negative", m_stride_negative},
    {"huge-size-or-stride", m_huge},
    {"shape-mismatch", m_shape_mismatch},
    {"heads-not-multiple", m_heads_not_multiple},
    {"dtype", m_dtype},
    {"f64-flash", m_f64_flash},
    {"output-overlaps-itself", m_output_overlaps_itself},
    {"output-aliases", m_output_aliases},
    {"varlen", m_varlen},
    {"seqused-k", m_seqused},
    {"block-mask", m_block_mask},
    {"dropout", m_dropout},
    {"scale-softcap", m_float_params},
    {"enums", m_enums},
    {"alibi-stride", m_alibi_stride},
    {"workspace", m_workspace},
    {"null-args", m_null_args},
    {"batch-mismatch", m_batch_mismatch},
};
#define NMUTS (int)(sizeof k_muts / sizeof k_muts[0])

int fz_num_mutations(void) { return NMUTS; }
const char *fz_mutation_name(int m) { return k_muts[m % NMUTS].name; }

static size_t raw_bytes(const tu_buf *b) { return b->bytes + 2 * b->guard_bytes; }

int fz_check_invalid(const fz_case *c0, int m, const fz_dev *dev, fz_ctx *x) {
  fz_case c = *c0;
  c.backward = 1; /* every tensor exists */
  /* the CUDA backend has no backward for the standard algorithm: the broken
   * arguments go to flash2's instead */
  if (dev->device == FA_DEVICE_CUDA && c.algo == FA_ALGO_STANDARD) c.algo = FA_ALGO_FLASH2;
  c.page = 0; /* the backward takes no paged cache: the broken arguments go to a plain one */
  fz_data d;
  fz_data_make(&d, &c);
  fz_run r;
  fz_opt o = fz_opt_tested(&c, dev);
  o.workspace = 0;
  o.label = "invalid";
  fz_run_setup(&r, &c, &d, &o);
  tu_rng rng;
  tu_rng_seed(&rng, c.seed ^ 0x3c6ef372fe94f82bull);

  fz_call k;
  memset(&k, 0, sizeof k);
  k.c = &c;
  k.r = &r;
  k.rng = &rng;
  k.host_arrays = dev->device == FA_DEVICE_CPU;
  k.device_build = fa_device_available(FA_DEVICE_CUDA);
  k.p = r.p;
  k.pp = &k.p;
  for (int t = 0; t < FZ_NT; t++) {
    k.t[t] = r.desc[t];
    k.pt[t] = &k.t[t];
  }
  k.lse_out = (float *)(r.mlse + r.lse.guard_bytes);
  k.lse_in = k.lse_out;
  k.pass_f = FA_PASS_FORWARD;
  k.pass_b = FA_PASS_BACKWARD;
  k.pbytes = &k.bytes;
  /* the valid call's workspace sizes (the forward's with lse = NULL as well) */
  if (fa_workspace_size(FA_PASS_FORWARD, &k.p, &k.t[FZ_Q], &k.t[FZ_K], &k.t[FZ_V], &k.need[0]) !=
          FA_OK ||
      fa_workspace_size(FA_PASS_BACKWARD, &k.p, &k.t[FZ_Q], &k.t[FZ_K], &k.t[FZ_V], &k.need[1]) !=
          FA_OK)
    fz_fail(x, "the valid case before the mutation was refused: %s", fa_last_error());

  /* the first mutation from m on that applies to this case */
  int calls = 0, mi = m % NMUTS;
  for (int tries = 0; tries < NMUTS && !calls; tries++, mi = (mi + 1) % NMUTS) {
    fz_call save = k;
    calls = k_muts[mi].fn(&k);
    if (!calls) k = save;
  }
  mi = (mi + NMUTS - 1) % NMUTS;
  const char *name = k_muts[mi].name;
  if (x->verbose) { /* before the calls: a crash shows which */
    printf("  mutation: %s\n", name);
    fflush(stdout);
  }

  for (int call = CF; call <= CWB && !x->failures; call <<= 1) {
    if (!(calls & call)) continue;
    /* a message of another call first: this call must replace it */
    const char *sentinel = "pass: unknown pass 777";
    size_t dummy;
    (void)fa_workspace_size((fa_pass)777, &k.p, &k.t[FZ_Q], &k.t[FZ_K], &k.t[FZ_V], &dummy);
    if (strcmp(fa_last_error(), sentinel) != 0)
      fz_fail(x, "fa_workspace_size with pass 777 left \"%s\", not \"%s\"", fa_last_error(),
              sentinel);
    fa_status st;
    const char *cname;
    switch (call) {
      case CF:
        cname = "fa_forward";
        st = fa_forward(k.pp, k.pt[FZ_Q], k.pt[FZ_K], k.pt[FZ_V], (fa_tensor *)k.pt[FZ_O],
                        k.lse_out);
        break;
      case CB:
        cname = "fa_backward";
        st = fa_backward(k.pp, k.pt[FZ_Q], k.pt[FZ_K], k.pt[FZ_V], k.pt[FZ_O], k.pt[FZ_DO],
                         k.lse_in, (fa_tensor *)k.pt[FZ_DQ], (fa_tensor *)k.pt[FZ_DK],
                         (fa_tensor *)k.pt[FZ_DV]);
        break;
      case CWF:
        cname = "fa_workspace_size(FORWARD)";
        st = fa_workspace_size(k.pass_f, k.pp, k.pt[FZ_Q], k.pt[FZ_K], k.pt[FZ_V], k.pbytes);
        break;
      default:
        cname = "fa_workspace_size(BACKWARD)";
        st = fa_workspace_size(k.pass_b, k.pp, k.pt[FZ_Q], k.pt[FZ_K], k.pt[FZ_V], k.pbytes);
    }
    const char *msg = fa_last_error();
    if (st == FA_OK)
      fz_fail(x, "%s: %s accepted the broken argument", name, cname);
    else if (!msg || !msg[0])
      fz_fail(x, "%s: %s returned %s with an empty fa_last_error()", name, cname,
              fa_status_string(st));
    else if (!strcmp(msg, sentinel))
      fz_fail(x, "%s: %s returned %s but left another call's message", name, cname,
              fa_status_string(st));
    fz_run_download(&r);
    for (int t = 0; t < FZ_NT; t++) {
      const tu_buf *b = &r.t[t].buf;
      if (t >= FZ_O && t != FZ_DO) {
        if (!tu_bytes_poisoned(b->raw, raw_bytes(b)))
          fz_fail(x, "%s: the refused %s wrote into %s", name, cname,
                  t == FZ_O    ? "o"
                  : t == FZ_DQ ? "dq"
                  : t == FZ_DK ? "dk"
                               : "dv");
      } else if (!tu_snap_same(&r.snap[t], b)) {
        fz_fail(x, "%s: the refused %s modified an input", name, cname);
      }
    }
    if (!tu_bytes_poisoned(r.lse.raw, raw_bytes(&r.lse)))
      fz_fail(x, "%s: the refused %s wrote into lse", name, cname);
    if (x->failures) {
      const size_t u = strlen(x->first);
      snprintf(x->first + u, sizeof x->first - u, " (message: \"%s\")", msg ? msg : "(null)");
    }
  }
  free(k.extra);
  fz_run_free(&r);
  fz_data_free(&d);
  return mi;
}
