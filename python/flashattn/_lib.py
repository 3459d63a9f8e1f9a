"""ctypes mirror of include/flashattn.h and the calls into libflashattn.so.

Nothing here knows about numpy or torch: callers hand in raw pointers, shapes and
element strides. Structures mirror the header field by field (same order, same C
types); ctypes applies the platform's C alignment rules, and
python/tests/test_abi.py checks every offset against the header with a C compiler.
"""
import ctypes
import enum
import os

# ---- enums (values from include/flashattn.h) --------------------------------


class Status(enum.IntEnum):
    OK = 0
    ERR_INVALID_ARGUMENT = 1
    ERR_UNSUPPORTED = 2
    ERR_OUT_OF_MEMORY = 3
    ERR_DEVICE = 4
    ERR_INTERNAL = 5


class DType(enum.IntEnum):
    F32 = 0
    F16 = 1
    BF16 = 2
    F64 = 3


class Device(enum.IntEnum):
    CPU = 0
    CUDA = 1


class Algorithm(enum.IntEnum):
    FLASH2 = 0
    FLASH1 = 1
    STANDARD = 2


class Pass(enum.IntEnum):
    FORWARD = 0
    BACKWARD = 1
    PROBS = 2


ALGORITHMS = {"flash2": Algorithm.FLASH2, "flash1": Algorithm.FLASH1,
              "standard": Algorithm.STANDARD}

MAX_HEADDIM = 256

# ---- structures ---------------------------------------------------------------

_enum_t = ctypes.c_int  # C enums with small non-negative values are int-sized


class FaTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", _enum_t),
        ("batch", ctypes.c_int64),
        ("seqlen", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("headdim", ctypes.c_int64),
        ("stride_batch", ctypes.c_int64),
        ("stride_seq", ctypes.c_int64),
        ("stride_head", ctypes.c_int64),
    ]


class FaParams(ctypes.Structure):
    _fields_ = [
        ("device", _enum_t),
        ("algorithm", _enum_t),
        ("softmax_scale", ctypes.c_float),
        ("causal", ctypes.c_int),
        ("window_enabled", ctypes.c_int),
        ("window_left", ctypes.c_int64),
        ("window_right", ctypes.c_int64),
        ("shard_enabled", ctypes.c_int),
        ("shard_q_offset", ctypes.c_int64),
        ("shard_k_offset", ctypes.c_int64),
        ("softcap", ctypes.c_float),
        ("alibi_slopes", ctypes.c_void_p),
        ("alibi_stride_batch", ctypes.c_int64),
        ("cu_seqlens_q", ctypes.c_void_p),
        ("cu_seqlens_k", ctypes.c_void_p),
        ("num_seqs", ctypes.c_int64),
        ("seqused_k", ctypes.c_void_p),
        ("dropout_p", ctypes.c_float),
        ("dropout_seed", ctypes.c_uint64),
        ("dropout_offset", ctypes.c_uint64),
        ("block_mask", ctypes.c_void_p),
        ("block_size_q", ctypes.c_int64),
        ("block_size_k", ctypes.c_int64),
        ("block_mask_stride_batch", ctypes.c_int64),
        ("block_mask_stride_head", ctypes.c_int64),
        ("block_mask_stride_row", ctypes.c_int64),
        ("deterministic", ctypes.c_int),
        ("num_threads", ctypes.c_int),
        ("stream", ctypes.c_void_p),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_size_t),
        ("block_table", ctypes.c_void_p),
        ("block_table_stride", ctypes.c_int64),
        ("max_pages_per_seq", ctypes.c_int64),
        ("num_splits", ctypes.c_int),
        ("sm_margin", ctypes.c_int),
    ]


class FaKvcache(ctypes.Structure):
    _fields_ = [
        ("cache_seqlens", ctypes.c_void_p),
        ("k_new", ctypes.POINTER(FaTensor)),
        ("v_new", ctypes.POINTER(FaTensor)),
        ("cache_batch_idx", ctypes.c_void_p),
        ("cache_leftpad", ctypes.c_void_p),
        ("rotary_cos", ctypes.c_void_p),
        ("rotary_sin", ctypes.c_void_p),
        ("rotary_seqlen", ctypes.c_int64),
        ("rotary_dim", ctypes.c_int64),
        ("rotary_stride", ctypes.c_int64),
        ("rotary_interleaved", ctypes.c_int),
    ]


# ---- errors -------------------------------------------------------------------


class FlashAttnError(RuntimeError):
    """A call into libflashattn failed.

    Attributes: status (a Status), status_name ("FA_ERR_UNSUPPORTED", ...),
    message (the library's fa_last_error() text), function (the C entry point).
    Constructed with FA_ERR_INVALID_ARGUMENT it is an InvalidArgumentError (also a
    ValueError), with FA_ERR_UNSUPPORTED an UnsupportedError (also a
    NotImplementedError): the caller's input is what to change.
    """

    def __new__(cls, status, message="", function=""):
        if cls is FlashAttnError:
            cls = _ERROR_CLASSES.get(int(status), cls)
        return super().__new__(cls, status, message, function)

    def __init__(self, status, message="", function=""):
        try:
            status = Status(status)
            name = "FA_" + status.name
        except ValueError:
            name = "FA_STATUS_%d" % status
        self.status = status
        self.status_name = name
        self.message = message
        self.function = function
        where = function + ": " if function else ""
        super().__init__("%s%s: %s" % (where, name, message))

    def __reduce__(self):
        return (FlashAttnError, (int(self.status), self.message, self.function))


class InvalidArgumentError(FlashAttnError, ValueError):
    """FA_ERR_INVALID_ARGUMENT: a bad size, stride or value."""


class UnsupportedError(FlashAttnError, NotImplementedError):
    """FA_ERR_UNSUPPORTED: valid, but not available here (device, dtype, feature)."""


_ERROR_CLASSES = {int(Status.ERR_INVALID_ARGUMENT): InvalidArgumentError,
                  int(Status.ERR_UNSUPPORTED): UnsupportedError}


# ---- loading ------------------------------------------------------------------


def _find_library():
    env = os.environ.get("FLASHATTN_LIBRARY")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    for name in ("libflashattn.so", "libflashattn.dylib", "flashattn.dll"):
        path = os.path.join(here, name)
        if os.path.exists(path):
            return path
    raise ImportError(
        "flashattn: libflashattn.so not found next to %s. Install the package with "
        "`pip install .` from the repository root (it builds the C library), or point "
        "FLASHATTN_LIBRARY at a libflashattn.so built with -DBUILD_SHARED_LIBS=ON." % here)


LIBRARY_PATH = _find_library()
try:
    lib = ctypes.CDLL(LIBRARY_PATH)
except OSError as e:  # e.g. a CUDA build on a machine without libcudart
    raise ImportError("flashattn: cannot load %s: %s" % (LIBRARY_PATH, e)) from e

_P = ctypes.POINTER
_status = ctypes.c_int

lib.fa_forward.argtypes = [_P(FaParams), _P(FaTensor), _P(FaTensor), _P(FaTensor),
                           _P(FaTensor), ctypes.c_void_p]
lib.fa_forward.restype = _status
lib.fa_backward.argtypes = [_P(FaParams), _P(FaTensor), _P(FaTensor), _P(FaTensor),
                            _P(FaTensor), _P(FaTensor), ctypes.c_void_p, _P(FaTensor),
                            _P(FaTensor), _P(FaTensor)]
lib.fa_backward.restype = _status
lib.fa_workspace_size.argtypes = [_enum_t, _P(FaParams), _P(FaTensor), _P(FaTensor),
                                  _P(FaTensor), _P(ctypes.c_size_t)]
lib.fa_workspace_size.restype = _status
lib.fa_device_available.argtypes = [_enum_t]
lib.fa_device_available.restype = ctypes.c_int
lib.fa_last_error.argtypes = []
lib.fa_last_error.restype = ctypes.c_char_p
lib.fa_status_string.argtypes = [_status]
lib.fa_status_string.restype = ctypes.c_char_p
lib.fa_version.argtypes = []
lib.fa_version.restype = ctypes.c_char_p
lib.fa_tensor_bnhd.argtypes = [ctypes.c_void_p, _enum_t] + [ctypes.c_int64] * 4
lib.fa_tensor_bnhd.restype = FaTensor
lib.fa_tensor_bhnd.argtypes = [ctypes.c_void_p, _enum_t] + [ctypes.c_int64] * 4
lib.fa_tensor_bhnd.restype = FaTensor
lib.fa_dtype_size.argtypes = [_enum_t]
lib.fa_dtype_size.restype = ctypes.c_size_t
lib.fa_dropout_mask.argtypes = [_P(FaParams)] + [ctypes.c_int64] * 5 + [ctypes.c_void_p]
lib.fa_dropout_mask.restype = _status
lib.fa_attention_probs.argtypes = [_P(FaParams), _P(FaTensor), _P(FaTensor), ctypes.c_int64,
                                   ctypes.c_int64, ctypes.c_void_p]
lib.fa_attention_probs.restype = _status
lib.fa_forward_kvcache.argtypes = [_P(FaParams), _P(FaKvcache), _P(FaTensor), _P(FaTensor),
                                   _P(FaTensor), _P(FaTensor), ctypes.c_void_p]
lib.fa_forward_kvcache.restype = _status
lib.fa_kvcache_workspace_size.argtypes = [_P(FaParams), _P(FaKvcache), _P(FaTensor),
                                          _P(FaTensor), _P(FaTensor), _P(ctypes.c_size_t)]
lib.fa_kvcache_workspace_size.restype = _status


def _check(status, function):
    if status != Status.OK:
        msg = lib.fa_last_error() or b""
        raise FlashAttnError(status, msg.decode("utf-8", "replace"), function)


def version():
    """The C library's version string, "MAJOR.MINOR.PATCH"."""
    return lib.fa_version().decode()


def device_available(device):
    """True if this build and machine can run on the device ("cpu" or "cuda")."""
    d = {"cpu": Device.CPU, "cuda": Device.CUDA}[device] if isinstance(device, str) else device
    return bool(lib.fa_device_available(int(d)))


def status_string(status):
    return lib.fa_status_string(int(status)).decode()


def make_tensor(ptr, dtype, shape, strides):
    """An fa_tensor for a (batch, seqlen, heads, headdim) view with element strides
    (stride_batch, stride_seq, stride_head); headdim must be contiguous."""
    b, n, h, d = shape
    sb, ss, sh = strides
    # positional, in _fields_ order: one constructor call instead of nine attribute sets
    return FaTensor(ptr, int(dtype), int(b), int(n), int(h), int(d), int(sb), int(ss),
                    int(sh))


def workspace_size(pass_, params, q, k, v, function="fa_workspace_size"):
    n = ctypes.c_size_t(0)
    _check(lib.fa_workspace_size(int(pass_), ctypes.byref(params), ctypes.byref(q),
                                 ctypes.byref(k), ctypes.byref(v), ctypes.byref(n)),
           function)
    return n.value


WORKSPACE_ALIGN = 64


def _with_workspace(pass_, params, q, k, v, alloc):
    """Asks the library how much scratch the call needs and lets `alloc(nbytes)`
    provide it (returning (address, keepalive)); the address must be 64-aligned."""
    # the query validates every argument the call will: name the call in errors
    n = workspace_size(pass_, params, q, k, v,
                       "fa_forward" if pass_ == Pass.FORWARD else "fa_backward")
    return _use_workspace(params, n, alloc)


def _use_workspace(params, n, alloc):
    keep = None
    if n and alloc is not None:
        addr, keep = alloc(n)
        if addr % WORKSPACE_ALIGN:
            raise FlashAttnError(Status.ERR_INTERNAL, "workspace allocator returned a "
                                 "misaligned address", "workspace")
        params.workspace = addr
        params.workspace_bytes = n
    else:
        params.workspace = None
        params.workspace_bytes = 0
    return keep


def forward(params, q, k, v, o, lse_ptr, alloc=None):
    keep = _with_workspace(Pass.FORWARD, params, q, k, v, alloc)
    _check(lib.fa_forward(ctypes.byref(params), ctypes.byref(q), ctypes.byref(k),
                          ctypes.byref(v), ctypes.byref(o), lse_ptr), "fa_forward")
    del keep


def backward(params, q, k, v, o, dout, lse_ptr, dq, dk, dv, alloc=None):
    keep = _with_workspace(Pass.BACKWARD, params, q, k, v, alloc)
    _check(lib.fa_backward(ctypes.byref(params), ctypes.byref(q), ctypes.byref(k),
                           ctypes.byref(v), ctypes.byref(o), ctypes.byref(dout), lse_ptr,
                           ctypes.byref(dq), ctypes.byref(dk), ctypes.byref(dv)),
           "fa_backward")
    del keep


def forward_kvcache(params, kv, q, k_cache, v_cache, o, lse_ptr, alloc=None):
    """fa_forward_kvcache, its workspace from `alloc(nbytes)` (as forward's)."""
    n = ctypes.c_size_t(0)
    # the query validates every argument the call will: name the call in errors
    _check(lib.fa_kvcache_workspace_size(ctypes.byref(params), ctypes.byref(kv),
                                         ctypes.byref(q), ctypes.byref(k_cache),
                                         ctypes.byref(v_cache), ctypes.byref(n)),
           "fa_forward_kvcache")
    keep = _use_workspace(params, n.value, alloc)
    _check(lib.fa_forward_kvcache(ctypes.byref(params), ctypes.byref(kv), ctypes.byref(q),
                                  ctypes.byref(k_cache), ctypes.byref(v_cache),
                                  ctypes.byref(o), lse_ptr), "fa_forward_kvcache")
    del keep


def dropout_mask(dropout_p, seed, offset, nheads, seqlen_q, seqlen_k, batch=1):
    """The keep (1) / drop (0) decisions of dropout, as every backend draws them
    (docs/DROPOUT.md), for a (batch, nheads, seqlen_q, seqlen_k) problem: a bytes
    object of that many elements in that order (batch = sequence index for varlen)."""
    p = FaParams()
    p.dropout_p = float(dropout_p)
    p.dropout_seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    p.dropout_offset = int(offset) & 0xFFFFFFFFFFFFFFFF
    one = int(seqlen_q) * int(seqlen_k)
    buf = ctypes.create_string_buffer(max(1, int(batch) * int(nheads) * one))
    for s in range(int(batch)):
        for h in range(int(nheads)):
            at = ctypes.addressof(buf) + (s * int(nheads) + h) * one
            _check(lib.fa_dropout_mask(ctypes.byref(p), int(nheads), s, h, int(seqlen_q),
                                       int(seqlen_k), at), "fa_dropout_mask")
    return buf.raw[:int(batch) * int(nheads) * one]
