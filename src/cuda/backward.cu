/* CUDA backend, backward pass: FlashAttention-2 (backward_kernel.cuh).
 * Asynchronous on params->stream, allocates nothing. Workspace, in order
 * (each part rounded up to 256 bytes):
 *   Di      heads_q * total_q floats (lse layout)
 *   lse2    as many floats (lse * log2 e)
 *   dQ acc  heads_q * total_q * Dp floats, Dp = dq_acc_cols (below): the
 *           padded head dim, 128 at 65-96 (the Hopper kernel pads those; the
 *           sm_80 kernel uses the start of each row). The sm_80 kernels leave
 *           it unused with params.deterministic (their dQ kernel keeps dQ in
 *           registers), but its size does not depend on the device.
 *   kv_done batch * heads_k ints: the Hopper kv kernel's finished blocks per
 *           (sequence, K/V head).
 *   dq_sem  with params.deterministic: heads_q * total_q ints (lse layout),
 *           the Hopper kernel's per-tile counts, then 256 bytes, its ticket.
 *   copies  the padded copies of tensors whose rows are not 16-byte aligned
 *           (repack.cuh).
 * For varlen, total_q is q's seqlen (the packed rows). O(B H N D), never N^2. */
#include <cuda_runtime.h>

#include "backend.h"
#include "backward_kernel.cuh"
#include "layout.cuh"
#include "repack.cuh"
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

size_t kv_done_bytes(const fa_problem *pb) {
  return round256((size_t)pb->batch * (size_t)pb->heads_k * sizeof(int));
}

/* The flash backward's own workspace (the padded copies follow it). */
size_t flash_bwd_bytes(const fa_problem *pb) {
  size_t n = 2 * rows_bytes(pb) + dq_acc_bytes(pb) + kv_done_bytes(pb);
  if (pb->deterministic)
    n += round256((size_t)pb->heads_q * (size_t)pb->total_q * sizeof(int)) + 256;
  return n;
}

template <typename T>
fa_status bwd_dispatch(const fa::BwdArgs &a, cudaStream_t s) {
#ifdef FA_HAVE_SM90A
  if (fa::sm90_device() && fa::sm90_backward_covers(a)) {
    const fa_status st = fa::sm90_backward<T>(a, s);
    if (st != FA_ERR_UNSUPPORTED || fa::sm90_strict()) return st; /* else TMA cannot map it */
  }
#endif
  fa::BwdArgs b = a;
  if (a.deterministic) /* the sm_80 kernels' deterministic mode: their dQ kernel */
    b.dq_acc = NULL, b.kv_done = NULL, b.dq_sem = NULL, b.kv_ticket = NULL;
  return fa::dispatch_headdim(
      b.d, [&](auto dp) { return fa::flash_bwd_launch<T, decltype(dp)::value>(b, s); });
}

fa_status flash_backward(const fa_problem *pb) {
  fa::BwdArgs a;
  a.o = pb->o.data, a.dout = pb->dout.data;
  a.dq = pb->dq.data, a.dk = pb->dk.data, a.dv = pb->dv.data;
  a.lse = pb->lse;
  char *ws = (char *)pb->workspace;
  const size_t acc0 = 2 * rows_bytes(pb), done0 = acc0 + dq_acc_bytes(pb);
  const size_t sem0 = done0 + kv_done_bytes(pb);
  a.dsum = (float *)ws;
  a.lse2 = (float *)(ws + rows_bytes(pb));
  a.dq_acc = (float *)(ws + acc0);
  a.kv_done = (int *)(ws + done0);
  a.deterministic = pb->deterministic;
  a.det_wave = 0;
  a.dq_sem = a.deterministic ? (int *)(ws + sem0) : NULL;
  a.kv_ticket =
      a.deterministic
          ? (int *)(ws + sem0 + round256((size_t)pb->heads_q * (size_t)pb->total_q * sizeof(int)))
          : NULL;
  int64_t *st[5][3] = {{&a.o_sb, &a.o_ss, &a.o_sh},
                       {&a.do_sb, &a.do_ss, &a.do_sh},
                       {&a.dq_sb, &a.dq_ss, &a.dq_sh},
                       {&a.dk_sb, &a.dk_ss, &a.dk_sh},
                       {&a.dv_sb, &a.dv_ss, &a.dv_sh}};
  const fa_tensor *ts[5] = {&pb->o, &pb->dout, &pb->dq, &pb->dk, &pb->dv};
  for (int i = 0; i < 5; i++) {
    *st[i][0] = ts[i]->stride_batch;
    *st[i][1] = ts[i]->stride_seq;
    *st[i][2] = ts[i]->stride_head;
  }
  fa::fill_common_args(a, pb);
  a.scale = pb->scale;
  if (pb->batch == 0 || pb->heads_q == 0) return FA_OK;
  cudaStream_t s = (cudaStream_t)pb->stream;
  return pb->dtype == FA_DTYPE_F16 ? bwd_dispatch<__half>(a, s) : bwd_dispatch<__nv_bfloat16>(a, s);
}

}  // namespace

size_t fa_cuda_backward_workspace(const fa_problem *pb) {
  return fa::is_flash(pb) ? fa::repack_workspace(pb, FA_PASS_BACKWARD, flash_bwd_bytes(pb)) : 0;
}

fa_status fa_cuda_backward(const fa_problem *pb) {
  return fa::repack_around(pb, FA_PASS_BACKWARD, flash_bwd_bytes(pb), flash_backward);
}
