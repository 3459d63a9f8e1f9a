"""flash_attn_with_kvcache (CPU): a padded KV cache whose rows past the used keys hold
NaN, against the float64 reference on each sequence's used keys alone."""
import zlib

import numpy as np
import pytest

from conftest import TOL_F32, assert_close, drawn_rng, ref_attention_np

import flashattn

try:
    import torch
except ImportError:  # numpy-only
    torch = None


def _cache(b, nq, cap, hq, hk, d, used, seed=3):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, nq, hq, d)).astype(np.float32)
    kc = rng.standard_normal((b, cap, hk, d)).astype(np.float32)
    vc = rng.standard_normal((b, cap, hk, d)).astype(np.float32)
    for i, u in enumerate(used):
        kc[i, u:] = np.nan  # never read
        vc[i, u:] = np.nan
    return q, kc, vc


def _reference(q, kc, vc, used, **kw):
    outs, lses = [], []
    for i, u in enumerate(used):
        if u == 0:  # no keys: every row masked
            outs.append(np.zeros(q[i:i + 1].shape))
            lses.append(np.full((1, q.shape[2], q.shape[1]), -np.inf))
            continue
        o, l = ref_attention_np(q[i:i + 1], kc[i:i + 1, :u], vc[i:i + 1, :u], **kw)
        outs.append(o)
        lses.append(l)
    return np.concatenate(outs), np.concatenate(lses)


@pytest.mark.parametrize("nq,causal", [(1, False), (1, True), (5, True), (5, False)])
@pytest.mark.parametrize("algorithm", ["flash2", "flash1", "standard"])
def test_used_lengths(nq, causal, algorithm):
    used = [40, 7, 0]
    q, kc, vc = _cache(3, nq, 64, 4, 2, 32, used)
    out, lse = flashattn.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=np.array(used, dtype=np.int32), causal=causal,
        return_softmax_lse=True, algorithm=algorithm)
    rout, rlse = _reference(q, kc, vc, used, causal=causal)
    assert np.isfinite(out).all()
    assert_close(out, rout, TOL_F32, "out")
    assert np.array_equal(np.isinf(lse), np.isinf(rlse))
    fin = np.isfinite(rlse)
    assert_close(lse[fin], rlse[fin], TOL_F32, "lse")
    assert (out[2] == 0).all()  # no keys: O = 0, lse = -inf


def test_append_new_keys():
    used = [10, 3]
    q, kc, vc = _cache(2, 2, 32, 2, 1, 16, used)
    rng = np.random.default_rng(9)
    kn = rng.standard_normal((2, 2, 1, 16)).astype(np.float32)
    vn = rng.standard_normal((2, 2, 1, 16)).astype(np.float32)
    out = flashattn.flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=used,
                                            causal=True)
    for i, u in enumerate(used):  # written in place
        assert np.array_equal(kc[i, u:u + 2], kn[i]) and np.array_equal(vc[i, u:u + 2], vn[i])
    rout, _ = _reference(q, kc, vc, [u + 2 for u in used], causal=True)
    assert_close(out, rout, TOL_F32, "out")


def test_errors():
    q, kc, vc = _cache(2, 1, 8, 2, 2, 16, [8, 8])
    with pytest.raises(flashattn.FlashAttnError, match="cache_seqlens") as e:  # the library's
        flashattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=[9, 1])
    assert isinstance(e.value, ValueError)
    before = kc.copy()
    with pytest.raises(flashattn.InvalidArgumentError, match="cache_seqlens"):
        flashattn.flash_attn_with_kvcache(q, kc, vc, k=kc[:, :2].copy(), v=vc[:, :2].copy(),
                                          cache_seqlens=7)
    assert np.array_equal(kc, before)
    with pytest.raises(ValueError, match="batch_size"):
        flashattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=[1, 2, 3])


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_torch_errors():
    q, kc, vc = (torch.from_numpy(x) for x in _cache(2, 1, 8, 2, 2, 16, [8, 8]))
    with pytest.raises(ValueError, match="cache_seqlens"):
        flashattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([9, 1]))
    with pytest.raises(ValueError, match="cache_seqlens must have shape"):
        flashattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="integer"):
        flashattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([1.0, 2.0]))
    before = kc.clone()
    with pytest.raises(ValueError, match="cache_seqlens"):  # past the end: nothing written
        flashattn.flash_attn_with_kvcache(q, kc, vc, k=kc[:, :2].clone(), v=vc[:, :2].clone(),
                                          cache_seqlens=torch.tensor([7, 0]))
    assert torch.equal(kc, before)


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_torch_append_matches_reference():
    used = [10, 3]
    q, kc, vc = (torch.from_numpy(x) for x in _cache(2, 2, 32, 2, 1, 16, used))
    g = torch.Generator().manual_seed(9)
    kn, vn = torch.randn(2, 2, 1, 16, generator=g), torch.randn(2, 2, 1, 16, generator=g)
    out = flashattn.flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn,
                                            cache_seqlens=torch.tensor(used, dtype=torch.int32),
                                            causal=True)
    for i, u in enumerate(used):
        assert torch.equal(kc[i, u:u + 2], kn[i]) and torch.equal(vc[i, u:u + 2], vn[i])
    rout, _ = _reference(q.numpy(), kc.numpy(), vc.numpy(), [u + 2 for u in used], causal=True)
    assert_close(out.numpy(), rout, TOL_F32, "out")


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_torch_cpu():
    used = [17, 30]
    q, kc, vc = _cache(2, 3, 30, 4, 4, 32, used)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, kc, vc))
    out = flashattn.flash_attn_with_kvcache(tq, tk, tv, cache_seqlens=torch.tensor(used),
                                            causal=True)
    rout, _ = _reference(q, kc, vc, used, causal=True)
    assert isinstance(out, torch.Tensor)
    assert_close(out.numpy(), rout, TOL_F32, "out")


@pytest.mark.skipif(torch is None or not flashattn.cuda_available(), reason="needs a GPU")
def test_cuda_matches_reference():
    used = [900, 1, 0]
    q, kc, vc = _cache(3, 1, 1024, 8, 2, 128, used)
    tq, tk, tv = (torch.from_numpy(x).to("cuda", torch.float16) for x in (q, kc, vc))
    out = flashattn.flash_attn_with_kvcache(tq, tk, tv, cache_seqlens=torch.tensor(used),
                                            causal=True)
    rout, _ = _reference(tq.double().cpu().numpy(), tk.double().cpu().numpy(),
                         tv.double().cpu().numpy(), used, causal=True)
    assert_close(out.double().cpu().numpy(), rout, 2e-3, "out")


# ---- the whole flash_attn_with_kvcache: paged caches, append, rotary, batch indices -------
#
# A float64 reference of the call: each batch entry's logical cache (its cache row, or its
# pages through the block table), the new rows written at cache_seqlens[b] (keys rotated),
# then attention of q (rotated) over rows [cache_leftpad[b], cache_seqlens[b] + seqlen_new).
# Rows and pages the call must not read hold NaN; so do the rows the append overwrites.


def _rotate(x, cos, sin, pos, interleaved):
    """x (..., D) float64 rotated at positions pos (broadcast to x's leading shape but
    the last); cos, sin (S, rotary_dim / 2)."""
    x = np.array(x, dtype=np.float64)
    half = cos.shape[1]
    c, s = cos[pos].astype(np.float64), sin[pos].astype(np.float64)
    if interleaved:
        x1, x2 = x[..., 0:2 * half:2].copy(), x[..., 1:2 * half:2].copy()
        x[..., 0:2 * half:2] = x1 * c - x2 * s
        x[..., 1:2 * half:2] = x1 * s + x2 * c
    else:
        x1, x2 = x[..., :half].copy(), x[..., half:2 * half].copy()
        x[..., :half] = x1 * c - x2 * s
        x[..., half:2 * half] = x1 * s + x2 * c
    return x


class _Case:
    """Random inputs for one call, and what the call must produce."""

    def __init__(self, seed, b=3, nq=1, hq=4, hk=2, d=32, cap=300, page=None, nnew=0,
                 rotary=None, interleaved=True, leftpad=False, batch_idx=False, causal=False,
                 window=(-1, -1), softcap=0.0, alibi=False, scale=None, seqlens=None):
        rng = np.random.default_rng(seed)
        f = np.float32
        self.b, self.nq, self.hq, self.hk, self.d, self.nnew = b, nq, hq, hk, d, nnew
        self.page, self.causal, self.window, self.softcap, self.scale = (page, causal, window,
                                                                         softcap, scale)
        self.interleaved = interleaved
        self.q = rng.standard_normal((b, nq, hq, d)).astype(f)
        if page:
            self.maxb = -(-cap // page)
            cap = self.maxb * page
            npages = b * self.maxb + 3  # spare pages, never referenced: NaN
            self.block_table = rng.permutation(npages)[:b * self.maxb].reshape(
                b, self.maxb).astype(np.int32)
            shape = (npages, page, hk, d)
        else:
            self.block_table = None
            shape = (b + (2 if batch_idx else 0), cap, hk, d)
        self.cap = cap
        self.kc = np.full(shape, np.nan, dtype=f)
        self.vc = np.full(shape, np.nan, dtype=f)
        self.seqlens = rng.integers(0, cap - nnew + 1, size=b).astype(np.int32)
        self.seqlens[0] = cap - nnew  # a full cache
        if seqlens is not None:
            self.seqlens[:] = seqlens
        self.leftpad = (rng.integers(0, self.seqlens + 1).astype(np.int32) if leftpad
                        else None)
        self.batch_idx = (rng.permutation(shape[0])[:b].astype(np.int32) if batch_idx
                          else None)
        # the rows each entry reads before the append hold data; the others stay NaN
        for i in range(b):
            lp = 0 if self.leftpad is None else self.leftpad[i]
            for j in range(lp, self.seqlens[i]):
                pg, row = self._where(i, j)
                self.kc[pg, row] = rng.standard_normal((hk, d))
                self.vc[pg, row] = rng.standard_normal((hk, d))
        if nnew:
            self.k = rng.standard_normal((b, nnew, hk, d)).astype(f)
            self.v = rng.standard_normal((b, nnew, hk, d)).astype(f)
        else:
            self.k = self.v = None
        if rotary:
            rd = d if rotary == "full" else rotary
            ang = rng.uniform(0, 2 * np.pi, size=(cap + nq, rd // 2))  # every q position
            self.cos, self.sin = np.cos(ang).astype(f), np.sin(ang).astype(f)
        else:
            self.cos = self.sin = None
        self.alibi = rng.uniform(0.01, 0.3, size=(hq,)).astype(f) if alibi else None

    def _where(self, i, j):
        """Where row j of entry i's logical cache lives: (index along axis 0, row)."""
        if self.page:
            return self.block_table[i, j // self.page], j % self.page
        return (i if self.batch_idx is None else self.batch_idx[i]), j

    def expected(self):
        """(caches after the call, out, lse) in float64."""
        kc, vc = self.kc.astype(np.float64), self.vc.astype(np.float64)
        for i in range(self.b):
            for t in range(self.nnew):
                pg, row = self._where(i, self.seqlens[i] + t)
                kn = self.k[i, t]
                if self.cos is not None:
                    kn = _rotate(kn, self.cos, self.sin, self.seqlens[i] + t, self.interleaved)
                kc[pg, row], vc[pg, row] = kn, self.v[i, t]
        outs, lses = [], []
        rot_rows = self.causal or self.window[0] >= 0 or self.window[1] >= 0
        for i in range(self.b):
            lp = 0 if self.leftpad is None else self.leftpad[i]
            end = self.seqlens[i] + self.nnew
            rows = [self._where(i, j) for j in range(lp, end)]
            kk = np.stack([kc[pg, r] for pg, r in rows]) if rows else np.zeros((0, self.hk, self.d))
            vv = np.stack([vc[pg, r] for pg, r in rows]) if rows else np.zeros((0, self.hk, self.d))
            qi = self.q[i:i + 1].astype(np.float64)
            if self.cos is not None:
                pos = self.seqlens[i] + (np.arange(self.nq) if rot_rows else 0 * np.arange(self.nq))
                qi = _rotate(qi, self.cos, self.sin, pos[None, :, None], self.interleaved)
            if not rows:
                outs.append(np.zeros(qi.shape))
                lses.append(np.full((1, self.hq, self.nq), -np.inf))
                continue
            o, l = ref_attention_np(qi, kk[None], vv[None], scale=self.scale, causal=self.causal,
                                    window=self.window, softcap=self.softcap, alibi=self.alibi)
            outs.append(o)
            lses.append(l)
        return kc, vc, np.concatenate(outs), np.concatenate(lses)

    def run(self, kind, num_splits=0, algorithm="flash2", seqlens_as=None):
        """Calls flash_attn_with_kvcache on numpy arrays or torch CPU tensors; returns
        (k_cache, v_cache, out, lse) as numpy arrays."""
        conv = (lambda x: x) if kind == "numpy" else \
            (lambda x: None if x is None else torch.from_numpy(x))
        kc, vc = conv(self.kc.copy()), conv(self.vc.copy())
        seqlens = self.seqlens if seqlens_as is None else seqlens_as(self.seqlens)
        out, lse = flashattn.flash_attn_with_kvcache(
            conv(self.q), kc, vc, conv(self.k), conv(self.v), conv(self.cos), conv(self.sin),
            conv(seqlens) if isinstance(seqlens, np.ndarray) else seqlens,
            conv(self.batch_idx), conv(self.leftpad), conv(self.block_table), self.scale,
            self.causal, self.window, self.softcap, self.interleaved, conv(self.alibi),
            num_splits, True, algorithm=algorithm)
        if kind != "numpy":
            kc, vc, out, lse = (x.numpy() for x in (kc, vc, out, lse))
        return kc, vc, out, lse

    def check(self, kind, **kw):
        kc, vc, out, lse = self.run(kind, **kw)
        ekc, evc, eout, else_ = self.expected()
        # the caches: appended rows as written (keys rotated: to rounding), the rest intact
        appended = np.zeros(self.kc.shape[:2], dtype=bool)
        for i in range(self.b):
            for t in range(self.nnew):
                appended[self._where(i, self.seqlens[i] + t)] = True
        assert np.array_equal(kc[~appended], self.kc[~appended], equal_nan=True)
        assert np.array_equal(vc[~appended], self.vc[~appended], equal_nan=True)
        assert np.array_equal(vc[appended], evc[appended].astype(np.float32))
        if self.cos is None:
            assert np.array_equal(kc[appended], ekc[appended].astype(np.float32))
        elif appended.any():
            assert_close(kc[appended], ekc[appended], 1e-6, "rotated keys")
        assert np.isfinite(out).all()
        assert_close(out, eout, TOL_F32, "out")
        assert np.array_equal(np.isinf(lse), np.isinf(else_))
        fin = np.isfinite(else_)
        assert_close(lse[fin], else_[fin], TOL_F32, "lse")


KINDS = ["numpy"] + (["torch"] if torch is not None else [])
LAYOUTS = [None, 16, 64, 256]  # a cache per batch entry, or pages of these sizes
FEATURES = {
    "decode": dict(nq=1),
    "append_causal": dict(nq=3, nnew=3, causal=True),
    "rotary_interleaved": dict(nq=2, nnew=2, rotary="full", interleaved=True, causal=True),
    "rotary_halves_partial_window": dict(nq=4, nnew=4, rotary=16, interleaved=False,
                                         window=(40, 0)),
    "rotary_noncausal": dict(nq=3, nnew=1, rotary=8, interleaved=True),
    "gqa_softcap_alibi": dict(nq=5, nnew=2, hq=6, hk=2, softcap=4.0, alibi=True, causal=True,
                              scale=0.3),
    "local_window": dict(nq=6, nnew=0, window=(20, 3), hq=2, hk=2),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page", LAYOUTS)
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_kvcache_call(kind, page, feature):
    seed = zlib.crc32(repr((kind, page, feature)).encode())
    _Case(seed, page=page, **FEATURES[feature]).check(kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("feature", ["leftpad", "batch_idx", "both"])
def test_leftpad_and_batch_idx(kind, feature):
    kw = dict(leftpad=feature != "batch_idx", batch_idx=feature != "leftpad")
    _Case(11, nq=3, nnew=2, causal=True, rotary=16, **kw).check(kind)
    _Case(12, nq=2, nnew=0, window=(30, -1), **kw).check(kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("algorithm", ["flash2", "flash1", "standard"])
def test_num_splits_and_algorithms(kind, num_splits, algorithm):
    _Case(5, nq=2, nnew=2, page=64, causal=True, rotary="full").check(
        kind, num_splits=num_splits, algorithm=algorithm)


def _drawn(r):
    """One _Case's arguments drawn from r (random.Random): every feature in combination."""
    hk = r.choice((1, 2, 3))
    kw = dict(b=r.randint(1, 4), nq=r.randint(1, 7), hk=hk, hq=hk * r.choice((1, 2, 4)),
              d=r.choice((8, 16, 24, 32, 40, 64)), cap=r.randint(1, 200),
              page=r.choice((None, None, 16, 32, 64, 256)), causal=r.random() < 0.5)
    kw["nnew"] = r.randint(0, min(kw["cap"], 6))
    if kw["nnew"] and r.random() < 0.5:
        kw["rotary"] = r.choice(("full", 2 * r.randint(1, kw["d"] // 2)))
        kw["interleaved"] = r.random() < 0.5
    if kw["page"] is None:
        kw["leftpad"], kw["batch_idx"] = r.random() < 0.3, r.random() < 0.3
    if r.random() < 0.3:
        kw["window"] = (r.choice((-1, r.randint(0, 60))),
                        -1 if kw["causal"] else r.choice((-1, r.randint(0, 20))))
    if r.random() < 0.2:
        kw["softcap"] = r.uniform(1.0, 8.0)
    kw["alibi"] = r.random() < 0.2
    if r.random() < 0.3:
        kw["scale"] = r.uniform(0.05, 0.5)
    run = dict(num_splits=r.choice((0, 0, 1, 2, 5)),
               algorithm=r.choice(("flash2", "flash2", "flash1", "standard")))
    return kw, run


@pytest.mark.parametrize("kind", KINDS)
def test_kvcache_drawn(kind):
    """Drawn combinations of the call's features (shapes, pages, append, rotary, left
    padding, batch index, masks, softcap, ALiBi, splits, algorithms); FLASHATTN_KV_SEED
    replays a run, whose seed a failure prints."""
    seed, r = drawn_rng("FLASHATTN_KV_SEED")
    for i in range(60):
        kw, run = _drawn(r)
        try:
            _Case(seed * 100 + i, **kw).check(kind, **run)
        except Exception as e:
            raise AssertionError("FLASHATTN_KV_SEED=%d, case %d: %r %r: %s"
                                 % (seed, i, kw, run, e)) from e


@pytest.mark.parametrize("kind", KINDS)
def test_cache_seqlens_forms(kind):
    """An int, a list, an int64 array/tensor: the same call."""
    c = _Case(8, nq=2, nnew=1, page=16, causal=True, seqlens=100)
    for form in (lambda s: int(s[0]), lambda s: [int(x) for x in s],
                 lambda s: s.astype(np.int64)):
        c.check(kind, seqlens_as=form)


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_no_append_is_the_forward_operator_and_whole_cache_default():
    c = _Case(4, nq=2, page=64, causal=True, seqlens=300)
    assert c.cap == 320
    c = _Case(4, nq=2, page=64, causal=True, seqlens=320)  # every row of every page
    q, kc, vc, bt = (torch.from_numpy(x) for x in (c.q, c.kc, c.vc, c.block_table))
    out = flashattn.flash_attn_with_kvcache(q, kc, vc, block_table=bt, causal=True)
    _, _, eout, _ = c.expected()
    assert_close(out.numpy(), eout, TOL_F32, "out")
    outn = flashattn.flash_attn_with_kvcache(c.q, c.kc, c.vc, block_table=c.block_table,
                                             causal=True)
    assert_close(outn, eout, TOL_F32, "out (numpy)")


# ---- paged varlen: flash_attn_varlen_func(block_table=...) --------------------------------


def _paged_varlen(seed, page, lens_q, lens_k, hq=4, hk=2, d=32):
    rng = np.random.default_rng(seed)
    f = np.float32
    maxb = max(-(-n // page) for n in lens_k)
    nseq = len(lens_q)
    npages = nseq * maxb + 2
    bt = rng.permutation(npages)[:nseq * maxb].reshape(nseq, maxb).astype(np.int32)
    kc = np.full((npages, page, hk, d), np.nan, dtype=f)
    vc = np.full((npages, page, hk, d), np.nan, dtype=f)
    ks, vs = [], []
    for s, n in enumerate(lens_k):
        kk = rng.standard_normal((n, hk, d)).astype(f)
        vv = rng.standard_normal((n, hk, d)).astype(f)
        for j in range(n):
            kc[bt[s, j // page], j % page] = kk[j]
            vc[bt[s, j // page], j % page] = vv[j]
        ks.append(kk)
        vs.append(vv)
    q = rng.standard_normal((sum(lens_q), hq, d)).astype(f)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    return q, kc, vc, bt, cu_q, cu_k, ks, vs


def _varlen_expected(q, cu_q, ks, vs, **kw):
    outs, lses = [], []
    for s in range(len(ks)):
        qs = q[cu_q[s]:cu_q[s + 1]][None]
        if len(ks[s]) == 0:
            outs.append(np.zeros(qs[0].shape))
            lses.append(np.full((q.shape[1], qs.shape[1]), -np.inf))
            continue
        o, l = ref_attention_np(qs, ks[s][None], vs[s][None], **kw)
        outs.append(o[0])
        lses.append(l[0])
    return np.concatenate(outs), np.concatenate(lses, 1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page", [16, 64, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_block_table(kind, page, causal):
    lens_q, lens_k = [3, 1, 7], [40, 300, 7]
    q, kc, vc, bt, cu_q, cu_k, ks, vs = _paged_varlen(page + causal, page, lens_q, lens_k)
    conv = (lambda x: x) if kind == "numpy" else torch.from_numpy
    out = flashattn.flash_attn_varlen_func(
        conv(q), conv(kc), conv(vc), conv(cu_q), conv(cu_k), max(lens_q), max(lens_k),
        causal=causal, window_size=(-1, -1) if causal else (50, 2), block_table=conv(bt))
    eout, _ = _varlen_expected(q, cu_q, ks, vs, causal=causal,
                               window=(-1, -1) if causal else (50, 2))
    out = out if kind == "numpy" else out.numpy()
    assert np.isfinite(out).all()
    assert_close(out, eout, TOL_F32, "out")


@pytest.mark.parametrize("kind", KINDS)
def test_varlen_block_table_drawn(kind):
    """Drawn packed batches over paged caches: sequence lengths (empty ones among them),
    page sizes, GQA, head dims, masks, softcap, ALiBi, scale; FLASHATTN_KV_SEED replays."""
    seed, r = drawn_rng("FLASHATTN_KV_SEED")
    conv = (lambda x: x) if kind == "numpy" else torch.from_numpy
    for i in range(25):
        nseq, hk = r.randint(1, 4), r.choice((1, 2))
        hq, d, page = hk * r.choice((1, 3)), r.choice((8, 16, 40)), r.choice((8, 16, 48, 256))
        lens_q = [r.randint(0, 9) for _ in range(nseq)]
        lens_k = [r.randint(1, 120) for _ in range(nseq)]
        causal = r.random() < 0.5
        window = (-1, -1)
        if r.random() < 0.4:
            window = (r.choice((-1, r.randint(0, 50))), -1 if causal else r.randint(-1, 10))
        softcap = r.uniform(1, 6) if r.random() < 0.2 else 0.0
        scale = r.uniform(0.05, 0.5) if r.random() < 0.3 else None
        alibi = (np.random.default_rng(i).uniform(0.01, 0.3, size=hq).astype(np.float32)
                 if r.random() < 0.2 else None)
        q, kc, vc, bt, cu_q, cu_k, ks, vs = _paged_varlen(seed * 100 + i, page, lens_q, lens_k,
                                                          hq, hk, d)
        what = "FLASHATTN_KV_SEED=%d, case %d: lens_q %s lens_k %s page %d hq %d hk %d d %d " \
            "causal %s window %s softcap %g scale %s alibi %s" % (
                seed, i, lens_q, lens_k, page, hq, hk, d, causal, window, softcap, scale,
                alibi is not None)
        out = flashattn.flash_attn_varlen_func(
            conv(q), conv(kc), conv(vc), conv(cu_q), conv(cu_k), max(lens_q), max(lens_k),
            softmax_scale=scale, causal=causal, window_size=window, softcap=softcap,
            alibi_slopes=None if alibi is None else conv(alibi), block_table=conv(bt))
        eout, _ = _varlen_expected(q, cu_q, ks, vs, scale=scale, causal=causal, window=window,
                                   softcap=softcap, alibi=alibi)
        out = out if kind == "numpy" else out.numpy()
        assert np.isfinite(out).all(), what
        assert_close(out, eout, TOL_F32, what)


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_varlen_block_table_backward_raises():
    q, kc, vc, bt, cu_q, cu_k, ks, vs = _paged_varlen(1, 16, [2, 3], [20, 33])
    q, kc, vc = (torch.from_numpy(x).requires_grad_() for x in (q, kc, vc))
    out = flashattn.flash_attn_varlen_func(q, kc, vc, torch.from_numpy(cu_q),
                                           torch.from_numpy(cu_k), block_table=torch.from_numpy(bt))
    assert out.requires_grad
    with pytest.raises(NotImplementedError, match="block_table"):
        out.sum().backward()
    with pytest.raises(flashattn.UnsupportedError, match="return_attn_probs"):
        flashattn.flash_attn_varlen_func(q, kc, vc, torch.from_numpy(cu_q),
                                         torch.from_numpy(cu_k), return_attn_probs=True,
                                         block_table=torch.from_numpy(bt))
    with pytest.raises(flashattn.UnsupportedError, match="block_table"):
        flashattn.flash_attn_varlen_func(q.detach().numpy(), kc.detach().numpy(),
                                         vc.detach().numpy(), cu_q, cu_k,
                                         block_table=bt, return_attn_probs=True)


# ---- argument errors: clear messages, nothing written ----------------------------------


def _bad_calls(kind):
    """(expected exception, message pattern, keyword changes) for a paged append call."""
    c = _Case(21, nq=2, nnew=2, page=16, causal=True, rotary=16)
    if kind == "numpy":
        conv, f16 = (lambda x: x), np.float16
        meta = None
    else:
        conv, f16 = torch.from_numpy, torch.float16
        meta = torch.empty(c.b, c.maxb, dtype=torch.int32, device="meta")
    base = dict(q=c.q, k_cache=c.kc, v_cache=c.vc, k=c.k, v=c.v, rotary_cos=c.cos,
                rotary_sin=c.sin, cache_seqlens=c.seqlens, block_table=c.block_table,
                causal=True)
    base = {n: conv(x) if isinstance(x, np.ndarray) else x for n, x in base.items()}
    bt, cos = base["block_table"], base["rotary_cos"]
    bad = [
        (TypeError, "integer", dict(block_table=bt.astype(np.float32) if kind == "numpy"
                                    else bt.float())),
        (ValueError, "block_table must have shape", dict(block_table=bt[:2])),
        (ValueError, "block_table must have shape", dict(block_table=bt.reshape(-1))),
        (flashattn.InvalidArgumentError, "block_table", dict(block_table=bt * 0 + 10 ** 6)),
        (flashattn.InvalidArgumentError, "block_table", dict(block_table=bt * 0 - 1)),
        (ValueError, "cache_seqlens must have shape",
         dict(cache_seqlens=base["cache_seqlens"][:2])),
        (TypeError, "integer", dict(cache_seqlens=conv(c.seqlens.astype(np.float32)))),
        (flashattn.InvalidArgumentError, "cache_seqlens", dict(cache_seqlens=c.cap - 1)),
        (flashattn.InvalidArgumentError, "cache_seqlens", dict(cache_seqlens=-1)),
        (TypeError, "cache_seqlens must be an int", dict(cache_seqlens=1.5)),
        (TypeError, "dtype", dict(rotary_cos=cos.astype(f16) if kind == "numpy"
                                  else cos.to(f16), rotary_sin=cos.astype(f16)
                                  if kind == "numpy" else cos.to(f16))),
        (ValueError, "together", dict(rotary_sin=None)),
        (ValueError, "rotary_cos must have shape", dict(rotary_cos=cos[0], rotary_sin=cos[0])),
        (ValueError, "same shape", dict(rotary_sin=cos[:, :4])),
        (flashattn.InvalidArgumentError, "rotary_seqlen", dict(rotary_cos=cos[:10],
                                                                rotary_sin=cos[:10])),
        # three query rows after two new keys in a full cache: the last takes position cap
        (flashattn.InvalidArgumentError, "rotary_seqlen",
         dict(q=conv(np.concatenate([c.q, c.q[:, :1]], axis=1)), cache_seqlens=c.cap - 2,
              rotary_cos=cos[:c.cap], rotary_sin=cos[:c.cap])),
        (ValueError, "rotary", dict(k=None, v=None)),
        (ValueError, "together", dict(v=None)),
        (TypeError, "dtype", dict(k=base["k"].astype(f16) if kind == "numpy"
                                  else base["k"].to(f16))),
        (ValueError, "shape", dict(v=base["v"][:, :1])),
        (flashattn.InvalidArgumentError, "cache_batch_idx",
         dict(cache_batch_idx=conv(np.zeros(c.b, dtype=np.int32)))),
        (flashattn.InvalidArgumentError, "cache_leftpad",
         dict(cache_leftpad=conv(np.zeros(c.b, dtype=np.int32)))),
        (ValueError, "num_splits", dict(num_splits=129)),
        (ValueError, "k_cache must have 4 dimensions", dict(k_cache=base["k_cache"][0],
                                                              v_cache=base["v_cache"][0])),
        (ValueError, "alibi_slopes", dict(alibi_slopes=conv(np.ones(3, dtype=np.float32)))),
    ]
    if meta is not None:
        bad.append((ValueError, "device", dict(block_table=meta)))
        bad.append((ValueError, "device", dict(cache_leftpad=torch.zeros(c.b, dtype=torch.int32,
                                                                          device="meta"),
                                               block_table=None)))
    return c, base, bad


@pytest.mark.parametrize("kind", KINDS)
def test_bad_arguments_raise_and_write_nothing(kind):
    c, base, bad = _bad_calls(kind)
    for exc, pattern, change in bad:
        kw = dict(base, **change)
        as_np = (lambda x: x.copy()) if kind == "numpy" else (lambda x: x.numpy().copy())
        kc0, vc0 = as_np(kw["k_cache"]), as_np(kw["v_cache"])
        with pytest.raises(exc, match=pattern):
            flashattn.flash_attn_with_kvcache(**kw)
        assert np.array_equal(as_np(kw["k_cache"]), kc0, equal_nan=True), pattern
        assert np.array_equal(as_np(kw["v_cache"]), vc0, equal_nan=True), pattern


def test_read_only_numpy_cache():
    c = _Case(2, nq=1, nnew=1)
    c.kc.setflags(write=False)
    with pytest.raises(ValueError, match="writable"):
        flashattn.flash_attn_with_kvcache(c.q, c.kc, c.vc, c.k, c.v, cache_seqlens=c.seqlens)


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_kvcache_gradient_is_refused():
    c = _Case(2, nq=1, nnew=1)
    q = torch.from_numpy(c.q).requires_grad_()
    out = flashattn.flash_attn_with_kvcache(q, torch.from_numpy(c.kc), torch.from_numpy(c.vc),
                                            torch.from_numpy(c.k), torch.from_numpy(c.v),
                                            cache_seqlens=torch.from_numpy(c.seqlens))
    with pytest.raises(RuntimeError, match="kvcache|derivative|autograd"):
        out.sum().backward()


@pytest.mark.skipif(torch is None or not hasattr(torch.library, "opcheck"),
                    reason="needs torch.library.opcheck")
def test_kvcache_opcheck():
    """Schema (mutated caches), fake kernel and autograd registration agree."""
    c = _Case(9, nq=2, nnew=2, page=16, causal=True, rotary=16, seqlens=20)
    c.kc[np.isnan(c.kc)] = 0  # opcheck compares runs: no NaN anywhere
    c.vc[np.isnan(c.vc)] = 0
    t = {n: torch.from_numpy(getattr(c, n)) for n in ("q", "kc", "vc", "seqlens", "k", "v",
                                                      "cos", "sin", "block_table")}
    torch.library.opcheck(torch.ops.flashattn.kvcache.default,
                          (t["q"], t["kc"], t["vc"], t["seqlens"]),
                          dict(k=t["k"], v=t["v"], rotary_cos=t["cos"], rotary_sin=t["sin"],
                               block_table=t["block_table"], causal=True))


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_eager_entry_matches_the_operator():
    """flashattn._C.kvcache (the eager entry) and torch.ops.flashattn.kvcache: the same
    outputs and cache writes; a tensor subclass is left to torch.ops (NotImplemented)."""
    from flashattn import _ops
    if _ops._fast_kvcache is _ops._not_taken:
        pytest.skip("the package was built without the eager entry")
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 3, 4, 16, generator=g)
    caches = [torch.full((2, 12, 2, 16), float("nan")) for _ in range(2)]
    for c in caches:
        c[:, :5] = torch.randn(2, 5, 2, 16, generator=g)
    k, v = torch.randn(2, 3, 2, 16, generator=g), torch.randn(2, 3, 2, 16, generator=g)
    lens = torch.tensor([5, 2], dtype=torch.int32)
    args = lambda kc, vc: (q, kc, vc, lens, k, v, None, None, None, None, None,  # noqa: E731
                           None, None, True, -1, -1, 0.0, True, 0, 0)
    fast = [c.clone() for c in caches]
    slow = [c.clone() for c in caches]
    o1, l1 = _ops._fast_kvcache(*args(*fast))
    o2, l2 = _ops._kvcache(*args(*slow))
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    for a, b in zip(fast, slow):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    assert not torch.isnan(o1).any()

    class Sub(torch.Tensor):
        pass

    assert _ops._fast_kvcache(*args(fast[0].as_subclass(Sub), fast[1])) is NotImplemented


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_decode_step_error_names_cache_seqlens():
    q = torch.randn(2, 1, 4, 16)
    kc = torch.randn(2, 8, 2, 16)
    lens = torch.tensor([3, 9], dtype=torch.int32)  # 9 > the cache's 8 rows
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 9"):
        flashattn.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=lens)
