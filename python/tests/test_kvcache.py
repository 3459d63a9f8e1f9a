"""flash_attn_with_kvcache (CPU): a padded KV cache whose rows past the used keys hold
NaN, against the float64 reference on each sequence's used keys alone."""
import numpy as np
import pytest

from conftest import TOL_F32, assert_close, ref_attention_np

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
    with pytest.raises(flashattn.FlashAttnError, match="seqused_k") as e:  # the library's check
        flashattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=[9, 1])
    assert isinstance(e.value, ValueError)
    with pytest.raises(ValueError, match="exceed"):
        flashattn.flash_attn_with_kvcache(q, kc, vc, k=kc[:, :2], v=vc[:, :2], cache_seqlens=7)
    with pytest.raises(ValueError, match="batch_size"):
        flashattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=[1, 2, 3])


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_torch_errors():
    q, kc, vc = (torch.from_numpy(x) for x in _cache(2, 1, 8, 2, 2, 16, [8, 8]))
    with pytest.raises(ValueError, match="seqused_k"):
        flashattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([9, 1]))
    with pytest.raises(ValueError, match="seqused_k must have shape"):
        flashattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="integer"):
        flashattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="exceed"):  # an append past the end: nothing written
        before = kc.clone()
        flashattn.flash_attn_with_kvcache(q, kc, vc, k=kc[:, :2], v=vc[:, :2],
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
