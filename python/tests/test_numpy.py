"""numpy path (CPU): forward and backward against float64 references."""
import numpy as np
import pytest

from conftest import (TOL_F32, assert_close, draw_options, drawn_rng, ref_attention_np,
                      ref_grads_np, rel_err)

import flashattn
import flashattn.numpy as fnp


def _qkv(b, nq, nk, hq, hk, d, dtype=np.float32):
    rng = np.random.default_rng(1)
    return (rng.standard_normal((b, nq, hq, d)).astype(dtype),
            rng.standard_normal((b, nk, hk, d)).astype(dtype),
            rng.standard_normal((b, nk, hk, d)).astype(dtype))


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(4, 1)),
                                dict(softcap=2.0, softmax_scale=0.3)],
                         ids=["plain", "causal", "window", "softcap_scale"])
@pytest.mark.parametrize("algorithm", ["flash2", "flash1", "standard"])
def test_forward_f32(kw, algorithm):
    q, k, v = _qkv(2, 23, 31, 4, 2, 32)
    out, lse = fnp.forward(q, k, v, algorithm=algorithm, **kw)
    ref_kw = {{"window_size": "window", "softmax_scale": "scale"}.get(a, a): b
              for a, b in kw.items()}
    rout, rlse = ref_attention_np(q, k, v, **ref_kw)
    assert out.dtype == np.float32 and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == (2, 4, 23)
    assert_close(out, rout, TOL_F32, "out")
    assert_close(lse, rlse, TOL_F32, "lse")
    # the top-level function takes numpy arrays too
    out2 = flashattn.flash_attn_func(q, k, v, algorithm=algorithm, **kw)
    assert np.array_equal(out, out2)


def test_alibi_and_gqa():
    q, k, v = _qkv(2, 17, 17, 4, 1, 16)
    slopes = np.array([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]], dtype=np.float32)
    out, lse, none = flashattn.flash_attn_func(q, k, v, alibi_slopes=slopes, causal=True,
                                               return_attn_probs=True)
    assert none is None
    rout, rlse = ref_attention_np(q, k, v, alibi=slopes, causal=True)
    assert_close(out, rout, TOL_F32, "out")
    assert_close(lse, rlse, TOL_F32, "lse")


def test_float16():
    q, k, v = _qkv(1, 40, 40, 2, 2, 64, np.float16)
    out, _ = fnp.forward(q, k, v, causal=True)
    assert out.dtype == np.float16
    rout, _ = ref_attention_np(q, k, v, causal=True)
    # one rounding of the output to float16 (2^-11 relative) plus accumulated P rounding
    assert_close(out, rout, 2e-3, "out")


def test_bfloat16_with_ml_dtypes():
    ml = pytest.importorskip("ml_dtypes")
    q, k, v = (x.astype(ml.bfloat16) for x in _qkv(1, 40, 40, 2, 2, 64))
    out, _ = fnp.forward(q, k, v)
    assert out.dtype == q.dtype
    rout, _ = ref_attention_np(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    assert_close(out.astype(np.float64), rout, 1.6e-2, "out")


def test_backward_against_the_float64_oracle():
    """flash2 float32 gradients vs the library's own standard algorithm in float64."""
    q, k, v = _qkv(2, 29, 37, 4, 2, 32)
    kw = dict(causal=True, softcap=3.0, window_size=(10, -1))
    out, lse = fnp.forward(q, k, v, **kw)
    dout = np.random.default_rng(2).standard_normal(out.shape).astype(np.float32)
    dq, dk, dv = fnp.backward(dout, q, k, v, out, lse, **kw)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, dout))
    o64, l64 = fnp.forward(q64, k64, v64, algorithm="standard", **kw)
    rout, _ = ref_attention_np(q, k, v, causal=True, softcap=3.0, window=(10, -1))
    assert rel_err(o64, rout) < 1e-7  # params.softmax_scale is a float32
    g64 = fnp.backward(do64, q64, k64, v64, o64, l64, algorithm="standard", **kw)
    for name, a, b in zip("qkv", (dq, dk, dv), g64):
        assert_close(a, b, TOL_F32, "d" + name)
    # the generic entry point too
    g = flashattn.backward(dout, q, k, v, out, lse, **kw)
    for a, b in zip(g, (dq, dk, dv)):
        assert np.array_equal(a, b)


def test_backward_with_finite_differences():
    q, k, v = (x.astype(np.float64) for x in _qkv(1, 4, 5, 2, 1, 3))
    kw = dict(causal=True, algorithm="standard")
    out, lse = fnp.forward(q, k, v, **kw)
    dout = np.random.default_rng(3).standard_normal(out.shape)
    dq, dk, dv = fnp.backward(dout, q, k, v, out, lse, **kw)
    eps = 1e-6
    for x, g in ((q, dq), (k, dk), (v, dv)):
        num = np.zeros_like(x)
        it = np.nditer(x, flags=["multi_index"])
        for _ in it:
            i = it.multi_index
            old = x[i]
            x[i] = old + eps
            fp = (fnp.forward(q, k, v, **kw)[0] * dout).sum()
            x[i] = old - eps
            fm = (fnp.forward(q, k, v, **kw)[0] * dout).sum()
            x[i] = old
            num[i] = (fp - fm) / (2 * eps)
        assert np.allclose(g, num, atol=1e-7, rtol=1e-6)


def test_varlen_numpy():
    cu_q = np.array([0, 3, 10, 10, 16], dtype=np.int32)
    cu_k = np.array([0, 8, 9, 15, 15], dtype=np.int32)
    q = np.random.randn(16, 2, 8).astype(np.float32)
    k = np.random.randn(15, 2, 8).astype(np.float32)
    v = np.random.randn(15, 2, 8).astype(np.float32)
    out, lse, _ = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 8, causal=True,
                                                   return_attn_probs=True)
    assert lse.shape == (2, 16)
    for s in range(4):
        a, b = cu_q[s], cu_q[s + 1]
        c, d = cu_k[s], cu_k[s + 1]
        if a == b:
            continue
        if c == d:  # no keys: every row masked
            assert np.all(out[a:b] == 0) and np.all(np.isneginf(lse[:, a:b]))
            continue
        rout, rlse = ref_attention_np(q[None, a:b], k[None, c:d], v[None, c:d], causal=True)
        assert_close(out[a:b], rout[0], TOL_F32, "out seq %d" % s)
        assert_close(lse[:, a:b], rlse[0], TOL_F32, "lse seq %d" % s)
    dout = np.random.randn(*out.shape).astype(np.float32)
    dq, dk, dv = fnp.backward(dout, q, k, v, out, lse, causal=True, cu_seqlens_q=cu_q,
                              cu_seqlens_k=cu_k)
    g64 = fnp.backward(dout.astype(np.float64), q.astype(np.float64), k.astype(np.float64),
                       v.astype(np.float64), out.astype(np.float64), lse, causal=True,
                       cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, algorithm="standard")
    for a, b in zip((dq, dk, dv), g64):
        assert_close(a, b, 1e-4, "varlen grad")


@pytest.mark.parametrize("shape", [(0, 5, 2, 8), (2, 0, 2, 8)], ids=["batch0", "seqlen0"])
def test_empty_arrays(shape):
    """numpy gives arrays without elements zero strides: accepted, outputs empty."""
    q = np.zeros(shape, np.float32)
    assert q.strides[-1] == 0
    out, lse = fnp.forward(q, q, q, causal=True)
    assert out.shape == shape and lse.shape == (shape[0], shape[2], shape[1])
    dq, dk, dv = fnp.backward(out, q, q, q, out, lse, causal=True)
    assert dq.shape == dk.shape == dv.shape == shape
    assert flashattn.flash_attn_func(q, q, q).shape == shape
    c = np.zeros((shape[0], 16, 2, 8), np.float32)
    out = flashattn.flash_attn_with_kvcache(q[:, :0], c, c, cache_seqlens=3)
    assert out.shape == (shape[0], 0, 2, 8)  # as the torch path gives
    empty = np.zeros((0, 2, 8), np.float32)
    cu = np.zeros(3, np.int32)
    assert flashattn.flash_attn_varlen_func(empty, empty, empty, cu, cu, 0, 0).shape == (0, 2, 8)


def test_strided_and_readonly_inputs():
    base = np.random.randn(2, 6, 21, 16).astype(np.float32)  # (B, H, N, D)
    q = base.swapaxes(1, 2)  # (B, N, H, D) view, no copy
    q.setflags(write=False)
    out, _ = fnp.forward(q, q, q)
    rout, _ = ref_attention_np(q, q, q)
    assert_close(out, rout, TOL_F32, "out")
    sd = flashattn.scaled_dot_product_attention(base, base, base, is_causal=True)
    rsd, _ = ref_attention_np(q, q, q, causal=True)
    assert_close(sd, rsd.swapaxes(1, 2), TOL_F32, "sdpa")


def test_numpy_errors():
    q, k, v = _qkv(1, 8, 8, 2, 2, 16)
    with pytest.raises(ValueError, match="negative strides"):
        fnp.forward(q[:, ::-1], k, v)
    # numpy users are told numpy's spelling, not torch's .contiguous()
    with pytest.raises(ValueError, match=r"np\.ascontiguousarray\(q\)") as e:
        fnp.forward(np.asfortranarray(q), k, v)
    assert ".contiguous()" not in str(e.value)
    with pytest.raises(ValueError, match=r"np\.ascontiguousarray\(v\)"):
        flashattn.flash_attn_func(q, k, np.asfortranarray(v))
    with pytest.raises(TypeError, match="dtype"):
        fnp.forward(q.astype(np.int32), k, v)
    with pytest.raises(TypeError, match="same dtype"):
        fnp.forward(q, k.astype(np.float16), v)
    with pytest.raises(ValueError, match="4 dimensions"):
        fnp.forward(q[0], k, v)
    with pytest.raises(TypeError):
        flashattn.flash_attn_func(q.tolist(), k, v)
    with pytest.raises(flashattn.FlashAttnError, match="f64"):
        fnp.forward(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))


def test_numpy_without_torch():
    """A process where torch cannot be imported: the numpy entry works (ctypes), and
    flashattn says it has no compiled operators."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['torch'] = None\n"
            "import numpy as np, flashattn, flashattn.numpy as fnp\n"
            "assert not flashattn.torch_ops_available()\n"
            "q = np.random.default_rng(0).standard_normal((1, 9, 2, 8)).astype(np.float32)\n"
            "out, lse = fnp.forward(q, q, q, causal=True)\n"
            "assert np.isfinite(out).all() and out.shape == q.shape\n"
            "assert flashattn.flash_attn_func(q, q, q).shape == q.shape\n"
            "try:\n"
            "    flashattn.flash_attn_func([1.0], q, q)\n"
            "except TypeError as e:\n"
            "    assert 'numpy.ndarray' in str(e) and 'torch' not in str(e), e\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


# float32 roundings of a gradient's terms' magnitudes (ref_grads_np's bound) its error may
# reach: the drawn cases' worst reached a fifth of one (400 seeds)
GRAD_EPS = 2 * 2.0**-24


def grad_bounds(dout, q, k, v, kw, ref, cq=None, ck=None):
    """A drawn case's gradients' rounding-error magnitudes (ref_grads_np's bound), sequence
    by sequence where packed (cq, ck: its cu_seqlens)."""
    al = kw.get("alibi_slopes")
    if cq is None:
        return ref_grads_np(dout, q, k, v, alibi=al, bound=True, **ref)
    out = [np.zeros(x.shape) for x in (q, k, v)]
    for s in range(len(cq) - 1):
        a, e, c, f = cq[s], cq[s + 1], ck[s], ck[s + 1]
        if a == e or c == f:
            continue
        g = ref_grads_np(dout[None, a:e], q[None, a:e], k[None, c:f], v[None, c:f],
                         alibi=None if al is None else al[s], bound=True, **ref)
        out[0][a:e], out[1][c:f], out[2][c:f] = (x[0] for x in g)
    return out


def test_numpy_drawn():
    """Drawn numpy calls (fixed-length or packed, GQA, masks, softcap, ALiBi, scale,
    strided and read-only views, algorithms): out and lse against the float64 reference,
    gradients against the library's float64 standard algorithm (itself checked by
    gradcheck); FLASHATTN_NUMPY_SEED replays a run, whose seed a failure prints."""
    seed, r = drawn_rng("FLASHATTN_NUMPY_SEED")
    for i in range(40):
        rng = np.random.default_rng(seed * 100 + i)
        hk = r.choice((1, 2, 3))
        hq, d = hk * r.choice((1, 2)), r.choice((1, 8, 24, 64, 128))
        kw = dict(draw_options(r, 30, 9), algorithm=r.choice(("flash2", "flash1", "standard")))
        varlen = r.random() < 0.4
        if varlen:
            n = r.randint(1, 4)
            lq, lk = [r.randint(0, 20) for _ in range(n)], [r.randint(0, 20) for _ in range(n)]
            cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
            ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
            q = rng.standard_normal((cq[-1], hq, d)).astype(np.float32)
            k, v = (rng.standard_normal((ck[-1], hk, d)).astype(np.float32) for _ in range(2))
            if r.random() < 0.2:
                kw["alibi_slopes"] = rng.uniform(0.01, 0.3, size=(n, hq)).astype(np.float32)
            kw.update(cu_seqlens_q=cq, cu_seqlens_k=ck)
        else:
            b, nq, nk = r.randint(1, 3), r.randint(1, 40), r.randint(1, 40)
            if r.random() < 0.4:  # (B, H, N, D) memory seen as (B, N, H, D)
                q = rng.standard_normal((b, hq, nq, d)).astype(np.float32).swapaxes(1, 2)
                k, v = (rng.standard_normal((b, hk, nk, d)).astype(np.float32).swapaxes(1, 2)
                        for _ in range(2))
            else:
                q = rng.standard_normal((b, nq, hq, d)).astype(np.float32)
                k, v = (rng.standard_normal((b, nk, hk, d)).astype(np.float32)
                        for _ in range(2))
            if r.random() < 0.3:
                for x in (q, k, v):
                    x.setflags(write=False)
            if r.random() < 0.2:
                kw["alibi_slopes"] = rng.uniform(0.01, 0.3, size=(hq,)).astype(np.float32)
        what = "FLASHATTN_NUMPY_SEED=%d, case %d: q %s k %s %s" % (
            seed, i, q.shape, k.shape, {a: x for a, x in kw.items() if "cu_" not in a})
        out, lse = fnp.forward(q, k, v, **kw)
        ref = dict(scale=kw.get("softmax_scale"), causal=kw["causal"],
                   window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0))
        if varlen:
            for s in range(n):
                a, e, c, f = cq[s], cq[s + 1], ck[s], ck[s + 1]
                if a == e:
                    continue
                al = kw.get("alibi_slopes")
                if c == f:
                    assert np.all(out[a:e] == 0) and np.all(np.isneginf(lse[:, a:e])), what
                    continue
                ro, rl = ref_attention_np(q[None, a:e], k[None, c:f], v[None, c:f],
                                          alibi=None if al is None else al[s], **ref)
                assert_close(out[a:e], ro[0], TOL_F32, what + " out seq %d" % s)
                fin = np.isfinite(rl[0])
                assert_close(lse[:, a:e][fin], rl[0][fin], TOL_F32, what + " lse seq %d" % s)
        else:
            ro, rl = ref_attention_np(q, k, v, alibi=kw.get("alibi_slopes"), **ref)
            assert_close(out, ro, TOL_F32, what + " out")
            fin = np.isfinite(rl)
            assert_close(lse[fin], rl[fin], TOL_F32, what + " lse")
        if out.size == 0:
            continue
        dout = rng.standard_normal(out.shape).astype(np.float32)
        grads = fnp.backward(dout, q, k, v, out, lse, **kw)
        kw64 = dict(kw, algorithm="standard")
        up = [x.astype(np.float64) for x in (q, k, v)]
        o64, l64 = fnp.forward(*up, **kw64)
        g64 = fnp.backward(dout.astype(np.float64), *up, o64, l64, **kw64)
        bounds = grad_bounds(dout, q, k, v, kw, ref, *((cq, ck) if varlen else ()))
        if not varlen:  # the bounds' arithmetic, without the magnitudes, is the gradient
            for name, a, e in zip("qkv", ref_grads_np(dout, q, k, v, alibi=kw.get(
                    "alibi_slopes"), **ref), g64):
                assert_close(a, e, 1e-6, what + " numpy d" + name)  # scale: a float32
        for name, g, e, mag in zip("qkv", grads, g64, bounds):
            assert g.shape == e.shape, what
            # within 1e-4 of the gradient, or of its terms' magnitudes where they cancel
            err = np.linalg.norm(np.asarray(g, dtype=np.float64) - e)
            lim = max(1e-4 * np.linalg.norm(e), GRAD_EPS * np.linalg.norm(mag))
            assert err <= lim, "%s d%s: error %.3g > %.3g" % (what, name, err, lim)
