"""CUDA path (skipped without a GPU or a CUDA build): forward against our CPU backend and
against torch math in float64; backward where the CUDA backend has it."""
import math

import numpy as np
import pytest

from conftest import assert_close, needs_cuda, ref_attention, ref_varlen, rel_err

torch = pytest.importorskip("torch")
import flashattn  # noqa: E402

pytestmark = [needs_cuda, pytest.mark.cuda]
DTYPES = [torch.float16, torch.bfloat16]
# one rounding of O to the storage type plus P rounded for the PV product
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _qkv(b, nq, nk, hq, hk, d, dtype, grad=False):
    q = torch.randn(b, nq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, nk, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, nk, hk, d, device="cuda", dtype=dtype)
    return tuple(x.requires_grad_(grad) for x in (q, k, v))


def _backward_or_skip(fn):
    try:
        return fn()
    except flashattn.FlashAttnError as e:
        if e.status == flashattn.Status.ERR_UNSUPPORTED:
            pytest.skip("CUDA backward: %s" % e.message)
        raise


CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(32, 8)),
    "softcap": dict(softcap=5.0),
    "alibi": "alibi",
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_vs_cpu_and_float64(dtype, d, case):
    kw = CASES[case]
    if kw == "alibi":
        kw = dict(alibi_slopes=torch.rand(4, device="cuda") * 0.2)
    q, k, v = _qkv(2, 131, 257, 4, 2, d, dtype)
    out, lse, _ = flashattn.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    torch.cuda.synchronize()
    ref_kw = {{"window_size": "window", "alibi_slopes": "alibi"}.get(a, a): b
              for a, b in kw.items()}
    rout, rlse = ref_attention(q, k, v, **ref_kw)
    assert_close(out, rout, TOL[dtype], "out vs float64")
    assert_close(lse, rlse, 1e-4, "lse vs float64")
    cpu_kw = {a: (b.cpu() if isinstance(b, torch.Tensor) else b) for a, b in kw.items()}
    cout = flashattn.flash_attn_func(q.cpu(), k.cpu(), v.cpu(), **cpu_kw)
    assert rel_err(out, cout) <= 2 * TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
def test_sdpa_layout_vs_torch(dtype):
    q = torch.randn(2, 8, 300, 64, device="cuda", dtype=dtype)
    k = torch.randn(2, 8, 300, 64, device="cuda", dtype=dtype)
    v = torch.randn(2, 8, 300, 64, device="cuda", dtype=dtype)
    out = flashattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                           is_causal=True)
    assert out.shape == q.shape and out.transpose(1, 2).is_contiguous()
    assert_close(out, ref, TOL[dtype], "sdpa")


def test_varlen_cuda():
    cu_q = torch.tensor([0, 50, 50, 177], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 80, 100, 260], dtype=torch.int32, device="cuda")
    q = torch.randn(177, 4, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(260, 2, 64, device="cuda", dtype=torch.float16)
    v = torch.randn(260, 2, 64, device="cuda", dtype=torch.float16)
    out = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 127, 160, causal=True)
    ref, _ = ref_varlen(q, k, v, cu_q.cpu(), cu_k.cpu(), causal=True)
    assert_close(out, ref, TOL[torch.float16], "varlen")


def test_runs_on_the_current_stream():
    q, k, v = _qkv(4, 512, 512, 8, 8, 64, torch.float16)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = q * 1.0  # queued on s before the call
        out = flashattn.flash_attn_func(x, k, v)
    s.synchronize()
    ref = flashattn.flash_attn_func(q, k, v)
    torch.cuda.synchronize()
    assert torch.equal(out, ref)


def test_device_mismatch():
    q, k, v = _qkv(1, 8, 8, 2, 2, 32, torch.float16)
    with pytest.raises(ValueError, match="same device"):
        flashattn.flash_attn_func(q, k.cpu(), v)
    with pytest.raises(ValueError, match="same device"):
        flashattn.flash_attn_func(q, k, v, alibi_slopes=torch.ones(2))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_backward(dtype, causal):
    q, k, v = _qkv(2, 100, 140, 4, 2, 64, dtype, grad=True)
    out = flashattn.flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    g = _backward_or_skip(lambda: torch.autograd.grad(out, (q, k, v), dout))
    rq, rk, rv = (x.detach().double().requires_grad_() for x in (q, k, v))
    rout, _ = ref_attention(rq, rk, rv, causal=causal)
    rg = torch.autograd.grad(rout, (rq, rk, rv), dout.double())
    for name, a, b in zip("qkv", g, rg):
        assert_close(a, b, 4 * TOL[dtype], "d" + name)


def test_compile_cuda():
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: flashattn.flash_attn_func(q, k, v, causal=True) + 1,
                      fullgraph=True)
    q, k, v = _qkv(1, 64, 64, 2, 2, 64, torch.float16)
    assert torch.equal(f(q, k, v), flashattn.flash_attn_func(q, k, v, causal=True) + 1)


def _masked_math(q, k, v, allowed, z=None):
    """float64 softmax attention with an element mask (B, H, Nq, Nk) and dropout's Z."""
    q, k, v = (x.double() for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows that see nothing give 0
    if z is not None:
        p = p * z
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
def test_dropout_cuda_equals_cpu(dtype):
    """The package draws the seed from torch's CPU generator: the same torch.manual_seed gives
    the same Philox mask on both devices, which is flashattn.dropout_mask's."""
    B, N, H, D, p = 2, 200, 4, 64, 0.2
    q, k, v = _qkv(B, N, N, H, 2, D, dtype, grad=True)
    torch.manual_seed(7)
    seed = int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64).item())
    torch.manual_seed(7)
    out = flashattn.flash_attn_func(q, k, v, dropout_p=p, causal=True)
    qc, kc, vc = (x.detach().cpu().requires_grad_() for x in (q, k, v))
    torch.manual_seed(7)
    cout = flashattn.flash_attn_func(qc, kc, vc, dropout_p=p, causal=True)
    assert rel_err(out, cout) <= 2 * TOL[dtype]
    keep = torch.from_numpy(flashattn.dropout_mask(p, seed, 0, H, N, N, batch=B)).bool()
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    z = keep.double() / (1 - np.float32(p).item())
    ref = _masked_math(q.cpu(), k.cpu(), v.cpu(), causal.expand(B, H, N, N), z)
    assert_close(out, ref, TOL[dtype], "dropout out vs float64 with dropout_mask")
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), dout)
    cg = torch.autograd.grad(cout, (qc, kc, vc), dout.cpu())
    for name, a, b in zip("qkv", g, cg):
        assert rel_err(a, b) <= 8 * TOL[dtype], "d" + name


@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("heads_broadcast", [False, True])
def test_block_mask_cuda_vs_masked_math(dtype, heads_broadcast):
    B, Nq, Nk, H, D, bq, bk = 2, 300, 520, 4, 128, 64, 128
    q, k, v = _qkv(B, Nq, Nk, H, H, D, dtype, grad=True)
    nbq, nbk = -(-Nq // bq), -(-Nk // bk)
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(B, 1 if heads_broadcast else H, nbq, nbk, generator=gen) < 0.5
    mask[0, 0, 1] = False  # a query block that sees nothing: O = 0, zero gradients there
    out = flashattn.flash_attn_func(q, k, v, block_mask=mask.to(torch.uint8).cuda(),
                                    block_size=(bq, bk))
    allowed = mask.expand(B, H, nbq, nbk).repeat_interleave(bq, 2).repeat_interleave(bk, 3)
    allowed = allowed[:, :, :Nq, :Nk].cuda()
    rq, rk, rv = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = _masked_math(rq, rk, rv, allowed)
    assert_close(out, ref, TOL[dtype], "block-sparse out vs float64")
    assert torch.all(out[0, bq:2 * bq, 0] == 0)
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), dout)
    rg = torch.autograd.grad(ref, (rq, rk, rv), dout.double())
    for name, a, b in zip("qkv", g, rg):
        assert_close(a, b, 4 * TOL[dtype], "d" + name)
    assert torch.all(g[0][0, bq:2 * bq, 0] == 0)


# ---- the compiled operators on CUDA: no host synchronisation, CUDA graphs -------------


def test_no_host_synchronisation():
    """Forward, backward, varlen and a KV-cache decode step (device cache_seqlens, an
    append included) never wait for the GPU: torch's sync debug mode raises if they do."""
    q, k, v = _qkv(2, 256, 256, 8, 2, 64, torch.float16, grad=True)
    cu = torch.tensor([0, 100, 256], dtype=torch.int32, device="cuda")
    kc, vc = (torch.randn(2, 512, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    lens = torch.tensor([100, 300], dtype=torch.int32, device="cuda")
    new = torch.randn(2, 1, 2, 64, device="cuda", dtype=torch.float16)
    qd = torch.randn(2, 1, 8, 64, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = flashattn.flash_attn_func(q, k, v, causal=True)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        flashattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, causal=True)
        flashattn.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens)
        flashattn.flash_attn_with_kvcache(qd, kc, vc, k=new, v=new, cache_seqlens=lens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(dq).all()


def test_cuda_graph_capture_and_replay():
    """Forward and backward captured in one CUDA graph and replayed on new inputs equal
    eager calls (outputs and workspace come from the graph's memory pool)."""
    q, k, v = _qkv(2, 300, 300, 4, 2, 64, torch.bfloat16, grad=True)
    dout = torch.randn_like(q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up on a side stream, as capture requires
        for _ in range(2):
            out = flashattn.flash_attn_func(q, k, v, causal=True)
            torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = flashattn.flash_attn_func(q, k, v, causal=True)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for _ in range(2):
        with torch.no_grad():
            for x in (q, k, v, dout):
                x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        ref = flashattn.flash_attn_func(q, k, v, causal=True)
        rg = torch.autograd.grad(ref, (q, k, v), dout)
        assert torch.equal(out, ref)
        for a, b in zip((dq, dk, dv), rg):
            assert torch.equal(a, b)


def test_dropout_seed_is_not_drawn_under_capture():
    q, k, v = _qkv(1, 64, 64, 2, 2, 64, torch.float16)
    flashattn.flash_attn_func(q, k, v, dropout_p=0.1)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="CUDA graph"):
        with torch.cuda.graph(g):
            flashattn.flash_attn_func(q, k, v, dropout_p=0.1)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
def test_element_mask_as_block_mask(dtype):
    """A dense boolean mask through block_size (1, 1), as flashattn.transformers passes
    masks that are more than padding."""
    B, N, H, D = 2, 200, 4, 64
    q, k, v = _qkv(B, N, N, H, H, D, dtype, grad=True)
    gen = torch.Generator().manual_seed(3)
    keep = (torch.rand(B, 1, N, N, generator=gen) < 0.7).cuda()
    keep[..., 0] = True
    out = flashattn.flash_attn_func(q, k, v, block_mask=keep, block_size=(1, 1))
    rq, rk, rv = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = _masked_math(rq, rk, rv, keep.expand(B, H, N, N))
    assert_close(out, ref, TOL[dtype], "element mask out")
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), dout)
    rg = torch.autograd.grad(ref, (rq, rk, rv), dout.double())
    for name, a, b in zip("qkv", g, rg):
        assert_close(a, b, 4 * TOL[dtype], "d" + name)


def test_transformers_llama_on_cuda():
    transformers = pytest.importorskip("transformers")
    import flashattn.transformers as fat
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 101, (3, 40), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    mask[2, :25] = 0
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model(input_ids=ids, attention_mask=mask).logits.float()
        model.set_attn_implementation(fat.register())
        out = model(input_ids=ids, attention_mask=mask).logits.float()
    keep = mask.bool()
    assert rel_err(out[keep], ref[keep]) < 3e-2
    gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                         pad_token_id=0)
    assert gen.shape == (3, 45)


# ---- flash_attn_with_kvcache and paged varlen: test_kvcache.py's cases on the GPU --------

from test_kvcache import FEATURES, _Case, _paged_varlen, _varlen_expected  # noqa: E402


def _round_case(c, dtype):
    """The case's float inputs rounded to dtype (kept as float32), so that the float64
    reference sees the values the GPU does."""
    for name in ("q", "kc", "vc", "k", "v", "cos", "sin"):
        x = getattr(c, name)
        if x is not None:
            setattr(c, name, torch.from_numpy(x).to(dtype).float().numpy())
    return c


def _run_cuda(c, dtype, num_splits=0):
    def conv(x):
        if x is None:
            return None
        t = torch.from_numpy(x).to("cuda")
        return t.to(dtype) if t.is_floating_point() else t
    kc, vc = conv(c.kc), conv(c.vc)
    out, lse = flashattn.flash_attn_with_kvcache(
        conv(c.q), kc, vc, conv(c.k), conv(c.v), conv(c.cos), conv(c.sin), conv(c.seqlens),
        conv(c.batch_idx), conv(c.leftpad), conv(c.block_table), c.scale, c.causal, c.window,
        c.softcap, c.interleaved, None if c.alibi is None else torch.from_numpy(c.alibi).cuda(),
        num_splits, True)
    return tuple(x.float().cpu().numpy() for x in (kc, vc, out, lse))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [None, 16, 64, 256])
@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("num_splits", [0, 1, 4])
def test_kvcache_call(dtype, page, feature, num_splits):
    c = _round_case(_Case(7 + (page or 0), page=page, d=64, **FEATURES[feature]), dtype)
    kc, vc, out, lse = _run_cuda(c, dtype, num_splits)
    ekc, evc, eout, else_ = c.expected()
    appended = np.zeros(c.kc.shape[:2], dtype=bool)
    for i in range(c.b):
        for t in range(c.nnew):
            appended[c._where(i, c.seqlens[i] + t)] = True
    assert np.array_equal(kc[~appended], c.kc[~appended], equal_nan=True)
    assert np.array_equal(vc[~appended], c.vc[~appended], equal_nan=True)
    assert np.array_equal(vc[appended], evc[appended])
    if appended.any():
        assert_close(kc[appended], ekc[appended], TOL[dtype], "appended keys")
    assert np.isfinite(out).all()
    assert_close(out, eout, TOL[dtype], "out")
    fin = np.isfinite(else_)
    assert np.array_equal(np.isfinite(lse), fin)
    assert_close(lse[fin], else_[fin], 1e-3, "lse")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("feature", ["leftpad", "batch_idx"])
def test_kvcache_leftpad_and_batch_idx(dtype, feature):
    c = _round_case(_Case(3, nq=3, nnew=2, causal=True, rotary=16, d=64,
                          **{feature: True}), dtype)
    kc, vc, out, _ = _run_cuda(c, dtype)
    ekc, evc, eout, _ = c.expected()
    assert_close(out, eout, TOL[dtype], "out")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [16, 64, 256])
def test_varlen_block_table(dtype, page):
    q, kc, vc, bt, cu_q, cu_k, ks, vs = _paged_varlen(page, page, [3, 1, 70], [40, 600, 70],
                                                      d=64)
    r = (lambda x: torch.from_numpy(x).to(dtype).float().numpy())
    q, kc, vc = r(q), r(kc), r(vc)
    ks, vs = [r(x) for x in ks], [r(x) for x in vs]
    dev = (lambda x: torch.from_numpy(x).to("cuda", dtype))
    out = flashattn.flash_attn_varlen_func(dev(q), dev(kc), dev(vc),
                                           torch.from_numpy(cu_q).cuda(),
                                           torch.from_numpy(cu_k).cuda(), causal=True,
                                           block_table=torch.from_numpy(bt).cuda())
    eout, _ = _varlen_expected(q, cu_q, ks, vs, causal=True)
    assert_close(out.float().cpu().numpy(), eout, TOL[dtype], "out")


def test_kvcache_paged_append_no_host_synchronisation():
    c = _Case(1, nq=1, nnew=1, page=64, causal=True, rotary=32, d=64)
    c.kc[np.isnan(c.kc)] = 0
    c.vc[np.isnan(c.vc)] = 0
    t = {n: torch.from_numpy(getattr(c, n)).cuda() for n in ("q", "kc", "vc", "k", "v", "cos",
                                                             "sin", "seqlens", "block_table")}
    t = {n: x.half() if x.is_floating_point() else x for n, x in t.items()}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flashattn.flash_attn_with_kvcache(t["q"], t["kc"], t["vc"], t["k"], t["v"], t["cos"],
                                          t["sin"], t["seqlens"], block_table=t["block_table"],
                                          causal=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
def test_torch_drawn_cuda(dtype, device="cuda"):
    """test_torch's drawn calls (every form and option, head dims 1-256, varlen with empty
    sequences) on the GPU in 16-bit against float64 on the CPU, within twice the error of
    the same math done naively in the storage dtype (at least TOL); FLASHATTN_TORCH_SEED
    replays."""
    from conftest import drawn_rng
    from test_torch import check_drawn
    check_drawn(*drawn_rng("FLASHATTN_TORCH_SEED"), 30, device, dtype, TOL[dtype], 2,
                lambda *a: _backward_or_skip(lambda: torch.autograd.grad(*a)))
