/* Padded copies of tensors whose rows the flash kernels cannot move in
 * 16-byte chunks (repack.cuh). One launch copies every tensor of a step:
 * grid y is the tensor, each warp moves 32 / (dp / 8) rows at a time, a lane
 * one 16-byte chunk of the padded row (2-byte accesses on the caller's side,
 * whose rows may start anywhere). */
#include <limits.h>
#include <stdint.h>

#include "backend.h"
#include "layout.cuh"
#include "repack.cuh"

namespace fa {
namespace {

/* The padded copies of one call: each tensor that needs one, its copy, and
 * whether it is copied in before the kernels and back after them. */
struct Repack {
  static constexpr int kMax = 8; /* backward: q, k, v, o, dout, dq, dk, dv */
  struct Job {
    const fa_tensor *user; /* the caller's tensor */
    fa_tensor pad;         /* its copy */
    bool in, out;
  };
  Job job[kMax];
  int n = 0;
  size_t bytes = 0; /* workspace the copies take */
};

struct CopyJob {
  uint16_t *user;
  uint4 *pad;
  int64_t sb, ss, sh, batch, seqlen, heads;
  int d, cpr; /* head dim, 16-byte chunks per padded row */
};
struct CopyJobs {
  CopyJob j[Repack::kMax];
};

/* I: the row index type (32-bit when every tensor has fewer than 2^31 rows). */
template <typename I, bool IN>
__global__ void __launch_bounds__(256) repack_kernel(const CopyJobs J) {
  const CopyJob &jb = J.j[blockIdx.y];
  const int lane = threadIdx.x & 31, rpw = 32 / jb.cpr, sub = lane / jb.cpr, ch = lane % jb.cpr;
  if (sub >= rpw) return;
  const I rows = (I)(jb.batch * jb.seqlen * jb.heads), heads = (I)jb.heads, seq = (I)jb.seqlen;
  const I step = (I)gridDim.x * 8 * rpw;
  const int e = min(8, jb.d - ch * 8); /* columns of this chunk in the tensor (>= 1) */
  for (I row = ((I)blockIdx.x * 8 + (I)(threadIdx.x >> 5)) * rpw + sub; row < rows; row += step) {
    const I h = row % heads, bn = row / heads, n = bn % seq, b = bn / seq;
    uint16_t *u = jb.user + (int64_t)b * jb.sb + (int64_t)n * jb.ss + (int64_t)h * jb.sh + ch * 8;
    uint4 *p = jb.pad + (int64_t)row * jb.cpr + ch;
    uint16_t v[8];
    if (IN) {
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = k < e ? u[k] : (uint16_t)0;
      *p = make_uint4(v[0] | (uint32_t)v[1] << 16, v[2] | (uint32_t)v[3] << 16,
                      v[4] | (uint32_t)v[5] << 16, v[6] | (uint32_t)v[7] << 16);
    } else {
      const uint4 w = *p;
      const uint32_t x[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int k = 0; k < 8; ++k)
        if (k < e) u[k] = (uint16_t)(x[k >> 1] >> (16 * (k & 1)));
    }
  }
}

/* The shape of a tensor not given yet: its pass's counterpart (o, dout, dq
 * are shaped as q; dk, dv as k). */
fa_tensor shaped(const fa_tensor *t, const fa_tensor *like) {
  if (t->headdim) return *t;
  fa_tensor r = *like;
  r.data = NULL;
  r.stride_head = like->headdim; /* rows back to back */
  r.stride_seq = like->heads * like->headdim;
  r.stride_batch = like->seqlen * r.stride_seq;
  return r;
}

/* Plans the copies into the workspace from byte base on (ws NULL: sizes
 * only) and points *view's tensors at them (repack.cuh says which). */
void repack_plan(const fa_problem *pb, fa_pass pass, char *ws, size_t base, Repack *rp,
                 fa_problem *view) {
  *view = *pb;
  rp->n = 0;
  rp->bytes = 0;
  const bool bwd = pass == FA_PASS_BACKWARD, varlen = pb->varlen;
  const bool cache = pb->seqused_k != NULL;
  struct Slot {
    fa_tensor *t;
    const fa_tensor *like;
    bool in, out;
  };
  /* outputs whose untouched rows must survive are copied in as well */
  const Slot fwd_slots[4] = {{&view->q, &pb->q, true, false},
                             {&view->k, &pb->k, true, false},
                             {&view->v, &pb->k, true, false},
                             {&view->o, &pb->q, varlen, true}};
  const Slot bwd_slots[8] = {{&view->q, &pb->q, true, false},
                             {&view->k, &pb->k, true, false},
                             {&view->v, &pb->k, true, false},
                             {&view->o, &pb->q, true, false},
                             {&view->dout, &pb->q, true, false},
                             {&view->dq, &pb->q, varlen, true},
                             {&view->dk, &pb->k, varlen || cache, true},
                             {&view->dv, &pb->k, varlen || cache, true}};
  const Slot *slots = bwd ? bwd_slots : fwd_slots;
  const int count = bwd ? 8 : 4;
  const int64_t d = pb->headdim, dp = (d + 7) / 8 * 8;
  size_t off = base;
  for (int i = 0; i < count; i++) {
    const fa_tensor sh = shaped(slots[i].t, slots[i].like);
    const bool known = slots[i].t->headdim != 0;
    if (known ? rows_aligned(slots[i].t) : d % 8 == 0) continue;
    Repack::Job &jb = rp->job[rp->n++];
    jb.user = slots[i].t; /* view's copy of the caller's descriptor, replaced below */
    jb.in = slots[i].in;
    jb.out = slots[i].out;
    fa_tensor &p = jb.pad;
    p = sh;
    p.data = ws ? ws + off : NULL;
    p.stride_head = dp;
    p.stride_seq = sh.heads * dp;
    p.stride_batch = sh.seqlen * p.stride_seq;
    off += round256((size_t)(sh.batch * sh.seqlen * sh.heads * dp) * 2);
  }
  rp->bytes = off - base;
  if (!ws) return;
  /* the jobs keep the caller's tensors (pb's), the view gets the copies */
  for (int i = 0; i < rp->n; i++) {
    fa_tensor *t = const_cast<fa_tensor *>(rp->job[i].user);
    const ptrdiff_t at = (const char *)t - (const char *)view;
    rp->job[i].user = (const fa_tensor *)((const char *)pb + at);
    *t = rp->job[i].pad;
  }
}

/* The copies in (in = true) or back, one launch for all of them. */
fa_status repack_run(const Repack &rp, bool in, cudaStream_t stream) {
  CopyJobs jobs;
  int n = 0;
  int64_t most = 0, chunks = 0;
  for (int i = 0; i < rp.n; i++) {
    const Repack::Job &jb = rp.job[i];
    if (!(in ? jb.in : jb.out)) continue;
    const fa_tensor *u = jb.user;
    CopyJob &c = jobs.j[n++];
    c.user = (uint16_t *)u->data;
    c.pad = (uint4 *)jb.pad.data;
    c.sb = u->stride_batch, c.ss = u->stride_seq, c.sh = u->stride_head;
    c.batch = u->batch, c.seqlen = u->seqlen, c.heads = u->heads;
    c.d = (int)u->headdim;
    c.cpr = (int)(jb.pad.stride_head / 8);
    const int64_t rows = u->batch * u->seqlen * u->heads;
    most = rows > most ? rows : most;
    const int64_t per_block = 8 * (32 / c.cpr);
    const int64_t blocks = (rows + per_block - 1) / per_block;
    chunks = blocks > chunks ? blocks : chunks;
  }
  if (n == 0 || most == 0) return FA_OK;
  /* enough blocks to fill the GPU several times over; the rest loop */
  const dim3 grid((unsigned)(chunks < 8192 ? chunks : 8192), (unsigned)n);
  const bool narrow = most < INT_MAX / 2; /* row + step stays below 2^31 */
  if (in)
    narrow ? repack_kernel<int, true><<<grid, 256, 0, stream>>>(jobs)
           : repack_kernel<int64_t, true><<<grid, 256, 0, stream>>>(jobs);
  else
    narrow ? repack_kernel<int, false><<<grid, 256, 0, stream>>>(jobs)
           : repack_kernel<int64_t, false><<<grid, 256, 0, stream>>>(jobs);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return fa_set_error(FA_ERR_DEVICE, "cuda: %s", cudaGetErrorString(e));
  return FA_OK;
}

}  // namespace

size_t repack_workspace(const fa_problem *pb, fa_pass pass, size_t base) {
  Repack rp;
  fa_problem view;
  repack_plan(pb, pass, NULL, base, &rp, &view);
  return base + rp.bytes;
}

fa_status repack_around(const fa_problem *pb, fa_pass pass, size_t base,
                        fa_status (*run)(const fa_problem *view)) {
  Repack rp;
  fa_problem view;
  repack_plan(pb, pass, (char *)pb->workspace, base, &rp, &view);
  const cudaStream_t s = (cudaStream_t)pb->stream;
  fa_status st = repack_run(rp, true, s);
  if (st == FA_OK) st = run(&view);
  if (st == FA_OK) st = repack_run(rp, false, s);
  return st;
}

}  // namespace fa
