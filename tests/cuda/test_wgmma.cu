/* Hopper tile primitives (src/cuda/sm90/wgmma.cuh) on their own: one
 * warpgroup loads Q (64 x D), K and V (BC x D) into SW128 tiles, computes
 * S = Q K^T with the SS wgmma and O = bf16(S) V with the RS wgmma, and the
 * host checks both against float64 on random inputs (outputs poisoned first).
 * A wrong descriptor shows as a wrong block of rows or columns, so the first
 * bad element is printed. Exits 77 (skipped) without a compute capability 9.0
 * device. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <vector>

#include "cuda/sm90/wgmma.cuh"

using T = __nv_bfloat16;
constexpr int BC = 128;

template <int D>
__global__ void probe(const T *q, const T *k, const T *v, float *s_out, float *o_out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace fa::sm90;
  extern __shared__ __align__(16) unsigned char raw[];
  const uint32_t sQ = (fa::smem_addr(raw) + 1023) & ~1023u;
  const uint32_t sK = sQ + 64 * D * 2, sV = sK + BC * D * 2;
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3;
  load_tile_sw128<T, 64, D, 128>(sQ, q, D, 64, D, tid);
  load_tile_sw128<T, BC, D, 128>(sK, k, D, BC, D, tid);
  load_tile_sw128<T, BC, D, 128>(sV, v, D, BC, D, tid);
  fa::cp_async_commit();
  fa::cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();
  float s[BC / 8][4], o[D / 8][4];
  wg_fence();
  for (int kk = 0; kk < D / 16; ++kk)
    wgmma_ss<T, BC>(s, sw128_kmajor<64>(sQ, kk), sw128_kmajor<BC>(sK, kk), kk > 0);
  wg_commit();
  wg_wait<0>();
  reg_fence(s);
  uint32_t pa[BC / 16][4];
  for (int kk = 0; kk < BC / 16; ++kk) fa::c_to_a<T>(pa[kk], s[2 * kk], s[2 * kk + 1]);
  wg_fence();
  for (int kk = 0; kk < BC / 16; ++kk)
    wgmma_rs<T, D>(o, pa[kk], sw128_mnmajor(sV, kk, BC * 128), kk > 0);
  wg_commit();
  wg_wait<0>();
  reg_fence(o);
  reg_fence(pa);
  const int row = (tid >> 5) * 16 + g;
  for (int j = 0; j < BC / 8; ++j)
    for (int e = 0; e < 4; ++e)
      s_out[(row + 8 * (e >> 1)) * BC + j * 8 + 2 * t + (e & 1)] = s[j][e];
  for (int j = 0; j < D / 8; ++j)
    for (int e = 0; e < 4; ++e) o_out[(row + 8 * (e >> 1)) * D + j * 8 + 2 * t + (e & 1)] = o[j][e];
#endif
}

static float bf(float x) { return __bfloat162float(__float2bfloat16(x)); }

template <int D>
static int run() {
  std::vector<T> q(64 * D), k(BC * D), v(BC * D);
  std::vector<float> qf(q.size()), kf(k.size()), vf(v.size());
  srand(D);
  auto fill = [](std::vector<T> &h, std::vector<float> &f) {
    for (size_t i = 0; i < h.size(); i++) {
      f[i] = bf((float)rand() / RAND_MAX * 2 - 1);
      h[i] = __float2bfloat16(f[i]);
    }
  };
  fill(q, qf), fill(k, kf), fill(v, vf);
  T *dq, *dk, *dv;
  float *ds, *dout;
  cudaMalloc(&dq, q.size() * 2), cudaMalloc(&dk, k.size() * 2), cudaMalloc(&dv, v.size() * 2);
  cudaMalloc(&ds, 64 * BC * 4), cudaMalloc(&dout, 64 * D * 4);
  cudaMemset(ds, 0xff, 64 * BC * 4), cudaMemset(dout, 0xff, 64 * D * 4); /* NaN poison */
  cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dk, k.data(), k.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dv, v.data(), v.size() * 2, cudaMemcpyHostToDevice);
  const int smem = (64 + 2 * BC) * D * 2 + 1024;
  cudaFuncSetAttribute(probe<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  probe<D><<<1, 128, smem>>>(dq, dk, dv, ds, dout);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    printf("FAIL wgmma D=%d: %s\n", D, cudaGetErrorString(e));
    return 1;
  }
  std::vector<float> s(64 * BC), o(64 * D);
  cudaMemcpy(s.data(), ds, s.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(o.data(), dout, o.size() * 4, cudaMemcpyDeviceToHost);
  int bad = 0;
  double worst_s = 0, worst_o = 0;
  std::vector<float> pb(64 * BC);
  for (int i = 0; i < 64; i++)
    for (int j = 0; j < BC; j++) {
      double ref = 0;
      for (int d = 0; d < D; d++) ref += (double)qf[i * D + d] * kf[j * D + d];
      const double err = fabs(s[i * BC + j] - ref);
      if (!(err <= 1e-3 * (1 + fabs(ref))) && bad++ < 3)
        printf("  S[%d][%d] = %g, want %g\n", i, j, s[i * BC + j], ref);
      worst_s = err > worst_s || err != err ? err : worst_s;
      pb[i * BC + j] = bf(s[i * BC + j]); /* P as the kernel rounded it */
    }
  for (int i = 0; i < 64; i++)
    for (int d = 0; d < D; d++) {
      double ref = 0;
      for (int j = 0; j < BC; j++) ref += (double)pb[i * BC + j] * vf[j * D + d];
      const double err = fabs(o[i * D + d] - ref);
      if (!(err <= 1e-3 * (1 + fabs(ref))) && bad++ < 6)
        printf("  O[%d][%d] = %g, want %g\n", i, d, o[i * D + d], ref);
      worst_o = err > worst_o || err != err ? err : worst_o;
    }
  printf("%s wgmma D=%d: max |S err| %.3g, max |O err| %.3g, %d bad\n", bad ? "FAIL" : "ok", D,
         worst_s, worst_o, bad);
  cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(ds), cudaFree(dout);
  return bad != 0;
}

int main() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 77;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (major != 9 || minor != 0) {
    printf("skipped: needs compute capability 9.0\n");
    return 77;
  }
  const int fails = run<64>() + run<128>();
  return fails ? 1 : 0;
}
