/* Forward kernels for head dims up to 64 (one file per head dim: parallel builds). */
#include "forward_kernel.cuh"

namespace fa {
template fa_status flash_fwd_launch<__half, 64>(const FwdArgs &, cudaStream_t);
template fa_status flash_fwd_launch<__nv_bfloat16, 64>(const FwdArgs &, cudaStream_t);
}  // namespace fa
