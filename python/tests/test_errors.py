"""Bad input gives a clear Python exception, never a crash; C errors carry the C message."""
import pytest

from conftest import needs_torch, has_cuda

torch = pytest.importorskip("torch")
import flashattn  # noqa: E402

pytestmark = needs_torch


def _qkv(shape=(1, 8, 2, 16), dtype=torch.float32):
    return tuple(torch.randn(*shape, dtype=dtype) for _ in range(3))


def test_error_class_and_status():
    assert issubclass(flashattn.FlashAttnError, RuntimeError)
    q, k, v = _qkv()
    with pytest.raises(flashattn.FlashAttnError) as e:  # flash2 has no float64 kernels
        flashattn.flash_attn_func(q.double(), k.double(), v.double())
    err = e.value
    assert err.status == flashattn.Status.ERR_UNSUPPORTED
    assert err.status_name == "FA_ERR_UNSUPPORTED"
    assert "f64" in err.message and err.message in str(err)
    assert err.function == "fa_forward"
    # valid, but not available here: a NotImplementedError too
    assert isinstance(err, NotImplementedError) and isinstance(err, flashattn.UnsupportedError)


def test_c_validation_message_surfaces():
    q, k, v = _qkv((1, 4, 1, 300))
    with pytest.raises(flashattn.FlashAttnError, match="headdim") as e:
        flashattn.flash_attn_func(q, k, v)
    assert e.value.status == flashattn.Status.ERR_INVALID_ARGUMENT
    # the caller's input is at fault: a ValueError too
    assert isinstance(e.value, ValueError) and isinstance(e.value, flashattn.InvalidArgumentError)


def test_error_classes_pickle_and_construct():
    import pickle
    e = flashattn.FlashAttnError(flashattn.Status.ERR_INVALID_ARGUMENT, "bad", "fa_forward")
    assert type(e) is flashattn.InvalidArgumentError and str(e).startswith("fa_forward: FA_ERR")
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is type(e) and e2.message == "bad" and e2.function == "fa_forward"
    assert type(flashattn.FlashAttnError(flashattn.Status.ERR_DEVICE, "x")) \
        is flashattn.FlashAttnError


def test_every_bad_input_error_is_value_or_type_error():
    """Bad caller input raises ValueError or TypeError (FlashAttnError for the library's
    own checks is one of them), never a bare RuntimeError."""
    q, k, v = _qkv((2, 8, 4, 16))
    cases = [
        lambda: flashattn.flash_attn_func(q, k[:1], v[:1]),                 # batch
        lambda: flashattn.flash_attn_func(q, k, v, softmax_scale=float("inf")),
        lambda: flashattn.flash_attn_func(q, k, v, softcap=-2.0),
        lambda: flashattn.flash_attn_func(q, k, v, dropout_p=1.0),
        lambda: flashattn.flash_attn_func(q, k, v, window_size=(1.5, 2)),
        lambda: flashattn.flash_attn_func(q, k, v, window_size="left"),
        lambda: flashattn.flash_attn_func(q, [1], v),
        lambda: flashattn.flash_attn_func(q, k, v, alibi_slopes=[0.1] * 4),
        lambda: flashattn.flash_attn_func(q, k, v, block_mask=torch.ones(1, 1, 1, 1,
                                                                         dtype=torch.uint8)),
        lambda: flashattn.flash_attn_func(q, k, v, block_size=(8, 8.5)),
        lambda: flashattn.flash_attn_func(q.int(), k.int(), v.int()),
        lambda: flashattn.flash_attn_func(q, k, v, algorithm=3),
    ]
    for i, f in enumerate(cases):
        with pytest.raises((ValueError, TypeError)):
            f()


def test_window_size_floats_are_refused():
    q, k, v = _qkv()
    for bad in [(1.5, 2), (2, 0.5), (2.0, 3)]:
        with pytest.raises(TypeError, match="window_size must be a pair of ints"):
            flashattn.flash_attn_func(q, k, v, window_size=bad)
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        flashattn.flash_attn_func(q.numpy(), k.numpy(), v.numpy(), window_size=(3.5, 0))
    # ints of other kinds are ints
    a = flashattn.flash_attn_func(q, k, v, window_size=(np.int64(3), torch.tensor(1)))
    b = flashattn.flash_attn_func(q, k, v, window_size=(3, 1))
    assert torch.equal(a, b)


def test_block_mask_without_block_size():
    q, k, v = _qkv()
    mask = torch.ones(1, 2, 8, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"block_mask needs block_size=\(block_q, block_k\)"):
        flashattn.flash_attn_func(q, k, v, block_mask=mask)
    with pytest.raises(ValueError, match=r"block_mask needs block_size"):
        flashattn.flash_attn_func(q.numpy(), k.numpy(), v.numpy(), block_mask=mask.numpy())


def test_block_mask_block_size_is_checked():
    q, k, v = _qkv()
    mask = torch.ones(1, 2, 1, 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="block"):
        flashattn.flash_attn_func(q, k, v, block_mask=mask, block_size=(0, 64))
    with pytest.raises(ValueError, match="block_mask"):  # 8 rows in blocks of 4: 2 query blocks
        flashattn.flash_attn_func(q, k, v, block_mask=mask, block_size=(4, 64))


@pytest.mark.parametrize("dtype", [torch.int32, torch.complex64, torch.float8_e4m3fn]
                         if hasattr(torch, "float8_e4m3fn") else [torch.int32])
def test_bad_dtype(dtype):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="dtype"):
        flashattn.flash_attn_func(q.to(dtype), k.to(dtype), v.to(dtype))


def test_mixed_dtypes():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="same dtype"):
        flashattn.flash_attn_func(q, k.half(), v)


@pytest.mark.parametrize("bad", ["q3d", "kv_mismatch", "heads", "batch", "headdim"])
def test_bad_shapes(bad):
    q, k, v = _qkv((2, 8, 4, 16))
    if bad == "q3d":
        q = q[0]
    elif bad == "kv_mismatch":
        v = v[:, :5]
    elif bad == "heads":
        k, v = k[:, :, :3], v[:, :, :3]
    elif bad == "batch":
        k, v = k[:1], v[:1]
    elif bad == "headdim":
        k, v = k[..., :8], v[..., :8]
    with pytest.raises(ValueError):
        flashattn.flash_attn_func(q, k, v)


def test_bad_options():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="window_size"):
        flashattn.flash_attn_func(q, k, v, window_size=3)
    with pytest.raises(ValueError, match="softcap"):
        flashattn.flash_attn_func(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="dropout_p"):
        flashattn.flash_attn_func(q, k, v, dropout_p=1.5)
    with pytest.raises(ValueError, match="algorithm"):
        flashattn.flash_attn_func(q, k, v, algorithm="flash3")
    with pytest.raises(ValueError, match="softmax_scale"):
        flashattn.flash_attn_func(q, k, v, softmax_scale=float("nan"))
    with pytest.raises(ValueError, match="alibi_slopes"):
        flashattn.flash_attn_func(q, k, v, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match="page_block_size"):  # k is not a page pool
        flashattn.flash_attn_varlen_func(q[0], k[0], v[0], torch.tensor([0, 8]),
                                         torch.tensor([0, 8]), 8, 8, block_table=torch.ones(1))


def test_bad_varlen_offsets():
    q, k, v = (x[0] for x in _qkv((1, 8, 2, 16)))
    good = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(flashattn.FlashAttnError, match="cu_seqlens_q"):
        flashattn.flash_attn_varlen_func(q, k, v, torch.tensor([0, 5, 3], dtype=torch.int32),
                                         good, 5, 5)
    with pytest.raises(flashattn.FlashAttnError, match="exceeds"):
        flashattn.flash_attn_varlen_func(q, k, v, good, torch.tensor([0, 3, 9],
                                                                     dtype=torch.int32), 5, 5)
    with pytest.raises(ValueError, match="same length"):
        flashattn.flash_attn_varlen_func(q, k, v, good, torch.tensor([0, 8], dtype=torch.int32),
                                         8, 8)
    with pytest.raises(TypeError, match="integer"):
        flashattn.flash_attn_varlen_func(q, k, v, good.float(), good, 5, 5)
    with pytest.raises(ValueError, match="3 dimensions"):
        flashattn.flash_attn_varlen_func(q[None], k[None], v[None], good, good, 5, 5)


def test_wide_integers_do_not_wrap():
    """int64 offsets and cache lengths past int32 are refused, not wrapped to valid ones."""
    import numpy as np
    q = torch.randn(10, 2, 8)
    big, ok = [0, 2 ** 32 + 10], [0, 10]
    for conv in (torch.tensor, np.array):
        x = q if conv is torch.tensor else q.numpy()
        with pytest.raises(ValueError, match="outside int32"):
            flashattn.flash_attn_varlen_func(x, x, x, conv(big), conv(ok), 10, 10)
        flashattn.flash_attn_varlen_func(x, x, x, conv(ok), conv(ok), 10, 10)  # int64, in range
    qd, cache = torch.randn(2, 1, 2, 8), torch.randn(2, 16, 2, 8)
    for lengths in (2 ** 40, [3, 2 ** 32 + 3], torch.tensor([3, 2 ** 32 + 3]),
                    np.array([3, 2 ** 32 + 3])):
        args = (qd, cache, cache.clone()) if not isinstance(lengths, np.ndarray) else \
            (qd.numpy(), cache.numpy(), cache.numpy().copy())
        with pytest.raises(ValueError, match="outside int32"):
            flashattn.flash_attn_with_kvcache(*args, cache_seqlens=lengths)


def test_mixed_array_kinds():
    np = pytest.importorskip("numpy")
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="torch.Tensor"):
        flashattn.flash_attn_func(q, k.numpy(), v)
    with pytest.raises(TypeError, match="numpy.ndarray"):
        flashattn.flash_attn_func(q.numpy(), k, v.numpy())


def test_unsupported_devices():
    q, k, v = _qkv()
    qm, km, vm = (x.to("meta") for x in (q, k, v))
    out = flashattn.flash_attn_func(qm, km, vm)  # shapes only: the fake kernel
    assert out.device.type == "meta" and out.shape == q.shape
    if has_cuda():
        with pytest.raises(ValueError, match="same device"):
            flashattn.flash_attn_func(q.cuda().half(), k.half(), v.half())


@pytest.mark.skipif(has_cuda(), reason="checks the error of a build/machine without CUDA")
def test_cuda_tensor_without_cuda_backend():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    q, k, v = (x.cuda().half() for x in _qkv())
    with pytest.raises(flashattn.FlashAttnError) as e:
        flashattn.flash_attn_func(q, k, v)
    assert e.value.status == flashattn.Status.ERR_UNSUPPORTED


def test_backward_checks_dout_out_lse_first():
    """A non-tensor or a tensor on another device (meta) is refused before dispatch: it used
    to raise AttributeError, or to return the meta kernel's uninitialised gradients."""
    q, k, v = _qkv()
    out, lse, _ = flashattn.flash_attn_func(q, k, v, return_attn_probs=True)
    dout = torch.randn_like(out)
    with pytest.raises(TypeError, match="dout must be a torch.Tensor"):
        flashattn.backward(dout.tolist(), q, k, v, out, lse)
    with pytest.raises(ValueError, match="dout must be on q's device"):
        flashattn.backward(dout.to("meta"), q, k, v, out, lse)
    with pytest.raises(ValueError, match="lse must be on q's device"):
        flashattn.backward(dout, q, k, v, out, lse.to("meta"))
    dq, dk, dv = flashattn.backward(dout, q, k, v, out, lse)  # and the good call still works
    assert torch.isfinite(dq).all() and dk.shape == k.shape and dv.shape == v.shape
