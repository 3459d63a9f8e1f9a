/* float16 / bfloat16 <-> float32 conversion (round to nearest even), and row
 * loaders that turn a strided storage row into float32 in one call, so inner
 * loops never convert element by element through a function call. */
#ifndef FA_COMMON_CONVERT_H
#define FA_COMMON_CONVERT_H

#include <stdint.h>
#include <string.h>

#include "flashattn.h"

static inline float fa_bits_to_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline uint32_t fa_f32_to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static inline float fa_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return fa_bits_to_f32(sign | 0x7f800000u | (man << 13)); /* inf/nan */
  if (exp == 0) {
    /* zero or subnormal: man * 2^-24 is exact in float32 */
    float f = (float)man * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  return fa_bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline uint16_t fa_f32_to_f16(float f) {
  uint32_t x = fa_f32_to_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
  if (ax < 0x38800000u) {
    /* subnormal f16 (or zero): round ax * 2^24 to an integer, ties to even */
    float a = fa_bits_to_f32(ax) * 16777216.0f;
    uint32_t r = (uint32_t)a;
    float frac = a - (float)r;
    if (frac > 0.5f || (frac == 0.5f && (r & 1u))) r++;
    return (uint16_t)(sign | r);
  }
  uint32_t m = ax + 0xc8000fffu + ((ax >> 13) & 1u); /* rebias exponent, round to even */
  return (uint16_t)(sign | (m >> 13));
}

static inline float fa_bf16_to_f32(uint16_t h) { return fa_bits_to_f32((uint32_t)h << 16); }

static inline uint16_t fa_f32_to_bf16(float f) {
  uint32_t x = fa_f32_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* quiet nan */
  x += 0x7fffu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}

/* dst[0..n) = float32 of n contiguous elements of src in dtype. */
static inline void fa_load_row_f32(float *dst, const void *src, fa_dtype dt, int64_t n) {
  int64_t i;
  switch (dt) {
    case FA_DTYPE_F32:
      memcpy(dst, src, (size_t)n * sizeof(float));
      break;
    case FA_DTYPE_F16: {
      const uint16_t *s = (const uint16_t *)src;
      for (i = 0; i < n; i++) dst[i] = fa_f16_to_f32(s[i]);
      break;
    }
    case FA_DTYPE_BF16: {
      const uint16_t *s = (const uint16_t *)src;
      for (i = 0; i < n; i++) dst[i] = fa_bf16_to_f32(s[i]);
      break;
    }
    case FA_DTYPE_F64: {
      const double *s = (const double *)src;
      for (i = 0; i < n; i++) dst[i] = (float)s[i];
      break;
    }
  }
}

/* n contiguous elements of dst in dtype = src (rounded to nearest even). */
static inline void fa_store_row_f32(void *dst, const float *src, fa_dtype dt, int64_t n) {
  int64_t i;
  switch (dt) {
    case FA_DTYPE_F32:
      memcpy(dst, src, (size_t)n * sizeof(float));
      break;
    case FA_DTYPE_F16: {
      uint16_t *d = (uint16_t *)dst;
      for (i = 0; i < n; i++) d[i] = fa_f32_to_f16(src[i]);
      break;
    }
    case FA_DTYPE_BF16: {
      uint16_t *d = (uint16_t *)dst;
      for (i = 0; i < n; i++) d[i] = fa_f32_to_bf16(src[i]);
      break;
    }
    case FA_DTYPE_F64: {
      double *d = (double *)dst;
      for (i = 0; i < n; i++) d[i] = (double)src[i];
      break;
    }
  }
}

#endif
