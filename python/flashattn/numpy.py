"""flashattn on numpy arrays (CPU): forward and backward.

    import numpy as np, flashattn
    out, lse = flashattn.numpy.forward(q, k, v, causal=True)          # (B, N, H, D)
    dq, dk, dv = flashattn.numpy.backward(dout, q, k, v, out, lse, causal=True)

dtypes: float32, float16, float64 (algorithm="standard" only) and bfloat16 when
ml_dtypes is installed. flashattn.flash_attn_func and friends accept numpy arrays
too and come here.
"""
import numpy as np

from . import _core
from ._lib import Device, DType

try:  # optional: numpy has no bfloat16 of its own
    import ml_dtypes as _ml_dtypes

    _BF16 = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    _BF16 = None

_DTYPES = {np.dtype(np.float32): DType.F32, np.dtype(np.float16): DType.F16,
           np.dtype(np.float64): DType.F64}
if _BF16 is not None:
    _DTYPES[_BF16] = DType.BF16
_AUX = {"int32": np.int32, "float32": np.float32, "uint8": np.uint8}
_CPU = (Device.CPU, 0)


class NumpyAdapter:
    array_name = "numpy.ndarray"
    contiguous_hint = "np.ascontiguousarray(%s)"

    @staticmethod
    def is_array(x):
        return isinstance(x, np.ndarray)

    @staticmethod
    def shape(x):
        return x.shape

    @staticmethod
    def strides(x):
        isz = x.itemsize
        if any(s % isz for s in x.strides):
            raise ValueError("array strides %s are not multiples of the item size %d"
                             % (x.strides, isz))
        return tuple(s // isz for s in x.strides)

    @staticmethod
    def dtype_name(x):
        return str(x.dtype)

    @staticmethod
    def dtype_code(x, name):
        dt = _DTYPES.get(x.dtype)
        if dt is None:
            extra = "" if _BF16 is not None else " (bfloat16 needs the ml_dtypes package)"
            raise TypeError("%s: unsupported dtype %s; flashattn takes float32, float16, "
                            "bfloat16 and (standard algorithm only) float64%s"
                            % (name, x.dtype, extra))
        return dt

    @staticmethod
    def device(x):
        return _CPU

    @staticmethod
    def device_name(x):
        return "cpu"

    @staticmethod
    def device_name_of(dev):
        return "cpu"

    @staticmethod
    def ptr(x):
        return x.__array_interface__["data"][0]

    @staticmethod
    def empty_like(x):
        return np.empty_like(x, order="K")

    @staticmethod
    def empty(shape, dtype, like):
        return np.empty(shape, dtype=_AUX[dtype])

    @staticmethod
    def writable(x):
        return bool(x.flags.writeable)

    @staticmethod
    def fill_(x, value):
        x.fill(value)

    @staticmethod
    def aux_contiguous(x, kind, name):
        want = np.dtype(_AUX[kind])
        if kind == "int32" and x.dtype != want:
            if not np.issubdtype(x.dtype, np.integer):
                raise TypeError("%s must be an integer array (int32), got %s" % (name, x.dtype))
            if x.size and (x.min() < -2 ** 31 or x.max() >= 2 ** 31):  # no silent wrap
                raise ValueError("%s has values outside int32 (min %d, max %d)"
                                 % (name, x.min(), x.max()))
        return np.ascontiguousarray(x, dtype=want)

    @staticmethod
    def workspace(nbytes, like):
        buf = np.empty(nbytes + 64, dtype=np.uint8)
        addr = buf.__array_interface__["data"][0]
        return (addr + 63) & ~63, buf


A = NumpyAdapter


def _threads(num_threads):
    return 0 if num_threads is None else int(num_threads)


def forward(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
            softcap=0.0, alibi_slopes=None, deterministic=False, block_mask=None, *,
            cu_seqlens_q=None, cu_seqlens_k=None, block_size=None, algorithm="flash2",
            num_threads=None, dropout_seed=0, dropout_offset=0):
    """Returns (out, lse); the arguments are flash_attn_func's. q: (B, Nq, Hq, D), k and v: (B, Nk, Hk, D); with cu_seqlens
    (int32 offsets) q: (total_q, Hq, D), k, v: (total_k, Hk, D). lse is float32
    (B, Hq, Nq), or (Hq, total_q) for variable-length batches."""
    opts = _core.make_options(softmax_scale, causal, window_size, softcap, dropout_p,
                              deterministic, algorithm, block_size, dropout_seed,
                              _threads(num_threads))
    opts.dropout_offset = int(dropout_offset)
    return _core.forward(A, q, k, v, opts, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                         block_mask)


def backward(dout, q, k, v, out, lse, dropout_p=0.0, softmax_scale=None, causal=False,
             window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
             block_mask=None, *, cu_seqlens_q=None, cu_seqlens_k=None,
             block_size=None, algorithm="flash2", num_threads=None, dropout_seed=0,
             dropout_offset=0):
    """Returns (dq, dk, dv) given dout (like out) and the forward's out and lse; pass
    the forward's attention options again."""
    opts = _core.make_options(softmax_scale, causal, window_size, softcap, dropout_p,
                              deterministic, algorithm, block_size, dropout_seed,
                              _threads(num_threads))
    opts.dropout_offset = int(dropout_offset)
    if isinstance(dout, np.ndarray) and dout.ndim and dout.shape[-1] > 1 \
            and dout.strides[-1] != dout.itemsize:
        dout = np.ascontiguousarray(dout)
    return _core.backward(A, dout, q, k, v, out, lse, opts, cu_seqlens_q, cu_seqlens_k,
                          alibi_slopes, block_mask)
