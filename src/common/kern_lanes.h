/* Kernels written once over a vector type, included by kern_body.h once per
 * width: V (vf, or vw where the ISA has 16-lane vectors), VOP(op) its
 * operations (kern_body.h's list, vf_ or vw_), VIOP(op) those of its
 * integer lanes, VNAME(name) the names to give. Every lane
 * computes what it would in the other width, so both give the same bits.
 * No include guard: the macros are undefined at the end. */

/* e^x: x = n ln2 + r with n = round(x log2 e) and r reduced in two FMA steps
 * (Cody-Waite: n ln2_hi is exact), e^r by a degree-6 minimax polynomial on
 * [-ln2/2, ln2/2] (approximation error 1.9e-9) in Horner form with FMA, and
 * 2^n built in the exponent bits. Measured: max relative error 1.2e-7 (1 ulp)
 * over 1e8 points of [-87, 88], e^0 = 1 exactly; results below ~2^-126.5 flush
 * to 0, -inf gives 0, NaN stays NaN. */
static inline V VNAME(vexp)(V x) {
  const V magic = VOP(set1)(12582912.0f); /* 1.5 * 2^23: y + magic rounds y to an integer */
  x = VOP(max)(VOP(set1)(-88.0f), x);
  x = VOP(min)(VOP(set1)(88.7f), x);
  const V t = VOP(fma)(x, VOP(set1)(FA_LOG2E), magic);
  const V n = VOP(sub)(t, magic);
  V r = VOP(fma)(n, VOP(set1)(-0.693359375f), x);
  r = VOP(fma)(n, VOP(set1)(2.12194440e-4f), r);
  V p = VOP(set1)(1.3836845990719037e-3f);
  p = VOP(fma)(p, r, VOP(set1)(8.374815804362865e-3f));
  p = VOP(fma)(p, r, VOP(set1)(4.166822556952568e-2f));
  p = VOP(fma)(p, r, VOP(set1)(1.6666420169849686e-1f));
  p = VOP(fma)(p, r, VOP(set1)(4.9999992079816696e-1f));
  p = VOP(fma)(p, r, VOP(set1)(1.0000000363231976f));
  p = VOP(fma)(p, r, VOP(set1)(1.0f));
  /* t's bits are magic's + n: 2^n = (bits - magic + 127) << 23 */
  return VOP(mul)(p, VOP(from_bits)(VIOP(add_shl23)(VOP(bits)(t), 127u - 0x4b400000u)));
}

/* 2^x for x <= 0 (or NaN), the online softmax's exponential in base 2: with
 * the scores already in log2 units, x = n + r with n = round(x) and r = x - n
 * exact, so the range reduction costs two additions and no multiply. 2^r on
 * [-1/2, 1/2] is vexp's polynomial with x = r ln2 substituted (coefficient k
 * times ln2^k: the same minimax error); below 2^-126.5 results flush to 0,
 * -inf gives 0. */
static inline V VNAME(vexp2)(V x) {
  /* 1.5 * 2^23 + 127: t's low mantissa bits hold n + 127, 2^n's exponent field */
  const V magic = VOP(set1)(12583039.0f);
  x = VOP(max)(VOP(set1)(-127.0f), x);
  const V t = VOP(add)(x, magic);
  const V r = VOP(sub)(x, VOP(sub)(t, magic));
  V p = VOP(set1)(1.534581199919384e-4f);
  p = VOP(fma)(p, r, VOP(set1)(1.3399931219172016e-3f));
  p = VOP(fma)(p, r, VOP(set1)(9.618488957123618e-3f));
  p = VOP(fma)(p, r, VOP(set1)(5.550328776965466e-2f));
  p = VOP(fma)(p, r, VOP(set1)(2.402264689063413e-1f));
  p = VOP(fma)(p, r, VOP(set1)(6.931472057372673e-1f));
  p = VOP(fma)(p, r, VOP(set1)(1.0f));
  return VOP(mul)(p,
                  VOP(from_bits)(VIOP(add_shl23)(VOP(bits)(t), 0))); /* the shift drops the rest */
}

/* 2^x (E2) or e^x */
static inline __attribute__((always_inline)) V VNAME(vexpb)(const int E2, V x) {
  return E2 ? VNAME(vexp2)(x) : VNAME(vexp)(x);
}

/* The online softmax of one chunk of columns of ST (keys x query rows: nc
 * keys, ld lds; a column per lane), each a query row, m, l and alpha its
 * state: m := max(m, the column's scores); ST := 2^(ST - m) (E2) or
 * e^(ST - m); alpha := 2^(m_old - m) (or e^); l := alpha l + the column's
 * sum. */

static inline __attribute__((always_inline)) void VNAME(softmax_chunk)(const int E2, float *ST,
                                                                       int64_t lds, int64_t nc,
                                                                       float *m, float *l,
                                                                       float *alpha) {
  const V ninf = VOP(set1)(-INFINITY), zero = VOP(set1)(0.0f);
  const V mo = VOP(load)(m);
  V mx = mo, mx2 = mo;
  int64_t j = 0;
  for (; j + 2 <= nc; j += 2) { /* two chains: max latency, not throughput, binds */
    mx = VOP(max)(VOP(load)(ST + j * lds), mx);
    mx2 = VOP(max)(VOP(load)(ST + (j + 1) * lds), mx2);
  }
  if (j < nc) mx = VOP(max)(VOP(load)(ST + j * lds), mx);
  mx = VOP(max)(mx2, mx);
  /* exponents relative to 0 while a column has seen no finite score */
  const V mref = VOP(sel_eq)(mx, ninf, zero, mx);
  V sum = zero, sum2 = zero;
  for (j = 0; j + 2 <= nc; j += 2) {
    float *s0 = ST + j * lds, *s1 = s0 + lds;
    const V p0 = VNAME(vexpb)(E2, VOP(sub)(VOP(load)(s0), mref));
    const V p1 = VNAME(vexpb)(E2, VOP(sub)(VOP(load)(s1), mref));
    VOP(store)(s0, p0);
    VOP(store)(s1, p1);
    sum = VOP(add)(sum, p0);
    sum2 = VOP(add)(sum2, p1);
  }
  if (j < nc) {
    float *s0 = ST + j * lds;
    const V p0 = VNAME(vexpb)(E2, VOP(sub)(VOP(load)(s0), mref));
    VOP(store)(s0, p0);
    sum = VOP(add)(sum, p0);
  }
  const V al = VNAME(vexpb)(E2, VOP(sub)(mo, mref));
  VOP(store)(alpha, al);
  VOP(store)(l, VOP(fma)(al, VOP(load)(l), VOP(add)(sum, sum2)));
  VOP(store)(m, mx);
}

/* Elements c .. of a K or V row read in place, f32, f16 or bf16, as float32
 * lanes (dt a constant wherever this inlines: the decode kernels are
 * instantiated once per dtype, through kern_body.h's KB_BY_DT). */
static inline V VNAME(kv_load)(const void *row, int64_t c, fa_dtype dt) {
  return dt == FA_DTYPE_F16    ? VOP(load_f16)((const uint16_t *)row + c)
         : dt == FA_DTYPE_BF16 ? VOP(load_bf16)((const uint16_t *)row + c)
                               : VOP(load)((const float *)row + c);
}

/* Columns [c0, c1) (whole vectors) of SG O rows (o, ld ldo) += the
 * products of KB V rows (vh, vs apart) with their probabilities pt[t][g],
 * added in key order (kern_body.h's pv_keys). */
static inline __attribute__((always_inline)) void VNAME(pv_span)(
    const fa_dtype dt, const int SG, const int KB, const float (*pt)[4], const char *vh,
    int64_t vs, float *o, int64_t ldo, int64_t c0, int64_t c1) {
  V p[4][4];
#pragma GCC unroll 4
  for (int t = 0; t < KB; t++)
#pragma GCC unroll 4
    for (int g = 0; g < SG; g++) p[t][g] = VOP(set1)(pt[t][g]);
  for (int64_t c = c0; c < c1; c += (int64_t)(sizeof(V) / sizeof(float))) {
    V x[4];
#pragma GCC unroll 4
    for (int t = 0; t < KB; t++) x[t] = VNAME(kv_load)(vh + t * vs, c, dt);
#pragma GCC unroll 8
    for (int g = 0; g < SG; g++) {
      V acc = VOP(load)(o + g * ldo + c);
#pragma GCC unroll 4
      for (int t = 0; t < KB; t++) acc = VOP(fma)(p[t][g], x[t], acc);
      VOP(store)(o + g * ldo + c, acc);
    }
  }
}

/* The backward's elementwise steps on columns [j0, j1) of one row (a whole
 * number of vectors): exp_span, s := e^(s - x) (P from the scores and the
 * row's lse); dsoftmax_span, g := p (g - di), times 1 - t^2 where softcap's
 * tanh t is given, and 0 where p is (dS from dP). */
static inline void VNAME(exp_span)(float *s, int64_t j0, int64_t j1, float x) {
  const V vx = VOP(set1)(x);
  for (int64_t j = j0; j < j1; j += (int64_t)(sizeof(V) / sizeof(float)))
    VOP(store)(s + j, VNAME(vexp)(VOP(sub)(VOP(load)(s + j), vx)));
}
static inline void VNAME(dsoftmax_span)(float *g, const float *p, const float *t, int64_t j0,
                                        int64_t j1, float di) {
  const V vdi = VOP(set1)(di), one = VOP(set1)(1.0f);
  for (int64_t j = j0; j < j1; j += (int64_t)(sizeof(V) / sizeof(float))) {
    const V pv = VOP(load)(p + j);
    V x = VOP(mul)(pv, VOP(sub)(VOP(load)(g + j), vdi));
    if (t) {
      const V tv = VOP(load)(t + j);
      x = VOP(mul)(x, VOP(sub)(one, VOP(mul)(tv, tv)));
    }
    VOP(store)(g + j, VOP(sel_ne0)(pv, x));
  }
}

#undef V
#undef VOP
#undef VIOP
#undef VNAME
