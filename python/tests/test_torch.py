"""torch CPU path: outputs and gradients against the float64 torch reference."""
import math

import numpy as np
import pytest

from conftest import (TOL_F32, assert_close, check_with_gradients, draw_options, drawn_rng,
                      ref_attention, ref_varlen, rel_err, needs_torch)

torch = pytest.importorskip("torch")
import flashattn  # noqa: E402

pytestmark = needs_torch
ALGOS = ["flash2", "flash1", "standard"]


def _qkv(b, nq, nk, hq, hk, d, dtype=torch.float32, grad=True, device="cpu"):
    q = torch.randn(b, nq, hq, d, dtype=dtype, device=device)
    k = torch.randn(b, nk, hk, d, dtype=dtype, device=device)
    v = torch.randn(b, nk, hk, d, dtype=dtype, device=device)
    return tuple(x.requires_grad_(grad) for x in (q, k, v))


def _run_and_grad(fn, q, k, v, dout):
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return out, grads


def _check(q, k, v, tol_out, tol_grad, algorithm="flash2", **kw):
    """flash_attn_func vs the reference: out, lse, dq, dk, dv."""
    fa_kw = dict(kw)
    ref_kw = dict(kw)
    if "window_size" in fa_kw:
        ref_kw["window"] = ref_kw.pop("window_size")
    if "softmax_scale" in fa_kw:
        ref_kw["scale"] = ref_kw.pop("softmax_scale")
    if "alibi_slopes" in fa_kw:
        ref_kw["alibi"] = ref_kw.pop("alibi_slopes")
    out, lse, probs = flashattn.flash_attn_func(q, k, v, return_attn_probs=True,
                                                algorithm=algorithm, **fa_kw)
    assert probs.shape[:2] == (q.shape[0], q.shape[2]) and probs.dtype == q.dtype
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    rq, rk, rv = (x.detach().double().requires_grad_() for x in (q, k, v))
    rout, rlse = ref_attention(rq, rk, rv, **ref_kw)
    assert_close(out, rout, tol_out, "out")
    assert_close(lse, rlse, max(tol_out, 1e-6), "lse")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    rgrads = torch.autograd.grad(rout, (rq, rk, rv), dout.double())
    for name, g, r in zip("qkv", grads, rgrads):
        assert g.shape == r.shape and g.dtype == q.dtype
        assert_close(g, r, tol_grad, "d" + name)


# ---- float32 against float64: every variant ---------------------------------------

SHAPES = [  # b, nq, nk, hq, hk, d
    (2, 65, 65, 3, 3, 32),
    (1, 17, 70, 2, 2, 64),
    (1, 70, 17, 2, 2, 16),
    (2, 1, 1, 1, 1, 8),
    (1, 33, 129, 4, 1, 128),   # MQA
    (2, 40, 40, 4, 2, 24),     # GQA
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("algorithm", ALGOS)
def test_f32_plain_causal(shape, causal, algorithm):
    q, k, v = _qkv(*shape)
    _check(q, k, v, TOL_F32, TOL_F32, algorithm, causal=causal)


VARIANTS = {
    "scale": dict(softmax_scale=0.37),
    "window": dict(window_size=(7, 3)),
    "window_left": dict(window_size=(5, -1)),
    "window_right": dict(window_size=(-1, 0)),
    "window_causal": dict(window_size=(6, -1), causal=True),
    "softcap": dict(softcap=2.5),
    "alibi_h": "alibi_h",
    "alibi_bh": "alibi_bh",
    "all": "all",
}


def _variant(name, b, hq):
    v = VARIANTS[name]
    if v == "alibi_h":
        return dict(alibi_slopes=torch.rand(hq) * 0.5)
    if v == "alibi_bh":
        return dict(alibi_slopes=torch.rand(b, hq) * 0.5)
    if v == "all":
        return dict(alibi_slopes=torch.rand(hq) * 0.3, softcap=4.0, window_size=(9, 2),
                    causal=True, softmax_scale=0.2)
    return dict(v)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("algorithm", ALGOS)
def test_f32_variants(variant, algorithm):
    b, nq, nk, hq, hk, d = 2, 45, 61, 4, 2, 32
    q, k, v = _qkv(b, nq, nk, hq, hk, d)
    _check(q, k, v, TOL_F32, TOL_F32, algorithm, **_variant(variant, b, hq))


@pytest.mark.parametrize("d", [1, 40, 96, 160, 256])
def test_f32_headdims(d):
    q, k, v = _qkv(1, 19, 23, 2, 2, d)
    _check(q, k, v, TOL_F32, TOL_F32, causal=True)


def test_fully_masked_rows():
    # causal with nq > nk: the first nq - nk rows see no key at all
    q, k, v = _qkv(1, 12, 5, 2, 2, 16)
    out, lse, _ = flashattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.all(out[:, :7] == 0)
    assert torch.all(torch.isneginf(lse[:, :, :7]))
    (out * torch.randn_like(out)).sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    _check(*_qkv(1, 12, 5, 2, 2, 16), TOL_F32, TOL_F32, causal=True)


def test_empty_inputs():
    q, k, v = _qkv(2, 0, 5, 2, 2, 8)
    out = flashattn.flash_attn_func(q, k, v)
    assert out.shape == q.shape
    q, k, v = _qkv(1, 4, 0, 2, 2, 8)
    out, lse, _ = flashattn.flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    out.sum().backward()
    assert torch.all(q.grad == 0)


# ---- half precisions: held to the error of the same math done naively in them --------


def _naive_err(q, k, v, dtype, **kw):
    """Error of plain torch math in `dtype` (inputs, scores, P and output rounded)."""
    rq, rk, rv = (x.detach().double() for x in (q, k, v))
    rout, _ = ref_attention(rq, rk, rv, **kw)
    d = q.shape[-1]
    kk = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    vv = v.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk.float()).to(dtype).float()
    s = s * (1 / math.sqrt(d))
    if kw.get("causal"):
        nq, nk = q.shape[1], k.shape[1]
        mask = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, -1).to(dtype).float()
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv.float()).to(dtype)
    return rel_err(out, rout)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("algorithm", ALGOS)
def test_half_precisions(dtype, causal, algorithm):
    q, k, v = _qkv(2, 50, 67, 4, 2, 64, dtype=dtype)
    naive = _naive_err(q, k, v, dtype, causal=causal)
    # the output is rounded once to dtype; inputs are exact in the reference
    _check(q, k, v, max(2 * naive, 1e-3), max(8 * naive, 2e-2), algorithm, causal=causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_half_variants(dtype):
    q, k, v = _qkv(1, 33, 41, 2, 1, 32, dtype=dtype)
    naive = _naive_err(q, k, v, dtype)
    _check(q, k, v, max(4 * naive, 2e-3), max(8 * naive, 3e-2), softcap=3.0,
           window_size=(8, 8), alibi_slopes=torch.tensor([0.1, 0.3]))


# ---- layouts, packing, varlen --------------------------------------------------------


def test_strided_views_without_copies():
    # q, k, v as head-slices of one wider buffer: strides differ from contiguous
    buf = torch.randn(2, 31, 10, 16)
    q, k, v = buf[:, :, 0:4], buf[:, :, 4:6], buf[:, :, 6:8]
    assert not q.is_contiguous()
    out = flashattn.flash_attn_func(q, k, v, causal=True)
    ref, _ = ref_attention(q, k, v, causal=True)
    assert_close(out, ref, TOL_F32, "out")


def test_last_dim_must_be_contiguous():
    q, k, v = _qkv(1, 8, 8, 2, 2, 16, grad=False)
    bad = torch.randn(1, 8, 2, 16 * 2)[..., ::2]
    with pytest.raises(ValueError, match="contiguous"):
        flashattn.flash_attn_func(bad, k, v)
    with pytest.raises(ValueError, match="contiguous"):
        flashattn.flash_attn_func(q, k, v.transpose(-1, -2).contiguous().transpose(-1, -2))


def test_qkvpacked_and_kvpacked():
    qkv = torch.randn(2, 29, 3, 4, 32, requires_grad=True)
    out = flashattn.flash_attn_qkvpacked_func(qkv, causal=True)
    ref, _ = ref_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    assert_close(out, ref, TOL_F32, "out")
    dout = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, qkv, dout)
    (rg,) = torch.autograd.grad(ref, qkv, dout.double())
    assert_close(g, rg, TOL_F32, "dqkv")

    q = torch.randn(2, 13, 4, 32, requires_grad=True)
    kv = torch.randn(2, 29, 2, 2, 32, requires_grad=True)
    out = flashattn.flash_attn_kvpacked_func(q, kv, window_size=(4, 4))
    ref, _ = ref_attention(q, kv[:, :, 0], kv[:, :, 1], window=(4, 4))
    assert_close(out, ref, TOL_F32, "out")
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, kv), dout)
    rg = torch.autograd.grad(ref, (q, kv), dout.double())
    assert_close(g[0], rg[0], TOL_F32, "dq")
    assert_close(g[1], rg[1], TOL_F32, "dkv")


CU_Q = [0, 5, 5, 22, 40]
CU_K = [0, 9, 12, 12, 47]


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(3, 2)),
                                dict(softcap=3.0, causal=True),
                                "alibi"], ids=["plain", "causal", "window", "softcap", "alibi"])
@pytest.mark.parametrize("algorithm", ALGOS)
def test_varlen(kw, algorithm):
    hq, hk, d = 4, 2, 32
    if kw == "alibi":
        kw = dict(alibi_slopes=torch.rand(len(CU_Q) - 1, hq) * 0.4)
    q = torch.randn(CU_Q[-1], hq, d, requires_grad=True)
    k = torch.randn(CU_K[-1], hk, d, requires_grad=True)
    v = torch.randn(CU_K[-1], hk, d, requires_grad=True)
    cq = torch.tensor(CU_Q, dtype=torch.int32)
    ck = torch.tensor(CU_K, dtype=torch.int32)
    out, lse, _ = flashattn.flash_attn_varlen_func(
        q, k, v, cq, ck, max(np.diff(CU_Q)), max(np.diff(CU_K)), return_attn_probs=True,
        algorithm=algorithm, **kw)
    assert lse.shape == (hq, CU_Q[-1])
    ref_kw = {{"window_size": "window", "alibi_slopes": "alibi"}.get(a, a): b
              for a, b in kw.items()}
    rq, rk, rv = (x.detach().double().requires_grad_() for x in (q, k, v))
    rout, rlse = ref_varlen(rq, rk, rv, CU_Q, CU_K, **ref_kw)
    assert_close(out, rout, TOL_F32, "out")
    assert_close(lse, rlse, TOL_F32, "lse")
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), dout)
    rg = torch.autograd.grad(rout, (rq, rk, rv), dout.double())
    for name, a, b in zip("qkv", g, rg):
        assert_close(a, b, TOL_F32, "d" + name)


def test_varlen_packed_forms():
    cu = torch.tensor([0, 7, 20, 31], dtype=torch.int32)
    qkv = torch.randn(31, 3, 2, 16, requires_grad=True)
    out = flashattn.flash_attn_varlen_qkvpacked_func(qkv, cu, 13, causal=True)
    ref, _ = ref_varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, causal=True)
    assert_close(out, ref, TOL_F32, "out")
    dout = torch.randn_like(out)
    assert_close(torch.autograd.grad(out, qkv, dout)[0],
                 torch.autograd.grad(ref, qkv, dout.double())[0], TOL_F32, "dqkv")
    q = torch.randn(31, 4, 16)
    kv = torch.randn(31, 2, 2, 16)
    cu64 = cu.long()  # int64 offsets are accepted (converted)
    out = flashattn.flash_attn_varlen_kvpacked_func(q, kv, cu64, cu64, 13, 13)
    ref, _ = ref_varlen(q, kv[:, 0], kv[:, 1], cu, cu)
    assert_close(out, ref, TOL_F32, "out")


# ---- scaled_dot_product_attention -------------------------------------------------


@pytest.mark.parametrize("nq,nk", [(37, 37), (20, 45), (45, 20)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_matches_torch(nq, nk, is_causal):
    q = torch.randn(2, 3, nq, 32, dtype=torch.float64).float().requires_grad_()
    k = torch.randn(2, 3, nk, 32, dtype=torch.float64).float().requires_grad_()
    v = torch.randn(2, 3, nk, 32, dtype=torch.float64).float().requires_grad_()
    out = flashattn.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=0.3)
    # out is (B, H, N, D) over (B, N, H, D) memory, as torch's CUDA flash SDPA returns it
    assert out.shape == (2, 3, nq, 32) and out.transpose(1, 2).is_contiguous()
    rq, rk, rv = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(rq, rk, rv, is_causal=is_causal,
                                                           scale=0.3)
    assert_close(out, ref, TOL_F32, "out")
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), dout)
    rg = torch.autograd.grad(ref, (rq, rk, rv), dout.double())
    for name, a, b in zip("qkv", g, rg):
        assert_close(a, b, TOL_F32, "d" + name)


def test_sdpa_gqa_and_unbatched():
    q = torch.randn(1, 4, 21, 16)
    k = torch.randn(1, 2, 21, 16)
    v = torch.randn(1, 2, 21, 16)
    with pytest.raises(ValueError, match="enable_gqa"):
        flashattn.scaled_dot_product_attention(q, k, v)
    out = flashattn.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True)
    ref, _ = ref_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    assert_close(out, ref.transpose(1, 2), TOL_F32, "gqa out")
    out3 = flashattn.scaled_dot_product_attention(q[0], q[0], q[0])
    ref3 = torch.nn.functional.scaled_dot_product_attention(q[0].double(), q[0].double(),
                                                            q[0].double())
    assert out3.shape == (4, 21, 16)
    assert_close(out3, ref3, TOL_F32, "unbatched")


def test_sdpa_attn_mask_not_implemented():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(NotImplementedError):
        flashattn.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=bool))


# ---- gradcheck in float64 through the standard algorithm -----------------------------


GRADCHECK_CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(2, 1)),
    "softcap": dict(softcap=1.5),
    "alibi": "alibi",
    "scale_causal_nq_gt_nk": dict(causal=True, softmax_scale=0.7),
}


@pytest.mark.parametrize("case", list(GRADCHECK_CASES))
def test_gradcheck_standard_f64(case):
    kw = GRADCHECK_CASES[case]
    if kw == "alibi":
        kw = dict(alibi_slopes=torch.tensor([0.2, 0.5]))
    nq = 7 if case == "scale_causal_nq_gt_nk" else 5
    q = torch.randn(1, nq, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 6, 1, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 6, 1, 4, dtype=torch.float64, requires_grad=True)

    def f(q, k, v):
        return flashattn.flash_attn_func(q, k, v, algorithm="standard", **kw)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_varlen_f64():
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    q = torch.randn(7, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(7, 2, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(7, 2, 4, dtype=torch.float64, requires_grad=True)

    def f(q, k, v):
        return flashattn.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True,
                                                algorithm="standard")

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_float64_needs_standard():
    q, k, v = _qkv(1, 4, 4, 1, 1, 8, dtype=torch.float64, grad=False)
    with pytest.raises(flashattn.FlashAttnError) as e:
        flashattn.flash_attn_func(q, k, v)
    assert e.value.status == flashattn.Status.ERR_UNSUPPORTED
    assert "f64" in str(e.value)


# ---- the functional backward (no autograd) -----------------------------------------


def test_functional_backward_matches_autograd():
    q, k, v = _qkv(2, 21, 30, 4, 2, 16)
    out, lse, _ = flashattn.flash_attn_func(q, k, v, causal=True, softcap=2.0,
                                            return_attn_probs=True)
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), dout)
    g2 = flashattn.backward(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse,
                            causal=True, softcap=2.0)
    for a, b in zip(g, g2):
        assert torch.equal(a, b)


def test_deterministic_flag_and_threads():
    q, k, v = _qkv(1, 64, 64, 2, 2, 32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out1 = flashattn.flash_attn_func(q, k, v, deterministic=True)
    finally:
        torch.set_num_threads(threads)
    out2 = flashattn.flash_attn_func(q, k, v, deterministic=True)
    assert torch.equal(out1, out2)



# ---- drawn cases: every form and option in combination ------------------------------------


def _drawn_options(r, b, hq, device="cpu"):
    """Options drawn from r (random.Random) for the call and for its float64 reference."""
    kw = draw_options(r)
    if r.random() < 0.2:
        shape = (hq,) if r.random() < 0.5 else (b, hq)
        kw["alibi_slopes"] = (torch.rand(*shape, generator=torch.Generator().manual_seed(
            r.randrange(1 << 30))) * 0.4).to(device)
    if r.random() < 0.2:
        kw["deterministic"] = True
    names = {"window_size": "window", "softmax_scale": "scale", "alibi_slopes": "alibi"}
    ref = {names.get(a, a): x.cpu() if torch.is_tensor(x) else x
           for a, x in kw.items() if a != "deterministic"}
    return kw, ref


def _drawn_case(r, device="cpu"):
    """One call drawn from r: (description, leaves (CPU float32), call(leaves) -> out,
    views(leaves) -> (q, k, v), reference(q, k, v, dtype) -> out). device: where the call's
    auxiliary tensors (offsets, slopes) live; CUDA takes the flash2 algorithm only."""
    hk = r.choice((1, 2, 3))
    hq, d = hk * r.choice((1, 2, 4)), r.choice((1, 3, 8, 16, 40, 64, 72, 128, 160, 256))
    algo = r.choice(("flash2", "flash2", "flash1", "standard"))
    algo = "flash2" if device != "cpu" else algo
    form = r.choice(("plain", "strided", "qkvpacked", "kvpacked", "varlen", "varlen"))
    g = torch.Generator().manual_seed(r.randrange(1 << 30))
    mk = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if form == "varlen":
        n = r.randint(1, 4)
        lq = [r.randint(0, 30) for _ in range(n)]
        lk = lq if r.random() < 0.4 else [r.randint(0, 30) for _ in range(n)]
        cq = torch.tensor(np.concatenate([[0], np.cumsum(lq)]), dtype=torch.int32)
        ck = torch.tensor(np.concatenate([[0], np.cumsum(lk)]), dtype=torch.int32)
        kw, ref = _drawn_options(r, n, hq, device)
        leaves = [mk(sum(lq), hq, d), mk(sum(lk), hk, d), mk(sum(lk), hk, d)]
        return ("varlen lq %s lk %s hq %d hk %d d %d %s %s" % (lq, lk, hq, hk, d, algo, kw),
                leaves,
                lambda x: flashattn.flash_attn_varlen_func(*x, cq.to(device), ck.to(device),
                                                           max(lq), max(lk), algorithm=algo,
                                                           **kw),
                lambda x: x, lambda q, k, v, dt: ref_varlen(q, k, v, cq, ck, dtype=dt, **ref)[0])
    b, nq = r.randint(1, 3), r.randint(1, 40)
    nk = nq if form == "qkvpacked" or r.random() < 0.4 else r.randint(1, 40)
    hk = hq if form == "qkvpacked" else hk
    kw, ref = _drawn_options(r, b, hq, device)
    what = "%s b %d nq %d nk %d hq %d hk %d d %d %s %s" % (form, b, nq, nk, hq, hk, d, algo, kw)
    reference = lambda q, k, v, dt: ref_attention(q, k, v, dtype=dt, **ref)[0]  # noqa: E731
    if form == "qkvpacked":
        return (what, [mk(b, nq, 3, hq, d)],
                lambda x: flashattn.flash_attn_qkvpacked_func(x[0], algorithm=algo, **kw),
                lambda x: (x[0][:, :, 0], x[0][:, :, 1], x[0][:, :, 2]), reference)
    if form == "kvpacked":
        return (what, [mk(b, nq, hq, d), mk(b, nk, 2, hk, d)],
                lambda x: flashattn.flash_attn_kvpacked_func(x[0], x[1], algorithm=algo, **kw),
                lambda x: (x[0], x[1][:, :, 0], x[1][:, :, 1]), reference)
    if form == "strided":  # q, k, v: heads sliced out of one wider buffer (views)
        buf = mk(b, max(nq, nk), hq + 2 * hk + 1, d)
        leaves = [buf[:, :nq, :hq], buf[:, :nk, hq:hq + hk], buf[:, :nk, hq + hk:hq + 2 * hk]]
    else:
        leaves = [mk(b, nq, hq, d), mk(b, nk, hk, d), mk(b, nk, hk, d)]
    return (what, leaves, lambda x: flashattn.flash_attn_func(*x, algorithm=algo, **kw),
            lambda x: x, reference)


def check_drawn(seed, r, count, device="cpu", dtype=torch.float32, floor=TOL_F32,
                grad_factor=1, grad=None):
    """count of _drawn_case's calls on device in dtype (the inputs rounded to it first)
    against float64 on the CPU (check_with_gradients)."""
    for i in range(count):
        what, leaves, call, views, reference = _drawn_case(r, device)
        what = "FLASHATTN_TORCH_SEED=%d, case %d (%s): %s" % (seed, i, dtype, what)
        base = [x.detach().to(dtype) for x in leaves]  # CPU float32: views keep their strides
        rleaves = [x.detach().double().requires_grad_() for x in base]
        nleaves = [x.detach().clone().requires_grad_() for x in base]
        dev = [x.to(device).requires_grad_() for x in base]
        out = call(dev)
        assert out.dtype == dtype, what
        check_with_gradients(out, reference(*views(rleaves), torch.float64),
                             reference(*views(nleaves), dtype), dev, rleaves, nleaves, floor,
                             what, grad_factor, grad)


def test_torch_drawn():
    """Drawn forms (plain, strided views, packed, varlen with empty sequences) and options
    against the float64 reference, out and gradients, within twice the error of the same
    math done naively in float32 (at least TOL_F32); FLASHATTN_TORCH_SEED replays a run,
    whose seed a failure prints."""
    check_drawn(*drawn_rng("FLASHATTN_TORCH_SEED"), 40)


def _ref_block_masked(q, k, v, allowed, scale, causal, softcap, dtype):
    """Attention of (B, N, H, D) tensors where allowed (B, H, Nq, Nk) and the causal mask
    both keep a key, in dtype; rows keeping none give 0."""
    from conftest import _mask_np
    q, k, v = (x.to(dtype) for x in (q, k, v))
    hq, hk = q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(hq // hk, 2), v.repeat_interleave(hq // hk, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    keep = allowed & torch.from_numpy(_mask_np(q.shape[1], k.shape[1], causal, None)[0])
    s = s.masked_fill(~keep, float("-inf"))
    rows = keep.any(-1, keepdim=True)
    p = torch.softmax(torch.where(rows, s, torch.zeros_like(s)), -1) * keep
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def test_block_mask_drawn():
    """Drawn block-sparse calls on the CPU: block sizes, masks broadcast over the batch or
    the heads, empty query blocks, causal, GQA, softcap, algorithms; out and gradients
    against float64 within twice a naive float32 computation's error (at least TOL_F32);
    FLASHATTN_TORCH_SEED replays."""
    seed, r = drawn_rng("FLASHATTN_TORCH_SEED")
    for i in range(25):
        b, hk = r.randint(1, 2), r.choice((1, 2))
        hq, d = hk * r.choice((1, 2)), r.choice((8, 16, 40, 64))
        nq, nk = r.randint(1, 70), r.randint(1, 70)
        bq, bk = r.choice((1, 4, 16, 32, 64)), r.choice((1, 8, 16, 64, 128))
        nbq, nbk = -(-nq // bq), -(-nk // bk)
        mb, mh = r.choice((1, b)), r.choice((1, hq))
        g = torch.Generator().manual_seed(r.randrange(1 << 30))
        mask = torch.rand(mb, mh, nbq, nbk, generator=g) < r.uniform(0.2, 0.9)
        causal, softcap = r.random() < 0.4, (r.uniform(1, 6) if r.random() < 0.2 else 0.0)
        scale = r.uniform(0.05, 0.5)
        algo = r.choice(("flash2", "flash1", "standard"))
        what = "FLASHATTN_TORCH_SEED=%d, case %d: b %d nq %d nk %d hq %d hk %d d %d block " \
            "(%d, %d) mask %s causal %s softcap %g %s" % (seed, i, b, nq, nk, hq, hk, d, bq, bk,
                                                         tuple(mask.shape), causal, softcap, algo)
        q = torch.randn(b, nq, hq, d, generator=g).requires_grad_()
        k = torch.randn(b, nk, hk, d, generator=g).requires_grad_()
        v = torch.randn(b, nk, hk, d, generator=g).requires_grad_()
        out = flashattn.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal,
                                        softcap=softcap, block_mask=mask.to(torch.uint8),
                                        block_size=(bq, bk), algorithm=algo)
        allowed = mask.expand(b, hq, nbq, nbk).repeat_interleave(bq, 2).repeat_interleave(bk, 3)
        allowed = allowed[:, :, :nq, :nk]
        rl = [x.detach().double().requires_grad_() for x in (q, k, v)]
        nl = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        check_with_gradients(
            out, _ref_block_masked(*rl, allowed, scale, causal, softcap, torch.float64),
            _ref_block_masked(*nl, allowed, scale, causal, softcap, torch.float32), (q, k, v),
            rl, nl, TOL_F32, what)


def test_sdpa_drawn():
    """Drawn calls of flashattn.scaled_dot_product_attention (batched or not, GQA, causal
    top-left with nq != nk, scale, (B, H, N, D) tensors or transposed (B, N, H, D) views)
    against torch's own in float64, out and gradients; FLASHATTN_TORCH_SEED replays."""
    F = torch.nn.functional
    seed, r = drawn_rng("FLASHATTN_TORCH_SEED")
    for i in range(30):
        b, hk = r.randint(1, 3), r.choice((1, 2))
        hq, d = hk * r.choice((1, 2, 3)), r.choice((1, 8, 16, 40, 64, 128))
        nq, nk = r.randint(1, 50), r.randint(1, 50)
        causal, scale = r.random() < 0.5, (r.uniform(0.05, 0.5) if r.random() < 0.5 else None)
        views, unbatched = r.random() < 0.5, r.random() < 0.2
        g = torch.Generator().manual_seed(r.randrange(1 << 30))
        mk = lambda n, h: (torch.randn(b, n, h, d, generator=g).transpose(1, 2) if views  # noqa
                           else torch.randn(b, h, n, d, generator=g))
        q, k, v = mk(nq, hq), mk(nk, hk), mk(nk, hk)
        if unbatched:
            q, k, v = q[0], k[0], v[0]
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        what = "FLASHATTN_TORCH_SEED=%d, case %d: b %d hq %d hk %d d %d nq %d nk %d causal %s " \
            "scale %s views %s unbatched %s" % (seed, i, b, hq, hk, d, nq, nk, causal, scale,
                                                views, unbatched)
        kw = dict(is_causal=causal, scale=scale, enable_gqa=hq != hk)
        out = flashattn.scaled_dot_product_attention(*leaves, **kw)
        rl = [x.detach().double().requires_grad_() for x in leaves]
        nl = [x.detach().clone().requires_grad_() for x in leaves]
        check_with_gradients(out, F.scaled_dot_product_attention(*rl, **kw),
                             F.scaled_dot_product_attention(*nl, **kw), leaves, rl, nl,
                             TOL_F32, what)
