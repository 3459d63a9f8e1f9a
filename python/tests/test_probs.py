"""return_attn_probs=True: S_dmask, the probabilities with dropout's pattern in the sign.

Checked against a float64 softmax of the masked scores (causal/window aligned
bottom-right, GQA, softcap, ALiBi), the zero padding to multiples of 128, and, with
dropout, that the kept entries rescaled by 1 / (1 - p) reproduce the call's output and
that the dropped ones are those of flashattn.dropout_mask (the library's Philox draws).
"""
import math

import pytest

from conftest import has_cuda, needs_torch, torch

import flashattn

pytestmark = needs_torch

DEVICES = ["cpu"] + (["cuda"] if has_cuda() else [])


def _ref_probs(q, k, causal, window, softcap, alibi, scale):
    q, k = q.double(), k.double()
    b, nq, hq, d = q.shape
    nk, hk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(hq // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(nq, device=q.device)[:, None] + (nk - nq)
    j = torch.arange(nk, device=q.device)[None, :]
    if alibi is not None:
        s = s - alibi.double()[None, :, None, None] * (i - j).abs()
    keep = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    if causal:
        keep &= j <= i
    if window[0] >= 0:
        keep &= j >= i - window[0]
    if window[1] >= 0:
        keep &= j <= i + window[1]
    s = s.masked_fill(~keep, -math.inf)
    p = torch.softmax(s, dim=-1)
    return torch.nan_to_num(p, nan=0.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal,window,softcap,alibi", [
    (False, (-1, -1), 0.0, False), (True, (-1, -1), 0.0, False), (False, (7, 3), 0.0, True),
    (True, (-1, -1), 5.0, False)])
def test_probs_match_softmax(device, causal, window, softcap, alibi):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    b, nq, nk, hq, hk, d = 2, 37, 53, 4, 2, 40
    q = torch.randn(b, nq, hq, d, device=device, dtype=dtype)
    k = torch.randn(b, nk, hk, d, device=device, dtype=dtype)
    v = torch.randn(b, nk, hk, d, device=device, dtype=dtype)
    slopes = torch.rand(hq, device=device) if alibi else None
    out, lse, s = flashattn.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                            softcap=softcap, alibi_slopes=slopes,
                                            return_attn_probs=True)
    assert s.shape == (b, hq, 128, 128) and s.dtype == dtype
    ref = _ref_probs(q, k, causal, window, softcap, slopes, 1 / math.sqrt(d))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (s[:, :, :nq, :nk].double() - ref).abs().max().item() < tol
    assert s[:, :, nq:, :].abs().max().item() == 0 and s[:, :, :, nk:].abs().max().item() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_probs_encode_dropout(device):
    dtype = torch.float32 if device == "cpu" else torch.float16
    b, n, h, d, p = 2, 64, 3, 32, 0.25
    q, k, v = (torch.randn(b, n, h, d, device=device, dtype=dtype) for _ in range(3))
    out, lse, s = flashattn.flash_attn_func(q, k, v, dropout_p=p, causal=True,
                                            return_attn_probs=True)
    s = s[:, :, :n, :n].float()
    dropped = torch.signbit(s)
    frac = dropped.float().mean().item()
    assert 0.15 < frac < 0.35, frac
    kept = torch.where(dropped, torch.zeros_like(s), s) / (1 - p)
    o2 = torch.einsum("bhqk,bkhd->bqhd", kept, v.float())
    assert (o2 - out.float()).abs().max().item() < (1e-4 if dtype == torch.float32 else 2e-2)
    # a second call draws a fresh mask
    _, _, s2 = flashattn.flash_attn_func(q, k, v, dropout_p=p, causal=True,
                                         return_attn_probs=True)
    assert not torch.equal(torch.signbit(s2[:, :, :n, :n].float()), dropped)


@pytest.mark.parametrize("device", DEVICES)
def test_probs_varlen(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    lens = [5, 0, 40, 17]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32,
                      device=device)
    total, h, d = sum(lens), 2, 16
    q, k, v = (torch.randn(total, h, d, device=device, dtype=dtype) for _ in range(3))
    out, lse, s = flashattn.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens),
                                                   causal=True, return_attn_probs=True)
    assert s.shape == (len(lens), h, 128, 128)
    for i, n in enumerate(lens):
        assert s[i, :, n:, :].abs().max().item() == 0
        if n == 0:
            continue
        a = int(cu[i])
        ref = _ref_probs(q[None, a:a + n], k[None, a:a + n], True, (-1, -1), 0.0, None,
                         1 / math.sqrt(d))[0]
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (s[i, :, :n, :n].double() - ref).abs().max().item() <= tol
