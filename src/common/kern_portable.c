/* kern_body.h in portable C: GCC/Clang vector extensions, which compile to
 * SSE2 pairs on baseline x86-64 and to NEON on ARM64. The path for CPUs
 * without AVX2/FMA, and a second implementation the tests run (see kern.h). */
#include <stdint.h>
#include <string.h>

#include "common/convert.h"

/* The vectors never cross a call boundary that is not inlined: no ABI to keep. */
#pragma GCC diagnostic ignored "-Wpsabi"

typedef float vf __attribute__((vector_size(32)));
typedef uint32_t vi __attribute__((vector_size(32)));
typedef int32_t vm __attribute__((vector_size(32)));

static inline vf vf_load(const float *p) {
  vf v;
  memcpy(&v, p, sizeof v);
  return v;
}
static inline void vf_store(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf vf_set1(float x) { return (vf){x, x, x, x, x, x, x, x}; }
static inline vf vf_add(vf a, vf b) { return a + b; }
static inline vf vf_sub(vf a, vf b) { return a - b; }
static inline vf vf_mul(vf a, vf b) { return a * b; }
static inline vf vf_fma(vf a, vf b, vf c) { return a * b + c; }
static inline vf vf_bits_sel(vm mask, vf a, vf b) {
  return (vf)(((vi)mask & (vi)a) | (~(vi)mask & (vi)b));
}
/* as x86 max/min: the second operand when either is NaN */
static inline vf vf_max(vf a, vf b) { return vf_bits_sel(a > b, a, b); }
static inline vf vf_min(vf a, vf b) { return vf_bits_sel(a < b, a, b); }
static inline vf vf_sel_eq(vf x, vf y, vf a, vf b) { return vf_bits_sel(x == y, a, b); }
static inline vf vf_sel_ne0(vf p, vf a) { return vf_bits_sel(p != 0, a, vf_set1(0.0f)); }
static inline vi vf_bits(vf x) { return (vi)x; }
static inline vf vf_from_bits(vi u) { return (vf)u; }
static inline vi vi_add_shl23(vi u, unsigned k) { return (u + k) << 23; }
static inline vi vi_set1(uint32_t x) { return (vi){x, x, x, x, x, x, x, x}; }
static inline vi vi_iota(uint32_t x) { return (vi){0, 1, 2, 3, 4, 5, 6, 7} + x; }
static inline vi vi_xor(vi a, vi b) { return a ^ b; }
static inline vi vi_mullo(vi a, uint32_t m) { return a * m; }
static inline vi vi_mulhi(vi a, uint32_t m) {
  vi r;
  for (int i = 0; i < 8; i++) r[i] = (uint32_t)(((uint64_t)a[i] * m) >> 32);
  return r;
}
static inline vf vf_sel_ge_u(vi x, uint32_t t, float a) {
  return vf_bits_sel((vm)(x >= t), vf_set1(a), vf_set1(0.0f));
}
static inline vf vf_load_f16(const uint16_t *p) {
  float t[8];
  for (int i = 0; i < 8; i++) t[i] = fa_f16_to_f32(p[i]);
  return vf_load(t);
}
static inline vf vf_load_bf16(const uint16_t *p) {
  float t[8];
  for (int i = 0; i < 8; i++) t[i] = fa_bf16_to_f32(p[i]);
  return vf_load(t);
}
static inline void vf_store_f16(uint16_t *p, vf v) {
  for (int i = 0; i < 8; i++) p[i] = fa_f32_to_f16(v[i]);
}

static inline vf vf_sum8(const vf *v) {
  vf r;
  for (int i = 0; i < 8; i++)
    r[i] =
        ((v[i][0] + v[i][1]) + (v[i][2] + v[i][3])) + ((v[i][4] + v[i][5]) + (v[i][6] + v[i][7]));
  return r;
}

static inline void vf_transpose8(vf *v) { /* v[i] lane j <-> v[j] lane i */
  vf t[8];
  for (int i = 0; i < 8; i++)
    for (int j = 0; j < 8; j++) t[j][i] = v[i][j];
  for (int i = 0; i < 8; i++) v[i] = t[i];
}

#define SFX(name) name##_portable
#define KB_ISA "portable"
#include "common/kern_body.h"
