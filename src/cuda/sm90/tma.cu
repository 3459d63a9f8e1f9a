/* Host side of the Hopper kernels: tensor maps for their TMA copies, the
 * persistent launches' CTA count. */
#include <limits.h>

#include "schedule.cuh"
#include "sm90.h"

namespace fa {
namespace sm90 {

/* cuTensorMapEncodeTiled, from the driver through the runtime (no -lcuda). */
using EncodeFn = CUresult (*)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                              const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                              const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                              CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
static EncodeFn encode_fn() {
  static EncodeFn fn = nullptr; /* a race only repeats the lookup */
  if (!fn) {
    void *ptr = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<EncodeFn>(ptr);
  }
  return fn;
}

/* The (d, seqlen, heads, batch) map both makers share, with the Hopper
 * kernels' fixed choices (128-byte swizzle, 256-byte L2 promotion, zeros
 * outside the tensor): esize-byte elements at element strides ss, sh, sb,
 * boxes of box_cols x box_rows x box_heads (land head-major: row r of the
 * tile is row r % box_rows of head r / box_rows). Dimensions of extent 1 get a packed stride
 * (theirs is arbitrary). packed (varlen, seqlen = the total rows): the
 * batch dimension (extent total + 1) is a row
 * stride too and the base moves back total rows, so coordinate (row, end)
 * addresses packed row row + end - total, and a sequence that ends at packed
 * row end, addressed from row total - len (map_seq in wgmma.cuh), has its own
 * end as the map's: rows past it load as zeros and take no reductions, as a
 * fixed-length batch's do (NaN or inf in a neighbour never reaches it). */
static fa_status map_4d(CUtensorMap *m, CUtensorMapDataType type, int64_t esize, const void *base,
                        int d, int64_t seqlen, int64_t heads, int64_t batch, int64_t ss, int64_t sh,
                        int64_t sb, bool packed, int box_cols, int box_rows, int box_heads) {
  const cuuint64_t dims[4] = {(cuuint64_t)d, (cuuint64_t)seqlen, (cuuint64_t)heads,
                              (cuuint64_t)(packed ? seqlen + 1 : batch)};
  int64_t st[4] = {1, ss, sh, sb};
  for (int i = 1; i < 4; i++)
    if (dims[i] == 1) st[i] = ((st[i - 1] * (int64_t)dims[i - 1] * esize + 15) / 16) * 16 / esize;
  if (packed) st[3] = st[1];
  const cuuint64_t strides[3] = {(cuuint64_t)(st[1] * esize), (cuuint64_t)(st[2] * esize),
                                 (cuuint64_t)(st[3] * esize)};
  const cuuint32_t box[4] = {(cuuint32_t)box_cols, (cuuint32_t)box_rows, (cuuint32_t)box_heads, 1};
  /* the moved base is never read: only coordinates inside the map are */
  const char *b0 = (const char *)base - (packed ? seqlen * st[1] * esize : 0);
  EncodeFn fn = encode_fn();
  if (!fn) return fa_set_error(FA_ERR_UNSUPPORTED, "cuda: cuTensorMapEncodeTiled is unavailable");
  const cuuint32_t estr[4] = {1, 1, 1, 1};
  CUresult r = fn(m, type, 4, const_cast<char *>(b0), dims, strides, box, estr,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  /* e.g. a broadcast (zero) stride: the caller falls back to the sm_80 kernels */
  if (r != CUDA_SUCCESS)
    return fa_set_error(FA_ERR_UNSUPPORTED, "cuda: cuTensorMapEncodeTiled failed (%d)", (int)r);
  return FA_OK;
}

fa_status make_map(CUtensorMap *m, bool bf16, const void *base, int d, int64_t seqlen,
                   int64_t heads, int64_t batch, int64_t ss, int64_t sh, int64_t sb, bool packed,
                   int box_rows, int box_heads) {
  return map_4d(m, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
                base, d, seqlen, heads, batch, ss, sh, sb, packed, 64, box_rows, box_heads);
}

fa_status make_kv_map(CUtensorMap *m, bool bf16, const void *base, int d, int64_t seqlen,
                      int64_t heads, int64_t batch, int64_t ss, int64_t sh, int64_t sb, bool varlen,
                      bool cache, int box_rows) {
  if (cache && !varlen)
    return make_map(m, bf16, base, d, batch * seqlen, heads, 1, ss, sh, sb, true, box_rows);
  return make_map(m, bf16, base, d, seqlen, heads, batch, ss, sh, sb, varlen, box_rows);
}
fa_status make_map_f32(CUtensorMap *m, const float *base, int d, int64_t seqlen, int64_t heads,
                       int64_t batch, bool packed, int box_rows) {
  return map_4d(m, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, d, seqlen, heads, batch, d, seqlen * d,
                heads * seqlen * d, packed, 32, box_rows, 1);
}

int persistent_ctas(int64_t blocks, int margin) {
  static int sms[64]; /* per device; a race only repeats the query */
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) dev = 0;
  if (!sms[dev] &&
      cudaDeviceGetAttribute(&sms[dev], cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    (void)cudaGetLastError(); /* not the launch's error */
    sms[dev] = 132;
  }
  if (blocks > INT_MAX / 2) return 0; /* taking blocks past the last stays below 2^31 */
  const int ctas = margin < sms[dev] ? sms[dev] - margin : 1;
  return (int)(blocks > ctas ? ctas : blocks);
}

}  // namespace sm90
}  // namespace fa
