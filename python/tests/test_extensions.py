"""Dropout and block-sparse attention through the torch functions, on the algorithm that
implements them so far (standard, CPU): gradients by gradcheck in float64 with the mask
held fixed, and the block mask against masked math attention."""
import math

import pytest

torch = pytest.importorskip("torch")
import flashattn  # noqa: E402


def _rand(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


def _math(q, k, v, allowed):
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows that see nothing give 0
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def test_dropout_gradcheck():
    q, k, v = _rand(1, 9, 2, 8), _rand(1, 11, 2, 8), _rand(1, 11, 2, 8)

    def f(q, k, v):
        torch.manual_seed(3)  # the seed flashattn draws: the same mask every call
        return flashattn.flash_attn_func(q, k, v, dropout_p=0.3, causal=True,
                                         algorithm="standard")

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-7)
    torch.manual_seed(3)
    a = f(q, k, v)
    torch.manual_seed(4)
    b = flashattn.flash_attn_func(q, k, v, dropout_p=0.3, causal=True, algorithm="standard")
    assert not torch.equal(a, b), "another seed must give another mask"


@pytest.mark.parametrize("algorithm", ["standard", "flash2", "flash1"])
@pytest.mark.parametrize("heads_broadcast", [False, True])
def test_block_mask_matches_masked_math(heads_broadcast, algorithm):
    B, Nq, Nk, H, D, bq, bk = 2, 13, 21, 3, 8, 4, 8
    q, k, v = _rand(B, Nq, H, D), _rand(B, Nk, H, D), _rand(B, Nk, H, D)
    nbq, nbk = -(-Nq // bq), -(-Nk // bk)
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(B, 1 if heads_broadcast else H, nbq, nbk, generator=g) < 0.5)
    mask[0, 0, 0] = False  # a query block that sees nothing: O = 0 there
    dt = torch.float64 if algorithm == "standard" else torch.float32
    out = flashattn.flash_attn_func(q.to(dt), k.to(dt), v.to(dt), block_mask=mask.to(torch.uint8),
                                    block_size=(bq, bk), algorithm=algorithm).double()
    allowed = mask.expand(B, H, nbq, nbk).repeat_interleave(bq, 2).repeat_interleave(bk, 3)
    ref = _math(q, k, v, allowed[:, :, :Nq, :Nk])
    # the softmax scale reaches the library as a float32: agreement to ~1e-8 in float64
    tol = 1e-7 if algorithm == "standard" else 2e-5
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    assert torch.all(out[0, :bq, 0] == 0)
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref.sum().backward()
    for got, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, t.grad, rtol=10 * tol, atol=10 * tol)


def test_dropout_with_the_public_mask():
    """O = (Z * P) V with Z from flashattn.dropout_mask and the seed torch drew."""
    np = pytest.importorskip("numpy")
    q, k, v = _rand(2, 7, 3, 8), _rand(2, 10, 3, 8), _rand(2, 10, 3, 8)
    p = 0.4
    torch.manual_seed(11)
    seed = int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64).item())
    torch.manual_seed(11)
    out = flashattn.flash_attn_func(q, k, v, dropout_p=p, algorithm="standard")
    keep = torch.from_numpy(flashattn.dropout_mask(p, seed, 0, 3, 7, 10, batch=2)).bool()
    assert 0.3 < keep.float().mean().item() < 0.9
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(8)
    z = keep.double() / (1 - np.float32(p).item())
    ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1) * z, v)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)


def test_block_mask_shape_is_checked():
    q, k, v = _rand(1, 16, 2, 8), _rand(1, 16, 2, 8), _rand(1, 16, 2, 8)
    small = torch.ones(1, 2, 1, 4, dtype=torch.uint8)  # 1 query block of 8 < 16 rows
    with pytest.raises(ValueError, match="block_mask"):
        flashattn.flash_attn_func(q, k, v, block_mask=small, block_size=(8, 4),
                                  algorithm="standard")


@pytest.mark.parametrize("algorithm", ["flash2", "flash1"])
def test_flash_dropout_draws_the_same_mask(algorithm):
    """Same seed, same mask: flash in float32 against standard in float64, with gradients."""
    q, k, v = _rand(2, 33, 2, 16), _rand(2, 40, 2, 16), _rand(2, 40, 2, 16)
    torch.manual_seed(5)
    ref = flashattn.flash_attn_func(q, k, v, dropout_p=0.25, causal=True, algorithm="standard")
    ref.sum().backward()
    want = [t.grad.float() for t in (q, k, v)]
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    torch.manual_seed(5)
    out = flashattn.flash_attn_func(qf, kf, vf, dropout_p=0.25, causal=True, algorithm=algorithm)
    torch.testing.assert_close(out, ref.float(), rtol=2e-5, atol=2e-5)
    out.sum().backward()
    for got, w in zip((qf.grad, kf.grad, vf.grad), want):
        torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-4)
