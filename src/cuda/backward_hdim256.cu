/* Backward kernels for head dims up to 256 (one file per head dim: parallel builds). */
#include "backward_kernel.cuh"

namespace fa {
template fa_status flash_bwd_launch<__half, 256>(const BwdArgs &, cudaStream_t);
template fa_status flash_bwd_launch<__nv_bfloat16, 256>(const BwdArgs &, cudaStream_t);
template fa_status bwd_rows_launch<__half, 256>(const BwdArgs &, cudaStream_t, bool);
template fa_status bwd_rows_launch<__nv_bfloat16, 256>(const BwdArgs &, cudaStream_t, bool);
}  // namespace fa
