"""The eager fast path (flashattn._torch._FlashAttnFunction) against the custom ops
flashattn::fwd / flashattn::bwd: bit-identical outputs and gradients, the same autograd
behaviour, and the op wherever something traces or intercepts torch calls."""
import contextlib

import pytest

from conftest import needs_torch

torch = pytest.importorskip("torch")
import flashattn  # noqa: E402
from flashattn import _torch as fa_torch  # noqa: E402

pytestmark = needs_torch

if not fa_torch.HAS_CUSTOM_OP:
    pytest.skip("needs torch.library.custom_op (torch >= 2.4): only one path otherwise",
                allow_module_level=True)

FAST = "_FlashAttnFunctionBackward"
OP = "GeneratedBackwardFor_flashattn_fwd_defaultBackward"


@pytest.fixture
def op_path(monkeypatch):
    """Calls inside `with op_path():` go through the custom ops, as under torch.compile."""
    class Switch:
        def __enter__(self):
            monkeypatch.setattr(fa_torch, "EAGER_FAST_PATH", False)

        def __exit__(self, *exc):
            monkeypatch.setattr(fa_torch, "EAGER_FAST_PATH", True)
    return Switch


def _both(op_path):
    return (contextlib.nullcontext, op_path)  # fast path, then the custom ops


def _qkv(b=2, nq=19, nk=23, hq=4, hk=2, d=16, grad=True):
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(b, n, h, d, generator=g).requires_grad_(grad)
                 for n, h in ((nq, hq), (nk, hk), (nk, hk)))


CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window_softcap": dict(window_size=(5, 2), softcap=2.0, softmax_scale=0.3),
    "alibi": dict(causal=True, alibi_slopes=torch.tensor([0.5, 0.25, 0.1, 0.05])),
    "dropout": dict(dropout_p=0.3),
    "block_mask": dict(block_mask=torch.tensor([[[[1, 0], [1, 1]]]], dtype=torch.uint8),
                       block_size=(16, 16)),
    "standard": dict(causal=True, algorithm="standard"),
}


def _fwd_bwd(kw, strided_dout=False):
    q, k, v = _qkv()
    torch.manual_seed(7)  # the dropout seed is drawn from torch's generator on each call
    out, lse, _ = flashattn.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    g = torch.Generator().manual_seed(2)
    if strided_dout:  # last stride 2: the backward makes it unit-stride first
        dout = torch.randn(*out.shape[:-1], 2 * out.shape[-1], generator=g)[..., ::2]
    else:
        dout = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return type(out.grad_fn).__name__, (out, lse) + grads


@pytest.mark.parametrize("case", list(CASES))
def test_paths_bit_identical(case, op_path):
    fast_fn, fast = _fwd_bwd(CASES[case], strided_dout=case == "causal")
    with op_path():
        op_fn, slow = _fwd_bwd(CASES[case], strided_dout=case == "causal")
    assert (fast_fn, op_fn) == (FAST, OP)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), fast, slow):
        assert torch.equal(a, b), name
    assert not fast[1].requires_grad and not slow[1].requires_grad  # lse


def test_varlen_and_functional_backward_identical(op_path):
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)

    def run():
        q, k, v = (x[0] for x in _qkv(b=1, nq=20, nk=20))
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        out, lse, _ = flashattn.flash_attn_varlen_func(q, k, v, cu, cu, 13, 13, causal=True,
                                                       return_attn_probs=True)
        dout = torch.ones_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        direct = flashattn.backward(dout, q, k, v, out, lse, causal=True, cu_seqlens_q=cu,
                                    cu_seqlens_k=cu)
        return (out, lse) + grads + tuple(direct)

    fast = run()
    with op_path():
        slow = run()
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)
    for a, b in zip(fast[2:5], fast[5:]):  # autograd == flashattn.backward
        assert torch.equal(a, b)


def test_inputs_without_grad_and_no_grad(op_path):
    for path in _both(op_path):
        with path():
            q, k, v = _qkv()
            k.requires_grad_(False)
            out = flashattn.flash_attn_func(q, k, v, causal=True)
            dq, dv = torch.autograd.grad(out.sum(), (q, v))
            assert dq.shape == q.shape and dv.shape == v.shape
            with torch.no_grad():
                out = flashattn.flash_attn_func(q, k, v)
            assert not out.requires_grad and out.grad_fn is None


def _double_backward():
    q, k, v = _qkv()
    out = flashattn.flash_attn_func(q, k, v, causal=True)
    grads = torch.autograd.grad(out.sum(), (q, k, v), create_graph=True)
    assert all(g.requires_grad for g in grads)
    with pytest.raises(RuntimeError) as err:
        torch.autograd.grad(grads[0].sum(), (q, k, v))
    return str(err.value)


def test_double_backward_same_error(op_path):
    fast = _double_backward()
    with op_path():
        slow = _double_backward()
    assert fast == slow
    assert "flashattn.bwd" in fast


def test_errors_identical(op_path):
    q, k, v = _qkv()
    bad = [(q.int(), k, v), (q[0], k, v), (q, k.to("meta"), v)]
    for args in bad:
        msgs = []
        for path in _both(op_path):
            with path():
                with pytest.raises((TypeError, ValueError)) as err:
                    flashattn.flash_attn_func(*args)
                msgs.append((type(err.value), str(err.value)))
        assert msgs[0] == msgs[1]


def test_meta_tensors_use_the_fake_kernel():
    q, k, v = (x.to("meta") for x in _qkv(grad=False))
    out, lse, _ = flashattn.flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.device.type == "meta" and out.shape == q.shape
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])


def test_dispatch_modes_and_tracers_see_the_op():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = _qkv()
    with Record():
        out = flashattn.flash_attn_func(q, k, v, causal=True)
        torch.autograd.grad(out.sum(), (q, k, v))
    assert "flashattn.fwd.default" in seen and "flashattn.bwd.default" in seen

    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(lambda q, k, v: flashattn.flash_attn_func(q, k, v))(
        *(x.detach() for x in (q, k, v)))
    assert any("flashattn.fwd" in str(n.target) for n in gm.graph.nodes)


def test_default_device_keeps_the_fast_path():
    q, k, v = _qkv()
    with torch.device("cpu"):  # a DeviceContext torch-function mode, like set_default_device
        out = flashattn.flash_attn_func(q, k, v)
    assert type(out.grad_fn).__name__ == FAST


def test_compile_uses_the_op_and_matches_eager():
    """Under torch.compile the custom op (and its fake kernel) is traced, not the fast path."""
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
