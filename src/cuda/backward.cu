/* CUDA backend, backward pass: FlashAttention-2 (backward_kernel.cuh).
 * Asynchronous on params->stream, allocates nothing. Workspace, in order
 * (each part rounded up to 256 bytes):
 *   Di      heads_q * total_q floats (lse layout)
 *   lse2    as many floats (lse * log2 e)
 *   dQ acc  heads_q * total_q * Dp floats, Dp = dq_acc_cols (below): the
 *           padded head dim, 128 at 65-96 (the Hopper kernel pads those; the
 *           sm_80 kernel uses the start of each row); not
 *           with params.deterministic, whose dQ kernel keeps dQ in registers.
 *   kv_done batch * heads_k ints (not with params.deterministic either): the
 *           Hopper kv kernel's finished blocks per (sequence, K/V head).
 * For varlen, total_q is q's seqlen (the packed rows). O(B H N D), never N^2.
 * The flash kernels need q, k, v, o, dout, dq, dk, dv 16-byte aligned with
 * strides that are multiples of 8 elements (else FA_ERR_UNSUPPORTED). */
#include <cuda_runtime.h>

#include "backend.h"
#include "backward_kernel.cuh"
#include "layout.cuh"
#include "sm90/sm90.h"

namespace {

using fa::round256;

/* the dQ accumulator's row width (the sm_80 kernel's narrower rows use the
 * start of each row) */
int dq_acc_cols(int64_t d) { return d > 64 && d <= 96 ? 128 : fa::padded_headdim(d); }

size_t rows_bytes(const fa_problem *pb) {
  return round256((size_t)pb->heads_q * (size_t)pb->total_q * sizeof(float));
}

size_t dq_acc_bytes(const fa_problem *pb) {
  return round256((size_t)pb->heads_q * (size_t)pb->total_q * (size_t)dq_acc_cols(pb->headdim) *
                  sizeof(float));
}

template <typename T>
fa_status bwd_dispatch(const fa::BwdArgs &a, cudaStream_t s) {
#ifdef FA_HAVE_SM90A
  if (fa::sm90_device() && fa::sm90_backward_covers(a)) {
    const fa_status st = fa::sm90_backward<T>(a, s);
    if (st != FA_ERR_UNSUPPORTED || fa::sm90_strict()) return st; /* else TMA cannot map it */
  }
#endif
  return fa::dispatch_headdim(
      a.d, [&](auto dp) { return fa::flash_bwd_launch<T, decltype(dp)::value>(a, s); });
}

}  // namespace

size_t fa_cuda_backward_workspace(const fa_problem *pb) {
  if (!fa::is_flash(pb)) return 0;
  size_t n = 2 * rows_bytes(pb);
  if (!pb->params->deterministic)
    n += dq_acc_bytes(pb) + (size_t)pb->batch * (size_t)pb->heads_k * sizeof(int);
  return n;
}

fa_status fa_cuda_backward(const fa_problem *pb) {
  const fa_tensor *ts[5] = {&pb->o, &pb->dout, &pb->dq, &pb->dk, &pb->dv};
  const char *nm[5] = {"o", "dout", "dq", "dk", "dv"};
  for (int i = 0; i < 5; i++)
    if (!fa::rows_aligned(ts[i]))
      return fa_set_error(FA_ERR_UNSUPPORTED,
                          "cuda: flash kernels need %s 16-byte aligned with strides that are "
                          "multiples of 8 elements",
                          nm[i]);
  const fa_params *pr = pb->params;
  fa::BwdArgs a;
  a.o = pb->o.data, a.dout = pb->dout.data;
  a.dq = pb->dq.data, a.dk = pb->dk.data, a.dv = pb->dv.data;
  a.lse = pb->lse;
  char *ws = (char *)pb->workspace;
  a.dsum = (float *)ws;
  a.lse2 = (float *)(ws + rows_bytes(pb));
  a.dq_acc = pr->deterministic ? NULL : (float *)(ws + 2 * rows_bytes(pb));
  a.kv_done = pr->deterministic ? NULL : (int *)(ws + 2 * rows_bytes(pb) + dq_acc_bytes(pb));
  int64_t *st[5][3] = {{&a.o_sb, &a.o_ss, &a.o_sh},
                       {&a.do_sb, &a.do_ss, &a.do_sh},
                       {&a.dq_sb, &a.dq_ss, &a.dq_sh},
                       {&a.dk_sb, &a.dk_ss, &a.dk_sh},
                       {&a.dv_sb, &a.dv_ss, &a.dv_sh}};
  for (int i = 0; i < 5; i++) {
    *st[i][0] = ts[i]->stride_batch;
    *st[i][1] = ts[i]->stride_seq;
    *st[i][2] = ts[i]->stride_head;
  }
  fa::fill_common_args(a, pb);
  a.scale = pb->scale;
  if (pb->batch == 0 || pb->heads_q == 0) return FA_OK;
  cudaStream_t s = (cudaStream_t)pr->stream;
  return pb->dtype == FA_DTYPE_F16 ? bwd_dispatch<__half>(a, s) : bwd_dispatch<__nv_bfloat16>(a, s);
}
