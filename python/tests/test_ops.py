"""The compiled operators flashattn::fwd / flashattn::bwd: one operator call each way,
what tracers and dispatch modes see, empty problems, the functional fwd/bwd other modules
use, and what a user without the compiled operators is told."""
import os
import subprocess
import sys
import types

import pytest

from conftest import TOL_F32, assert_close, needs_torch, ref_attention, ref_varlen

torch = pytest.importorskip("torch")
import flashattn  # noqa: E402
from flashattn import _ops  # noqa: E402

pytestmark = needs_torch


def _qkv(b=2, nq=19, nk=23, hq=4, hk=2, d=16, grad=True, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(b, n, h, d, generator=g, dtype=dtype).requires_grad_(grad)
                 for n, h in ((nq, hq), (nk, hk), (nk, hk)))


class _Record:
    """Every operator the dispatcher runs inside the `with`, by name."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        seen = self.seen = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.append(str(func))
                return func(*args, **(kwargs or {}))
        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self.seen

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def test_ops_are_loaded():
    assert flashattn.torch_ops_available() and _ops.AVAILABLE and _ops.MISSING is None
    assert hasattr(torch.ops.flashattn, "fwd") and hasattr(torch.ops.flashattn, "bwd")


def test_one_operator_call_each_way():
    q, k, v = _qkv()
    with _Record() as seen:
        out = flashattn.flash_attn_func(q, k, v, causal=True)
    assert [s for s in seen if "flashattn" in s] == ["flashattn.fwd.default"]
    with _Record() as seen:
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert [s for s in seen if "flashattn" in s] == ["flashattn.bwd.default"]
    ref = torch.autograd.grad(ref_attention(q, k, v, causal=True)[0], (q, k, v),
                              torch.ones_like(out, dtype=torch.float64))
    for a, b in zip((dq, dk, dv), ref):
        assert_close(a, b, TOL_F32)


@pytest.mark.parametrize("fn", ["func", "qkvpacked", "kvpacked", "varlen", "varlen_qkvpacked",
                                "varlen_kvpacked", "sdpa", "kvcache"])
def test_every_public_function_goes_through_the_operator(fn):
    q, k, v = _qkv(grad=False, nq=23)
    cu = torch.tensor([0, 10, 23], dtype=torch.int32)
    calls = {
        "func": lambda: flashattn.flash_attn_func(q, k, v),
        "qkvpacked": lambda: flashattn.flash_attn_qkvpacked_func(torch.stack((q, q, q), 2)),
        "kvpacked": lambda: flashattn.flash_attn_kvpacked_func(q, torch.stack((k, v), 2)),
        "varlen": lambda: flashattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 13, 13),
        "varlen_qkvpacked": lambda: flashattn.flash_attn_varlen_qkvpacked_func(
            torch.stack((q[0], q[0], q[0]), 1), cu, 13),
        "varlen_kvpacked": lambda: flashattn.flash_attn_varlen_kvpacked_func(
            q[0], torch.stack((k[0], v[0]), 1), cu, cu, 13, 13),
        "sdpa": lambda: flashattn.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True),
        "kvcache": lambda: flashattn.flash_attn_with_kvcache(
            q, k, v, cache_seqlens=torch.tensor([5, 20], dtype=torch.int32)),
    }
    with _Record() as seen:
        calls[fn]()
    assert [s for s in seen if "flashattn" in s] == ["flashattn.fwd.default"]


def test_kvcache_append_is_one_operator_call():
    q, k, v = _qkv()
    new = k[:, :2].detach().clone()
    kc, vc = k.detach().clone(), v.detach().clone()
    with _Record() as seen:
        flashattn.flash_attn_with_kvcache(q.detach(), kc, vc, new, new,
                                          cache_seqlens=torch.tensor([5, 20], dtype=torch.int32))
    assert [s for s in seen if "flashattn" in s] == ["flashattn.kvcache.default"]


def test_no_grad_and_inputs_without_grad():
    q, k, v = _qkv()
    k.requires_grad_(False)
    out = flashattn.flash_attn_func(q, k, v, causal=True)
    dq, dv = torch.autograd.grad(out.sum(), (q, v))
    assert dq.shape == q.shape and dv.shape == v.shape
    with torch.no_grad():
        out = flashattn.flash_attn_func(q, k, v)
    assert not out.requires_grad and out.grad_fn is None
    _, lse, _ = flashattn.flash_attn_func(q, k, v, return_attn_probs=True)
    assert not lse.requires_grad


def test_double_backward_is_a_clear_error():
    q, k, v = _qkv()
    out = flashattn.flash_attn_func(q, k, v, causal=True)
    grads = torch.autograd.grad(out.sum(), (q, k, v), create_graph=True)
    assert all(g.requires_grad for g in grads)
    with pytest.raises(RuntimeError, match="flashattn::bwd"):
        torch.autograd.grad(grads[0].sum(), (q, k, v))


@pytest.mark.parametrize("shape", [(0, 5, 2, 8), (2, 0, 2, 8), (2, 5, 0, 8)],
                         ids=["batch0", "seqlen0", "heads0"])
def test_empty_backward(shape):
    """out.sum().backward() on an empty problem: zero gradients, no stride complaint (the
    gradient of a sum is an expanded scalar: every stride 0)."""
    b, n, h, d = shape
    q = torch.randn(b, n, h, d, requires_grad=True)
    k = torch.randn(b, 7, h, d, requires_grad=True)
    v = torch.randn(b, 7, h, d, requires_grad=True)
    out = flashattn.flash_attn_func(q, k, v, causal=True)
    assert out.shape == q.shape
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    assert torch.all(k.grad == 0) and torch.all(v.grad == 0)
    # varlen with no tokens, and an SDPA-layout call with no queries
    cu = torch.zeros(2, dtype=torch.int32)
    qv = torch.randn(0, 2, 8, requires_grad=True)
    kv = torch.randn(0, 2, 8, requires_grad=True)
    flashattn.flash_attn_varlen_func(qv, kv, kv, cu, cu, 0, 0).sum().backward()
    assert qv.grad.shape == qv.shape
    qs = torch.randn(2, 2, 0, 8, requires_grad=True)
    flashattn.scaled_dot_product_attention(qs, qs, qs).sum().backward()
    assert qs.grad.shape == qs.shape


def test_no_keys_backward():
    q, k, v = _qkv(nk=0)
    out, lse, _ = flashattn.flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    out.sum().backward()
    assert torch.all(q.grad == 0)


def test_expanded_and_strided_dout():
    q, k, v = _qkv()
    out = flashattn.flash_attn_func(q, k, v, causal=True)
    dout = torch.randn(out.shape[:-1] + (2 * out.shape[-1],))[..., ::2]  # last stride 2
    g = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    r = torch.autograd.grad(out, (q, k, v), dout.contiguous())
    for a, b in zip(g, r):
        assert torch.equal(a, b)


def test_meta_tensors_use_the_fake_kernel():
    q, k, v = (x.to("meta") for x in _qkv(grad=False))
    out, lse, _ = flashattn.flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.device.type == "meta" and out.shape == q.shape
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    qv = q[0]
    cu = torch.zeros(3, dtype=torch.int32, device="meta")
    out, lse, _ = flashattn.flash_attn_varlen_func(qv, k[0], v[0], cu, cu, 1, 1,
                                                   return_attn_probs=True)
    assert lse.shape == (qv.shape[1], qv.shape[0])


def test_tracers_see_the_operators():
    from torch.fx.experimental.proxy_tensor import make_fx
    q, k, v = _qkv(grad=False)

    def f(q, k, v):
        return flashattn.flash_attn_func(q, k, v, causal=True, softcap=2.0)

    gm = make_fx(f)(q, k, v)
    assert [str(n.target) for n in gm.graph.nodes if "flashattn" in str(n.target)] \
        == ["flashattn.fwd.default"]
    assert torch.equal(gm(q, k, v), f(q, k, v))


def test_compile_aot_eager_matches_eager():
    if not hasattr(torch, "compile"):
        pytest.skip("needs torch.compile")
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: flashattn.flash_attn_func(q, k, v, causal=True).sum(),
                      backend="aot_eager", fullgraph=True)
    q, k, v = _qkv()
    g = torch.autograd.grad(f(q, k, v), (q, k, v))
    r = torch.autograd.grad(flashattn.flash_attn_func(q, k, v, causal=True).sum(), (q, k, v))
    for a, b in zip(g, r):
        assert torch.equal(a, b)


def test_compile_dropout_draws_a_fresh_mask_per_call():
    """The seed is drawn inside the operator: a compiled function does not bake it in."""
    if not hasattr(torch, "compile"):
        pytest.skip("needs torch.compile")
    torch._dynamo.reset()
    q, k, v = _qkv()
    f = torch.compile(lambda q, k, v: flashattn.flash_attn_func(q, k, v, dropout_p=0.5),
                      backend="aot_eager", fullgraph=True)
    a, b = f(q, k, v), f(q, k, v)
    assert not torch.equal(a, b)
    torch.manual_seed(3)
    c = f(q, k, v)
    torch.manual_seed(3)
    assert torch.equal(c, flashattn.flash_attn_func(q, k, v, dropout_p=0.5))
    # and the backward uses the forward's mask
    torch.manual_seed(5)
    gc = torch.autograd.grad(f(q, k, v).sum(), (q, k, v))
    torch.manual_seed(5)
    ge = torch.autograd.grad(flashattn.flash_attn_func(q, k, v, dropout_p=0.5).sum(), (q, k, v))
    for x, y in zip(gc, ge):
        assert torch.equal(x, y)


# ---- the functional fwd / bwd -------------------------------------------------------


def test_functional_fwd_bwd_match_autograd():
    q, k, v = _qkv()
    kw = dict(causal=True, softcap=2.0, window_size=(6, -1), softmax_scale=0.3)
    out, lse = _ops.fwd(q, k, v, **kw)
    assert out.grad_fn is None and lse.shape == (2, 4, 19)
    a_out, a_lse, _ = flashattn.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    assert torch.equal(out, a_out) and torch.equal(lse, a_lse)
    dout = torch.randn_like(out)
    dq, dk, dv = _ops.bwd(dout, q, k, v, out, lse, **kw)
    for a, b in zip((dq, dk, dv), torch.autograd.grad(a_out, (q, k, v), dout)):
        assert torch.equal(a, b)


def test_functional_varlen_and_explicit_dropout():
    np = pytest.importorskip("numpy")
    cu = [0, 7, 20]
    q = torch.randn(20, 2, 8, dtype=torch.float64)
    k = torch.randn(20, 2, 8, dtype=torch.float64)
    v = torch.randn(20, 2, 8, dtype=torch.float64)
    c = torch.tensor(cu, dtype=torch.int32)
    p, seed, offset = 0.3, 12345, 7
    kw = dict(cu_seqlens_q=c, cu_seqlens_k=c, dropout_p=p, dropout_seed=seed,
              dropout_offset=offset, algorithm="standard")
    out, lse = _ops.fwd(q, k, v, **kw)
    assert lse.shape == (2, 20)
    # the mask is flashattn.dropout_mask's for that seed and offset, per sequence
    for s in range(2):
        n = cu[s + 1] - cu[s]
        keep = torch.from_numpy(flashattn.dropout_mask(p, seed, offset, 2, n, n, batch=2)[s])
        qs, ks, vs = (x[cu[s]:cu[s + 1]] for x in (q, k, v))
        sc = torch.einsum("qhd,khd->hqk", qs, ks) / 8 ** 0.5
        z = keep.double() / (1 - np.float32(p).item())
        ref = torch.einsum("hqk,khd->qhd", torch.softmax(sc, -1) * z, vs)
        torch.testing.assert_close(out[cu[s]:cu[s + 1]], ref, rtol=1e-6, atol=1e-7)
    # a different offset is a different mask; bwd with the same seed and offset is autograd's
    assert not torch.equal(_ops.fwd(q, k, v, **dict(kw, dropout_offset=8))[0], out)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    def f(q, k, v):
        return _DropoutFn.apply(q, k, v, kw)

    assert torch.autograd.gradcheck(f, (qg, kg, vg), eps=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="dropout_seed"):
        _ops.fwd(q, k, v, dropout_p=0.1)


class _DropoutFn(torch.autograd.Function):
    """An autograd.Function over the functional fwd / bwd, as ring attention builds one."""

    @staticmethod
    def forward(ctx, q, k, v, kw):
        out, lse = _ops.fwd(q, k, v, **kw)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kw = kw
        return out

    @staticmethod
    def backward(ctx, dout):
        return _ops.bwd(dout, *ctx.saved_tensors, **ctx.kw) + (None,)


def test_sm_margin_reaches_the_library():
    """sm_margin (fa_params.sm_margin) changes nothing on the CPU but is validated."""
    q, k, v = _qkv(grad=False)
    out, lse = _ops.fwd(q, k, v, causal=True)
    out8, lse8 = _ops.fwd(q, k, v, causal=True, sm_margin=8)
    assert torch.equal(out, out8) and torch.equal(lse, lse8)
    dout = torch.randn_like(out)
    for a, b in zip(_ops.bwd(dout, q, k, v, out, lse, causal=True),
                    _ops.bwd(dout, q, k, v, out, lse, causal=True, sm_margin=1024)):
        assert torch.equal(a, b)
    for bad in (-1, 1025):
        with pytest.raises(ValueError, match="sm_margin"):
            _ops.fwd(q, k, v, sm_margin=bad)
        with pytest.raises(ValueError, match="sm_margin"):
            _ops.bwd(dout, q, k, v, out, lse, sm_margin=bad)
    with pytest.raises(TypeError, match="sm_margin"):
        _ops.fwd(q, k, v, sm_margin=1.5)
    # the public functions take it too (flash-attn 3's keyword), through autograd
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    a = flashattn.flash_attn_func(qg, kg, vg, causal=True, sm_margin=8)
    assert torch.equal(a, out)
    a.backward(dout)
    for g, want in zip((qg.grad, kg.grad, vg.grad),
                       _ops.bwd(dout, q, k, v, out, lse, causal=True)):
        assert torch.equal(g, want)
    for bad in (-1, 1025, 2.0):
        with pytest.raises(ValueError, match="sm_margin"):
            flashattn.flash_attn_func(q, k, v, sm_margin=bad)


def test_functional_bwd_errors():
    q, k, v = _qkv(grad=False)
    out, lse = _ops.fwd(q, k, v)
    with pytest.raises(ValueError, match="lse"):
        _ops.bwd(out, q, k, v, out, lse[:, :, :3])
    with pytest.raises(ValueError, match="dout must have the shape"):
        _ops.bwd(out[:, :3], q, k, v, out, lse)
    with pytest.raises(flashattn.FlashAttnError, match="f64"):
        _ops.fwd(q.double(), k.double(), v.double())


def test_public_backward_with_dropout_seed():
    q, k, v = _qkv(grad=False, dtype=torch.float64)
    torch.manual_seed(11)
    seed = _ops.draw_seed()
    out, lse = _ops.fwd(q, k, v, dropout_p=0.2, dropout_seed=seed, algorithm="standard")
    torch.manual_seed(11)
    a, a_lse, _ = flashattn.flash_attn_func(q, k, v, dropout_p=0.2, algorithm="standard",
                                            return_attn_probs=True)
    assert torch.equal(a, out)  # the operator draws what draw_seed draws
    dout = torch.randn_like(out)
    g1 = flashattn.backward(dout, q, k, v, out, lse, dropout_p=0.2, algorithm="standard",
                            dropout_seed=seed)
    g2 = _ops.bwd(dout, q, k, v, out, lse, dropout_p=0.2, dropout_seed=seed,
                  algorithm="standard")
    for x, y in zip(g1, g2):
        assert torch.equal(x, y)


def test_varlen_outputs_against_reference():
    cu = torch.tensor([0, 4, 4, 15], dtype=torch.int32)
    q = torch.randn(15, 4, 16, requires_grad=True)
    k = torch.randn(15, 2, 16, requires_grad=True)
    v = torch.randn(15, 2, 16, requires_grad=True)
    out = flashattn.flash_attn_varlen_func(q, k, v, cu, cu, causal=True)  # no max_seqlen
    ref, _ = ref_varlen(q.double(), k.double(), v.double(), cu, cu, causal=True)
    assert_close(out, ref, TOL_F32)


# ---- without the compiled operators -------------------------------------------------


def test_missing_operators_are_explained(monkeypatch, tmp_path):
    monkeypatch.delenv("FLASHATTN_TORCH_LIBRARY", raising=False)
    monkeypatch.setattr(_ops, "_HERE", str(tmp_path))
    build = types.ModuleType("flashattn._build")
    build.TORCH_VERSION = ""
    build.TORCH_MISSING = "torch was not importable by /usr/bin/python3"
    monkeypatch.setitem(sys.modules, "flashattn._build", build)
    monkeypatch.setattr(flashattn, "_build", build, raising=False)
    module, msg = _ops._load()
    assert module is None
    assert "without its PyTorch operators" in msg and "not importable" in msg
    assert "pip install --no-build-isolation" in msg
    (tmp_path / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    build.TORCH_VERSION = "0.0.1"
    module, msg = _ops._load()
    assert "built against torch 0.0.1" in msg and torch.__version__ in msg


def test_numpy_works_and_torch_is_told_without_operators(tmp_path):
    """A process whose operators cannot load: numpy calls work, torch calls say how to fix it."""
    code = (
        "import numpy as np, torch, flashattn\n"
        "assert not flashattn.torch_ops_available()\n"
        "q = np.random.randn(1, 4, 1, 8).astype(np.float32)\n"
        "assert flashattn.flash_attn_func(q, q, q).shape == q.shape\n"
        "try:\n"
        "    flashattn.flash_attn_func(*(torch.from_numpy(q),) * 3)\n"
        "except RuntimeError as e:\n"
        "    assert 'FLASHATTN_TORCH_LIBRARY' in str(e) and 'pip install' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no error')\n")
    env = dict(os.environ, FLASHATTN_TORCH_LIBRARY=str(tmp_path / "missing.so"))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


def test_forward_mode_ad_is_refused_clearly():
    import torch.autograd.forward_ad as fwAD
    q, k, v = _qkv(grad=False)
    with fwAD.dual_level():
        dq = fwAD.make_dual(q, torch.randn_like(q))
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            flashattn.flash_attn_func(dq, k, v)
