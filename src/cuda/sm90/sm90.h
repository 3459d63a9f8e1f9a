/* Hopper (sm_90a) kernels: compiled into the library when the build targets
 * arch 90 (FA_HAVE_SM90A), used when the device is compute capability 9.0. */
#ifndef FA_CUDA_SM90_H
#define FA_CUDA_SM90_H

#include <cuda_runtime.h>

#include "backend.h"

namespace fa {

struct FwdArgs;

/* The current device runs the sm_90a code (compute capability 9.0) and
 * FLASHATTN_CUDA_WGMMA is not "0" (read once per device). */
bool sm90_device();
/* The wgmma forward handles these arguments (plain scores, head dim 33..64 or
 * 97..128); otherwise the sm_80 kernels run. */
bool sm90_forward_covers(const FwdArgs &a);
template <typename T>
fa_status sm90_forward(const FwdArgs &a, cudaStream_t s);

}  // namespace fa

#endif
