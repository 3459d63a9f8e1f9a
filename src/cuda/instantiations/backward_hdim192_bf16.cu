/* Backward kernels for head dims up to 192, bf16: one file per (head dim, dtype), so a
 * parallel build spreads them and no file takes long. */
#include "cuda/backward_kernel.cuh"

namespace fa {
template fa_status flash_bwd_launch<__nv_bfloat16, 192>(const BwdArgs &, cudaStream_t);
template fa_status bwd_rows_launch<__nv_bfloat16, 192>(const BwdArgs &, cudaStream_t, bool);
}  // namespace fa
