/* Bytes per element of a storage dtype (0 for an unknown one): what every layer
 * needs to step through a tensor; the public fa_dtype_size returns it. */
#ifndef FA_COMMON_DTYPE_H
#define FA_COMMON_DTYPE_H

#include <stddef.h>

#include "flashattn.h"

static inline size_t fa_dtype_bytes(fa_dtype dtype) {
  switch (dtype) {
    case FA_DTYPE_F32:
      return 4;
    case FA_DTYPE_F16:
    case FA_DTYPE_BF16:
      return 2;
    case FA_DTYPE_F64:
      return 8;
  }
  return 0;
}

#endif
