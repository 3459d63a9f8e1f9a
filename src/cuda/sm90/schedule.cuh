/* Persistent scheduling for the Hopper kernels: CTA c of G walks blocks c,
 * c + G, c + 2G ... of the launch order (query or key blocks fastest, then
 * heads, then sequences), so with one CTA per SM a block's first loads
 * overlap the previous block's tail and no CTA is launched per block.
 * Concurrent CTAs still share a head's K/V in L2, as with one CTA per block.
 *
 * The order is static, so it balances only blocks of equal work. Causal
 * launches keep one CTA per block (G = blocks), where the hardware's greedy
 * block scheduler balances them: a static round-robin in launch order would
 * give one CTA the long blocks of several heads (~1.5x the ideal time at
 * N=16k), and a longest-first order across heads lost the K/V sharing (D=128
 * causal N <= 2048 7-18% slower on an H100, docs/PERF.md). */
#ifndef FA_CUDA_SM90_SCHEDULE_CUH
#define FA_CUDA_SM90_SCHEDULE_CUH

#include <stdint.h>

namespace fa {
namespace sm90 {

struct Schedule {
  int nblk, heads, batch; /* blocks per (sequence, head), heads, sequences */

  /* Block x (0 = the first in the kernel's own order), head h and sequence b
   * of this CTA's round r; false once the rounds are exhausted. 32-bit: the
   * launch checks that the blocks fit (64-bit division would cost the
   * producer warp, which runs on few registers, a spill). */
  __device__ __forceinline__ bool block(int r, int &x, int &h, int &b) const {
    const unsigned i = (unsigned)r * gridDim.x + blockIdx.x;
    if (i >= (unsigned)(heads * batch) * nblk) return false;
    const int rest = (int)(i / nblk);
    x = (int)(i % nblk);
    h = rest % heads;
    b = rest / heads;
    return true;
  }
};

/* CTAs for a launch of `blocks` blocks on the current device: one per SM
 * when persistent, else one per block; 0 when blocks is 0 or does not fit
 * Schedule's 32-bit indices (the caller then takes the sm_80 kernels). */
int launch_ctas(int64_t blocks, bool persistent);

}  // namespace sm90
}  // namespace fa

#endif
