/* Persistent, dynamically scheduled Hopper kernels: one CTA per SM runs
 * block after block (query blocks forward), taking the next one from a
 * counter in global memory (zeroed by the launch when it is read), in
 * launch order: query blocks fastest, longest first for causal, then heads,
 * then sequences.
 * Taking blocks as CTAs free up is what the hardware's block scheduler does
 * for one CTA per block, so causal work stays balanced and concurrent CTAs
 * still share a head's K/V in L2; being persistent, a CTA loads its next
 * block's Q and first K/V tiles while it stores this block's output.
 *
 * Static orders were measured worse (docs/PERF.md): every G-th block in
 * launch order piles the long causal blocks of several heads on the same
 * CTAs, and longest-first across heads loses the K/V sharing (D=128 causal
 * N <= 2048 7-18% slower on an H100). */
#ifndef FA_CUDA_SM90_SCHEDULE_CUH
#define FA_CUDA_SM90_SCHEDULE_CUH

#include <stdint.h>

namespace fa {
namespace sm90 {

/* Division by a divisor fixed at launch, without the divide instruction
 * sequence (a multiply-high, an add and a shift): for 0 <= n < 2^31 and
 * 1 <= d < 2^31, with s = ceil(log2 d) and m = floor(2^32 (2^s - d) / d) + 1,
 * n / d = (umulhi(n, m) + n) >> s (Granlund and Montgomery; the sum stays
 * under 2^32 as n < 2^31). */
struct FastDiv {
  uint32_t m;
  int s;
  static FastDiv make(int d) {
    FastDiv f;
    if (d < 1) d = 1; /* an empty launch's: never divided by */
    f.s = 0;
    while ((1ull << f.s) < (uint64_t)d) ++f.s;
    f.m = (uint32_t)(((1ull << 32) * ((1ull << f.s) - (uint64_t)d)) / (uint64_t)d + 1);
    return f;
  }
#ifdef __CUDACC__
  __device__ __forceinline__ int div(int n) const {
    return (int)((__umulhi((uint32_t)n, m) + (uint32_t)n) >> s);
  }
#endif
};

struct Schedule {
  int nblk, heads, batch; /* blocks per (sequence, head), heads, sequences */
  FastDiv by_nblk, by_heads;
  int *next; /* blocks taken past the first gridDim.x; zero at launch (if read) */

  __device__ __forceinline__ int total() const { return nblk * heads * batch; }
  /* The block after this CTA's current one (the first is blockIdx.x). With
   * no more blocks than CTAs there is none: the counter is neither read nor
   * zeroed (one graph node less for a decode step). */
  __device__ __forceinline__ int take() const {
    return total() <= (int)gridDim.x ? total() : (int)gridDim.x + atomicAdd(next, 1);
  }
  /* Block t: index x in the kernel's own order, head h, sequence b. 32-bit:
   * the launch checks that the blocks fit (64-bit division would spill the
   * producer warp's few registers). */
  __device__ __forceinline__ void decode(int t, int &x, int &h, int &b) const {
    const int rest = by_nblk.div(t);
    x = t - rest * nblk;
    b = by_heads.div(rest);
    h = rest - b * heads;
  }
  void set(int nblk_, int heads_, int batch_, int *next_) {
    nblk = nblk_, heads = heads_, batch = batch_, next = next_;
    by_nblk = FastDiv::make(nblk_);
    by_heads = FastDiv::make(heads_);
  }
};

/* CTAs for a persistent launch of `blocks` blocks on the current device: one
 * per SM, less `margin` SMs left to other work (fa_params.sm_margin; at least
 * one CTA); 0 when blocks is 0 or does not fit Schedule's 32-bit indices (the
 * caller then takes the sm_80 kernels). */
int persistent_ctas(int64_t blocks, int margin = 0);

}  // namespace sm90
}  // namespace fa

#endif
