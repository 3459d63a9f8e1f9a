/* Bad input: every entry point returns the documented status, names the
 * offending argument in fa_last_error(), and writes nothing. Plus the small
 * API surface: version, status strings, dtype sizes, tensor helpers, devices,
 * thread-local error messages, and the valid corner cases next to the invalid
 * ones (lse NULL, window with both bounds unlimited, varlen). */
#include <ctype.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

/* ---- the setup every case starts from --------------------------------------- */

enum { VB = 2, VNQ = 6, VNK = 5, VHQ = 4, VHK = 2, VD = 8, VMAXD = 272 };

typedef struct vs {
  fa_params p;
  const fa_params *pp;
  fa_tensor q, k, v, o, oin, dout, dq, dk, dv;
  fa_tensor *pq, *pk, *pv, *po, *poin, *pdout, *pdq, *pdk, *pdv;
  float *lse;   /* forward output (poisoned) */
  float *lsein; /* backward input (from a valid forward) */
  const float *plsein;
  tu_buf bq, bk, bv, bo, boin, bdout, bdq, bdk, bdv, blse, blsein, bws;
  int32_t cu_q[4], cu_k[4];
  size_t *pbytes;
  size_t bytes;
  fa_pass pass_f, pass_b;
} vs;

/* Buffers hold the largest shape any case reshapes to, so that a library that
 * fails to reject a case still stays inside them. */
#define VCAP ((size_t)VB * 8 * VHQ * VMAXD)

static void fill_random(tu_buf *b, uint64_t seed) {
  tu_rng r;
  tu_rng_seed(&r, seed);
  float *f = (float *)b->data;
  for (size_t i = 0; i < b->n; i++) f[i] = (float)(tu_rng_normal(&r) + 0.01);
}

static void vs_init(vs *s) {
  memset(s, 0, sizeof *s);
  tu_buf *bufs[] = {&s->bq, &s->bk, &s->bv, &s->bo, &s->boin, &s->bdout, &s->bdq, &s->bdk, &s->bdv};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) tu_buf_alloc(bufs[i], VCAP, 8);
  tu_buf_alloc(&s->blse, (size_t)VB * VHQ * VMAXD, 4);
  tu_buf_alloc(&s->blsein, (size_t)VB * VHQ * VMAXD, 4);
  fill_random(&s->bq, 1);
  fill_random(&s->bk, 2);
  fill_random(&s->bv, 3);
  fill_random(&s->bdout, 4);
  s->q = fa_tensor_bnhd(s->bq.data, FA_DTYPE_F32, VB, VNQ, VHQ, VD);
  s->k = fa_tensor_bnhd(s->bk.data, FA_DTYPE_F32, VB, VNK, VHK, VD);
  s->v = fa_tensor_bnhd(s->bv.data, FA_DTYPE_F32, VB, VNK, VHK, VD);
  s->o = fa_tensor_bnhd(s->bo.data, FA_DTYPE_F32, VB, VNQ, VHQ, VD);
  s->oin = fa_tensor_bnhd(s->boin.data, FA_DTYPE_F32, VB, VNQ, VHQ, VD);
  s->dout = fa_tensor_bnhd(s->bdout.data, FA_DTYPE_F32, VB, VNQ, VHQ, VD);
  s->dq = fa_tensor_bnhd(s->bdq.data, FA_DTYPE_F32, VB, VNQ, VHQ, VD);
  s->dk = fa_tensor_bnhd(s->bdk.data, FA_DTYPE_F32, VB, VNK, VHK, VD);
  s->dv = fa_tensor_bnhd(s->bdv.data, FA_DTYPE_F32, VB, VNK, VHK, VD);
  s->lse = (float *)s->blse.data;
  s->lsein = (float *)s->blsein.data;
  s->pp = &s->p;
  s->pq = &s->q;
  s->pk = &s->k;
  s->pv = &s->v;
  s->po = &s->o;
  s->poin = &s->oin;
  s->pdout = &s->dout;
  s->pdq = &s->dq;
  s->pdk = &s->dk;
  s->pdv = &s->dv;
  s->plsein = s->lsein;
  s->pbytes = &s->bytes;
  s->pass_f = FA_PASS_FORWARD;
  s->pass_b = FA_PASS_BACKWARD;
  s->p.num_threads = 2;
  /* A valid forward gives the backward pass its O and lse. */
  fa_status st = fa_forward(&s->p, &s->q, &s->k, &s->v, &s->oin, s->lsein);
  if (st != FA_OK) tr_fail("setup: a valid fa_forward returned %d: %s", (int)st, fa_last_error());
}

static void vs_free(vs *s) {
  tu_buf *bufs[] = {&s->bq,  &s->bk,  &s->bv,  &s->bo,   &s->boin,  &s->bdout,
                    &s->bdq, &s->bdk, &s->bdv, &s->blse, &s->blsein};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) tu_buf_free(bufs[i]);
  if (s->bws.raw) tu_buf_free(&s->bws);
}

static void reshape(fa_tensor *t, int64_t b, int64_t n, int64_t h, int64_t d) {
  *t = fa_tensor_bnhd(t->data, t->dtype, b, n, h, d);
}

static void set_dtype_all(vs *s, fa_dtype dt) {
  fa_tensor *ts[] = {&s->q, &s->k, &s->v, &s->o, &s->oin, &s->dout, &s->dq, &s->dk, &s->dv};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) ts[i]->dtype = dt;
}

static void make_varlen(vs *s) {
  static const int32_t cq[3] = {0, 2, 6}, ck[3] = {0, 3, 5};
  memcpy(s->cu_q, cq, sizeof cq);
  memcpy(s->cu_k, ck, sizeof ck);
  s->p.cu_seqlens_q = s->cu_q;
  s->p.cu_seqlens_k = s->cu_k;
  s->p.num_seqs = 2;
  reshape(&s->q, 1, VNQ, VHQ, VD);
  reshape(&s->o, 1, VNQ, VHQ, VD);
  reshape(&s->oin, 1, VNQ, VHQ, VD);
  reshape(&s->dout, 1, VNQ, VHQ, VD);
  reshape(&s->dq, 1, VNQ, VHQ, VD);
  reshape(&s->k, 1, VNK, VHK, VD);
  reshape(&s->v, 1, VNK, VHK, VD);
  reshape(&s->dk, 1, VNK, VHK, VD);
  reshape(&s->dv, 1, VNK, VHK, VD);
}

/* ---- message checks ---------------------------------------------------------- */

/* Case-insensitive; a word of one or two characters must stand alone (not be
 * part of a longer identifier), so "q" matches "q is NULL" but not "seqlen". */
static int has_word(const char *msg, const char *w) {
  size_t n = strlen(msg), m = strlen(w);
  for (size_t i = 0; i + m <= n; i++) {
    size_t j = 0;
    while (j < m && tolower((unsigned char)msg[i + j]) == tolower((unsigned char)w[j])) j++;
    if (j < m) continue;
    if (m > 2) return 1;
    int before = i > 0 && (isalnum((unsigned char)msg[i - 1]) || msg[i - 1] == '_');
    int after = i + m < n && (isalnum((unsigned char)msg[i + m]) || msg[i + m] == '_');
    if (!before && !after) return 1;
  }
  return 0;
}

/* words: alternatives separated by '|'. */
static int has_any_word(const char *msg, const char *words) {
  char buf[256];
  snprintf(buf, sizeof buf, "%s", words);
  for (char *tok = strtok(buf, "|"); tok; tok = strtok(NULL, "|"))
    if (has_word(msg, tok)) return 1;
  return 0;
}

static void check_status(const char *call, fa_status st, fa_status want, fa_status want2,
                         const char *words) {
  if (st != want && st != want2) {
    const char *m = fa_last_error();
    tr_fail("%s returned %s, expected %s (message: \"%s\")", call, fa_status_string(st),
            fa_status_string(want), m ? m : "(null)");
    return;
  }
  const char *msg = fa_last_error();
  if (!msg || !msg[0]) {
    tr_fail("%s: fa_last_error() is empty after a failure", call);
    return;
  }
  if (words && !has_any_word(msg, words))
    tr_fail("%s: message \"%s\" does not name the argument (expected one of: %s)", call, msg,
            words);
}

/* ---- the invalid cases -------------------------------------------------------------- */

enum { CF = 1, CB = 2, CWF = 4, CWB = 8, CW = CWF | CWB, CFB = CF | CB, CALL = CF | CB | CW };

typedef void (*vmut)(vs *s);
typedef struct vcase {
  const char *name;
  vmut mut;
  int calls;
  fa_status want, want2; /* want2: an alternative accepted (else same as want) */
  const char *words;
} vcase;

#define MUT(id, ...) \
  static void mut_##id(vs *s) { __VA_ARGS__; }

MUT(null_params, s->pp = NULL)
MUT(null_q, s->pq = NULL)
MUT(null_k, s->pk = NULL)
MUT(null_v, s->pv = NULL)
MUT(null_o, s->po = NULL)
MUT(null_oin, s->poin = NULL)
MUT(null_dout, s->pdout = NULL)
MUT(null_dq, s->pdq = NULL)
MUT(null_dk, s->pdk = NULL)
MUT(null_dv, s->pdv = NULL)
MUT(null_lse_bwd, s->plsein = NULL)
MUT(null_bytes, s->pbytes = NULL)
MUT(q_data_null, s->q.data = NULL)
MUT(k_data_null, s->k.data = NULL)
MUT(v_data_null, s->v.data = NULL)
MUT(o_data_null, s->o.data = NULL)
MUT(dout_data_null, s->dout.data = NULL)
MUT(dq_data_null, s->dq.data = NULL)
MUT(dk_data_null, s->dk.data = NULL)
MUT(dv_data_null, s->dv.data = NULL)
MUT(batch_zero, {
  fa_tensor *ts[] = {&s->q, &s->k, &s->v, &s->o, &s->oin, &s->dout, &s->dq, &s->dk, &s->dv};
  for (size_t i = 0; i < 9; i++) ts[i]->batch = 0;
})
MUT(batch_negative, {
  s->q.batch = -1;
  s->o.batch = -1;
})
MUT(seqlen_negative, {
  s->q.seqlen = -1;
  s->o.seqlen = -1;
  s->oin.seqlen = -1;
  s->dout.seqlen = -1;
  s->dq.seqlen = -1;
})
MUT(k_seqlen_negative, {
  s->k.seqlen = -3;
  s->v.seqlen = -3;
})
MUT(seqlen_q_zero, {
  s->q.seqlen = 0;
  s->o.seqlen = 0;
  s->oin.seqlen = 0;
  s->dout.seqlen = 0;
  s->dq.seqlen = 0;
})
MUT(seqlen_k_zero, {
  s->k.seqlen = 0;
  s->v.seqlen = 0;
  s->dk.seqlen = 0;
  s->dv.seqlen = 0;
})
MUT(heads_k_zero, {
  s->k.heads = 0;
  s->v.heads = 0;
  s->dk.heads = 0;
  s->dv.heads = 0;
})
MUT(heads_zero, {
  s->q.heads = 0;
  s->o.heads = 0;
  s->oin.heads = 0;
  s->dout.heads = 0;
  s->dq.heads = 0;
})
MUT(headdim_zero, {
  fa_tensor *ts[] = {&s->q, &s->k, &s->v, &s->o, &s->oin, &s->dout, &s->dq, &s->dk, &s->dv};
  for (size_t i = 0; i < 9; i++) reshape(ts[i], ts[i]->batch, ts[i]->seqlen, ts[i]->heads, 0);
})
MUT(headdim_too_big, {
  fa_tensor *ts[] = {&s->q, &s->k, &s->v, &s->o, &s->oin, &s->dout, &s->dq, &s->dk, &s->dv};
  for (size_t i = 0; i < 9; i++)
    reshape(ts[i], ts[i]->batch, ts[i]->seqlen, ts[i]->heads, FA_MAX_HEADDIM + 8);
})
MUT(dtype_k_f16, s->k.dtype = FA_DTYPE_F16)
MUT(dtype_v_bf16, s->v.dtype = FA_DTYPE_BF16)
MUT(dtype_o_f16, s->o.dtype = FA_DTYPE_F16)
MUT(dtype_dq_f16, s->dq.dtype = FA_DTYPE_F16)
MUT(dtype_dout_bf16, s->dout.dtype = FA_DTYPE_BF16)
MUT(dtype_invalid, set_dtype_all(s, (fa_dtype)9))
/* broadcast q heads (stride 0) describing 2^50 x the rest: refused before any
 * buffer is sized (a workspace size once overflowed here) */
MUT(problem_too_large, {
  s->q.heads = s->o.heads = s->oin.heads = s->dout.heads = s->dq.heads = (int64_t)1 << 50;
  s->q.stride_head = s->oin.stride_head = s->dout.stride_head = 0;
})
MUT(heads_not_multiple, {
  reshape(&s->q, VB, VNQ, 3, VD);
  reshape(&s->o, VB, VNQ, 3, VD);
  reshape(&s->oin, VB, VNQ, 3, VD);
  reshape(&s->dout, VB, VNQ, 3, VD);
  reshape(&s->dq, VB, VNQ, 3, VD);
})
MUT(heads_k_more_than_q, {
  reshape(&s->k, VB, VNK, 8, VD);
  reshape(&s->v, VB, VNK, 8, VD);
  reshape(&s->dk, VB, VNK, 8, VD);
  reshape(&s->dv, VB, VNK, 8, VD);
})
MUT(batch_k_mismatch, {
  reshape(&s->k, 1, VNK, VHK, VD);
  reshape(&s->v, 1, VNK, VHK, VD);
  reshape(&s->dk, 1, VNK, VHK, VD);
  reshape(&s->dv, 1, VNK, VHK, VD);
})
MUT(seqlen_v_mismatch, reshape(&s->v, VB, VNK - 1, VHK, VD))
MUT(heads_v_mismatch, reshape(&s->v, VB, VNK, 1, VD))
MUT(headdim_v_mismatch, reshape(&s->v, VB, VNK, VHK, 16))
MUT(headdim_k_mismatch, {
  reshape(&s->k, VB, VNK, VHK, 16);
  reshape(&s->v, VB, VNK, VHK, 16);
  reshape(&s->dk, VB, VNK, VHK, 16);
  reshape(&s->dv, VB, VNK, VHK, 16);
})
MUT(o_seqlen_mismatch, reshape(&s->o, VB, VNQ - 1, VHQ, VD))
MUT(o_heads_mismatch, reshape(&s->o, VB, VNQ, VHQ / 2, VD))
MUT(o_batch_mismatch, reshape(&s->o, 1, VNQ, VHQ, VD))
MUT(o_headdim_mismatch, reshape(&s->o, VB, VNQ, VHQ, 16))
MUT(oin_seqlen_mismatch, reshape(&s->oin, VB, VNQ - 1, VHQ, VD))
MUT(dout_seqlen_mismatch, reshape(&s->dout, VB, VNQ + 1, VHQ, VD))
MUT(dq_seqlen_mismatch, reshape(&s->dq, VB, VNQ - 1, VHQ, VD))
MUT(dk_heads_mismatch, reshape(&s->dk, VB, VNK, VHQ, VD))
MUT(dv_seqlen_mismatch, reshape(&s->dv, VB, VNK + 1, VHK, VD))
MUT(dv_headdim_mismatch, reshape(&s->dv, VB, VNK, VHK, 16))
MUT(q_stride_negative, {
  s->q.stride_seq = -s->q.stride_seq;
  s->q.data = (float *)s->q.data + (VNQ - 1) * VHQ * VD;
})
MUT(k_stride_head_negative, s->k.stride_head = -1)
MUT(v_stride_batch_negative, s->v.stride_batch = -3)
MUT(o_stride_seq_zero, s->o.stride_seq = 0)
MUT(o_stride_head_overlap, s->o.stride_head = VD / 2)
MUT(dq_stride_seq_zero, s->dq.stride_seq = 0)
MUT(dk_stride_head_overlap, s->dk.stride_head = 1)
MUT(o_is_q, s->o.data = s->q.data)
MUT(o_overlaps_q, s->o.data = (float *)s->q.data + 8)
MUT(o_overlaps_v_end, {
  /* o's last 4 elements are v's first 4 (both inside v's allocation) */
  s->v.data = (float *)s->bv.data + 1000;
  s->o.data = (float *)s->bv.data + 1000 - (VB * VNQ * VHQ * VD - 4);
})
MUT(lse_is_q, s->lse = (float *)s->q.data)
MUT(lse_in_o, s->lse = (float *)s->o.data + 3)
MUT(dq_is_dk, { s->dk.data = s->dq.data; })
MUT(dk_overlaps_dv, s->dv.data = (float *)s->dk.data + 5)
MUT(dq_is_dout, s->dq.data = s->dout.data)
MUT(dv_is_v, s->dv.data = s->v.data)
MUT(dq_is_o, s->dq.data = s->oin.data)
MUT(dk_is_lse, s->dk.data = s->lsein)
MUT(softcap_negative, s->p.softcap = -1.0f)
MUT(sm_margin_negative, s->p.sm_margin = -1)
MUT(sm_margin_too_large, s->p.sm_margin = 1025)
MUT(softcap_nan, s->p.softcap = NAN)
MUT(softcap_inf, s->p.softcap = INFINITY)
MUT(scale_nan, s->p.softmax_scale = NAN)
MUT(scale_inf, s->p.softmax_scale = INFINITY)
MUT(scale_neg_inf, s->p.softmax_scale = -INFINITY)
MUT(dropout_negative, s->p.dropout_p = -0.5f)
MUT(dropout_nan, s->p.dropout_p = NAN)
MUT(dropout_above_one, s->p.dropout_p = 1.5f)
MUT(block_mask_size0, {
  static const uint8_t mask[64] = {1};
  s->p.block_mask = mask;
  s->p.block_size_q = 64;
  s->p.block_size_k = 0;
})
MUT(device_cuda, s->p.device = FA_DEVICE_CUDA)
MUT(device_invalid, s->p.device = (fa_device)7)
MUT(algorithm_invalid, s->p.algorithm = (fa_algorithm)9)
MUT(f64_flash2, {
  set_dtype_all(s, FA_DTYPE_F64);
  s->p.algorithm = FA_ALGO_FLASH2;
})
MUT(f64_flash1, {
  set_dtype_all(s, FA_DTYPE_F64);
  s->p.algorithm = FA_ALGO_FLASH1;
})
MUT(num_threads_negative, s->p.num_threads = -2)
MUT(alibi_stride_negative, {
  static const float slopes[2 * VHQ] = {0.5f, 0.25f, 0.125f, 0.0625f, 0.5f, 0.25f, 0.125f, 0.0625f};
  s->p.alibi_slopes = slopes + VHQ;
  s->p.alibi_stride_batch = -VHQ;
})
MUT(pass_invalid, {
  s->pass_f = (fa_pass)5;
  s->pass_b = (fa_pass)-1;
})
MUT(varlen_decreasing, {
  make_varlen(s);
  static const int32_t cq[4] = {0, 4, 2, 6};
  memcpy(s->cu_q, cq, sizeof cq);
  static const int32_t ck[4] = {0, 1, 3, 5};
  memcpy(s->cu_k, ck, sizeof ck);
  s->p.num_seqs = 3;
})
MUT(varlen_k_decreasing, {
  make_varlen(s);
  static const int32_t cq[4] = {0, 2, 4, 6};
  memcpy(s->cu_q, cq, sizeof cq);
  static const int32_t ck[4] = {0, 3, 1, 5};
  memcpy(s->cu_k, ck, sizeof ck);
  s->p.num_seqs = 3;
})
MUT(varlen_not_from_zero, {
  make_varlen(s);
  s->cu_q[0] = 1;
})
MUT(varlen_q_past_end, {
  make_varlen(s);
  s->cu_q[2] = VNQ + 1;
})
MUT(varlen_k_past_end, {
  make_varlen(s);
  s->cu_k[2] = VNK + 2;
})
MUT(varlen_k_missing, {
  make_varlen(s);
  s->p.cu_seqlens_k = NULL;
})
MUT(varlen_q_missing, {
  make_varlen(s);
  s->p.cu_seqlens_q = NULL;
})
MUT(varlen_num_seqs_zero, {
  make_varlen(s);
  s->p.num_seqs = 0;
})
MUT(varlen_num_seqs_negative, {
  make_varlen(s);
  s->p.num_seqs = -1;
})
MUT(varlen_batch_two, {
  make_varlen(s);
  reshape(&s->q, 2, 3, VHQ, VD);
  reshape(&s->o, 2, 3, VHQ, VD);
  reshape(&s->oin, 2, 3, VHQ, VD);
  reshape(&s->dout, 2, 3, VHQ, VD);
  reshape(&s->dq, 2, 3, VHQ, VD);
  s->cu_q[2] = 3;
  s->cu_q[1] = 1;
})

static const vcase k_cases[] = {
    {"null-params", mut_null_params, CALL, FA_ERR_INVALID_ARGUMENT, 0, "params"},
    {"null-q", mut_null_q, CALL, FA_ERR_INVALID_ARGUMENT, 0, "q|query"},
    {"null-k", mut_null_k, CALL, FA_ERR_INVALID_ARGUMENT, 0, "k|key"},
    {"null-v", mut_null_v, CALL, FA_ERR_INVALID_ARGUMENT, 0, "v|value"},
    {"null-o", mut_null_o, CF, FA_ERR_INVALID_ARGUMENT, 0, "o|out|output"},
    {"null-o-backward", mut_null_oin, CB, FA_ERR_INVALID_ARGUMENT, 0, "o|out|output"},
    {"null-dout", mut_null_dout, CB, FA_ERR_INVALID_ARGUMENT, 0, "dout|do|grad"},
    {"null-dq", mut_null_dq, CB, FA_ERR_INVALID_ARGUMENT, 0, "dq"},
    {"null-dk", mut_null_dk, CB, FA_ERR_INVALID_ARGUMENT, 0, "dk"},
    {"null-dv", mut_null_dv, CB, FA_ERR_INVALID_ARGUMENT, 0, "dv"},
    {"null-lse-backward", mut_null_lse_bwd, CB, FA_ERR_INVALID_ARGUMENT, 0, "lse"},
    {"null-bytes", mut_null_bytes, CW, FA_ERR_INVALID_ARGUMENT, 0, "bytes"},
    {"null-data-q", mut_q_data_null, CFB, FA_ERR_INVALID_ARGUMENT, 0, "q|query"},
    {"null-data-k", mut_k_data_null, CFB, FA_ERR_INVALID_ARGUMENT, 0, "k|key"},
    {"null-data-v", mut_v_data_null, CFB, FA_ERR_INVALID_ARGUMENT, 0, "v|value"},
    {"null-data-o", mut_o_data_null, CF, FA_ERR_INVALID_ARGUMENT, 0, "o|out|output"},
    {"null-data-dout", mut_dout_data_null, CB, FA_ERR_INVALID_ARGUMENT, 0, "dout|do"},
    {"null-data-dq", mut_dq_data_null, CB, FA_ERR_INVALID_ARGUMENT, 0, "dq"},
    {"null-data-dk", mut_dk_data_null, CB, FA_ERR_INVALID_ARGUMENT, 0, "dk"},
    {"null-data-dv", mut_dv_data_null, CB, FA_ERR_INVALID_ARGUMENT, 0, "dv"},
    {"batch-zero", mut_batch_zero, CALL, FA_ERR_INVALID_ARGUMENT, 0, "batch"},
    {"batch-negative", mut_batch_negative, CALL, FA_ERR_INVALID_ARGUMENT, 0, "batch"},
    {"seqlen-negative", mut_seqlen_negative, CALL, FA_ERR_INVALID_ARGUMENT, 0, "seqlen"},
    {"seqlen-k-negative", mut_k_seqlen_negative, CALL, FA_ERR_INVALID_ARGUMENT, 0, "seqlen"},
    {"seqlen-q-zero", mut_seqlen_q_zero, CALL, FA_ERR_INVALID_ARGUMENT, 0, "seqlen"},
    {"seqlen-k-zero", mut_seqlen_k_zero, CALL, FA_ERR_INVALID_ARGUMENT, 0, "seqlen"},
    {"heads-k-zero", mut_heads_k_zero, CALL, FA_ERR_INVALID_ARGUMENT, 0, "heads"},
    {"heads-zero", mut_heads_zero, CALL, FA_ERR_INVALID_ARGUMENT, 0, "heads"},
    {"headdim-zero", mut_headdim_zero, CALL, FA_ERR_INVALID_ARGUMENT, 0, "headdim"},
    {"headdim-too-big", mut_headdim_too_big, CALL, FA_ERR_INVALID_ARGUMENT, FA_ERR_UNSUPPORTED,
     "headdim"},
    {"dtype-k-mismatch", mut_dtype_k_f16, CALL, FA_ERR_INVALID_ARGUMENT, 0, "dtype"},
    {"dtype-v-mismatch", mut_dtype_v_bf16, CALL, FA_ERR_INVALID_ARGUMENT, 0, "dtype"},
    {"dtype-o-mismatch", mut_dtype_o_f16, CF, FA_ERR_INVALID_ARGUMENT, 0, "dtype"},
    {"dtype-dq-mismatch", mut_dtype_dq_f16, CB, FA_ERR_INVALID_ARGUMENT, 0, "dtype"},
    {"dtype-dout-mismatch", mut_dtype_dout_bf16, CB, FA_ERR_INVALID_ARGUMENT, 0, "dtype"},
    {"dtype-invalid", mut_dtype_invalid, CALL, FA_ERR_INVALID_ARGUMENT, 0, "dtype"},
    {"problem-too-large", mut_problem_too_large, CALL, FA_ERR_INVALID_ARGUMENT, 0, "too large"},
    {"heads-not-multiple", mut_heads_not_multiple, CALL, FA_ERR_INVALID_ARGUMENT, 0, "heads"},
    {"heads-k-more-than-q", mut_heads_k_more_than_q, CALL, FA_ERR_INVALID_ARGUMENT, 0, "heads"},
    {"batch-k-mismatch", mut_batch_k_mismatch, CALL, FA_ERR_INVALID_ARGUMENT, 0, "batch"},
    {"seqlen-v-mismatch", mut_seqlen_v_mismatch, CALL, FA_ERR_INVALID_ARGUMENT, 0, "v|seqlen"},
    {"heads-v-mismatch", mut_heads_v_mismatch, CALL, FA_ERR_INVALID_ARGUMENT, 0, "v|heads"},
    {"headdim-v-mismatch", mut_headdim_v_mismatch, CALL, FA_ERR_INVALID_ARGUMENT, 0, "v|headdim"},
    {"headdim-k-mismatch", mut_headdim_k_mismatch, CALL, FA_ERR_INVALID_ARGUMENT, 0, "headdim"},
    {"o-seqlen-mismatch", mut_o_seqlen_mismatch, CF, FA_ERR_INVALID_ARGUMENT, 0, "o|seqlen"},
    {"o-heads-mismatch", mut_o_heads_mismatch, CF, FA_ERR_INVALID_ARGUMENT, 0, "o|heads"},
    {"o-batch-mismatch", mut_o_batch_mismatch, CF, FA_ERR_INVALID_ARGUMENT, 0, "o|batch"},
    {"o-headdim-mismatch", mut_o_headdim_mismatch, CF, FA_ERR_INVALID_ARGUMENT, 0, "o|headdim"},
    {"o-backward-seqlen-mismatch", mut_oin_seqlen_mismatch, CB, FA_ERR_INVALID_ARGUMENT, 0,
     "o|seqlen"},
    {"dout-seqlen-mismatch", mut_dout_seqlen_mismatch, CB, FA_ERR_INVALID_ARGUMENT, 0,
     "dout|seqlen"},
    {"dq-seqlen-mismatch", mut_dq_seqlen_mismatch, CB, FA_ERR_INVALID_ARGUMENT, 0, "dq|seqlen"},
    {"dk-heads-mismatch", mut_dk_heads_mismatch, CB, FA_ERR_INVALID_ARGUMENT, 0, "dk|heads"},
    {"dv-seqlen-mismatch", mut_dv_seqlen_mismatch, CB, FA_ERR_INVALID_ARGUMENT, 0, "dv|seqlen"},
    {"dv-headdim-mismatch", mut_dv_headdim_mismatch, CB, FA_ERR_INVALID_ARGUMENT, 0, "dv|headdim"},
    {"stride-q-negative", mut_q_stride_negative, CALL, FA_ERR_INVALID_ARGUMENT, 0, "stride"},
    {"stride-k-head-negative", mut_k_stride_head_negative, CALL, FA_ERR_INVALID_ARGUMENT, 0,
     "stride"},
    {"stride-v-batch-negative", mut_v_stride_batch_negative, CALL, FA_ERR_INVALID_ARGUMENT, 0,
     "stride"},
    {"stride-o-seq-zero", mut_o_stride_seq_zero, CF, FA_ERR_INVALID_ARGUMENT, 0,
     "stride|overlap|alias"},
    {"stride-o-heads-overlap", mut_o_stride_head_overlap, CF, FA_ERR_INVALID_ARGUMENT, 0,
     "stride|overlap|alias"},
    {"stride-dq-seq-zero", mut_dq_stride_seq_zero, CB, FA_ERR_INVALID_ARGUMENT, 0,
     "stride|overlap|alias"},
    {"stride-dk-heads-overlap", mut_dk_stride_head_overlap, CB, FA_ERR_INVALID_ARGUMENT, 0,
     "stride|overlap|alias"},
    {"overlap-o-is-q", mut_o_is_q, CF, FA_ERR_INVALID_ARGUMENT, 0, "overlap|alias"},
    {"overlap-o-inside-q", mut_o_overlaps_q, CF, FA_ERR_INVALID_ARGUMENT, 0, "overlap|alias"},
    {"overlap-o-end-touches-v", mut_o_overlaps_v_end, CF, FA_ERR_INVALID_ARGUMENT, 0,
     "overlap|alias"},
    {"overlap-lse-is-q", mut_lse_is_q, CF, FA_ERR_INVALID_ARGUMENT, 0, "overlap|alias"},
    {"overlap-lse-inside-o", mut_lse_in_o, CF, FA_ERR_INVALID_ARGUMENT, 0, "overlap|alias"},
    {"overlap-dq-is-dk", mut_dq_is_dk, CB, FA_ERR_INVALID_ARGUMENT, 0, "overlap|alias"},
    {"overlap-dv-inside-dk", mut_dk_overlaps_dv, CB, FA_ERR_INVALID_ARGUMENT, 0, "overlap|alias"},
    {"overlap-dq-is-dout", mut_dq_is_dout, CB, FA_ERR_INVALID_ARGUMENT, 0, "overlap|alias"},
    {"overlap-dv-is-v", mut_dv_is_v, CB, FA_ERR_INVALID_ARGUMENT, 0, "overlap|alias"},
    {"overlap-dq-is-o", mut_dq_is_o, CB, FA_ERR_INVALID_ARGUMENT, 0, "overlap|alias"},
    {"overlap-dk-is-lse", mut_dk_is_lse, CB, FA_ERR_INVALID_ARGUMENT, 0, "overlap|alias"},
    {"softcap-negative", mut_softcap_negative, CALL, FA_ERR_INVALID_ARGUMENT, 0, "softcap"},
    {"sm-margin-negative", mut_sm_margin_negative, CALL, FA_ERR_INVALID_ARGUMENT, 0, "sm_margin"},
    {"sm-margin-too-large", mut_sm_margin_too_large, CALL, FA_ERR_INVALID_ARGUMENT, 0, "sm_margin"},
    {"softcap-nan", mut_softcap_nan, CALL, FA_ERR_INVALID_ARGUMENT, 0, "softcap"},
    {"softcap-inf", mut_softcap_inf, CALL, FA_ERR_INVALID_ARGUMENT, 0, "softcap"},
    {"scale-nan", mut_scale_nan, CALL, FA_ERR_INVALID_ARGUMENT, 0, "scale"},
    {"scale-inf", mut_scale_inf, CALL, FA_ERR_INVALID_ARGUMENT, 0, "scale"},
    {"scale-neg-inf", mut_scale_neg_inf, CALL, FA_ERR_INVALID_ARGUMENT, 0, "scale"},
    {"dropout-negative", mut_dropout_negative, CALL, FA_ERR_INVALID_ARGUMENT, 0, "dropout"},
    {"dropout-nan", mut_dropout_nan, CALL, FA_ERR_INVALID_ARGUMENT, 0, "dropout"},
    {"dropout-above-one", mut_dropout_above_one, CALL, FA_ERR_INVALID_ARGUMENT, 0, "dropout"},
    {"block-mask-size-0", mut_block_mask_size0, CALL, FA_ERR_INVALID_ARGUMENT, 0, "block_size"},
    {"device-cuda", mut_device_cuda, CALL, FA_ERR_UNSUPPORTED, 0, "cuda|device"},
    {"device-invalid", mut_device_invalid, CALL, FA_ERR_INVALID_ARGUMENT, 0, "device"},
    {"algorithm-invalid", mut_algorithm_invalid, CALL, FA_ERR_INVALID_ARGUMENT, 0, "algorithm"},
    {"f64-flash2", mut_f64_flash2, CALL, FA_ERR_UNSUPPORTED, 0, "f64|float64|double|dtype"},
    {"f64-flash1", mut_f64_flash1, CALL, FA_ERR_UNSUPPORTED, 0, "f64|float64|double|dtype"},
    {"num-threads-negative", mut_num_threads_negative, CALL, FA_ERR_INVALID_ARGUMENT, 0, "thread"},
    {"alibi-stride-negative", mut_alibi_stride_negative, CALL, FA_ERR_INVALID_ARGUMENT, 0, "alibi"},
    {"pass-invalid", mut_pass_invalid, CW, FA_ERR_INVALID_ARGUMENT, 0, "pass"},
    {"varlen-q-decreasing", mut_varlen_decreasing, CALL, FA_ERR_INVALID_ARGUMENT, 0, "cu_seqlens"},
    {"varlen-k-decreasing", mut_varlen_k_decreasing, CALL, FA_ERR_INVALID_ARGUMENT, 0,
     "cu_seqlens"},
    {"varlen-not-from-zero", mut_varlen_not_from_zero, CALL, FA_ERR_INVALID_ARGUMENT, 0,
     "cu_seqlens"},
    {"varlen-q-past-end", mut_varlen_q_past_end, CALL, FA_ERR_INVALID_ARGUMENT, 0,
     "cu_seqlens|seqlen"},
    {"varlen-k-past-end", mut_varlen_k_past_end, CALL, FA_ERR_INVALID_ARGUMENT, 0,
     "cu_seqlens|seqlen"},
    {"varlen-k-missing", mut_varlen_k_missing, CALL, FA_ERR_INVALID_ARGUMENT, 0, "cu_seqlens"},
    {"varlen-q-missing", mut_varlen_q_missing, CALL, FA_ERR_INVALID_ARGUMENT, 0, "cu_seqlens"},
    {"varlen-num-seqs-zero", mut_varlen_num_seqs_zero, CALL, FA_ERR_INVALID_ARGUMENT, 0,
     "num_seqs"},
    {"varlen-num-seqs-negative", mut_varlen_num_seqs_negative, CALL, FA_ERR_INVALID_ARGUMENT, 0,
     "num_seqs"},
    {"varlen-batch-two", mut_varlen_batch_two, CALL, FA_ERR_INVALID_ARGUMENT, 0, "batch"},
};

/* Runs the calls a case names; each must fail as expected and write nothing. */
static void invalid_fn(const void *arg) {
  const vcase *vc = *(const vcase *const *)arg;
  fa_status want2 = vc->want2 ? vc->want2 : vc->want;
  if (vc->mut == mut_device_cuda && fa_device_available(FA_DEVICE_CUDA))
    return; /* not this build */
  for (int call = CF; call <= CWB; call <<= 1) {
    if (!(vc->calls & call)) continue;
    vs s;
    vs_init(&s);
    vc->mut(&s);
    tu_snap in[6];
    const tu_buf *inb[6] = {&s.bq, &s.bk, &s.bv, &s.boin, &s.bdout, &s.blsein};
    for (int i = 0; i < 6; i++) tu_snap_take(&in[i], inb[i]);
    fa_status st;
    const char *cname;
    switch (call) {
      case CF:
        cname = "fa_forward";
        st = fa_forward(s.pp, s.pq, s.pk, s.pv, s.po, s.lse);
        break;
      case CB:
        cname = "fa_backward";
        st = fa_backward(s.pp, s.pq, s.pk, s.pv, s.poin, s.pdout, s.plsein, s.pdq, s.pdk, s.pdv);
        break;
      case CWF:
        cname = "fa_workspace_size(FORWARD)";
        st = fa_workspace_size(s.pass_f, s.pp, s.pq, s.pk, s.pv, s.pbytes);
        break;
      default:
        cname = "fa_workspace_size(BACKWARD)";
        st = fa_workspace_size(s.pass_b, s.pp, s.pq, s.pk, s.pv, s.pbytes);
        break;
    }
    check_status(cname, st, vc->want, want2, vc->words);
    /* Nothing written: outputs still poisoned (with their guards), inputs as they were. */
    const tu_buf *outb[5] = {&s.bo, &s.blse, &s.bdq, &s.bdk, &s.bdv};
    static const char *outn[5] = {"o", "lse", "dq", "dk", "dv"};
    for (int i = 0; i < 5; i++)
      if (!tu_bytes_poisoned(outb[i]->raw, outb[i]->bytes + 2 * outb[i]->guard_bytes)) {
        tr_fail("%s wrote into %s although it failed", cname, outn[i]);
        break;
      }
    static const char *inn[6] = {"q", "k", "v", "o", "dout", "lse"};
    for (int i = 0; i < 6; i++) {
      if (!tu_snap_same(&in[i], inb[i])) tr_fail("%s modified %s", cname, inn[i]);
      tu_snap_free(&in[i]);
    }
    vs_free(&s);
  }
}

/* The workspace given is one byte short of what fa_workspace_size asked for. */
static void workspace_small_fn(const void *arg) {
  const fa_algorithm algo = *(const fa_algorithm *)arg;
  for (int pass = 0; pass < 2; pass++) {
    vs s;
    vs_init(&s);
    s.p.algorithm = algo;
    size_t need = 0;
    fa_status st = fa_workspace_size((fa_pass)pass, &s.p, &s.q, &s.k, &s.v, &need);
    if (st != FA_OK) {
      tr_fail("fa_workspace_size(%d) returned %s: %s", pass, fa_status_string(st), fa_last_error());
    } else if (need == 0) {
      if (algo == FA_ALGO_STANDARD) tr_fail("standard algorithm reports a 0-byte workspace");
    } else {
      tu_buf_alloc(&s.bws, need, 1);
      s.p.workspace = s.bws.data;
      s.p.workspace_bytes = need - 1;
      /* lse NULL: the forward then needs all of the queried size (its lse scratch too) */
      if (pass == 0)
        st = fa_forward(&s.p, &s.q, &s.k, &s.v, &s.o, NULL);
      else
        st = fa_backward(&s.p, &s.q, &s.k, &s.v, &s.oin, &s.dout, s.lsein, &s.dq, &s.dk, &s.dv);
      check_status(pass ? "fa_backward" : "fa_forward", st, FA_ERR_INVALID_ARGUMENT,
                   FA_ERR_INVALID_ARGUMENT, "workspace");
      if (!tu_bytes_poisoned(s.bws.raw, s.bws.bytes + 2 * s.bws.guard_bytes))
        tr_fail("the rejected call wrote into the workspace");
      if (!tu_bytes_poisoned(s.bo.data, s.bo.bytes) || !tu_bytes_poisoned(s.bdq.data, s.bdq.bytes))
        tr_fail("the rejected call wrote its outputs");
      /* exactly the size asked for works */
      s.p.workspace_bytes = need;
      if (pass == 0)
        st = fa_forward(&s.p, &s.q, &s.k, &s.v, &s.o, s.lse);
      else
        st = fa_backward(&s.p, &s.q, &s.k, &s.v, &s.oin, &s.dout, s.lsein, &s.dq, &s.dk, &s.dv);
      if (st != FA_OK)
        tr_fail("%s with exactly the queried workspace returned %s: %s",
                pass ? "fa_backward" : "fa_forward", fa_status_string(st), fa_last_error());
      if (!tu_buf_guards_ok(&s.bws)) tr_fail("the call wrote past its workspace");
    }
    vs_free(&s);
  }
}

/* A workspace that is not 64-byte aligned: either rejected (naming the
 * workspace) or used correctly; the header does not promise which. */
static void workspace_misaligned_fn(const void *arg) {
  (void)arg;
  for (int pass = 0; pass < 2; pass++) {
    vs s;
    vs_init(&s);
    s.p.algorithm = FA_ALGO_STANDARD;
    size_t need = 0;
    fa_status st = fa_workspace_size((fa_pass)pass, &s.p, &s.q, &s.k, &s.v, &need);
    if (st != FA_OK) {
      tr_fail("fa_workspace_size returned %s: %s", fa_status_string(st), fa_last_error());
      vs_free(&s);
      continue;
    }
    tu_buf_alloc(&s.bws, need + 64, 1);
    s.p.workspace = (char *)s.bws.data + 8;
    s.p.workspace_bytes = need;
    if (pass == 0)
      st = fa_forward(&s.p, &s.q, &s.k, &s.v, &s.o, s.lse);
    else
      st = fa_backward(&s.p, &s.q, &s.k, &s.v, &s.oin, &s.dout, s.lsein, &s.dq, &s.dk, &s.dv);
    if (st == FA_OK) {
      if (!tu_buf_guards_ok(&s.bws) || !tu_bytes_poisoned((char *)s.bws.data + 8 + need, 56))
        tr_fail("misaligned workspace accepted, but the call wrote past it");
      const tu_buf *out = pass ? &s.bdq : &s.bo;
      if (tu_bytes_poisoned(out->data, 4))
        tr_fail("misaligned workspace accepted, output not written");
    } else {
      check_status(pass ? "fa_backward" : "fa_forward", st, FA_ERR_INVALID_ARGUMENT,
                   FA_ERR_INVALID_ARGUMENT, "workspace");
      if (!tu_bytes_poisoned(s.bo.data, s.bo.bytes) || !tu_bytes_poisoned(s.bdq.data, s.bdq.bytes))
        tr_fail("the rejected call wrote its outputs");
    }
    vs_free(&s);
  }
}

/* ---- valid corner cases next to the invalid ones ----------------------------------- */

static void base_valid_fn(const void *arg) {
  (void)arg;
  static const fa_algorithm algos[3] = {FA_ALGO_FLASH2, FA_ALGO_FLASH1, FA_ALGO_STANDARD};
  for (int a = 0; a < 3; a++)
    for (int varlen = 0; varlen < 2; varlen++) {
      vs s;
      vs_init(&s);
      s.p.algorithm = algos[a];
      if (varlen) make_varlen(&s);
      size_t b = 0;
      fa_status st;
      if ((st = fa_workspace_size(FA_PASS_FORWARD, &s.p, &s.q, &s.k, &s.v, &b)) != FA_OK)
        tr_fail("%s%s: fa_workspace_size(FORWARD) returned %s: %s", tu_algo_name(algos[a]),
                varlen ? " varlen" : "", fa_status_string(st), fa_last_error());
      if ((st = fa_workspace_size(FA_PASS_BACKWARD, &s.p, &s.q, &s.k, &s.v, &b)) != FA_OK)
        tr_fail("%s%s: fa_workspace_size(BACKWARD) returned %s: %s", tu_algo_name(algos[a]),
                varlen ? " varlen" : "", fa_status_string(st), fa_last_error());
      if ((st = fa_forward(&s.p, &s.q, &s.k, &s.v, &s.o, s.lse)) != FA_OK)
        tr_fail("%s%s: fa_forward returned %s: %s", tu_algo_name(algos[a]), varlen ? " varlen" : "",
                fa_status_string(st), fa_last_error());
      if ((st = fa_backward(&s.p, &s.q, &s.k, &s.v, &s.o, &s.dout, s.lse, &s.dq, &s.dk, &s.dv)) !=
          FA_OK)
        tr_fail("%s%s: fa_backward returned %s: %s", tu_algo_name(algos[a]),
                varlen ? " varlen" : "", fa_status_string(st), fa_last_error());
      vs_free(&s);
    }
}

/* lse NULL is allowed in the forward pass and changes nothing else. */
static void lse_null_fn(const void *arg) {
  (void)arg;
  static const fa_algorithm algos[3] = {FA_ALGO_FLASH2, FA_ALGO_FLASH1, FA_ALGO_STANDARD};
  for (int a = 0; a < 3; a++) {
    vs s;
    vs_init(&s);
    s.p.algorithm = algos[a];
    s.p.causal = 1;
    fa_status st = fa_forward(&s.p, &s.q, &s.k, &s.v, &s.o, NULL);
    if (st != FA_OK) {
      tr_fail("%s: fa_forward with lse NULL returned %s: %s", tu_algo_name(algos[a]),
              fa_status_string(st), fa_last_error());
    } else {
      st = fa_forward(&s.p, &s.q, &s.k, &s.v, &s.dq, s.lse); /* dq: a spare output buffer */
      if (st != FA_OK || memcmp(s.o.data, s.dq.data, (size_t)VB * VNQ * VHQ * VD * 4) != 0)
        tr_fail("%s: O with lse NULL differs from O with lse", tu_algo_name(algos[a]));
      /* lse NULL with a caller workspace of the queried size */
      size_t need = 0;
      st = fa_workspace_size(FA_PASS_FORWARD, &s.p, &s.q, &s.k, &s.v, &need);
      if (st == FA_OK) {
        tu_buf_alloc(&s.bws, need, 1);
        s.p.workspace = s.bws.data;
        s.p.workspace_bytes = need;
        tu_buf_poison(&s.bdq);
        st = fa_forward(&s.p, &s.q, &s.k, &s.v, &s.dq, NULL);
        if (st != FA_OK)
          tr_fail("%s: lse NULL with a caller workspace of %zu bytes returned %s: %s",
                  tu_algo_name(algos[a]), need, fa_status_string(st), fa_last_error());
        else if (memcmp(s.o.data, s.dq.data, (size_t)VB * VNQ * VHQ * VD * 4) != 0)
          tr_fail("%s: O with lse NULL and caller workspace differs", tu_algo_name(algos[a]));
        if (!tu_buf_guards_ok(&s.bws)) tr_fail("wrote past the caller workspace");
      }
    }
    vs_free(&s);
  }
}

/* num_threads far past the cores (INT_MAX) is valid: the same bits as 2 threads,
 * in the same time (the standard algorithm once made one work item per thread
 * asked for, empty ones included: minutes for this problem). */
static void threads_huge_fn(const void *arg) {
  (void)arg;
  static const fa_algorithm algos[3] = {FA_ALGO_FLASH2, FA_ALGO_FLASH1, FA_ALGO_STANDARD};
  const size_t n = (size_t)VB * VNQ * VHQ * VD * 4, nk = (size_t)VB * VNK * VHK * VD * 4;
  for (int a = 0; a < 3; a++) {
    vs s;
    vs_init(&s);
    s.p.algorithm = algos[a];
    s.p.causal = 1;
    unsigned char *ref = (unsigned char *)malloc(2 * n + 2 * nk);
    fa_status st = fa_forward(&s.p, &s.q, &s.k, &s.v, &s.o, s.lse);
    if (st == FA_OK)
      st = fa_backward(&s.p, &s.q, &s.k, &s.v, &s.o, &s.dout, s.lse, &s.dq, &s.dk, &s.dv);
    memcpy(ref, s.o.data, n), memcpy(ref + n, s.dq.data, n);
    memcpy(ref + 2 * n, s.dk.data, nk), memcpy(ref + 2 * n + nk, s.dv.data, nk);
    s.p.num_threads = 2147483647;
    if (st == FA_OK) st = fa_forward(&s.p, &s.q, &s.k, &s.v, &s.o, s.lse);
    if (st == FA_OK)
      st = fa_backward(&s.p, &s.q, &s.k, &s.v, &s.o, &s.dout, s.lse, &s.dq, &s.dk, &s.dv);
    if (st != FA_OK)
      tr_fail("%s: returned %s: %s", tu_algo_name(algos[a]), fa_status_string(st), fa_last_error());
    else if (memcmp(ref, s.o.data, n) || memcmp(ref + n, s.dq.data, n) ||
             memcmp(ref + 2 * n, s.dk.data, nk) || memcmp(ref + 2 * n + nk, s.dv.data, nk))
      tr_fail("%s: num_threads INT_MAX differs from 2 threads", tu_algo_name(algos[a]));
    free(ref);
    vs_free(&s);
  }
}

/* A tiny problem runs on the calling thread whatever num_threads says (on a
 * busy host each woken thread costs a scheduler time slice), and a large one
 * still spreads: the CPU workspace holds one slice per thread it uses. */
static size_t ws_bytes(fa_pass pass, int threads, int64_t H, int64_t N, int64_t D) {
  fa_params p;
  memset(&p, 0, sizeof p);
  p.causal = 1;
  p.num_threads = threads;
  const fa_tensor t = fa_tensor_bnhd(NULL, FA_DTYPE_F32, 1, N, H, D);
  size_t bytes = 0;
  if (fa_workspace_size(pass, &p, &t, &t, &t, &bytes) != FA_OK) {
    tr_fail("fa_workspace_size(H=%lld, N=%lld, D=%lld): %s", (long long)H, (long long)N,
            (long long)D, fa_last_error());
    return 0;
  }
  return bytes;
}

static void tiny_one_thread_fn(const void *arg) {
  (void)arg;
  for (int pass = 0; pass < 2; pass++) {
    const char *name = pass ? "backward" : "forward";
    const size_t one = ws_bytes((fa_pass)pass, 1, 1, 64, 256),
                 many = ws_bytes((fa_pass)pass, 8, 1, 64, 256);
    if (one != many)
      tr_fail(
          "%s, H=1 N=64 D=256: workspace %zu bytes on 8 threads, %zu on 1: more than one "
          "thread's slice for a tiny problem",
          name, many, one);
    const size_t big1 = ws_bytes((fa_pass)pass, 1, 16, 4096, 64),
                 big2 = ws_bytes((fa_pass)pass, 2, 16, 4096, 64);
    if (big2 <= big1)
      tr_fail("%s, H=16 N=4096 D=64: workspace %zu bytes on 2 threads, %zu on 1: not spread", name,
              big2, big1);
  }
}

/* A window with both bounds negative is no window at all. */
static void window_unlimited_fn(const void *arg) {
  (void)arg;
  static const fa_algorithm algos[3] = {FA_ALGO_FLASH2, FA_ALGO_FLASH1, FA_ALGO_STANDARD};
  for (int a = 0; a < 3; a++)
    for (int causal = 0; causal < 2; causal++) {
      vs s;
      vs_init(&s);
      s.p.algorithm = algos[a];
      s.p.causal = causal;
      fa_status st1 = fa_forward(&s.p, &s.q, &s.k, &s.v, &s.o, s.lse);
      s.p.window_enabled = 1;
      s.p.window_left = -1;
      s.p.window_right = -7;
      fa_status st2 = fa_forward(&s.p, &s.q, &s.k, &s.v, &s.dq, s.lsein);
      if (st1 != FA_OK || st2 != FA_OK)
        tr_fail("%s: window (-1,-7) returned %s: %s", tu_algo_name(algos[a]), fa_status_string(st2),
                fa_last_error());
      else if (memcmp(s.o.data, s.dq.data, (size_t)VB * VNQ * VHQ * VD * 4) != 0)
        tr_fail("%s causal=%d: window (-1,-7) differs from no window", tu_algo_name(algos[a]),
                causal);
      vs_free(&s);
    }
}

/* A varlen batch whose query sequences are all empty (cu_seqlens_q = {0, 0, 0})
 * is valid: every call returns FA_OK and writes no row of O, lse or dQ; the
 * keys of its sequences get dK = dV = 0 and the rows past them stay as they
 * were. (It once divided by a zero chunk size in the forward's schedule and
 * fa_workspace_size, and the standard backward passed NULL to memset.) */
static void varlen_empty_queries_fn(const void *arg) {
  (void)arg;
  static const fa_algorithm algos[3] = {FA_ALGO_FLASH2, FA_ALGO_FLASH1, FA_ALGO_STANDARD};
  static const fa_dtype dts[4] = {FA_DTYPE_F32, FA_DTYPE_F16, FA_DTYPE_BF16, FA_DTYPE_F64};
  static const int32_t cks[2][3] = {{0, 0, 0}, {0, 3, 5}};
  for (int a = 0; a < 3; a++)
    for (int t = 0; t < 4; t++)
      for (int kc = 0; kc < 2; kc++)
        for (int threads = 1; threads <= 2; threads++) {
          if (dts[t] == FA_DTYPE_F64 && algos[a] != FA_ALGO_STANDARD) continue;
          vs s;
          vs_init(&s);
          make_varlen(&s);
          memset(s.cu_q, 0, sizeof s.cu_q);
          memcpy(s.cu_k, cks[kc], sizeof cks[kc]);
          set_dtype_all(&s, dts[t]);
          s.p.algorithm = algos[a];
          s.p.num_threads = threads;
          char what[96];
          snprintf(what, sizeof what, "%s %s cu_seqlens_k {%d,%d,%d} threads %d",
                   tu_algo_name(algos[a]), tu_dtype_name(dts[t]), cks[kc][0], cks[kc][1],
                   cks[kc][2], threads);
          tu_buf_poison(&s.bdq);
          tu_buf_poison(&s.bdk);
          tu_buf_poison(&s.bdv);
          tu_buf_poison(&s.blsein);
          size_t wf = 1, wb = 1;
          fa_status st;
          if ((st = fa_workspace_size(FA_PASS_FORWARD, &s.p, &s.q, &s.k, &s.v, &wf)) != FA_OK ||
              (st = fa_workspace_size(FA_PASS_BACKWARD, &s.p, &s.q, &s.k, &s.v, &wb)) != FA_OK)
            tr_fail("%s: fa_workspace_size returned %s: %s", what, fa_status_string(st),
                    fa_last_error());
          else if ((st = fa_forward(&s.p, &s.q, &s.k, &s.v, &s.o, s.lse)) != FA_OK)
            tr_fail("%s: fa_forward returned %s: %s", what, fa_status_string(st), fa_last_error());
          else if ((st = fa_backward(&s.p, &s.q, &s.k, &s.v, &s.oin, &s.dout, s.lse, &s.dq, &s.dk,
                                     &s.dv)) != FA_OK)
            tr_fail("%s: fa_backward returned %s: %s", what, fa_status_string(st), fa_last_error());
          else {
            const tu_buf *untouched[3] = {&s.bo, &s.blse, &s.bdq};
            for (int i = 0; i < 3; i++)
              if (!tu_bytes_poisoned(untouched[i]->raw,
                                     untouched[i]->bytes + 2 * untouched[i]->guard_bytes))
                tr_fail("%s: %s written although no query row exists", what,
                        i == 0   ? "o"
                        : i == 1 ? "lse"
                                 : "dq");
            /* the sequences' keys: zero gradients; the rest: as they were */
            const size_t es = fa_dtype_size(dts[t]), row = (size_t)VHK * VD * es;
            const size_t keys = (size_t)cks[kc][2];
            for (int g = 0; g < 2; g++) {
              const tu_buf *b = g ? &s.bdv : &s.bdk;
              const unsigned char *d = (const unsigned char *)b->data;
              for (size_t e = 0; e < keys * row; e++)
                if (d[e] != 0) {
                  tr_fail("%s: %s of a key no query sees is not 0", what, g ? "dv" : "dk");
                  break;
                }
              if (!tu_bytes_poisoned(d + keys * row, (VNK - keys) * row) || !tu_buf_guards_ok(b))
                tr_fail("%s: %s written past the last sequence's keys", what, g ? "dv" : "dk");
            }
          }
          vs_free(&s);
        }
}

/* ---- the small API surface ------------------------------------------------------------ */

static void version_fn(const void *arg) {
  (void)arg;
  char want[64];
  snprintf(want, sizeof want, "%d.%d.%d", FA_VERSION_MAJOR, FA_VERSION_MINOR, FA_VERSION_PATCH);
  const char *v = fa_version();
  if (!v || strcmp(v, want) != 0)
    tr_fail("fa_version() = \"%s\", expected \"%s\"", v ? v : "(null)", want);
}

static void status_string_fn(const void *arg) {
  (void)arg;
  const char *seen[6];
  for (int i = 0; i <= FA_ERR_INTERNAL; i++) {
    const char *s = fa_status_string((fa_status)i);
    seen[i] = s;
    if (!s || !s[0]) {
      tr_fail("fa_status_string(%d) is empty", i);
      continue;
    }
    for (int j = 0; j < i; j++)
      if (seen[j] && !strcmp(seen[j], s))
        tr_fail("fa_status_string(%d) == fa_status_string(%d) = \"%s\"", i, j, s);
  }
  const char *u = fa_status_string((fa_status)42);
  if (!u || !u[0]) tr_fail("fa_status_string(42) is empty or NULL");
  u = fa_status_string((fa_status)-1);
  if (!u || !u[0]) tr_fail("fa_status_string(-1) is empty or NULL");
}

static void dtype_size_fn(const void *arg) {
  (void)arg;
  if (fa_dtype_size(FA_DTYPE_F32) != 4 || fa_dtype_size(FA_DTYPE_F16) != 2 ||
      fa_dtype_size(FA_DTYPE_BF16) != 2 || fa_dtype_size(FA_DTYPE_F64) != 8)
    tr_fail("fa_dtype_size: %zu %zu %zu %zu, expected 4 2 2 8", fa_dtype_size(FA_DTYPE_F32),
            fa_dtype_size(FA_DTYPE_F16), fa_dtype_size(FA_DTYPE_BF16), fa_dtype_size(FA_DTYPE_F64));
}

static void tensor_helpers_fn(const void *arg) {
  (void)arg;
  int x;
  fa_tensor a = fa_tensor_bnhd(&x, FA_DTYPE_BF16, 2, 3, 5, 7);
  if (a.data != &x || a.dtype != FA_DTYPE_BF16 || a.batch != 2 || a.seqlen != 3 || a.heads != 5 ||
      a.headdim != 7 || a.stride_head != 7 || a.stride_seq != 35 || a.stride_batch != 105)
    tr_fail("fa_tensor_bnhd: strides (b %lld, n %lld, h %lld)", (long long)a.stride_batch,
            (long long)a.stride_seq, (long long)a.stride_head);
  fa_tensor b = fa_tensor_bhnd(&x, FA_DTYPE_F16, 2, 3, 5, 7);
  if (b.data != &x || b.dtype != FA_DTYPE_F16 || b.batch != 2 || b.seqlen != 3 || b.heads != 5 ||
      b.headdim != 7 || b.stride_seq != 7 || b.stride_head != 21 || b.stride_batch != 105)
    tr_fail("fa_tensor_bhnd: strides (b %lld, n %lld, h %lld)", (long long)b.stride_batch,
            (long long)b.stride_seq, (long long)b.stride_head);
}

static void devices_fn(const void *arg) {
  (void)arg;
  if (fa_device_available(FA_DEVICE_CPU) != 1) tr_fail("fa_device_available(CPU) != 1");
  int c = fa_device_available(FA_DEVICE_CUDA);
  if (c != 0 && c != 1) tr_fail("fa_device_available(CUDA) = %d", c);
  if (fa_device_available((fa_device)9) != 0) tr_fail("fa_device_available(9) != 0");
}

/* The last-error message belongs to the calling thread. */
typedef struct thr_arg {
  char seen_before[256];
  char own[256];
} thr_arg;

static void *thread_body(void *p) {
  thr_arg *t = (thr_arg *)p;
  const char *m = fa_last_error();
  snprintf(t->seen_before, sizeof t->seen_before, "%s", m ? m : "(null)");
  fa_params pr;
  memset(&pr, 0, sizeof pr);
  pr.dropout_p = 1.5f; /* invalid: this thread's own message names dropout */
  float buf[16] = {0};
  fa_tensor q = fa_tensor_bnhd(buf, FA_DTYPE_F32, 1, 2, 1, 8);
  size_t bytes;
  (void)fa_workspace_size(FA_PASS_FORWARD, &pr, &q, &q, &q, &bytes);
  m = fa_last_error();
  snprintf(t->own, sizeof t->own, "%s", m ? m : "(null)");
  return NULL;
}

static void error_thread_local_fn(const void *arg) {
  (void)arg;
  fa_params pr;
  memset(&pr, 0, sizeof pr);
  pr.softcap = -3;
  float buf[16] = {0};
  fa_tensor q = fa_tensor_bnhd(buf, FA_DTYPE_F32, 1, 2, 1, 8);
  size_t bytes;
  if (fa_workspace_size(FA_PASS_FORWARD, &pr, &q, &q, &q, &bytes) != FA_ERR_INVALID_ARGUMENT)
    tr_fail("softcap -3 not rejected");
  thr_arg t;
  memset(&t, 0, sizeof t);
  pthread_t th;
  if (pthread_create(&th, NULL, thread_body, &t) != 0) {
    tr_fail("pthread_create failed");
    return;
  }
  pthread_join(th, NULL);
  if (t.seen_before[0]) tr_fail("a new thread sees another thread's error: \"%s\"", t.seen_before);
  if (!has_word(t.own, "dropout")) tr_fail("thread's own error message: \"%s\"", t.own);
  const char *m = fa_last_error();
  if (!m || !has_word(m, "softcap"))
    tr_fail("main thread's message changed by another thread: \"%s\"", m ? m : "(null)");
}

void register_validation_tests(void) {
  tr_add("api/version", version_fn, NULL, 0, 0);
  tr_add("api/status-string", status_string_fn, NULL, 0, 0);
  tr_add("api/dtype-size", dtype_size_fn, NULL, 0, 0);
  tr_add("api/tensor-helpers", tensor_helpers_fn, NULL, 0, 0);
  tr_add("api/devices", devices_fn, NULL, 0, 0);
  tr_add("api/error-thread-local", error_thread_local_fn, NULL, 0, 0);
  tr_add("valid/base", base_valid_fn, NULL, 0, 0);
  tr_add("valid/lse-null", lse_null_fn, NULL, 0, 0);
  tr_add("valid/num-threads-huge", threads_huge_fn, NULL, 0, 0);
  tr_add("valid/tiny-problem-one-thread", tiny_one_thread_fn, NULL, 0, 0);
  tr_add("valid/window-unlimited", window_unlimited_fn, NULL, 0, 0);
  tr_add("valid/varlen-all-empty-queries", varlen_empty_queries_fn, NULL, 0, 0);
  for (size_t i = 0; i < sizeof k_cases / sizeof k_cases[0]; i++) {
    char name[128];
    snprintf(name, sizeof name, "invalid/%s", k_cases[i].name);
    const vcase *p = &k_cases[i];
    tr_add(name, invalid_fn, &p, sizeof p, 0);
  }
  static const fa_algorithm algos[3] = {FA_ALGO_FLASH2, FA_ALGO_FLASH1, FA_ALGO_STANDARD};
  for (int a = 0; a < 3; a++) {
    char name[128];
    snprintf(name, sizeof name, "invalid/workspace-too-small/%s", tu_algo_name(algos[a]));
    tr_add(name, workspace_small_fn, &algos[a], sizeof algos[a], 0);
  }
  tr_add("invalid/workspace-misaligned", workspace_misaligned_fn, NULL, 0, 0);
}
