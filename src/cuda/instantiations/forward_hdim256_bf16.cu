/* Forward kernels for head dims up to 256, bf16: one file per (head dim, dtype), so a
 * parallel build spreads them and no file takes long. */
#include "cuda/forward_kernel.cuh"

namespace fa {
template fa_status flash_fwd_launch<__nv_bfloat16, 256>(const FwdArgs &, cudaStream_t);
}  // namespace fa
