/* Hopper (sm_90a) kernels: compiled into the library when the build targets
 * arch 90 (FA_HAVE_SM90A), used when the device is compute capability 9.0. */
#ifndef FA_CUDA_SM90_H
#define FA_CUDA_SM90_H

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <utility>

#include "../layout.cuh"
#include "backend.h"

namespace fa {

struct AttnArgs;
struct FwdArgs;
struct BwdArgs;

/* The current device runs the sm_90a code (compute capability 9.0) and
 * FLASHATTN_CUDA_WGMMA is not "0" (read once per device). */
bool sm90_device();
/* FLASHATTN_CUDA_WGMMA=strict: a layout the Hopper kernels refuse (a tensor
 * map the driver will not encode) is an error instead of a fallback to the
 * sm_80 kernels, so tests can tell which kernels ran. */
bool sm90_strict();
/* The wgmma forward handles these arguments (plain scores or a block mask of
 * 128-multiple blocks, no dropout, head dim 33..64 or 97..128); otherwise the
 * sm_80 kernels run. */
bool sm90_forward_covers(const AttnArgs &a);
template <typename T>
fa_status sm90_forward(const FwdArgs &a, cudaStream_t s);
/* The wgmma backward handles these arguments (as the forward; deterministic
 * mode too); otherwise the sm_80 kernels run. */
bool sm90_backward_covers(const BwdArgs &a);
template <typename T>
fa_status sm90_backward(const BwdArgs &a, cudaStream_t s);

namespace sm90 {
/* The Hopper kernels' head dims: d (33..256) padded to 64, 128, 192 or 256
 * columns (the tensor maps fill the columns past d with zeros). */
constexpr int headdim(int64_t d) { return d > 192 ? 256 : d > 128 ? 192 : d > 64 ? 128 : 64; }
/* Calls f(std::integral_constant<int, D>()) for d's padded head dim D. */
template <class F>
fa_status dispatch_headdim(int64_t d, F &&f) {
  return dispatch_dim<64, 128, 192, 256>(headdim(d), std::forward<F>(f));
}
/* Tensor map of a (batch, seqlen, heads, d) 16-bit tensor with element strides
 * sb, ss, sh: boxes of 64 columns x box_rows rows (x box_heads heads, stacked
 * head after head), 128-byte swizzle (the SW128 tile layout of wgmma.cuh),
 * zeros outside the tensor. packed: a varlen
 * tensor of seqlen packed rows (batch unused), mapped so that each sequence
 * ends where the map does (map_seq in wgmma.cuh gives its coordinates).
 * FA_ERR_UNSUPPORTED when the driver refuses the layout: the launches then
 * take the sm_80 kernels. */
fa_status make_map(CUtensorMap *m, bool bf16, const void *base, int d, int64_t seqlen,
                   int64_t heads, int64_t batch, int64_t ss, int64_t sh, int64_t sb, bool packed,
                   int box_rows, int box_heads = 1);
/* make_map for K or V: packed for varlen, and for a fixed-length KV cache
 * (cache: used_k given) whose batch's rows are then one packed sequence of
 * batch * seqlen rows, seqlen the rows from one sequence's first key to the
 * next's (kv_map_rows; map_kv in wgmma.cuh gives a sequence's coordinates), so
 * each sequence's map ends at its last used key. */
fa_status make_kv_map(CUtensorMap *m, bool bf16, const void *base, int d, int64_t seqlen,
                      int64_t heads, int64_t batch, int64_t ss, int64_t sh, int64_t sb, bool varlen,
                      bool cache, int box_rows);
/* The same map of a packed (batch, heads, seqlen, d) float32 tensor (the dQ
 * accumulator; varlen: (heads, total rows, d)), boxes of 32 columns x
 * box_rows rows: rows past a sequence's end are outside it, so reductions
 * into them are dropped. */
/* The rows make_kv_map's cache map puts from one sequence's first key to the
 * next's: K's batch stride over its row stride, so any layout whose batch
 * stride is a whole number of rows, the same for K and V, maps: (batch,
 * seqlen, heads, d) gives seqlen, (batch, heads, seqlen, d) heads x seqlen.
 * nk at batch 1; -1 when the cache cannot be mapped so (the sm_80 kernels
 * then run). */
int64_t kv_map_rows(const AttnArgs &a);
fa_status make_map_f32(CUtensorMap *m, const float *base, int d, int64_t seqlen, int64_t heads,
                       int64_t batch, bool packed, int box_rows);
}  // namespace sm90

}  // namespace fa

#endif
