/* flashattn-block-sweep: the FlashAttention paper's Figure 2 (middle) for our
 * CUDA forward: runtime and HBM traffic of the FlashAttention-2 kernel against
 * the key block size Bc (and the query block size Br = 16 MT NW), at one
 * shape (default GPT-2 medium: B=64, H=16, N=1024, D=64, f16, not causal).
 *
 * Each configuration is a separate instantiation of the library's kernel
 * (flash_fwd_launch with another tile shape), so the sweep needs no rebuild of
 * the library. It is the one bench/ program below the public API: the tile
 * shape is not (and should not be) an API parameter. Before timing, each configuration's O is
 * compared with the library's own fa_forward; a mismatch fails the run. Analytic traffic in the
 * FlashAttention-2 order: Q and O once, K and V once per query block of Br rows
 * (Bc does not enter), plus the log-sum-exp. --once makes exactly one launch
 * per configuration and nothing else on the GPU, in the printed order, for
 * ncu's dram__bytes counters (tools/gpu_experiments.py pairs them up).
 *
 * Usage: flashattn-block-sweep [--batch B] [--heads H] [--seqlen N] [--once]
 * Prints one JSON object per configuration. */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "cuda/forward_kernel.cuh"
#include "cuda/layout.cuh"

namespace {

template <int MT_, int NW_, int BC_>
struct Shape {
  static constexpr int MT = MT_, NW = NW_, BC = BC_;
  static constexpr bool QREG = false;
};

struct Run {
  int mt, nw, bc;
  fa_status (*launch)(const fa::FwdArgs &, cudaStream_t);
};

template <int MT, int NW, int BC>
Run make_run() {
  return {MT, NW, BC, fa::flash_fwd_launch<__half, 64, Shape<MT, NW, BC>>};
}

#define CK(x)                                                  \
  do {                                                         \
    cudaError_t e_ = (x);                                      \
    if (e_ != cudaSuccess) {                                   \
      fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); \
      exit(1);                                                 \
    }                                                          \
  } while (0)

__global__ void fill_random(__half *x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    x[i] = __float2half((float)(h & 0xffff) / 32768.f - 1.f);
  }
}

}  // namespace

int main(int argc, char **argv) {
  int64_t B = 64, H = 16, N = 1024;
  const int64_t D = 64;
  bool once = false;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--once"))
      once = true;
    else if (i + 1 < argc && !strcmp(argv[i], "--batch"))
      B = atoll(argv[++i]);
    else if (i + 1 < argc && !strcmp(argv[i], "--heads"))
      H = atoll(argv[++i]);
    else if (i + 1 < argc && !strcmp(argv[i], "--seqlen"))
      N = atoll(argv[++i]);
    else {
      fprintf(stderr, "usage: %s [--batch B] [--heads H] [--seqlen N] [--once]\n", argv[0]);
      return 2;
    }
  }
  if (B < 1 || H < 1 || N < 1) {
    fprintf(stderr, "batch, heads and seqlen must be positive\n");
    return 2;
  }
  /* MT = 2 with 128-key tiles spills (its accumulators need more than 255 registers) */
  const Run runs[] = {make_run<1, 4, 16>(),  make_run<1, 4, 32>(), make_run<1, 4, 64>(),
                      make_run<1, 4, 128>(), make_run<2, 4, 16>(), make_run<2, 4, 32>(),
                      make_run<2, 4, 64>()};

  const size_t n = (size_t)(B * H * N * D);
  __half *q, *k, *v, *o, *o_ref;
  float *lse;
  CK(cudaMalloc(&q, n * 2));
  CK(cudaMalloc(&k, n * 2));
  CK(cudaMalloc(&v, n * 2));
  CK(cudaMalloc(&o, n * 2));
  CK(cudaMalloc(&o_ref, n * 2));
  CK(cudaMalloc(&lse, (size_t)(B * H * N) * 4));
  fill_random<<<1024, 256>>>(q, n, 1u);
  fill_random<<<1024, 256>>>(k, n, 2u);
  fill_random<<<1024, 256>>>(v, n, 3u);

  fa_params prm;
  memset(&prm, 0, sizeof prm);
  prm.device = FA_DEVICE_CUDA;
  auto tensor = [&](__half *p) {
    fa_tensor t = {p, FA_DTYPE_F16, B, N, H, D, N * H * D, H * D, D};
    return t;
  };
  fa_tensor tq = tensor(q), tk = tensor(k), tv = tensor(v), to = tensor(o), tr = tensor(o_ref);
  if (!once && fa_forward(&prm, &tq, &tk, &tv, &tr, lse) != FA_OK) {
    fprintf(stderr, "fa_forward: %s\n", fa_last_error());
    return 1;
  }
  fa_problem pb;
  memset(&pb, 0, sizeof pb);
  pb.device = FA_DEVICE_CUDA;
  pb.algorithm = prm.algorithm;
  pb.dropout = fa_dropout_make(0.f, 0, 0);
  pb.q = tq, pb.k = tk, pb.v = tv, pb.o = to, pb.lse = lse;
  pb.dtype = FA_DTYPE_F16;
  pb.batch = B, pb.heads_q = H, pb.heads_k = H, pb.group = 1, pb.headdim = D;
  pb.max_seqlen_q = N, pb.max_seqlen_k = N, pb.total_q = B * N, pb.k_cap = N;
  pb.scale = 1.f / sqrtf((float)D);
  fa::FwdArgs a;
  memset(&a, 0, sizeof a); /* no key splits, no GQA packing, no KV cache */
  a.nsplit = a.pack = 1;
  a.o = o;
  a.lse = lse;
  a.o_sb = to.stride_batch, a.o_ss = to.stride_seq, a.o_sh = to.stride_head;
  fa::fill_common_args(a, &pb);

  std::vector<__half> h_o(once ? 0 : n), h_ref(once ? 0 : n);
  if (!once) CK(cudaMemcpy(h_ref.data(), o_ref, n * 2, cudaMemcpyDeviceToHost));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  int failed = 0;
  for (const Run &r : runs) {
    const int br = 16 * r.mt * r.nw;
    double ms = 0, err = 0;
    if (r.launch(a, 0) != FA_OK) {
      fprintf(stderr, "launch Bc=%d Br=%d: %s\n", r.bc, br, fa_last_error());
      return 1;
    }
    CK(cudaDeviceSynchronize());
    if (!once) {
      CK(cudaMemcpy(h_o.data(), o, n * 2, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < n; i++)
        err = std::max(err, (double)fabsf(__half2float(h_o[i]) - __half2float(h_ref[i])));
      /* different tile orders round differently: a few f16 ulps of |O| < 1 */
      if (!(err <= 4e-3)) failed = 1;
      std::vector<float> t;
      for (int rep = 0; rep < 23; rep++) {
        CK(cudaEventRecord(e0));
        r.launch(a, 0);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float x;
        CK(cudaEventElapsedTime(&x, e0, e1));
        if (rep >= 3) t.push_back(x);
      }
      std::sort(t.begin(), t.end());
      ms = t[t.size() / 2];
    }
    const double blocks_q = (double)((N + br - 1) / br);
    const double bytes = 2.0 * B * H * N * D * (2 + 2 * blocks_q) + 4.0 * B * H * N;
    const double flops = 4.0 * B * H * N * N * D;
    printf(
        "{\"Bc\": %d, \"Br\": %d, \"MT\": %d, \"NW\": %d, \"B\": %lld, \"H\": %lld, "
        "\"N\": %lld, \"D\": %lld, \"ms\": %.4f, \"tflops\": %.1f, \"hbm_bytes_analytic\": "
        "%.0f, \"max_abs_diff_vs_library\": %.3g%s}\n",
        r.bc, br, r.mt, r.nw, (long long)B, (long long)H, (long long)N, (long long)D, ms,
        ms > 0 ? flops / ms * 1e-9 : 0.0, bytes, err, once ? ", \"once\": true" : "");
  }
  if (failed) fprintf(stderr, "FAIL: a configuration's O differs from fa_forward's\n");
  return failed;
}
