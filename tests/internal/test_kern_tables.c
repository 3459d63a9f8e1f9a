/* The CPU kernel tables (src/common/kern.h) share every summation order: the
 * matrix product of each table this CPU can run (AVX-512 with 512-bit tiles,
 * AVX-512VL, AVX2) must give bitwise the AVX2 table's C on random products
 * of every shape the backends make: row counts across the register tiles'
 * heights, one to six panel vectors, panel pairs, strided and transposed A,
 * alpha, beta with and without a row scale, and per-row key ranges (klo,
 * khi) that split rows between a tile and its own tail. Each C is also
 * checked against a float64 product. So must the online softmax's column
 * chunks (softmax_cols, softmax_step_cols) and the backward's elementwise
 * steps (exp_rows, dsoftmax), and the decode's P V in key-row order
 * (pv_rows). Internal: it links the tables. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/convert.h"
#include "common/kern.h"

static unsigned g_seed = 12345;
static float rnd(void) {
  g_seed = g_seed * 1664525u + 1013904223u;
  return (float)(g_seed >> 8) / 16777216.0f - 0.5f;
}
static int pick(int n) { return (int)((rnd() + 0.5f) * (float)n) % n; }

int main(void) {
  const fa_kern *tabs[2] = {NULL, NULL};
  int ntab = 0;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (!fa_kern_avx2.gemm || !__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    printf("test_kern_tables: no AVX2 table on this CPU: 0 passed, 0 failed\n");
    return 0;
  }
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")) {
    if (fa_kern_avx512.gemm) tabs[ntab++] = &fa_kern_avx512;
    if (fa_kern_avx512vl.gemm) tabs[ntab++] = &fa_kern_avx512vl;
  }
#endif
  int cases = 0, fail = 0;
  for (int it = 0; it < 3000; it++) {
    const int bwv = 1 + pick(3), bw = bwv * FA_VL; /* panel width: 1-3 vectors */
    const int64_t m = 1 + pick(40), n = FA_VL * (1 + pick(12)), k = pick(70);
    const int trans = pick(2), beta = pick(2), scaled = beta && pick(2), masked = pick(3) == 0;
    const int64_t rsa = trans ? 1 : k + pick(3), csa = trans ? m + pick(3) : 1;
    const int64_t ldb = bw, bps = (k + pick(2)) * bw, ldc = n + FA_VL * pick(2);
    float *a = malloc(sizeof(float) * (size_t)(m * rsa + k * csa + 1));
    float *b = malloc(sizeof(float) * (size_t)(bps * ((n + bw - 1) / bw) + 1));
    float *c0 = malloc(sizeof(float) * (size_t)(m * ldc)),
          *c1 = malloc(sizeof(float) * (size_t)(m * ldc));
    float rs[64];
    int32_t klo[64], khi[64];
    for (int64_t i = 0; i < m * rsa + k * csa + 1; i++) a[i] = rnd();
    for (int64_t i = 0; i < bps * ((n + bw - 1) / bw) + 1; i++) b[i] = rnd();
    for (int64_t i = 0; i < m * ldc; i++) c0[i] = rnd();
    for (int i = 0; i < 64; i++) {
      rs[i] = 1.0f + rnd();
      const int x = k ? pick((int)k + 1) : 0, y = k ? pick((int)k + 1) : 0;
      klo[i] = x < y ? x : y, khi[i] = x < y ? y : x; /* any, empty included */
    }
    fa_gemm g = {m,
                 n,
                 k,
                 a,
                 rsa,
                 csa,
                 b,
                 ldb,
                 bps,
                 bw,
                 c0,
                 ldc,
                 0.5f + rnd(),
                 beta,
                 scaled ? rs : NULL,
                 masked ? klo : NULL,
                 masked ? khi : NULL};
    memcpy(c1, c0, sizeof(float) * (size_t)(m * ldc));
    /* the float64 product, from the C before */
    double *want = malloc(sizeof(double) * (size_t)(m * n));
    for (int64_t i = 0; i < m; i++)
      for (int64_t j = 0; j < n; j++) {
        double acc = 0;
        const int64_t p0 = masked ? klo[i] : 0, p1 = masked ? khi[i] : k;
        for (int64_t p = p0; p < p1; p++)
          acc += (double)a[i * rsa + p * csa] * b[j / bw * bps + p * ldb + j % bw];
        want[i * n + j] =
            g.alpha * acc + (beta ? (double)c0[i * ldc + j] * (scaled ? rs[i] : 1) : 0);
      }
    fa_kern_avx2.gemm(&g);
    for (int64_t i = 0; i < m; i++)
      for (int64_t j = 0; j < n; j++)
        if (fabs(c0[i * ldc + j] - want[i * n + j]) > 1e-5 * (1 + k)) {
          if (fail++ < 10)
            printf("FAIL avx2 vs float64: m %ld n %ld k %ld bw %d (%ld, %ld)\n", (long)m, (long)n,
                   (long)k, bw, (long)i, (long)j);
          i = m;
          break;
        }
    for (int t = 0; t < ntab; t++) {
      float *c = malloc(sizeof(float) * (size_t)(m * ldc));
      memcpy(c, c1, sizeof(float) * (size_t)(m * ldc));
      fa_gemm h = g;
      h.c = c;
      tabs[t]->gemm(&h);
      cases++;
      if (memcmp(c, c0, sizeof(float) * (size_t)(m * ldc)) != 0 && fail++ < 10)
        printf(
            "FAIL %s differs bitwise from avx2: m %ld n %ld k %ld bw %d trans %d beta %d scaled %d "
            "masked %d\n",
            tabs[t]->isa, (long)m, (long)n, (long)k, bw, trans, beta, scaled, masked);
      free(c);
    }
    cases++;
    free(a), free(b), free(c0), free(c1), free(want);
  }
  /* The online softmax over column chunks (softmax_cols in base 2,
   * softmax_step_cols in base e): every table bitwise the AVX2 one's ST, m,
   * l and alpha, the AVX2 one against float64; columns of -inf (never a
   * finite score) and running states of -inf included. */
  for (int it = 0; it < 2000; it++) {
    const int64_t nc = 1 + pick(70), ncol = FA_VL * (1 + pick(6)), lds = ncol + FA_VL * pick(2);
    const int e2 = pick(2);
    const size_t nst = (size_t)(nc * lds), nv = (size_t)ncol;
    float *st0 = malloc(sizeof(float) * nst), *st1 = malloc(sizeof(float) * nst);
    float st[3][64 * 4]; /* m, l, alpha of the table under test; [0]: before */
    float *m0 = st[0], *l0 = st[0] + 64, *m1 = st[1], *l1 = st[1] + 64, *a1 = st[1] + 128;
    for (size_t q = 0; q < nv; q++) {
      m0[q] = pick(4) == 0 ? -INFINITY : 8 * rnd();
      l0[q] = m0[q] == -INFINITY ? 0.0f : 1 + 4 * (rnd() + 0.5f);
    }
    const int64_t dead = pick(ncol); /* a column with no finite score (if its m is -inf) */
    for (int64_t j = 0; j < nc; j++)
      for (int64_t q = 0; q < lds; q++)
        st0[j * lds + q] = q == dead || pick(6) == 0 ? -INFINITY : 30 * rnd();
    void (*sm)(float *, int64_t, int64_t, int64_t, float *, float *, float *) =
        e2 ? fa_kern_avx2.softmax_cols : fa_kern_avx2.softmax_step_cols;
    memcpy(st1, st0, sizeof(float) * nst);
    memcpy(m1, m0, sizeof(float) * 128);
    sm(st1, lds, nc, ncol, m1, l1, a1);
    for (int64_t q = 0; q < ncol; q++) { /* float64: the state, then the chunk */
      double mx = m0[q], sum = 0;
      for (int64_t j = 0; j < nc; j++) mx = st0[j * lds + q] > mx ? st0[j * lds + q] : mx;
      const double mref = mx == -INFINITY ? 0 : mx, base = e2 ? 2.0 : exp(1.0);
      int bad = m1[q] != (float)mx;
      for (int64_t j = 0; j < nc; j++) {
        /* of the difference as rounded to float32, as the kernels take it */
        const double pj = pow(base, (float)(st0[j * lds + q] - (float)mref));
        sum += pj;
        bad |= fabs(st1[j * lds + q] - pj) > 4e-7 * pj + 1e-30;
      }
      const double al = pow(base, (float)(m0[q] - (float)mref)), lw = al * l0[q] + sum;
      bad |= fabs(a1[q] - al) > 4e-7 * al + 1e-30 || fabs(l1[q] - lw) > 2e-6 * lw + 1e-30;
      if (bad) {
        if (fail++ < 10)
          printf("FAIL avx2 softmax (e2 %d) vs float64: nc %ld ncol %ld column %ld\n", e2, (long)nc,
                 (long)ncol, (long)q);
        break;
      }
    }
    cases++;
    for (int t = 0; t < ntab; t++) {
      float *s2 = malloc(sizeof(float) * nst), *m2 = st[2], *l2 = st[2] + 64, *a2 = st[2] + 128;
      memcpy(s2, st0, sizeof(float) * nst);
      memcpy(m2, m0, sizeof(float) * 128);
      (e2 ? tabs[t]->softmax_cols : tabs[t]->softmax_step_cols)(s2, lds, nc, ncol, m2, l2, a2);
      cases++;
      if ((memcmp(s2, st1, sizeof(float) * nst) || memcmp(m2, m1, sizeof(float) * nv) ||
           memcmp(l2, l1, sizeof(float) * nv) || memcmp(a2, a1, sizeof(float) * nv)) &&
          fail++ < 10)
        printf("FAIL %s softmax (e2 %d) differs bitwise from avx2: nc %ld ncol %ld\n", tabs[t]->isa,
               e2, (long)nc, (long)ncol);
      free(s2);
    }
    free(st0), free(st1);
  }
  /* The backward's P = e^(S - lse) (rows of lse -inf: all 0) and dS = P
   * (dP - Di), times 1 - T^2 with softcap's T: every table bitwise the AVX2
   * one's over n columns (any n; the rows padded to whole 8-lane vectors),
   * the AVX2 one against float64. */
  for (int it = 0; it < 2000; it++) {
    const int64_t nr = 1 + pick(5), n = 1 + pick(80), ld = fa_round_up(n, FA_VL) + FA_VL * pick(2);
    const int soft = pick(2);
    const size_t sz = (size_t)(nr * ld);
    float *s0 = malloc(sizeof(float) * sz), *p0 = malloc(sizeof(float) * sz),
          *g0 = malloc(sizeof(float) * sz), *t0 = malloc(sizeof(float) * sz),
          *s1 = malloc(sizeof(float) * sz), *g1 = malloc(sizeof(float) * sz),
          *s2 = malloc(sizeof(float) * sz), *g2 = malloc(sizeof(float) * sz);
    float lse[8], di[8];
    for (int64_t r = 0; r < nr; r++) {
      lse[r] = pick(5) == 0 ? -INFINITY : 20 * rnd();
      di[r] = rnd();
    }
    for (size_t i = 0; i < sz; i++) {
      s0[i] = pick(8) == 0 ? -INFINITY : 40 * rnd();
      p0[i] = pick(4) == 0 ? 0.0f : rnd() + 0.5f; /* P's zeros: dS 0 even where dP is NaN */
      g0[i] = pick(16) == 0 ? NAN : 4 * rnd();
      t0[i] = 2 * rnd();
    }
    memcpy(s1, s0, sizeof(float) * sz), memcpy(g1, g0, sizeof(float) * sz);
    fa_kern_avx2.exp_rows(s1, ld, nr, n, lse);
    fa_kern_avx2.dsoftmax(g1, p0, ld, nr, n, di, soft ? t0 : NULL);
    for (int64_t r = 0; r < nr; r++)
      for (int64_t j = 0; j < n; j++) {
        const size_t i = (size_t)(r * ld + j);
        const double pe = lse[r] == -INFINITY ? 0 : exp((double)(float)(s0[i] - lse[r]));
        double ge = p0[i] * ((double)g0[i] - di[r]) * (soft ? 1 - (double)t0[i] * t0[i] : 1);
        if (p0[i] == 0) ge = 0;
        const int bad = fabs(s1[i] - pe) > 4e-7 * pe + 1e-30 ||
                        (isnan(ge) ? !isnan(g1[i]) : fabs(g1[i] - ge) > 1e-6 * fabs(ge) + 1e-30);
        if (bad && fail++ < 10)
          printf("FAIL avx2 exp_rows/dsoftmax vs float64: n %ld row %ld column %ld\n", (long)n,
                 (long)r, (long)j);
      }
    cases++;
    for (int t = 0; t < ntab; t++) {
      memcpy(s2, s0, sizeof(float) * sz), memcpy(g2, g0, sizeof(float) * sz);
      tabs[t]->exp_rows(s2, ld, nr, n, lse);
      tabs[t]->dsoftmax(g2, p0, ld, nr, n, di, soft ? t0 : NULL);
      cases++;
      for (int64_t r = 0; r < nr; r++)
        if ((memcmp(s2 + r * ld, s1 + r * ld, sizeof(float) * (size_t)n) ||
             memcmp(g2 + r * ld, g1 + r * ld, sizeof(float) * (size_t)n)) &&
            fail++ < 10) {
          printf("FAIL %s exp_rows/dsoftmax differ bitwise from avx2: n %ld softcap %d\n",
                 tabs[t]->isa, (long)n, soft);
          break;
        }
    }
    free(s0), free(p0), free(g0), free(t0), free(s1), free(g1), free(s2), free(g2);
  }
  /* The decode's O += P V in key-row order (pv_rows): f32, f16 and bf16 V
   * rows, groups of 1, 2 and 4 query heads on a K/V head, head dims of odd
   * vector counts, enough rows for its blocked path, with and without a row
   * scale: every table bitwise the AVX2 one's O, the AVX2 one against
   * float64. */
  for (int it = 0; it < 1500; it++) {
    const int64_t group = (int64_t)1 << pick(3), nr = group * (1 + pick(40 / (int)group));
    const int64_t n = 1 + pick(9), d = FA_VL * (1 + pick(20)), ldp = fa_round_up(nr, FA_VL);
    const int dti = pick(3), scaled = pick(2);
    const fa_dtype dt = dti == 0 ? FA_DTYPE_F32 : dti == 1 ? FA_DTYPE_F16 : FA_DTYPE_BF16;
    const int64_t es = dti == 0 ? 4 : 2, vhs = d * es, vs = (nr / group) * vhs + es * pick(3);
    const int64_t ldo = d + FA_VL * pick(2);
    char *v = malloc((size_t)(n * vs));
    float *pt = malloc(sizeof(float) * (size_t)(n * ldp)),
          *vf32 = malloc(sizeof(float) * (size_t)(n * vs));
    float *o0 = malloc(sizeof(float) * (size_t)(nr * ldo)),
          *o1 = malloc(sizeof(float) * (size_t)(nr * ldo)),
          *o2 = malloc(sizeof(float) * (size_t)(nr * ldo)), rs[40];
    for (int64_t j = 0; j < n; j++)
      for (int64_t e = 0; e < vs / es; e++) {
        const float x = 2 * rnd();
        uint16_t h;
        if (dt == FA_DTYPE_F32) {
          memcpy(v + j * vs + e * 4, &x, 4), vf32[j * vs + e] = x;
        } else { /* the stored value, as the kernels read it */
          h = dt == FA_DTYPE_F16 ? fa_f32_to_f16(x) : fa_f32_to_bf16(x);
          memcpy(v + j * vs + e * 2, &h, 2);
          vf32[j * vs + e] = dt == FA_DTYPE_F16 ? fa_f16_to_f32(h) : fa_bf16_to_f32(h);
        }
      }
    for (int64_t i = 0; i < n * ldp; i++) pt[i] = rnd() + 0.5f;
    for (int64_t i = 0; i < nr * ldo; i++) o0[i] = rnd();
    for (int i = 0; i < 40; i++) rs[i] = rnd() + 0.5f;
    memcpy(o1, o0, sizeof(float) * (size_t)(nr * ldo));
    fa_kern_avx2.pv_rows(nr, n, d, pt, ldp, v, vs, vhs, group, dt, o1, ldo, scaled ? rs : NULL);
    for (int64_t r = 0; r < nr; r++) {
      int bad = 0;
      for (int64_t c = 0; c < d && !bad; c++) {
        double want = (scaled ? rs[r] : 1.0) * o0[r * ldo + c], mag = fabs(want);
        for (int64_t j = 0; j < n; j++) {
          const double term = (double)pt[j * ldp + r] * vf32[j * vs + (r / group) * (vhs / es) + c];
          want += term, mag += fabs(term);
        }
        bad = fabs(o1[r * ldo + c] - want) > 1e-6 * mag + 1e-30;
      }
      if (bad) {
        if (fail++ < 10)
          printf("FAIL avx2 pv_rows vs float64: nr %ld n %ld d %ld group %ld dtype %d row %ld\n",
                 (long)nr, (long)n, (long)d, (long)group, dti, (long)r);
        break;
      }
    }
    cases++;
    for (int t = 0; t < ntab; t++) {
      memcpy(o2, o0, sizeof(float) * (size_t)(nr * ldo));
      tabs[t]->pv_rows(nr, n, d, pt, ldp, v, vs, vhs, group, dt, o2, ldo, scaled ? rs : NULL);
      cases++;
      if (memcmp(o2, o1, sizeof(float) * (size_t)(nr * ldo)) && fail++ < 10)
        printf("FAIL %s pv_rows differs bitwise from avx2: nr %ld n %ld d %ld group %ld dtype %d\n",
               tabs[t]->isa, (long)nr, (long)n, (long)d, (long)group, dti);
    }
    free(v), free(pt), free(vf32), free(o0), free(o1), free(o2);
  }
  printf("test_kern_tables (%d tables beside avx2): %d passed, %d failed\n", ntab, cases - fail,
         fail);
  return fail != 0;
}
