"""Shared helpers: the float64 reference (plain torch math, or numpy when torch is
absent) and error measures.

Reference: softmax(s) v with s = scale q kᵀ, softcapped (c·tanh(s/c)), plus ALiBi
(-slope·|i + Nk - Nq - j|), then causal / sliding-window masks aligned bottom-right.
Fully masked rows give out 0 and lse -inf, as the library does.
"""
import math
import os

import numpy as np
import pytest

try:
    import torch
except ImportError:  # numpy-only environment
    torch = None

import flashattn

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


def has_cuda():
    return torch is not None and torch.cuda.is_available() and flashattn.cuda_available()


needs_cuda = pytest.mark.skipif(not has_cuda(), reason="no CUDA device or no CUDA backend")


def _mask_np(nq, nk, causal, window):
    i = np.arange(nq)[:, None] + (nk - nq)
    j = np.arange(nk)[None, :]
    keep = np.ones((nq, nk), dtype=bool)
    if causal:
        keep &= j <= i
    if window is not None and not (window[0] < 0 and window[1] < 0):
        left, right = window
        if left >= 0:
            keep &= j >= i - left
        if right >= 0:
            keep &= j <= i + right
    return keep, np.abs(i - j).astype(np.float64)


def _probs_np(q, k, v, scale, causal, window, softcap, alibi):
    """The float64 softmax of (B, N, H, D) arrays: (q, k and v with K/V heads repeated per
    query head, scale, tanh(S / softcap) or None, P, the row sums l and maxima m)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    b, nq, hq, d = q.shape
    nk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k = np.repeat(k, hq // hk, axis=2)
    v = np.repeat(v, hq // hk, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    t = None
    if softcap:
        t = np.tanh(s / softcap)
        s = softcap * t
    keep, dist = _mask_np(nq, nk, causal, window)
    if alibi is not None:
        sl = np.asarray(alibi, dtype=np.float64)
        sl = np.broadcast_to(sl, (b, hq)) if sl.ndim == 1 else sl
        s = s - sl[:, :, None, None] * dist
    s = np.where(keep, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    l = e.sum(-1, keepdims=True)
    p = np.where(l > 0, e / np.where(l > 0, l, 1.0), 0.0)
    return q, k, v, scale, t, p, l, m


def ref_attention_np(q, k, v, scale=None, causal=False, window=(-1, -1), softcap=0.0,
                     alibi=None):
    """numpy float64 reference on (B, N, H, D) arrays. Returns (out, lse)."""
    _, _, v, _, _, p, l, m = _probs_np(q, k, v, scale, causal, window, softcap, alibi)
    lse = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)) + m[..., 0],
                   -np.inf)
    out = np.einsum("bhqk,bkhd->bqhd", p, v)
    return out, lse


def ref_grads_np(dout, q, k, v, scale=None, causal=False, window=(-1, -1), softcap=0.0,
                 alibi=None, bound=False):
    """(dq, dk, dv) of attention on (B, N, H, D) arrays in float64; with bound, instead the
    magnitudes the rounding errors of a float32 computation scale with (every product's
    terms taken in absolute value, dS's two terms added, not cancelled): a row that sees a
    single key has dS = P (dP - D) = 0 exactly, which float32 leaves as noise of that size."""
    b, nk, hk, d = np.shape(k)
    q, kr, vr, scale, t, p, _, _ = _probs_np(q, k, v, scale, causal, window, softcap, alibi)
    do = np.asarray(dout, dtype=np.float64)
    if bound:
        q, kr, vr, do = (np.abs(x) for x in (q, kr, vr, do))
    o = np.einsum("bhqk,bkhd->bqhd", p, vr)
    dv = np.einsum("bhqk,bqhd->bkhd", p, do)
    dp = np.einsum("bqhd,bkhd->bhqk", do, vr)
    dd = np.einsum("bqhd,bqhd->bhq", do, o)[..., None]  # D = rowsum(dO o O)
    ds = p * (dp + dd) if bound else p * (dp - dd)
    if softcap:
        ds = ds * (1 - t * t)
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kr) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    fold = lambda x: x.reshape(b, nk, hk, -1, d).sum(3)  # noqa: E731 (a group's heads)
    return dq, fold(dk), fold(dv)


def ref_attention(q, k, v, scale=None, causal=False, window=(-1, -1), softcap=0.0, alibi=None,
                  dtype=None):
    """torch reference (differentiable) on (B, N, H, D) tensors -> (out, lse), in float64 or
    dtype (float32: the naive computation whose error is a tolerance's yardstick)."""
    dtype = dtype or torch.float64
    q, k, v = (x.to(dtype) for x in (q, k, v))
    b, nq, hq, d = q.shape
    nk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k = k.repeat_interleave(hq // hk, dim=2)
    v = v.repeat_interleave(hq // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    keep, dist = _mask_np(nq, nk, causal, window)
    keep = torch.from_numpy(keep).to(q.device)
    if alibi is not None:
        sl = alibi.to(dtype).to(q.device)
        sl = sl.expand(b, hq) if sl.dim() == 1 else sl
        s = s - sl[:, :, None, None] * torch.from_numpy(dist).to(q.device, dtype)
    s = s.masked_fill(~keep, float("-inf"))
    # fully masked rows: a finite dummy row keeps logsumexp's gradient NaN-free
    rows = keep.any(-1)[:, None]
    s = torch.where(rows, s, torch.zeros_like(s))
    lse = torch.logsumexp(s, -1)
    p = torch.where(keep, torch.exp(s - lse[..., None]), torch.zeros_like(s))
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    lse = torch.where(rows[..., 0], lse, torch.full_like(lse, float("-inf")))
    return out, lse


def ref_varlen(q, k, v, cu_q, cu_k, **kw):
    """Per-sequence reference for packed (total, H, D) tensors -> (out, lse (H, total_q))."""
    outs, lses = [], []
    cu_q = [int(x) for x in cu_q]
    cu_k = [int(x) for x in cu_k]
    hq, dtype = q.shape[1], kw.get("dtype") or torch.float64
    for s in range(len(cu_q) - 1):
        qs = q[cu_q[s]:cu_q[s + 1]][None]
        ks = k[cu_k[s]:cu_k[s + 1]][None]
        vs = v[cu_k[s]:cu_k[s + 1]][None]
        nq = qs.shape[1]
        if nq == 0:
            continue
        if ks.shape[1] == 0:
            outs.append(torch.zeros_like(qs[0], dtype=dtype))
            lses.append(torch.full((hq, nq), float("-inf"), dtype=dtype, device=q.device))
            continue
        al = kw.get("alibi")
        kw2 = dict(kw)
        if al is not None and al.dim() == 2:
            kw2["alibi"] = al[s]
        o, l = ref_attention(qs, ks, vs, **kw2)
        outs.append(o[0])
        lses.append(l[0])
    if not outs:  # no query rows at all
        return (q.new_zeros(q.shape, dtype=dtype),
                torch.zeros((hq, 0), dtype=dtype, device=q.device))
    return torch.cat(outs, 0), torch.cat(lses, 1)


def drawn_rng(env):
    """(seed, random.Random(seed)) of a drawn test: the seed from the environment variable
    env when set (a failure prints it), else fresh."""
    import random
    import time
    seed = int(os.environ.get(env, time.time_ns() % 1000003))
    return seed, random.Random(seed)


def check_with_gradients(out, ref, naive, leaves, rleaves, nleaves, floor, what,
                         grad_factor=1, grad=None):
    """out against the float64 ref within twice the error of the same math done naively in
    the storage dtype (at least floor: DESIGN.md's yardstick), then the gradients of a
    random dout w.r.t. leaves (rleaves, nleaves: the references' copies) likewise, times
    grad_factor. A reference with no path to its inputs (no key anywhere) has zero
    gradients. grad: torch.autograd.grad, or a wrapper of it."""
    assert out.shape == ref.shape, what
    tol = lambda x, r: max(floor, 2 * rel_err(x, r))  # noqa: E731
    assert_close(out.cpu(), ref, tol(naive, ref), what + ": out")
    if out.numel() == 0:
        return
    dout = torch.randn_like(out)
    grads = (grad or torch.autograd.grad)(out, leaves, dout)
    none = [None] * len(leaves)
    rgrads = torch.autograd.grad(ref, rleaves, dout.cpu().double(), allow_unused=True) \
        if ref.requires_grad else none
    ngrads = torch.autograd.grad(naive, nleaves, dout.cpu().to(naive.dtype), allow_unused=True) \
        if naive.requires_grad else none
    for j, (g, rg, ng) in enumerate(zip(grads, rgrads, ngrads)):
        rg = torch.zeros(g.shape, dtype=torch.float64) if rg is None else rg
        ng = torch.zeros(g.shape, dtype=naive.dtype) if ng is None else ng
        assert_close(g.cpu(), rg, grad_factor * tol(ng, rg),
                     "%s: gradient of input %d" % (what, j))


def draw_options(r, left=40, right=12):
    """causal, window_size, softcap and softmax_scale of a drawn call (r: random.Random)."""
    kw = dict(causal=r.random() < 0.5)
    if r.random() < 0.4:
        kw["window_size"] = (r.choice((-1, r.randint(0, left))),
                             r.choice((-1, r.randint(0, right))))
    if r.random() < 0.2:
        kw["softcap"] = r.uniform(1.0, 6.0)
    if r.random() < 0.3:
        kw["softmax_scale"] = r.uniform(0.05, 0.6)
    return kw


def rel_err(a, b):
    """||a - b|| / ||b|| in float64, NaN-aware (NaN anywhere -> inf)."""
    a = np.asarray(_np(a), dtype=np.float64)
    b = np.asarray(_np(b), dtype=np.float64)
    if np.isnan(a).any():
        return float("inf")
    fin = np.isfinite(b)
    if not np.array_equal(np.isfinite(a), fin) or not np.array_equal(a[~fin], b[~fin]):
        return float("inf")
    num = np.linalg.norm(a[fin] - b[fin])
    den = np.linalg.norm(b[fin])
    return float(num / den) if den > 0 else float(num)


def _np(x):
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().cpu().double().numpy()
    x = np.asarray(x)
    return x.astype(np.float64) if x.dtype.kind == "f" or x.dtype.name == "bfloat16" else x


def assert_close(actual, expected, tol, what=""):
    e = rel_err(actual, expected)
    assert e <= tol, "%s: relative error %.3g > %.3g" % (what, e, tol)


# Tolerances (relative Frobenius error vs the float64 reference). float32 storage
# with float32 accumulation meets ~1e-6; half precisions are held to a small multiple
# of the error of the same math done naively in that precision (measured per test).
TOL_F32 = 1e-5


@pytest.fixture(autouse=True)
def _seed():
    np.random.seed(0)
    if torch is not None:
        torch.manual_seed(0)


def slow_enabled():
    return os.environ.get("FLASHATTN_TEST_SLOW", "1") != "0"
