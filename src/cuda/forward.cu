/* CUDA backend: what this build supports (fa_cuda_check), the forward pass
 * (FlashAttention-2 kernels in forward_kernel.cuh; standard attention through
 * cuBLAS), stream-ordered allocation. Everything runs asynchronously on
 * params->stream; the flash path never synchronises the host and allocates
 * nothing. Notes:
 *  - FA_ALGO_FLASH1 maps to the FlashAttention-2 kernel on the GPU (same
 *    result; the keys-outer order exists to measure IO on the CPU).
 *  - The flash kernels move 16-byte rows (cp.async, the tensor copy engine,
 *    vector stores): a tensor whose rows do not start on 16-byte boundaries
 *    (a head dim that is not a multiple of 8 with rows back to back, an odd
 *    stride or pointer) goes through a padded copy in the workspace
 *    (repack.cuh); aligned tensors are used in place.
 *  - FA_ALGO_STANDARD with varlen copies cu_seqlens to the host (one
 *    stream synchronisation): it is the baseline, not the fast path.
 *  - Flash limits: heads_q and batch (num_seqs) at most 65535 each (grid y/z);
 *    any head dim up to 256 runs the kernel of the next size in {32, 64, 96,
 *    128, 192, 256} with the extra columns zero-filled in shared memory.
 *  - Flash workspace: 256 bytes (the Hopper kernel's block counter), plus a
 *    split decode's partials (fwd_split_bytes), plus the padded copies.
 *  - Standard workspace: batch * heads_q * max_seqlen_q * max_seqlen_k floats,
 *    every sequence's S (the papers' baseline: each step over the whole batch);
 *    varlen (the maxima are the total lengths on the device): one sequence's S
 *    at a time, reused in stream order. P is written in place over S.
 *  - The cuBLAS handle is per host thread, created on first use. */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <limits.h>
#include <math.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "backend.h"
#include "common/mask.h"
#include "common/philox.h"
#include "forward_kernel.cuh"
#include "layout.cuh"
#include "repack.cuh"
#include "sm90/sm90.h"

namespace {

fa_status cuda_error(cudaError_t e) {
  return fa_set_error(FA_ERR_DEVICE, "cuda: %s", cudaGetErrorString(e));
}

#define FA_CUDA_TRY(expr)                         \
  do {                                            \
    cudaError_t e_ = (expr);                      \
    if (e_ != cudaSuccess) return cuda_error(e_); \
  } while (0)

#define FA_CUBLAS_TRY(expr)                                                                    \
  do {                                                                                         \
    cublasStatus_t s_ = (expr);                                                                \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                                           \
      return fa_set_error(FA_ERR_DEVICE, "cublas: %s (%s)", cublasGetStatusString(s_), #expr); \
  } while (0)

using fa::is_flash;
using fa::padded_headdim;

/* ---- FlashAttention-2 ------------------------------------------------------ */

/* GQA packing (FwdArgs::pack): the whole group of query heads per block
 * where one head's query rows would leave a 128-row block part empty, so the
 * group's K/V tiles are read once instead of once per head (decode: the K/V
 * stream is the whole cost). The Hopper kernel's decode variant takes it
 * (the sm_80 kernel ignores it and packs through gqa_as_rows); not under
 * block masks (given per head). */
static int fwd_pack(const fa_problem *pb) {
  const int64_t g = pb->group;
  const bool on = g > 1 && g <= 128 && pb->max_seqlen_q < 128;
  return on && !pb->block_mask ? (int)g : 1;
}

/* Key splits where the blocks of query rows are fewer than an H100 has SMs
 * (decode steps; prefill chunks against a long cache, whose 64 blocks took
 * 107 us at batch 1, 32 query heads, 256 rows and 8k keys, 70 us split in two
 * on an H100), at least FA_SPLIT_KEYS keys (one Hopper key tile) each where a
 * block holds every query row of its head, FA_SPLIT_PREFILL_KEYS where it
 * does not, at most 32:
 * the fewest whose blocks fill the waves of 132 SMs within FA_SPLIT_EFF
 * percent of the best count's (the persistent CTAs take blocks in rounds, so
 * a last round of a few blocks costs a whole one). Both kernels take them
 * (the sm_80 kernel packs GQA decode through gqa_as_rows below); chosen from
 * the problem alone, so the workspace size is the same on every device. */
#ifndef FA_SPLIT_EFF
#define FA_SPLIT_EFF 95
#endif
#ifndef FA_SPLIT_KEYS
#define FA_SPLIT_KEYS 128
#endif
#ifndef FA_SPLIT_PREFILL_KEYS
#define FA_SPLIT_PREFILL_KEYS 512
#endif
static int fwd_splits(const fa_problem *pb) {
  if (!is_flash(pb)) return 1;
  /* params.num_splits: as asked, within the sm_80 grid's y extent (heads_q
   * * splits, at most 65535) and one key tile (32 keys at least) a split */
  const int ask = pb->num_splits;
  if (ask > 0) {
    int64_t most = std::min<int64_t>(65535 / pb->heads_q, (pb->max_seqlen_k + 31) / 32);
    return (int)std::max<int64_t>(1, std::min<int64_t>(ask, most));
  }
  /* the sm_80 grid's y extent is heads_q * splits (at most 65535) */
  if (pb->heads_q > 65535 / 32) return 1;
  const int64_t sms = 132; /* an H100's */
  /* blocks without a split: (sequence, K/V head) pairs when packed, each of
   * ceil(max_seqlen_q / rows per head) blocks */
  const int pk = fwd_pack(pb);
  const int64_t rq = 1 << fa::pack_rows_log2(pk, (int)pb->max_seqlen_q, 128);
  const int64_t per = pb->max_seqlen_q > rq ? (pb->max_seqlen_q + rq - 1) / rq : 1;
  const int64_t blocks = pb->batch * (pb->heads_q / pk) * per;
  /* a prefill chunk's blocks (more rows than the packing's block) split at
   * FA_SPLIT_PREFILL_KEYS keys at least: the partials are a block of rows each */
  const int64_t min_keys = pb->max_seqlen_q > rq ? FA_SPLIT_PREFILL_KEYS : FA_SPLIT_KEYS;
  const int64_t by_keys = pb->max_seqlen_k / min_keys, most = by_keys < 32 ? by_keys : 32;
  if (blocks >= sms || most < 2) return 1;
  /* wave efficiency of s splits: blocks per SM over the rounds they take */
  auto eff = [&](int64_t s) {
    const int64_t n = blocks * s;
    return (double)n / (double)(((n + sms - 1) / sms) * sms);
  };
  double best = 0;
  for (int64_t s = 1; s <= most; s++) best = eff(s) > best ? eff(s) : best;
  for (int64_t s = 1; s <= most; s++)
    if (eff(s) * 100 >= FA_SPLIT_EFF * best) return (int)s;
  return 1;
}

/* The forward's workspace: the Hopper kernel's block counter, then a split
 * forward's lse partials and O partials (kernel-D floats per row). */
constexpr size_t kFwdCounterBytes = 256;
static size_t fwd_lse_part_bytes(const fa_problem *pb, int ns) {
  return fa::round256((size_t)pb->heads_q * (size_t)pb->total_q * (size_t)ns * sizeof(float));
}
static size_t fwd_split_bytes(const fa_problem *pb, int ns) {
  const size_t rows = (size_t)pb->heads_q * (size_t)pb->total_q * (size_t)ns;
  const int64_t d = pb->headdim; /* Hopper's padded head dim (the sm_80 kernel's is <= it) */
  const size_t dk = d <= 64 ? 64 : d <= 128 ? 128 : d <= 192 ? 192 : 256;
  return ns > 1 ? fwd_lse_part_bytes(pb, ns) + rows * dk * sizeof(float) : 0;
}

/* GQA decode on the sm_80 kernel, whose blocks are one query head's: with
 * one query row per sequence (fixed length; no window, ALiBi, dropout or
 * block mask, which depend on the head or the row) the group's g query heads
 * become the g rows of one K/V head's problem. Q and O (B, 1, Hk g, D) are
 * read as (B, g, Hk, D), and lse, (B, Hk g, 1), keeps its layout as (B, Hk,
 * g): K/V is then read once per group. Causal is dropped (one row sees every
 * key). FlashAttention-2 does the same for its decode. */
static void gqa_as_rows(fa::FwdArgs &a) {
  if (a.group == 1 || a.nq != 1 || a.cu_q || a.window_enabled || a.alibi || a.shard ||
      fa::is_ext(a))
    return;
  const int g = a.group;
  a.nq = a.max_seqlen_q = g;
  a.heads_q /= g;
  a.group = 1;
  a.total_q = (int64_t)a.batch * g;
  a.q_ss = a.q_sh, a.q_sh *= g;
  a.o_ss = a.o_sh, a.o_sh *= g;
  a.causal = 0;
}

template <typename T>
fa_status flash_dispatch(fa::FwdArgs a, cudaStream_t s) {
  gqa_as_rows(a);
  return fa::dispatch_headdim(
      a.d, [&](auto dp) { return fa::flash_fwd_launch<T, decltype(dp)::value>(a, s); });
}

/* Programmatic dependent launches (compute capability 9.0 and up). */
static bool pdl_device() {
  static int cached[64]; /* per device: 0 unknown, 1 yes, 2 no */
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  if (!cached[dev]) {
    int major = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cached[dev] = major >= 9 ? 1 : 2;
  }
  return cached[dev] == 1;
}

fa_status flash_forward(const fa_problem *pb) {
  fa::FwdArgs a;
  memset(&a, 0, sizeof a);
  a.o = pb->o.data;
  a.lse = pb->lse;
  a.o_sb = pb->o.stride_batch, a.o_ss = pb->o.stride_seq, a.o_sh = pb->o.stride_head;
  a.sched = (int *)pb->workspace;
  fa::fill_common_args(a, pb);
  a.nsplit = fwd_splits(pb);
  a.pack = fwd_pack(pb);
  a.part_rows = pb->heads_q * pb->total_q;
  char *parts = (char *)pb->workspace + kFwdCounterBytes;
  a.part_lse = (float *)parts;
  a.part_o = (float *)(parts + fwd_lse_part_bytes(pb, a.nsplit));
  cudaStream_t s = (cudaStream_t)pb->stream;
  /* The attention launches as a programmatic dependent where the GPU can:
   * its blocks start as the stream's previous kernel ends, and wait for it
   * before they read or write memory. The KV-cache call's preparation
   * (rotated q, appended rows) comes first. */
  a.pdl = pdl_device();
  if (pb->kv && (pb->kv->rotary_cos || pb->k_new.data)) {
    const fa_status st = fa::kvcache_prepare(pb, s);
    if (st != FA_OK) return st;
  }
#ifdef FA_HAVE_SM90A
  if (fa::sm90_device() && fa::sm90_forward_covers(a)) {
    const fa_status st = pb->dtype == FA_DTYPE_F16 ? fa::sm90_forward<__half>(a, s)
                                                   : fa::sm90_forward<__nv_bfloat16>(a, s);
    if (st != FA_ERR_UNSUPPORTED || fa::sm90_strict()) return st; /* else TMA cannot map it */
  }
#endif
  return pb->dtype == FA_DTYPE_F16 ? flash_dispatch<__half>(a, s)
                                   : flash_dispatch<__nv_bfloat16>(a, s);
}

/* ---- standard attention (Algorithm 0) through cuBLAS ----------------------- */

struct SoftmaxArgs {
  float *s; /* head h's row i at s + h hs + i ld (nk floats); P written in place: as T
             * over the row's first half (the forward), or as float (probabilities) */
  int64_t hs, ld;
  float *lse; /* lse of (head 0, row 0) of this sequence */
  int64_t lse_hs;
  void *o; /* row 0 of this sequence, head 0 (zeroed when nk == 0) */
  int64_t o_ss, o_sh;
  int nq, nk, d;
  float softcap;
  const float *alibi; /* this sequence's slopes (indexed by head), or NULL */
  fa_mask mk;
  const uint8_t *bm; /* this sequence's block mask (head h at bm + h * bm_sh), or NULL */
  int64_t bm_sh, bm_sr, bq, bk;
  fa_dropout drop; /* keep_scale 0: no dropout */
  uint32_t bh0;    /* dropout's matrix index of head 0: sequence * heads_q */
};

/* One block per (row, head): applies softcap, ALiBi and the masks to the
 * scaled scores of the row, writes P = softmax (rounded to T) over the first
 * half of the row's own bytes (row stride 2 nk in T) and the row's lse; or
 * (PROBS: fa_attention_probs) P as float32, dropped elements negated, no lse. */
template <typename T, bool PROBS>
__global__ void __launch_bounds__(256) std_softmax_kernel(const SoftmaxArgs a) {
  __shared__ float red[32];
  const int i = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  float *row = a.s + (int64_t)h * a.hs + (int64_t)i * a.ld;
  int64_t lo64, hi64;
  fa_mask_row_range(&a.mk, i, &lo64, &hi64);
  const int lo = (int)lo64, hi = (int)hi64;
  const float slope = a.alibi ? a.alibi[h] : 0.f;
  const int diag = i + (int)a.mk.diag0;
  const uint8_t *brow = a.bm ? a.bm + h * a.bm_sh + (i / a.bq) * a.bm_sr : NULL;
  auto score = [&](int j) {
    float x = row[j];
    if (a.softcap > 0) x = a.softcap * tanhf(x / a.softcap);
    x -= slope * fabsf((float)(diag - j));
    return (j >= lo && j < hi && (!brow || brow[j / a.bk])) ? x : -INFINITY;
  };
  auto block_reduce = [&](float v, bool is_max) {
    for (int o = 16; o > 0; o >>= 1) {
      float w = __shfl_xor_sync(0xffffffffu, v, o);
      v = is_max ? fmaxf(v, w) : v + w;
    }
    __syncthreads();
    if ((tid & 31) == 0) red[tid >> 5] = v;
    __syncthreads();
    const int lane = tid & 31; /* every warp reduces the per-warp partials itself */
    v = lane < (int)(blockDim.x >> 5) ? red[lane] : (is_max ? -INFINITY : 0.f);
    for (int o = 16; o > 0; o >>= 1) {
      float w = __shfl_xor_sync(0xffffffffu, v, o);
      v = is_max ? fmaxf(v, w) : v + w;
    }
    return v;
  };
  float mx = -INFINITY;
  for (int j = tid; j < a.nk; j += blockDim.x) mx = fmaxf(mx, score(j));
  mx = block_reduce(mx, true);
  const float base = mx == -INFINITY ? 0.f : mx;
  float sum = 0.f;
  for (int j = tid; j < a.nk; j += blockDim.x) sum += expf(score(j) - base);
  sum = block_reduce(sum, false);
  const float inv = sum > 0 ? 1.f / sum : 0.f;
  if constexpr (PROBS) { /* each thread its own elements: in place as they are */
    for (int j = tid; j < a.nk; j += blockDim.x) {
      const float pj = expf(score(j) - base) * inv;
      row[j] = a.drop.keep_scale > 0.f && !fa_dropout_keep(&a.drop, a.bh0 + h, i, j) ? -pj : pj;
    }
  } else {
    T *prow = reinterpret_cast<T *>(row);
    if (tid == 0) a.lse[h * a.lse_hs + i] = sum > 0 ? base + logf(sum) : -INFINITY;
    /* In place: P[j] (2 bytes at 2j) overlaps S[j/2], read in this or an earlier chunk. */
    for (int c = 0; c < a.nk; c += blockDim.x) {
      const int j = c + tid;
      float pj = j < a.nk ? expf(score(j) - base) * inv : 0.f;
      if (a.drop.keep_scale > 0.f && j < a.nk) /* P -> Z o P (docs/DROPOUT.md) */
        pj *= fa_dropout_keep(&a.drop, a.bh0 + h, i, j) ? a.drop.keep_scale : 0.f;
      __syncthreads();
      if (j < a.nk) prow[j] = T(pj);
    }
    if (a.nk == 0) {
      T *orow = reinterpret_cast<T *>(a.o) + (int64_t)i * a.o_ss + h * a.o_sh;
      for (int d = tid; d < a.d; d += blockDim.x) orow[d] = T(0.f);
    }
  }
}

cublasHandle_t cublas_handle(fa_status *st) {
  static thread_local cublasHandle_t handle = NULL;
  *st = FA_OK;
  if (!handle) {
    cublasStatus_t s = cublasCreate(&handle);
    if (s != CUBLAS_STATUS_SUCCESS) {
      handle = NULL;
      *st = fa_set_error(FA_ERR_DEVICE, "cublas: cublasCreate: %s", cublasGetStatusString(s));
    }
  }
  return handle;
}

int ld_of(const fa_tensor *t, int64_t rows) {
  return rows > 1 ? (int)t->stride_seq : (int)t->headdim;
}

/* Workspace: the scores of every head of every sequence (P in place), as the
 * papers' baseline holds them; varlen (whose maxima are the total lengths here):
 * one sequence's, reused across sequences, stream-ordered. */
size_t std_workspace(const fa_problem *pb) {
  return (size_t)(pb->varlen ? 1 : pb->batch) * (size_t)pb->heads_q * (size_t)pb->max_seqlen_q *
         (size_t)pb->max_seqlen_k * sizeof(float);
}

/* Standard attention: S through cuBLAS, then the softmax kernel, then (the
 * forward) O = P V, each step over the whole batch (varlen: per sequence).
 * probs (fa_attention_probs):
 * S is computed into the caller's probabilities, where the softmax leaves P,
 * and there is no O. */
fa_status std_run(const fa_problem *pb, bool probs) {
  cudaStream_t stream = (cudaStream_t)pb->stream;
  fa_status st;
  cublasHandle_t hdl = cublas_handle(&st);
  if (st != FA_OK) return st;
  FA_CUBLAS_TRY(cublasSetStream(hdl, stream));
  const cudaDataType dt = pb->dtype == FA_DTYPE_F16 ? CUDA_R_16F : CUDA_R_16BF;
  const size_t es = 2;
  const int H = (int)pb->heads_q, Hk = (int)pb->heads_k, G = (int)pb->group;
  const int D = (int)pb->headdim;
  /* Fixed-length batches run each step (S = scale Q K^T, softmax, O = P V) over
   * the whole batch before the next; varlen runs the three per sequence. */
  const bool whole = !pb->varlen;
  const int64_t seq_floats = (int64_t)H * pb->max_seqlen_q * pb->max_seqlen_k;

  std::vector<int32_t> cq, ck;
  if (pb->varlen) {
    cq.resize((size_t)pb->batch + 1);
    ck.resize((size_t)pb->batch + 1);
    FA_CUDA_TRY(cudaMemcpyAsync(cq.data(), pb->cu_seqlens_q, cq.size() * 4, cudaMemcpyDeviceToHost,
                                stream));
    FA_CUDA_TRY(cudaMemcpyAsync(ck.data(), pb->cu_seqlens_k, ck.size() * 4, cudaMemcpyDeviceToHost,
                                stream));
  }
  std::vector<int32_t> used;
  if (pb->seqused_k) {
    used.resize((size_t)pb->batch);
    FA_CUDA_TRY(cudaMemcpyAsync(used.data(), pb->seqused_k, used.size() * 4, cudaMemcpyDeviceToHost,
                                stream));
  }
  if (pb->varlen || pb->seqused_k) FA_CUDA_TRY(cudaStreamSynchronize(stream));
  const int64_t prows = pb->probs_rows, pcols = pb->probs_cols;
  if (probs) {
    /* the host's first sight of device-resident offsets: every sequence must fit */
    for (int64_t s = 0; pb->varlen && s < pb->batch; s++)
      if (cq[s + 1] - cq[s] > prows || ck[s + 1] - ck[s] > pcols)
        return fa_set_error(FA_ERR_INVALID_ARGUMENT,
                            "rows %lld and cols %lld must be at least sequence %lld's %d query "
                            "rows and %d keys",
                            (long long)prows, (long long)pcols, (long long)s, cq[s + 1] - cq[s],
                            ck[s + 1] - ck[s]);
    FA_CUDA_TRY(cudaMemsetAsync(
        pb->probs, 0, (size_t)(pb->batch * H) * (size_t)prows * (size_t)pcols * 4, stream));
  }
  auto seq_step = [&](int64_t s, int step) -> fa_status {
    int64_t qb = s, kb = s, q0 = 0, k0 = 0, nq = pb->q.seqlen, nk = pb->k.seqlen;
    int64_t lse0 = s * H * nq, lse_hs = nq;
    if (pb->varlen) {
      qb = kb = 0;
      q0 = cq[s], nq = cq[s + 1] - cq[s];
      k0 = ck[s], nk = ck[s + 1] - ck[s];
      lse0 = q0, lse_hs = pb->total_q;
    }
    if (pb->seqused_k) nk = std::min<int64_t>(nk, std::max<int32_t>(0, used[(size_t)s]));
    if (nq == 0) return FA_OK;
    float *S = (float *)pb->workspace + (whole ? s * seq_floats : 0);
    const char *Q = (const char *)pb->q.data + fa_tensor_offset(&pb->q, qb, q0, 0) * es;
    const char *K = (const char *)pb->k.data + fa_tensor_offset(&pb->k, kb, k0, 0) * es;
    const char *V = (const char *)pb->v.data + fa_tensor_offset(&pb->v, kb, k0, 0) * es;
    char *O = probs ? NULL : (char *)pb->o.data + fa_tensor_offset(&pb->o, qb, q0, 0) * es;
    /* S: floats per head and per row */
    const long long snn = probs ? (long long)prows * pcols : (long long)nq * nk;
    const int64_t ld = probs ? pcols : nk;
    if (probs) S = pb->probs + s * H * snn;
    const float zero = 0.f, one = 1.f, scale = pb->scale;
    /* Heads sharing a K/V head form one strided batch (K/V stride 0 inside it);
     * with no grouping all heads form one batch. */
    const int calls = G == 1 ? 1 : Hk, per = G == 1 ? H : G;
    if (step == 0 && nk > 0)
      for (int c = 0; c < calls; c++) {
        const int h0 = c * per;
        const long long kstr = G == 1 ? pb->k.stride_head : 0;
        /* column-major: S^T (nk x nq) = K^T-view^T (nk x D) * Q-view (D x nq) */
        FA_CUBLAS_TRY(cublasGemmStridedBatchedEx(
            hdl, CUBLAS_OP_T, CUBLAS_OP_N, (int)nk, (int)nq, D, &scale,
            K + (int64_t)(h0 / G) * pb->k.stride_head * es, dt, ld_of(&pb->k, nk), kstr,
            Q + (int64_t)h0 * pb->q.stride_head * es, dt, ld_of(&pb->q, nq), pb->q.stride_head,
            &zero, S + h0 * snn, CUDA_R_32F, (int)ld, snn, per, CUBLAS_COMPUTE_32F,
            CUBLAS_GEMM_DEFAULT));
      }
    if (step == 1) {
      SoftmaxArgs sa;
      sa.s = S;
      sa.hs = snn;
      sa.ld = ld;
      sa.lse = probs ? NULL : pb->lse + lse0;
      sa.lse_hs = lse_hs;
      sa.o = O;
      sa.o_ss = pb->o.stride_seq;
      sa.o_sh = pb->o.stride_head;
      sa.nq = (int)nq;
      sa.nk = (int)nk;
      sa.d = D;
      sa.softcap = pb->softcap;
      sa.alibi = pb->alibi_slopes ? pb->alibi_slopes + s * pb->alibi_stride_batch : NULL;
      sa.mk =
          fa_mask_make(nq, nk, pb->causal, pb->window_enabled, pb->window_left, pb->window_right);
      if (pb->shard_enabled) fa_mask_shard(&sa.mk, pb->q_pos, pb->k_pos);
      sa.bm = pb->block_mask ? pb->block_mask + s * pb->block_mask_stride_batch : NULL;
      sa.bm_sh = pb->block_mask_stride_head;
      sa.bm_sr = pb->block_mask_stride_row;
      sa.bq = pb->block_size_q;
      sa.bk = pb->block_size_k;
      sa.drop = pb->dropout;
      if (!(pb->dropout_p > 0)) sa.drop.keep_scale = 0.f;
      sa.bh0 = (uint32_t)(s * H);
      const dim3 grid((unsigned)nq, (unsigned)H);
      if (probs)
        std_softmax_kernel<float, true><<<grid, 256, 0, stream>>>(sa);
      else if (pb->dtype == FA_DTYPE_F16)
        std_softmax_kernel<__half, false><<<grid, 256, 0, stream>>>(sa);
      else
        std_softmax_kernel<__nv_bfloat16, false><<<grid, 256, 0, stream>>>(sa);
      FA_CUDA_TRY(cudaGetLastError());
    }
    if (step == 2 && nk > 0 && !probs)
      for (int c = 0; c < calls; c++) {
        const int h0 = c * per;
        const long long vstr = G == 1 ? pb->v.stride_head : 0;
        /* column-major: O^T (D x nq) = V-view (D x nk) * P^T-view (nk x nq), ldP = 2 nk */
        FA_CUBLAS_TRY(cublasGemmStridedBatchedEx(
            hdl, CUBLAS_OP_N, CUBLAS_OP_N, D, (int)nq, (int)nk, &one,
            V + (int64_t)(h0 / G) * pb->v.stride_head * es, dt, ld_of(&pb->v, nk), vstr,
            S + h0 * snn, dt, (int)(2 * nk), 2 * snn, &zero,
            O + (int64_t)h0 * pb->o.stride_head * es, dt, ld_of(&pb->o, nq), pb->o.stride_head, per,
            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      }
    return FA_OK;
  };
  for (int64_t i = 0; i < 3 * pb->batch; i++) { /* (step, sequence) or (sequence, step) */
    st = whole ? seq_step(i % pb->batch, (int)(i / pb->batch)) : seq_step(i / 3, (int)(i % 3));
    if (st != FA_OK) return st;
  }
  return FA_OK;
}

fa_status std_forward(const fa_problem *pb) { return std_run(pb, false); }

}  // namespace

/* ---- backend interface ------------------------------------------------------ */

int fa_cuda_available(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n > 0;
}

fa_status fa_cuda_check(const fa_problem *pb, fa_pass pass) {
  if (pass == FA_PASS_BACKWARD && !is_flash(pb))
    return fa_set_error(FA_ERR_UNSUPPORTED,
                        "cuda: the backward pass of FA_ALGO_STANDARD is not implemented on CUDA "
                        "(FA_ALGO_FLASH2 is)");
  if (pb->dtype != FA_DTYPE_F16 && pb->dtype != FA_DTYPE_BF16)
    return fa_set_error(FA_ERR_UNSUPPORTED,
                        "cuda: only f16 and bf16 storage are supported on CUDA");
  if (pb->q.seqlen > INT_MAX || pb->k.seqlen > INT_MAX || pb->batch * pb->heads_q > INT_MAX ||
      pb->k.batch > INT_MAX)
    return fa_set_error(FA_ERR_UNSUPPORTED, "cuda: seqlen and batch*heads must fit in 32 bits");
  if ((pb->page_size || pb->kv) && !is_flash(pb))
    return fa_set_error(FA_ERR_UNSUPPORTED,
                        "cuda: paged KV caches and the KV-cache call run on the flash kernels "
                        "(FA_ALGO_FLASH2), not FA_ALGO_STANDARD");
  if (pb->page_size && (pb->dropout_p > 0 || pb->block_mask))
    return fa_set_error(FA_ERR_UNSUPPORTED,
                        "cuda: a paged KV cache (params.block_table) takes no dropout or block "
                        "mask on CUDA");
  if (pb->page_size || pb->kv) { /* read and written in place: no padded copies */
    const fa_tensor *ts[3] = {&pb->q, &pb->k, &pb->v};
    const char *nm[3] = {"q", "k", "v"};
    for (int i = 0; i < 3; i++)
      if (!fa::rows_aligned(ts[i]))
        return fa_set_error(FA_ERR_UNSUPPORTED,
                            "cuda: paged KV caches and the KV-cache call need %s 16-byte aligned "
                            "with strides that are multiples of 8 elements",
                            nm[i]);
  }
  if (is_flash(pb) && pass != FA_PASS_PROBS) {
    if (pb->heads_q > fa::kFwdMaxGridYZ || pb->batch > fa::kFwdMaxGridYZ)
      return fa_set_error(FA_ERR_UNSUPPORTED,
                          "cuda: flash kernels support at most %d heads and %d sequences",
                          fa::kFwdMaxGridYZ, fa::kFwdMaxGridYZ);
  } else { /* standard attention (fa_attention_probs too) */
    const fa_tensor *ts[3] = {&pb->q, &pb->k, &pb->v};
    for (int i = 0; i < 3; i++)
      if ((ts[i]->seqlen > 1 &&
           (ts[i]->stride_seq < ts[i]->headdim || ts[i]->stride_seq > INT_MAX)))
        return fa_set_error(FA_ERR_UNSUPPORTED,
                            "cuda: standard attention needs seqlen strides in [headdim, 2^31)");
    if (pb->heads_q > 65535)
      return fa_set_error(FA_ERR_UNSUPPORTED, "cuda: standard attention supports <= 65535 heads");
  }
  return FA_OK;
}

/* The flash forward's own workspace (the padded copies follow it). */
static size_t flash_fwd_bytes(const fa_problem *pb) {
  return fa::round256(kFwdCounterBytes + fwd_split_bytes(pb, fwd_splits(pb)));
}

size_t fa_cuda_forward_workspace(const fa_problem *pb) {
  /* flash: the Hopper kernel's block counter (sm90/schedule.cuh), a split
   * forward's partials, the padded copies */
  return is_flash(pb) ? fa::repack_workspace(pb, FA_PASS_FORWARD, flash_fwd_bytes(pb))
                      : std_workspace(pb);
}

fa_status fa_cuda_forward(const fa_problem *pb) {
  if (!is_flash(pb) && pb->o.seqlen > 1 &&
      (pb->o.stride_seq < pb->o.headdim || pb->o.stride_seq > INT_MAX))
    return fa_set_error(FA_ERR_UNSUPPORTED,
                        "cuda: standard attention needs seqlen strides in [headdim, 2^31)");
  return is_flash(pb) ? fa::repack_around(pb, FA_PASS_FORWARD, flash_fwd_bytes(pb), flash_forward)
                      : std_forward(pb);
}

fa_status fa_cuda_probs(const fa_problem *pb) { return std_run(pb, true); }

fa_status fa_cuda_alloc(void **ptr, size_t bytes, void *stream) {
  *ptr = NULL;
  cudaError_t e = cudaMallocAsync(ptr, bytes, (cudaStream_t)stream);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return fa_set_error(FA_ERR_OUT_OF_MEMORY, "cuda: cannot allocate %zu bytes of workspace",
                        bytes);
  }
  if (e != cudaSuccess) return cuda_error(e);
  return FA_OK;
}

void fa_cuda_free(void *ptr, void *stream) {
  if (ptr) (void)cudaFreeAsync(ptr, (cudaStream_t)stream);
}
