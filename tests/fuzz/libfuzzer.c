/* libFuzzer target over the API's arguments: the input's first 4 bytes draw a
 * valid case (fz_draw), the rest is a list of edits, each setting one field
 * of a tensor descriptor or of fa_params (sizes, strides, dtypes, data
 * pointers NULL or aliased, enums, floats, varlen offsets, seqused_k, block
 * mask, dropout, workspace, lse NULL, pass) to a small, a power-of-two or a
 * raw 64-bit value. Every buffer is allocated at exactly the size its
 * descriptor spans (AddressSanitizer sees any access past it); descriptors
 * too large to back with memory, or problems too large to compute, are given
 * to fa_workspace_size only. Every call must return FA_OK or a status with a
 * message, and a refused call must leave its outputs as they were.
 *
 *   clang -fsanitize=fuzzer,address,undefined ... (tools/test.sh builds it)
 *   build-fuzz/fa_libfuzzer -max_total_time=60 corpus/ */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"

typedef struct reader {
  const uint8_t *p;
  size_t n;
} reader;

static uint8_t rd_u8(reader *r) {
  if (!r->n) return 0;
  r->n--;
  return *r->p++;
}
static uint64_t rd_u64(reader *r) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v = v << 8 | rd_u8(r);
  return v;
}
static uint32_t rd_u32(reader *r) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v = v << 8 | rd_u8(r);
  return v;
}
/* small (-128..127), a power of two plus or minus a little, or anything */
static int64_t rd_val(reader *r) {
  const uint8_t mode = rd_u8(r);
  if (mode < 128) return (int8_t)rd_u8(r);
  if (mode < 224) return (int64_t)((uint64_t)1 << (rd_u8(r) % 63)) + (int8_t)rd_u8(r);
  return (int64_t)rd_u64(r);
}

#define CAP_BYTES ((int64_t)16 << 20) /* largest buffer backed with memory */
#define CAP_WORK ((double)(1 << 22))  /* largest problem computed */
#define CAP_UNITS ((double)(1 << 12)) /* most (sequence, head) pairs computed */
#define MAX_SEQS 64

typedef struct fuzz_args {
  fa_tensor t[FZ_NT];
  int alias[FZ_NT]; /* -1: own memory; else the tensor whose memory it uses */
  int null_data[FZ_NT], null_desc[FZ_NT];
  fa_params p;
  int null_params, lse_null, lse_in_null, bytes_null;
  int pass_f, pass_b;
  int varlen, used, block, alibi;
  int64_t num_seqs;
  int32_t cu_q[MAX_SEQS + 1], cu_k[MAX_SEQS + 1], seqused[MAX_SEQS];
  int64_t nslopes;
  int ws_mode; /* 0: none, 1: the queried size, 2: ws_bytes */
  int64_t ws_bytes;
} fuzz_args;

static void from_case(fuzz_args *a, const fz_case *c) {
  memset(a, 0, sizeof *a);
  for (int t = 0; t < FZ_NT; t++) {
    const int kside = t == FZ_K || t == FZ_V || t == FZ_DK || t == FZ_DV;
    int64_t st[3];
    const int64_t N = kside ? c->NK : c->NQ, H = kside ? c->HK : c->HQ;
    fz_layout_strides(&c->lay[t], c->B, N, H, c->D, st);
    a->t[t] = fa_tensor_bnhd(NULL, c->dtype, c->B, N, H, c->D);
    a->t[t].stride_batch = st[0], a->t[t].stride_seq = st[1], a->t[t].stride_head = st[2];
    a->alias[t] = -1;
  }
  fa_params *p = &a->p;
  p->algorithm = c->algo;
  p->softmax_scale = c->scale;
  p->causal = c->causal;
  p->window_enabled = c->window;
  p->window_left = c->wl, p->window_right = c->wr;
  p->softcap = c->softcap;
  p->num_threads = 1;
  a->varlen = c->varlen;
  a->num_seqs = c->nseq;
  memcpy(a->cu_q, c->cu_q, sizeof c->cu_q);
  memcpy(a->cu_k, c->cu_k, sizeof c->cu_k);
  a->used = c->used;
  memcpy(a->seqused, c->seqused, sizeof c->seqused);
  a->alibi = c->alibi;
  p->alibi_stride_batch = c->alibi_stride;
  p->dropout_p = c->dropout, p->dropout_seed = c->dseed, p->dropout_offset = c->doff;
  a->block = c->block;
  p->block_size_q = c->bq, p->block_size_k = c->bk;
  p->block_mask_stride_batch = c->bsb, p->block_mask_stride_head = c->bsh;
  p->block_mask_stride_row = c->bsr;
  a->ws_mode = c->workspace ? 1 : 0;
  a->lse_null = c->lse_null;
  a->pass_f = FA_PASS_FORWARD, a->pass_b = FA_PASS_BACKWARD;
}

static float as_float(int64_t v, reader *r) {
  switch (rd_u8(r) % 4) {
    case 0:
      return (float)v / 16.0f;
    case 1: {
      uint32_t u = (uint32_t)v;
      float f;
      memcpy(&f, &u, 4);
      return f;
    }
    case 2:
      return rd_u8(r) % 2 ? NAN : (v < 0 ? -INFINITY : INFINITY);
    default:
      return (float)v;
  }
}

static void edit(fuzz_args *a, reader *r) {
  const int field = rd_u8(r) % 49;
  const int64_t v = rd_val(r);
  if (field < 16) { /* a tensor's size or stride */
    fa_tensor *t = &a->t[rd_u8(r) % FZ_NT];
    int64_t *f[7] = {&t->batch,        &t->seqlen,     &t->heads,      &t->headdim,
                     &t->stride_batch, &t->stride_seq, &t->stride_head};
    *f[field % 7] = v;
    return;
  }
  const int t = rd_u8(r) % FZ_NT;
  fa_params *p = &a->p;
  switch (field) {
    case 16:
      a->t[t].dtype = (fa_dtype)(v % 2 ? v : v % 4);
      break;
    case 17:
      for (int u = 0; u < FZ_NT; u++) a->t[u].dtype = (fa_dtype)(v & 3);
      break;
    case 18:
      a->null_data[t] = 1;
      break;
    case 19:
      a->null_desc[t] = 1;
      break;
    case 20:
      a->alias[t] = (int)((uint64_t)v % FZ_NT) == t ? -1 : (int)((uint64_t)v % FZ_NT);
      break;
    case 21:
      a->null_params = 1;
      break;
    case 22:
      p->device = (fa_device)(v == 1 ? 0 : v);
      break;
    case 23:
      p->algorithm = (fa_algorithm)v;
      break;
    case 24:
      p->softmax_scale = as_float(v, r);
      break;
    case 25:
      p->causal = (int)v;
      break;
    case 26:
      p->window_enabled = 1, p->window_left = v;
      break;
    case 27:
      p->window_enabled = 1, p->window_right = v;
      break;
    case 28:
      p->softcap = as_float(v, r);
      break;
    case 29:
      a->alibi = !a->alibi;
      p->alibi_stride_batch = v;
      break;
    case 30:
      a->varlen = !a->varlen;
      break;
    case 31:
      a->num_seqs = v;
      break;
    case 32:
      a->cu_q[(uint64_t)rd_u8(r) % (MAX_SEQS + 1)] = (int32_t)v;
      break;
    case 33:
      a->cu_k[(uint64_t)rd_u8(r) % (MAX_SEQS + 1)] = (int32_t)v;
      break;
    case 34:
      a->used = 1;
      a->seqused[(uint64_t)rd_u8(r) % MAX_SEQS] = (int32_t)v;
      break;
    case 35:
      p->dropout_p = as_float(v, r);
      break;
    case 36:
      a->block = 1;
      p->block_size_q = v;
      break;
    case 37:
      a->block = 1;
      p->block_size_k = v;
      break;
    case 38:
      a->block = 1;
      p->block_mask_stride_batch = v;
      break;
    case 39:
      a->block = 1;
      p->block_mask_stride_head = v;
      break;
    case 40:
      a->block = 1;
      p->block_mask_stride_row = v;
      break;
    case 41:
      p->num_threads = v < 0 ? -1 : v > 2 ? 2 : (int)v; /* never many threads per input */
      break;
    case 42:
      a->ws_mode = 2, a->ws_bytes = v;
      break;
    case 43:
      a->lse_null = !a->lse_null;
      break;
    case 44:
      a->lse_in_null = 1;
      break;
    case 45:
      a->bytes_null = 1;
      break;
    case 46:
      a->pass_f = (int)v, a->pass_b = (int)(v >> 8);
      break;
    case 47:
      p->sm_margin = (int)v;
      break;
    default:
      p->deterministic = (int)v;
  }
}

/* Elements a descriptor spans (0: not a valid descriptor: the library must refuse it). */
static int64_t span_of(const fa_tensor *t) {
  if (fa_dtype_size(t->dtype) == 0 || t->batch < 1 || t->seqlen < 1 || t->heads < 1 ||
      t->headdim < 1 || t->headdim > FA_MAX_HEADDIM || t->stride_batch < 0 || t->stride_seq < 0 ||
      t->stride_head < 0)
    return 0;
  int64_t a, b, c, s;
  if (__builtin_mul_overflow(t->batch - 1, t->stride_batch, &a) ||
      __builtin_mul_overflow(t->seqlen - 1, t->stride_seq, &b) ||
      __builtin_mul_overflow(t->heads - 1, t->stride_head, &c) ||
      __builtin_add_overflow(a, b, &s) || __builtin_add_overflow(s, c, &s) ||
      __builtin_add_overflow(s, t->headdim, &s))
    return -1;
  return s;
}

/* Memory that ASan bounds exactly; NULL for 0 bytes is replaced by a small block. */
static void *exact(int64_t bytes, int fill) {
  unsigned char *m = (unsigned char *)malloc(bytes > 0 ? (size_t)bytes : 1);
  memset(m, fill, bytes > 0 ? (size_t)bytes : 1);
  return m;
}

static int poisoned(const void *p, int64_t n) {
  const unsigned char *c = (const unsigned char *)p;
  for (int64_t i = 0; i < n; i++)
    if (c[i] != 0xFF) return 0;
  return 1;
}

static void check(fa_status st, const char *call) {
  if (st != FA_OK && (!fa_last_error() || !fa_last_error()[0])) {
    fprintf(stderr, "%s returned %s with an empty fa_last_error()\n", call, fa_status_string(st));
    abort();
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  reader r = {data, size};
  fz_case c;
  fz_draw(&c, rd_u32(&r), 0); /* 4 bytes of seed: the edits start early */
  fuzz_args a;
  from_case(&a, &c);
  for (int e = rd_u8(&r) % 9; e > 0; e--) edit(&a, &r);

  /* memory for every descriptor, at the size it spans (aliases: the largest) */
  int64_t span[FZ_NT], bytes[FZ_NT];
  int runnable = 1; /* every buffer the call may touch is backed */
  for (int t = 0; t < FZ_NT; t++) {
    span[t] = span_of(&a.t[t]);
    bytes[t] = 64; /* refused descriptors point at a small block */
    if (span[t] < 0 ||
        (span[t] > 0 &&
         __builtin_mul_overflow(span[t], (int64_t)fa_dtype_size(a.t[t].dtype), &bytes[t])))
      bytes[t] = INT64_MAX;
    else if (span[t] > 0)
      bytes[t] = span[t] * (int64_t)fa_dtype_size(a.t[t].dtype);
    if (bytes[t] > CAP_BYTES) runnable = 0, bytes[t] = 64;
  }
  /* an alias shares its target's memory (no chains), sized for the larger of the two */
  for (int t = 0; t < FZ_NT; t++)
    if (a.alias[t] >= 0 && a.alias[a.alias[t]] >= 0) a.alias[t] = -1;
  for (int t = 0; t < FZ_NT; t++)
    if (a.alias[t] >= 0 && bytes[t] > bytes[a.alias[t]]) bytes[a.alias[t]] = bytes[t];
  void *mem[FZ_NT];
  for (int t = 0; t < FZ_NT; t++) {
    const int out = t == FZ_O || t >= FZ_DQ;
    mem[t] = exact(bytes[t], out ? 0xFF : 0x3C); /* 0x3C3C...: small finite numbers */
  }
  for (int t = 0; t < FZ_NT; t++)
    a.t[t].data = a.null_data[t] ? NULL : mem[a.alias[t] >= 0 ? a.alias[t] : t];

  /* the params' arrays at exactly the length the library reads */
  const fa_tensor *q = &a.t[FZ_Q], *k = &a.t[FZ_K];
  int arrays_ok = 1;
  int32_t *cu_q = NULL, *cu_k = NULL, *used = NULL;
  uint8_t *bm = NULL;
  float *slopes = NULL;
  const int64_t nseqs = a.varlen ? a.num_seqs : q->batch;
  if (a.varlen) {
    if (a.num_seqs >= 1 && a.num_seqs <= MAX_SEQS) {
      cu_q = (int32_t *)exact((a.num_seqs + 1) * 4, 0);
      cu_k = (int32_t *)exact((a.num_seqs + 1) * 4, 0);
      memcpy(cu_q, a.cu_q, (size_t)(a.num_seqs + 1) * 4);
      memcpy(cu_k, a.cu_k, (size_t)(a.num_seqs + 1) * 4);
    } else if (a.num_seqs >= 1) {
      arrays_ok = 0; /* the caller's offsets would be read past our copy */
    } else {
      cu_q = a.cu_q, cu_k = a.cu_k; /* num_seqs < 1: refused before they are read */
    }
    a.p.cu_seqlens_q = cu_q, a.p.cu_seqlens_k = cu_k, a.p.num_seqs = a.num_seqs;
  }
  if (a.used) {
    if (nseqs >= 1 && nseqs <= MAX_SEQS) {
      used = (int32_t *)exact(nseqs * 4, 0);
      memcpy(used, a.seqused, (size_t)nseqs * 4);
    } else if (nseqs >= 1) {
      arrays_ok = 0;
    }
    a.p.seqused_k = used ? used : a.seqused;
  }
  int64_t total_q = 0, lse_n = 0;
  if (span[FZ_Q] > 0 && span[FZ_K] > 0) {
    if (a.varlen)
      total_q = q->seqlen;
    else if (__builtin_mul_overflow(q->batch, q->seqlen, &total_q))
      total_q = INT64_MAX;
    double work = (double)q->batch * (double)q->heads * (double)q->seqlen * (double)k->seqlen *
                  (double)q->headdim;
    /* and few (sequence, head) units: each has a cost of its own, however small */
    if (!(work <= CAP_WORK) || (double)q->batch * (double)q->heads > CAP_UNITS) runnable = 0;
    if (__builtin_mul_overflow(q->heads, total_q, &lse_n) || lse_n > CAP_BYTES / 4)
      runnable = 0, lse_n = 0;
  }
  if (a.block) {
    const fa_params *p = &a.p;
    int64_t need = 1;
    if (p->block_size_q >= 1 && p->block_size_k >= 1 && span[FZ_Q] > 0 && span[FZ_K] > 0 &&
        p->block_mask_stride_batch >= 0 && p->block_mask_stride_head >= 0 &&
        p->block_mask_stride_row >= 0 && nseqs >= 1) {
      /* ceil divisions that cannot overflow (block sizes up to INT64_MAX) */
      const int64_t nbk = k->seqlen / p->block_size_k + (k->seqlen % p->block_size_k > 0);
      const int64_t nbq = q->seqlen / p->block_size_q + (q->seqlen % p->block_size_q > 0);
      const int64_t row = p->block_mask_stride_row ? p->block_mask_stride_row : nbk;
      const double far = (double)(nseqs - 1) * (double)p->block_mask_stride_batch +
                         (double)(q->heads - 1) * (double)p->block_mask_stride_head +
                         (double)(nbq - 1) * (double)row + (double)nbk;
      if (far > (double)CAP_BYTES)
        runnable = 0;
      else
        need = (int64_t)far;
    }
    bm = (uint8_t *)exact(need, 1);
    a.p.block_mask = bm;
  }
  if (a.alibi) {
    int64_t need = 1;
    const double far = (double)(nseqs - 1) * (double)a.p.alibi_stride_batch + (double)q->heads;
    if (nseqs >= 1 && a.p.alibi_stride_batch >= 0 && span[FZ_Q] > 0) {
      if (far > (double)CAP_BYTES / 4)
        runnable = 0;
      else
        need = (int64_t)far;
    }
    slopes = (float *)exact(need * 4, 0);
    for (int64_t i = 0; i < need; i++) slopes[i] = 0.25f;
    a.p.alibi_slopes = slopes;
  }

  float *lse = (float *)exact(lse_n * 4 + 4, 0xFF);
  void *ws = NULL;
  const fa_params *pp = a.null_params ? NULL : &a.p;
  const fa_tensor *pt[FZ_NT];
  for (int t = 0; t < FZ_NT; t++) pt[t] = a.null_desc[t] ? NULL : &a.t[t];
  if (arrays_ok) {
    size_t wsf = 0, wsb = 0;
    fa_status sf = fa_workspace_size((fa_pass)a.pass_f, pp, pt[FZ_Q], pt[FZ_K], pt[FZ_V],
                                     a.bytes_null ? NULL : &wsf);
    check(sf, "fa_workspace_size(FORWARD)");
    fa_status sb = fa_workspace_size((fa_pass)a.pass_b, pp, pt[FZ_Q], pt[FZ_K], pt[FZ_V],
                                     a.bytes_null ? NULL : &wsb);
    check(sb, "fa_workspace_size(BACKWARD)");
    if (a.ws_mode == 1 && sf == FA_OK && sb == FA_OK) {
      const size_t w = wsf > wsb ? wsf : wsb;
      if (w <= (size_t)CAP_BYTES) {
        ws = aligned_alloc(64, (w + 63) / 64 * 64 + 64);
        a.p.workspace = ws, a.p.workspace_bytes = w;
      } else {
        runnable = 0;
      }
    } else if (a.ws_mode == 2) {
      if (a.ws_bytes >= 0 && a.ws_bytes <= CAP_BYTES) {
        ws = aligned_alloc(64, (size_t)(a.ws_bytes + 63) / 64 * 64 + 64);
        a.p.workspace = ws, a.p.workspace_bytes = (size_t)a.ws_bytes;
      } else {
        a.p.workspace = ws = aligned_alloc(64, 64);
        a.p.workspace_bytes = (size_t)a.ws_bytes; /* more than is there: runnable only if refused */
        runnable = 0;
      }
    }
  }
  if (arrays_ok && runnable) {
    fa_status st = fa_forward(pp, pt[FZ_Q], pt[FZ_K], pt[FZ_V], (fa_tensor *)pt[FZ_O],
                              a.lse_null ? NULL : lse);
    check(st, "fa_forward");
    if (st != FA_OK && (!poisoned(mem[FZ_O], bytes[FZ_O]) || !poisoned(lse, lse_n * 4 + 4))) {
      fprintf(stderr, "the refused fa_forward wrote its outputs\n");
      abort();
    }
    /* the backward reads lse: give it a defined one */
    for (int64_t i = 0; i < lse_n; i++) lse[i] = 1.0f;
    const int64_t db[3] = {bytes[FZ_DQ], bytes[FZ_DK], bytes[FZ_DV]};
    for (int t = FZ_DQ; t <= FZ_DV; t++) memset(mem[t], 0xFF, (size_t)db[t - FZ_DQ]);
    st = fa_backward(pp, pt[FZ_Q], pt[FZ_K], pt[FZ_V], pt[FZ_O], pt[FZ_DO],
                     a.lse_in_null ? NULL : lse, (fa_tensor *)pt[FZ_DQ], (fa_tensor *)pt[FZ_DK],
                     (fa_tensor *)pt[FZ_DV]);
    check(st, "fa_backward");
    if (st != FA_OK)
      for (int t = FZ_DQ; t <= FZ_DV; t++)
        if (!poisoned(mem[t], db[t - FZ_DQ])) {
          fprintf(stderr, "the refused fa_backward wrote its output %d\n", t);
          abort();
        }
  }
  for (int t = 0; t < FZ_NT; t++) free(mem[t]);
  free(cu_q != a.cu_q ? cu_q : NULL);
  free(cu_k != a.cu_k ? cu_k : NULL);
  free(used);
  free(bm);
  free(slopes);
  free(lse);
  free(ws);
  return 0;
}
