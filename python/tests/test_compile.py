"""torch.compile keeps flashattn one graph node (fullgraph=True: no graph breaks)."""
import pytest

from conftest import TOL_F32, assert_close, needs_torch, slow_enabled

torch = pytest.importorskip("torch")
import flashattn  # noqa: E402

pytestmark = needs_torch

if not hasattr(torch, "compile"):
    pytest.skip("needs torch.compile", allow_module_level=True)


def _attn(q, k, v):
    return flashattn.flash_attn_func(q, k, v, causal=True, window_size=(8, -1), softcap=3.0)


def test_fullgraph_single_node():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: _attn(q, k, v) * 2, backend=backend, fullgraph=True)
    q, k, v = (torch.randn(2, 24, 2, 16) for _ in range(3))
    out = f(q, k, v)
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("flashattn.fwd" in t for t in targets) == 1, targets
    assert torch.equal(out, _attn(q, k, v) * 2)


def test_sdpa_fullgraph():
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: flashattn.scaled_dot_product_attention(q, k, v,
                                                                             is_causal=True),
                      backend="eager", fullgraph=True)
    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    assert torch.equal(f(q, k, v), flashattn.scaled_dot_product_attention(q, k, v,
                                                                          is_causal=True))


def test_aot_autograd_backward():
    """aot_eager traces forward and backward through the fake kernels."""
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: _attn(q, k, v).square().sum(), backend="aot_eager",
                      fullgraph=True)
    q, k, v = (torch.randn(2, 24, 4, 16, requires_grad=True) for _ in range(3))
    g = torch.autograd.grad(f(q, k, v), (q, k, v))
    r = torch.autograd.grad(_attn(q, k, v).square().sum(), (q, k, v))
    for a, b in zip(g, r):
        assert_close(a, b, TOL_F32)


@pytest.mark.parametrize("layout", ["bnhd", "bhnd", "varlen"])
def test_opcheck(layout):
    """torch.library.opcheck: schema, fake kernels, autograd registration consistent."""
    if not hasattr(torch.library, "opcheck"):
        pytest.skip("torch.library.opcheck needs torch >= 2.4")
    varlen = layout == "varlen"
    shape = (17, 2, 8) if varlen else (1, 9, 2, 8)
    q, k, v = (torch.randn(*shape, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 5, 17], dtype=torch.int32) if varlen else None
    rng = torch.tensor([123, 4], dtype=torch.int64)
    kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, softmax_scale=0.4, causal=True,
                  window_left=3, softcap=2.0, dropout_p=0.25, rng_state=rng,
                  bhnd=layout == "bhnd")
    torch.library.opcheck(torch.ops.flashattn.fwd.default, (q, k, v), kwargs)
    out, lse, _ = torch.ops.flashattn.fwd(q, k, v, **kwargs)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.flashattn.bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse),
                          kwargs)


@pytest.mark.slow
@pytest.mark.skipif(not slow_enabled(), reason="FLASHATTN_TEST_SLOW=0")
def test_inductor_cpu():
    """The default backend (inductor, C++ codegen on the CPU) around our op."""
    torch._dynamo.reset()

    def model(x, w):
        qkv = (x @ w).view(x.shape[0], x.shape[1], 3, 2, 16)
        return flashattn.flash_attn_qkvpacked_func(qkv, causal=True).sum(-1).relu()

    f = torch.compile(model, fullgraph=True)
    x = torch.randn(2, 32, 32)
    w = torch.randn(32, 96, requires_grad=True)
    out = f(x, w)
    ref = model(x, w)
    assert_close(out, ref, 1e-5)
    (gw,) = torch.autograd.grad(out.sum(), w)
    (rw,) = torch.autograd.grad(ref.sum(), w)
    assert_close(gw, rw, 1e-5)


def test_compiled_autograd_after_an_eager_forward():
    """torch._dynamo.compiled_autograd traces the backward node of an eager forward."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 11):
        pytest.skip("compiled autograd support is built for torch >= 2.11")
    from torch._dynamo import compiled_autograd
    torch._dynamo.reset()
    q, k, v = (torch.randn(2, 24, 2, 16, requires_grad=True) for _ in range(3))
    out = _attn(q, k, v)
    ref = torch.autograd.grad(out.square().sum(), (q, k, v), retain_graph=True)
    with compiled_autograd._enable(torch.compile(backend="aot_eager")):
        out.square().sum().backward()
    for a, t in zip(ref, (q, k, v)):
        assert torch.equal(a, t.grad)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_kvcache_fullgraph(backend):
    """The KV-cache call with an append, rotary and a page table under torch.compile:
    one flashattn.kvcache node, the caches written as in eager mode (aot_eager
    functionalizes the mutation and copies the result back)."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    g = torch.Generator().manual_seed(3)
    b, page, maxb, hk, hq, d = 2, 16, 3, 2, 4, 16
    q = torch.randn(b, 2, hq, d, generator=g)
    knew, vnew = (torch.randn(b, 2, hk, d, generator=g) for _ in range(2))
    kc0, vc0 = (torch.randn(b * maxb + 1, page, hk, d, generator=g) for _ in range(2))
    table = torch.randperm(b * maxb + 1, generator=g)[:b * maxb].view(b, maxb).int()
    ang = torch.rand(page * maxb, d // 4, generator=g) * 6.28
    cos, sin = ang.cos(), ang.sin()
    lens = torch.tensor([30, 7], dtype=torch.int32)

    def step(q, kc, vc, knew, vnew, cos, sin, lens, table):
        out = flashattn.flash_attn_with_kvcache(q, kc, vc, knew, vnew, cos, sin, lens,
                                                block_table=table, causal=True,
                                                rotary_interleaved=False)
        return out * 2

    torch._dynamo.reset()
    kc, vc = kc0.clone(), vc0.clone()
    ref = step(q, kc, vc, knew, vnew, cos, sin, lens, table)
    f = torch.compile(step, backend=record if backend == "eager" else backend, fullgraph=True)
    kc2, vc2 = kc0.clone(), vc0.clone()
    out = f(q, kc2, vc2, knew, vnew, cos, sin, lens, table)
    assert torch.equal(out, ref)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc) and not torch.equal(kc2, kc0)
    if backend == "eager":
        assert len(graphs) == 1
        targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
        assert sum("flashattn.kvcache" in t for t in targets) == 1, targets
