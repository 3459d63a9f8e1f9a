/* Body of the standard algorithm, included by standard.c with REAL double:
 * the float64 oracle (f32/f16/bf16 storage runs standard_fast.c). Work unit:
 * one (sequence, head) in the forward pass, one (sequence, K/V head) in the
 * backward pass (so the GQA sum over a group needs no atomics). Each thread
 * owns a workspace slice. */

/* Per-thread slice: `matrices` Nq x Nk matrices, `kd_rows` Nk x D blocks and
 * four D-vectors and one Nk-vector, all in REAL. */
static size_t SFX(ref_slice)(const fa_problem *pb, int matrices, int kd_rows) {
  size_t nn = (size_t)pb->max_seqlen_q * (size_t)pb->max_seqlen_k;
  size_t kd = (size_t)pb->max_seqlen_k * (size_t)pb->headdim;
  return fa_align64(((size_t)matrices * nn + (size_t)kd_rows * kd + 4 * (size_t)pb->headdim +
                     (size_t)pb->max_seqlen_k) *
                    sizeof(REAL));
}

static int SFX(ref_threads)(const fa_problem *pb, int64_t units) {
  if (units < 1) units = 1;
  return (int)(units < pb->num_threads ? units : pb->num_threads);
}

static size_t SFX(ref_fwd_workspace)(const fa_problem *pb) {
  return (size_t)SFX(ref_threads)(pb, pb->batch * pb->heads_q) * SFX(ref_slice)(pb, 1, 2);
}

static size_t SFX(ref_bwd_workspace)(const fa_problem *pb) {
  return (size_t)SFX(ref_threads)(pb, pb->batch * pb->heads_k) * SFX(ref_slice)(pb, 2, 4);
}

static REAL SFX(ref_dot)(const REAL *a, const REAL *b, int64_t n) {
  REAL s = 0;
  for (int64_t d = 0; d < n; d++) s += a[d] * b[d];
  return s;
}

static void SFX(ref_axpy)(REAL *y, REAL a, const REAL *x, int64_t n) {
  for (int64_t d = 0; d < n; d++) y[d] += a * x[d];
}

/* What Algorithm 0 keeps of a P value: it is written to memory in storage type. */
static REAL SFX(ref_round)(REAL x, fa_dtype dt) {
  return dt == FA_DTYPE_F64 ? x : (REAL)fa_round_to_storage((float)x, dt);
}

static const char *SFX(ref_row)(const fa_tensor *t, int64_t b, int64_t n, int64_t h) {
  return (const char *)t->data + fa_tensor_offset(t, b, n, h) * (int64_t)fa_dtype_bytes(t->dtype);
}

/* Loads the rows of keys [0, n) of sequence sq, head h, of K or V (t) into
 * dst (n x D), wherever they lie (fa_problem_krow: a cache's rows, pages). */
static void SFX(ref_load_rows)(REAL *dst, const fa_problem *pb, const fa_tensor *t,
                               const fa_seq *sq, int64_t n, int64_t h) {
  for (int64_t r = 0; r < n; r++) {
    int64_t b, row;
    fa_problem_krow(pb, sq, r, &b, &row);
    LOAD_ROW(dst + r * t->headdim, SFX(ref_row)(t, b, row, h), t->dtype, t->headdim);
  }
}

static REAL SFX(ref_slope)(const fa_problem *pb, int64_t s, int64_t h) {
  return pb->alibi_slopes ? (REAL)pb->alibi_slopes[s * pb->alibi_stride_batch + h] : 0;
}

/* Dropout's multiplier of P[i][j] of matrix bh: 0 or 1 / (1 - p). */
static REAL SFX(ref_dropout)(const fa_dropout *dr, float p, uint64_t bh, int64_t i, int64_t j) {
  if (p <= 0) return 1;
  return fa_dropout_keep(dr, bh, i, j) ? 1 / (1 - (REAL)p) : 0;
}

/* P = softmax(masked, capped, biased scale * Q K^T) for query head h of
 * sequence s, one row of nk per query row, rounded to dtype keep (what
 * Algorithm 0 stores; FA_DTYPE_F64: not rounded). tanh_out (optional)
 * receives tanh(scale*qk/softcap) for the backward chain rule; lse_out
 * (optional) each row's log-sum-exp. */
static void SFX(ref_probabilities)(const fa_problem *pb, int64_t s, const fa_seq *sq,
                                   const fa_mask *mk, int64_t h, REAL slope, const REAL *kb,
                                   REAL *p, REAL *tanh_out, REAL *qrow, float *lse_out,
                                   fa_dtype keep, const float *lse_in) {
  const float cap = pb->softcap;
  const int64_t D = pb->headdim, nk = sq->nk;
  for (int64_t i = 0; i < sq->nq; i++) {
    REAL *row = p + i * nk;
    int64_t lo, hi;
    fa_mask_row_range(mk, i, &lo, &hi);
    const uint8_t *brow = fa_problem_block_row(pb, s, h, i);
    const int64_t bk = pb->block_size_k;
#define REF_VISIBLE(j) ((j) >= lo && (j) < hi && (!brow || brow[(j) / bk]))
    LOAD_ROW(qrow, SFX(ref_row)(&pb->q, sq->qb, sq->q0 + i, h), pb->dtype, D);
    REAL mx = -INFINITY;
    for (int64_t j = lo; j < hi; j++) {
      if (!REF_VISIBLE(j)) continue;
      REAL x = (REAL)pb->scale * SFX(ref_dot)(qrow, kb + j * D, D);
      if (cap > 0) {
        REAL t = TANH(x / (REAL)cap);
        if (tanh_out) tanh_out[i * nk + j] = t;
        x = (REAL)cap * t;
      }
      x -= slope * (REAL)llabs(i + mk->diag0 - j);
      row[j] = x;
      if (x > mx) mx = x;
    }
    REAL l = 0;
    for (int64_t j = 0; j < nk; j++) {
      REAL e = REF_VISIBLE(j) ? EXP(row[j] - mx) : 0;
      row[j] = e;
      l += e;
    }
    if (lse_out) lse_out[i] = l > 0 ? (float)(mx + LOG(l)) : -INFINITY;
#undef REF_VISIBLE
    REAL inv = l > 0 ? 1 / l : 0;
    if (lse_in) /* a shard's backward: P = exp(S - lse_in), lse_in maybe the whole sequence's */
      inv = l > 0 && lse_in[i] != -INFINITY ? EXP(mx - (REAL)lse_in[i]) : 0;
    for (int64_t j = 0; j < nk; j++) row[j] = SFX(ref_round)(row[j] * inv, keep);
  }
}

/* Unit u = (sequence u / heads_q, query head u % heads_q) of a pass over
 * query heads, in the thread's workspace slice (the Nq x Nk matrix, then
 * kd_rows Nk x D blocks): K's rows loaded into the first block, P computed
 * into the matrix (rounded to keep; with_lse: each row's lse written).
 * Returns the slice; *sq is the unit's sequence. */
static REAL *SFX(ref_head_probs)(const fa_problem *pb, int64_t u, size_t slice, int kd_rows,
                                 fa_dtype keep, int with_lse, fa_seq *sq) {
  const int64_t s = u / pb->heads_q, h = u % pb->heads_q, D = pb->headdim;
  *sq = fa_problem_seq(pb, s);
  const fa_mask mk = fa_problem_mask(pb, sq);
  REAL *p = (REAL *)((char *)pb->workspace + (size_t)omp_get_thread_num() * slice);
  REAL *kb = p + (size_t)pb->max_seqlen_q * (size_t)pb->max_seqlen_k;
  REAL *qrow = kb + kd_rows * pb->max_seqlen_k * D;
  float *lse = with_lse ? pb->lse + sq->lse0 + h * sq->lse_head_stride : NULL;
  SFX(ref_load_rows)(kb, pb, &pb->k, sq, sq->nk, h / pb->group);
  const REAL slope = SFX(ref_slope)(pb, s, h);
  SFX(ref_probabilities)(pb, s, sq, &mk, h, slope, kb, p, NULL, qrow, lse, keep, NULL);
  return p;
}

static fa_status SFX(ref_forward)(const fa_problem *pb) {
  const int64_t D = pb->headdim, units = pb->batch * pb->heads_q;
  const size_t slice = SFX(ref_slice)(pb, 1, 2);
  const int nt = SFX(ref_threads)(pb, units);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t u = 0; u < units; u++) {
    const int64_t s = u / pb->heads_q, h = u % pb->heads_q, hk = h / pb->group;
    fa_seq sq;
    REAL *p = SFX(ref_head_probs)(pb, u, slice, 2, pb->dtype, 1, &sq);
    REAL *vb = p + (size_t)pb->max_seqlen_q * (size_t)pb->max_seqlen_k + pb->max_seqlen_k * D;
    REAL *orow = vb + pb->max_seqlen_k * D + D; /* after the unit's q row */
    SFX(ref_load_rows)(vb, pb, &pb->v, &sq, sq.nk, hk);
    const fa_dropout dr = pb->dropout;
    const uint64_t bh = (uint64_t)(s * pb->heads_q + h);
    for (int64_t i = 0; i < sq.nq; i++) {
      memset(orow, 0, (size_t)D * sizeof(REAL));
      for (int64_t j = 0; j < sq.nk; j++) {
        REAL w = p[i * sq.nk + j];
        if (w != 0) w *= SFX(ref_dropout)(&dr, pb->dropout_p, bh, i, j);
        if (w != 0) SFX(ref_axpy)(orow, w, vb + j * D, D);
      }
      STORE_ROW((char *)SFX(ref_row)(&pb->o, sq.qb, sq.q0 + i, h), orow, pb->dtype, D);
    }
  }
  return FA_OK;
}

/* dV = P^T dO, dP = dO V^T, dS = P o (dP - rowsum(P o dP)), dQ = scale dS K,
 * dK = scale dS^T Q, with P recomputed from scratch (not from lse) so the
 * oracle's gradients depend on nothing the implementation under test wrote;
 * a shard's P is exp(S - lse), the given lse being the whole sequence's. */
static fa_status SFX(ref_backward)(const fa_problem *pb) {
  const int64_t D = pb->headdim, units = pb->batch * pb->heads_k;
  const size_t slice = SFX(ref_slice)(pb, 2, 4);
  const size_t nn = (size_t)pb->max_seqlen_q * (size_t)pb->max_seqlen_k;
  const int nt = SFX(ref_threads)(pb, units);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t u = 0; u < units; u++) {
    const int64_t s = u / pb->heads_k, hk = u % pb->heads_k;
    const fa_seq sq = fa_problem_seq(pb, s);
    const fa_mask mk = fa_problem_mask(pb, &sq);
    const int64_t nk = sq.nk, MK = pb->max_seqlen_k;
    REAL *p = (REAL *)((char *)pb->workspace + (size_t)omp_get_thread_num() * slice);
    REAL *ds = p + nn, *kb = ds + nn, *vb = kb + MK * D, *dkb = vb + MK * D, *dvb = dkb + MK * D;
    REAL *qrow = dvb + MK * D, *dorow = qrow + D, *dqrow = dorow + D, *dprow = dqrow + D;
    SFX(ref_load_rows)(kb, pb, &pb->k, &sq, nk, hk);
    SFX(ref_load_rows)(vb, pb, &pb->v, &sq, nk, hk);
    memset(dkb, 0, (size_t)(nk * D) * sizeof(REAL));
    memset(dvb, 0, (size_t)(nk * D) * sizeof(REAL));
    for (int64_t h = hk * pb->group; h < (hk + 1) * pb->group; h++) {
      const float *lse_in = pb->shard_enabled ? pb->lse + sq.lse0 + h * sq.lse_head_stride : NULL;
      const REAL slope = SFX(ref_slope)(pb, s, h);
      SFX(ref_probabilities)(pb, s, &sq, &mk, h, slope, kb, p, ds, qrow, NULL, pb->dtype, lse_in);
      const fa_dropout dr = pb->dropout;
      const uint64_t bh = (uint64_t)(s * pb->heads_q + h);
      for (int64_t i = 0; i < sq.nq; i++) {
        const REAL *prow = p + i * nk;
        REAL *dsrow = ds + i * nk;
        LOAD_ROW(qrow, SFX(ref_row)(&pb->q, sq.qb, sq.q0 + i, h), pb->dtype, D);
        LOAD_ROW(dorow, SFX(ref_row)(&pb->dout, sq.qb, sq.q0 + i, h), pb->dtype, D);
        REAL di = 0;
        /* with dropout's Z: dV += Z P dO, dP~ = Z (dO V^T), dS = P (dP~ - rowsum(P dP~)) */
        for (int64_t j = 0; j < nk; j++) {
          REAL z = prow[j] != 0 ? SFX(ref_dropout)(&dr, pb->dropout_p, bh, i, j) : 0;
          dprow[j] = z != 0 ? z * SFX(ref_dot)(dorow, vb + j * D, D) : 0;
          di += prow[j] * dprow[j];
          if (z != 0) SFX(ref_axpy)(dvb + j * D, z * prow[j], dorow, D);
        }
        if (lse_in) { /* a shard's keys are a part of the row's: Di = dO . O, O the whole row's */
          LOAD_ROW(dqrow, SFX(ref_row)(&pb->o, sq.qb, sq.q0 + i, h), pb->dtype, D);
          di = SFX(ref_dot)(dorow, dqrow, D);
        }
        memset(dqrow, 0, (size_t)D * sizeof(REAL));
        for (int64_t j = 0; j < nk; j++) {
          REAL g = prow[j] * (dprow[j] - di);
          if (pb->softcap > 0 && prow[j] != 0) g *= 1 - dsrow[j] * dsrow[j];
          dsrow[j] = g; /* dS is materialised, as in Algorithm 0's backward */
          if (g == 0) continue;
          SFX(ref_axpy)(dqrow, g, kb + j * D, D);
          SFX(ref_axpy)(dkb + j * D, (REAL)pb->scale * g, qrow, D);
        }
        for (int64_t d = 0; d < D; d++) dqrow[d] *= (REAL)pb->scale;
        STORE_ROW((char *)SFX(ref_row)(&pb->dq, sq.qb, sq.q0 + i, h), dqrow, pb->dtype, D);
      }
    }
    for (int64_t j = 0; j < nk; j++) {
      STORE_ROW((char *)SFX(ref_row)(&pb->dk, sq.kb, sq.k0 + j, hk), dkb + j * D, pb->dtype, D);
      STORE_ROW((char *)SFX(ref_row)(&pb->dv, sq.kb, sq.k0 + j, hk), dvb + j * D, pb->dtype, D);
    }
  }
  return FA_OK;
}

static size_t SFX(ref_probs_workspace)(const fa_problem *pb) {
  return (size_t)SFX(ref_threads)(pb, pb->batch * pb->heads_q) * SFX(ref_slice)(pb, 1, 1);
}

/* fa_attention_probs: P of every (sequence, query head), unrounded, into the
 * caller's (seqs, heads_q, rows, cols) float32 array; dropped elements
 * negated (their sign bit set), entries past the sequence's lengths 0. */
static fa_status SFX(ref_probs)(const fa_problem *pb) {
  const int64_t units = pb->batch * pb->heads_q;
  const int64_t rows = pb->probs_rows, cols = pb->probs_cols;
  const size_t slice = SFX(ref_slice)(pb, 1, 1);
  const int nt = SFX(ref_threads)(pb, units);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t u = 0; u < units; u++) {
    fa_seq sq;
    const REAL *p = SFX(ref_head_probs)(pb, u, slice, 1, FA_DTYPE_F64, 0, &sq);
    const fa_dropout dr = pb->dropout;
    float *out = pb->probs + (size_t)u * (size_t)rows * (size_t)cols;
    for (int64_t i = 0; i < rows; i++)
      for (int64_t j = 0; j < cols; j++) {
        float x = i < sq.nq && j < sq.nk ? (float)p[i * sq.nk + j] : 0.f;
        /* u is the dropout matrix index: sequence * heads_q + head */
        if (pb->dropout_p > 0 && i < sq.nq && j < sq.nk && !fa_dropout_keep(&dr, (uint64_t)u, i, j))
          x = -x;
        out[i * cols + j] = x;
      }
  }
  return FA_OK;
}
