/* The x86 intrinsic layer of kern_body.h: 8-lane float32 vectors as __m256,
 * AVX2 + FMA + F16C. Included by kern_avx2.c and kern_avx512vl.c, which
 * define SFX and KB_ISA and differ only in their compile flags: with
 * AVX-512F/VL the compiler has 32 vector registers, EVEX encodings and
 * broadcast memory operands for the same 256-bit code; kern_avx512.c (KB_WIDE)
 * also runs the matrix product on 512-bit vectors. */
#ifndef FA_COMMON_KERN_X86_H
#define FA_COMMON_KERN_X86_H

#include <immintrin.h>
#include <stdint.h>

typedef __m256 vf;
typedef __m256i vi;

static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vf_sel_eq(vf x, vf y, vf a, vf b) {
  return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, y, _CMP_EQ_OQ));
}
static inline vf vf_sel_ne0(vf p, vf a) {
  return _mm256_and_ps(a, _mm256_cmp_ps(p, _mm256_setzero_ps(), _CMP_NEQ_UQ));
}
static inline vi vf_bits(vf x) { return _mm256_castps_si256(x); }
static inline vf vf_from_bits(vi u) { return _mm256_castsi256_ps(u); }
static inline vi vi_add_shl23(vi u, unsigned k) {
  return _mm256_slli_epi32(_mm256_add_epi32(u, _mm256_set1_epi32((int)k)), 23);
}
static inline vi vi_set1(uint32_t x) { return _mm256_set1_epi32((int)x); }
static inline vi vi_iota(uint32_t x) {
  return _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), vi_set1(x));
}
static inline vi vi_xor(vi a, vi b) { return _mm256_xor_si256(a, b); }
static inline vi vi_mullo(vi a, uint32_t m) { return _mm256_mullo_epi32(a, vi_set1(m)); }
static inline vi vi_mulhi(vi a, uint32_t m) { /* high halves of the 64-bit products */
  const vi mv = vi_set1(m);
  const vi even = _mm256_srli_epi64(_mm256_mul_epu32(a, mv), 32);
  const vi odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), mv);
  return _mm256_blend_epi32(even, odd, 0xAA);
}
static inline vf vf_sel_ge_u(vi x, uint32_t t, float a) { /* x >= t (unsigned) ? a : 0 */
  const vi ge = _mm256_cmpeq_epi32(_mm256_max_epu32(x, vi_set1(t)), x);
  return _mm256_and_ps(_mm256_castsi256_ps(ge), _mm256_set1_ps(a));
}
static inline vf vf_load_f16(const uint16_t *p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline vf vf_load_bf16(const uint16_t *p) { /* bf16 is float32's upper half */
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline void vf_store_f16(uint16_t *p, vf v) {
  _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

#ifdef KB_WIDE
/* 16-lane vectors for the matrix product's register tiles (kern_avx512.c) */
typedef __m512 vw;
static inline vw vw_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vw_store(float *p, vw v) { _mm512_storeu_ps(p, v); }
static inline vw vw_set1(float x) { return _mm512_set1_ps(x); }
static inline vw vw_mul(vw a, vw b) { return _mm512_mul_ps(a, b); }
static inline vw vw_fma(vw a, vw b, vw c) { return _mm512_fmadd_ps(a, b, c); }
/* and for kern_lanes.h's 16-lane kernels (the softmax chunks, the backward's
 * elementwise steps, the decode's P V): vf's semantics */
typedef __m512i vwi;
static inline vw vw_add(vw a, vw b) { return _mm512_add_ps(a, b); }
static inline vw vw_sub(vw a, vw b) { return _mm512_sub_ps(a, b); }
static inline vw vw_max(vw a, vw b) { return _mm512_max_ps(a, b); }
static inline vw vw_min(vw a, vw b) { return _mm512_min_ps(a, b); }
static inline vw vw_sel_eq(vw x, vw y, vw a, vw b) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, y, _CMP_EQ_OQ), b, a);
}
static inline vw vw_load_f16(const uint16_t *p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline vw vw_load_bf16(const uint16_t *p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vw vw_sel_ne0(vw p, vw a) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(p, _mm512_setzero_ps(), _CMP_NEQ_UQ), a);
}
static inline vwi vw_bits(vw x) { return _mm512_castps_si512(x); }
static inline vw vw_from_bits(vwi u) { return _mm512_castsi512_ps(u); }
static inline vwi vwi_add_shl23(vwi u, unsigned k) {
  return _mm512_slli_epi32(_mm512_add_epi32(u, _mm512_set1_epi32((int)k)), 23);
}
#endif

static inline vf vf_sum8(const vf *v) {
  const vf ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const vf cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

static inline void vf_transpose8(vf *v) { /* v[i] lane j <-> v[j] lane i */
  const vf t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
  const vf t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
  const vf t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
  const vf t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
  const vf u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const vf u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const vf u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const vf u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  v[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  v[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  v[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  v[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  v[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  v[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  v[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  v[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

#include "common/kern_body.h"

#endif
