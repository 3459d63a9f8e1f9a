"""flashattn's PyTorch operators, flashattn::fwd, flashattn::bwd and flashattn::kvcache.

They are compiled C++ (python/csrc/torch_ops.cpp, built by `pip install .` against the
installed torch): CPU and CUDA kernels calling the C library directly, outputs and
workspace from torch's allocators on the current stream, and a C++ autograd kernel
whose backward is one flashattn::bwd call. flashattn::kvcache (flash_attn_with_kvcache,
inference only) writes the new keys and values into its k_cache and v_cache arguments,
which its schema marks as mutated. Their shape (fake) kernels are registered here, so
torch.compile(fullgraph=True) keeps each call one graph node.

Two small functions for other modules of the package (ring attention, say) call them
without autograd: fwd() -> (out, lse) and bwd() -> (dq, dk, dv). Their signatures are
kept stable.
"""
import operator
import os
import re

import torch

from . import _core, _lib
from ._lib import FlashAttnError, UnsupportedError

_HERE = os.path.dirname(os.path.abspath(__file__))

# ---- loading ------------------------------------------------------------------------


def _base(version):
    return version.split("+")[0]


def _import(path):
    """The operators from path, or from the package: (flashattn._C or None, the file).
    _C is the extension module (operators and eager entry); libflashattn_ops.so, built
    where the interpreter's headers were missing, holds the operators alone."""
    if path is None:
        names = os.listdir(_HERE)
        entry = [f for f in names if f.startswith("_C.") and f.endswith((".so", ".pyd"))]
        if entry:
            from . import _C
            return _C, os.path.join(_HERE, entry[0])
        path = os.path.join(_HERE, "libflashattn_ops.so")
    if not os.path.basename(path).startswith("_C."):
        torch.ops.load_library(path)
        return None, path
    import importlib.machinery
    import importlib.util
    loader = importlib.machinery.ExtensionFileLoader(__package__ + "._C", path)
    spec = importlib.util.spec_from_file_location(__package__ + "._C", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module, path


def _load():
    """Loads the operators: (flashattn._C or None, None), or (None, why they are missing
    and how to get them)."""
    path = os.environ.get("FLASHATTN_TORCH_LIBRARY")
    how = ("reinstall flashattn where torch is installed: `pip install --no-build-isolation "
           "--force-reinstall .` from the repository (or `pip install .`), or point "
           "FLASHATTN_TORCH_LIBRARY at a built flashattn/_C extension")
    if not path:
        try:
            from . import _build
        except ImportError:
            _build = None
        if not any((f.startswith("_C.") and f.endswith((".so", ".pyd")))
                   or f == "libflashattn_ops.so" for f in os.listdir(_HERE)):
            why = getattr(_build, "TORCH_MISSING", "") or "no _C extension in %s" % _HERE
            return None, ("flashattn was installed without its PyTorch operators (%s); %s"
                          % (why, how))
        built = getattr(_build, "TORCH_VERSION", "")
        if built and _base(built) != _base(torch.__version__):
            return None, ("flashattn's PyTorch operators were built against torch %s, but "
                          "this is torch %s; %s" % (built, torch.__version__, how))
    try:
        return _import(path)[0], None
    except (ImportError, OSError, RuntimeError) as e:
        return None, ("flashattn cannot load its PyTorch operators (%s): %s; %s"
                      % (path or "flashattn._C", e, how))


_C, MISSING = _load()
AVAILABLE = MISSING is None


def _not_taken(*args):
    return NotImplemented


def _unavailable(*args, **kwargs):
    raise RuntimeError(MISSING)


# ---- errors -------------------------------------------------------------------------
# The operators raise "<fa function>: FA_<STATUS>: <message>" for the library's errors
# (as ValueError, NotImplementedError or RuntimeError); here they become FlashAttnError
# with the status. A wrong argument type fails torch's schema check: a TypeError here.

_LIB_ERROR = re.compile(r"(fa_\w+): FA_(ERR_\w+): (.*)", re.S)
_SCHEMA_ERROR = re.compile(r"Expected a value of type '([^']+)' for argument '(\w+)' but "
                           r"instead found type '(\w+)'")


def _translate(e):
    msg = str(e)
    m = _LIB_ERROR.search(msg)
    if m is not None:
        try:
            status = _lib.Status[m.group(2)]
        except KeyError:
            status = _lib.Status.ERR_INTERNAL
        return FlashAttnError(status, m.group(3).strip(), m.group(1))
    m = _SCHEMA_ERROR.search(msg)
    if m is not None:
        want = "a torch.Tensor" if m.group(1).startswith("Tensor") else m.group(1)
        return TypeError("flashattn: %s must be %s (q, k and v must all be torch.Tensor), got %s"
                         % (m.group(2), want, m.group(3)))
    return None


def _reraise(e):
    t = _translate(e)
    if t is None:
        raise e
    raise t from None


# ---- argument resolution ------------------------------------------------------------

ALGORITHMS = {"flash2": 0, "flash1": 1, "standard": 2, 0: 0, 1: 1, 2: 2}
_NO_WINDOW = (-1, -1)


def algorithm_code(algorithm):
    try:
        return ALGORITHMS[algorithm]
    except (KeyError, TypeError):
        pass
    if isinstance(algorithm, str) and algorithm.lower() in ALGORITHMS:
        return ALGORITHMS[algorithm.lower()]
    raise ValueError("algorithm must be one of 'flash2', 'flash1', 'standard' (got %r)"
                     % (algorithm,))


def window_bounds(window_size):
    """flash-attn's window_size=(left, right): (-1, -1) is no window, a negative side is
    unlimited. Returns (left, right) with -1 for unlimited."""
    return _core.resolve_window(window_size)[1:]


block_sizes = _core.resolve_block_size


# ---- the operators ------------------------------------------------------------------

if AVAILABLE:
    _fwd = torch.ops.flashattn.fwd.default
    _bwd = torch.ops.flashattn.bwd.default
    _kvcache = torch.ops.flashattn.kvcache.default
    # without the eager entry (built without Python.h) every call goes through torch.ops
    _fast_fwd = _C.fwd if _C is not None else _not_taken
    _fast_bwd = _C.bwd if _C is not None else _not_taken
    _fast_kvcache = getattr(_C, "kvcache", _not_taken)
    _compiler = getattr(torch, "compiler", None)
    _is_compiling = getattr(_compiler, "is_compiling", None) or torch._dynamo.is_compiling

    def _lse_shape(q, varlen, bhnd):
        if varlen:
            return (q.shape[1], q.shape[0])  # (heads, total_q)
        return (q.shape[0], q.shape[1], q.shape[2]) if bhnd else \
            (q.shape[0], q.shape[2], q.shape[1])

    def _check_fake(q, k, v, varlen, paged=False):
        for name, x in (("q", q), ("k", k), ("v", v)):
            nd = 3 if varlen and not (paged and name != "q") else 4
            if x.dim() != nd:
                raise ValueError("flashattn: %s must have %d dimensions, got shape %s"
                                 % (name, nd, tuple(x.shape)))
        if k.device != q.device or v.device != q.device:
            raise ValueError("flashattn: q, k and v must be on the same device (q is on %s, "
                             "k on %s, v on %s)" % (q.device, k.device, v.device))

    def _check_devices(q, named):
        # a tensor on another device makes the dispatcher pick that device's kernel (a
        # meta one: this one): refused here as the kernels refuse it
        for name, x in named:
            if x is not None and x.device != q.device:
                raise ValueError("flashattn: %s must be on the same device as q (%s), got %s"
                                 % (name, q.device, x.device))

    @torch.library.register_fake("flashattn::fwd")
    def _fwd_fake(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None,
                  alibi_slopes=None, block_mask=None, softmax_scale=None, causal=False,
                  window_left=-1, window_right=-1, softcap=0.0, dropout_p=0.0, rng_state=None,
                  deterministic=False, algorithm=0, block_size_q=0, block_size_k=0, bhnd=False,
                  shard_q=-1, shard_k=-1, block_table=None, num_splits=0, sm_margin=0):
        varlen = cu_seqlens_q is not None
        _check_fake(q, k, v, varlen, block_table is not None)
        _check_devices(q, (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                           ("seqused_k", seqused_k), ("alibi_slopes", alibi_slopes),
                           ("block_mask", block_mask), ("block_table", block_table)))
        if bhnd:  # (batch, seqlen, heads, headdim) memory, as the kernels allocate it
            b, h, n, d = q.shape
            out = q.new_empty((b, n, h, d)).transpose(1, 2)
        else:
            out = torch.empty_like(q)
        lse = q.new_empty(_lse_shape(q, varlen, bhnd), dtype=torch.float32)
        return out, lse, torch.empty(2, dtype=torch.int64, device="cpu")

    @torch.library.register_fake("flashattn::bwd")
    def _bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None,
                  seqused_k=None, alibi_slopes=None, block_mask=None, softmax_scale=None,
                  causal=False, window_left=-1, window_right=-1, softcap=0.0, dropout_p=0.0,
                  rng_state=None, deterministic=False, algorithm=0, block_size_q=0,
                  block_size_k=0, bhnd=False, shard_q=-1, shard_k=-1, block_table=None,
                  num_splits=0, sm_margin=0):
        if block_table is not None:
            raise UnsupportedError(_lib.Status.ERR_UNSUPPORTED, "params.block_table: the "
                                   "backward pass does not take a paged KV cache (paged "
                                   "attention is inference-only)", "fa_backward")
        _check_fake(q, k, v, cu_seqlens_q is not None)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    @torch.library.register_fake("flashattn::kvcache")
    def _kvcache_fake(q, k_cache, v_cache, cache_seqlens, k=None, v=None, rotary_cos=None,
                      rotary_sin=None, cache_batch_idx=None, cache_leftpad=None,
                      block_table=None, alibi_slopes=None, softmax_scale=None, causal=False,
                      window_left=-1, window_right=-1, softcap=0.0, rotary_interleaved=True,
                      num_splits=0, algorithm=0):
        for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if x.dim() != 4:
                raise ValueError("flashattn: %s must have 4 dimensions, got shape %s"
                                 % (name, tuple(x.shape)))
            if x.device != q.device:
                raise ValueError("flashattn: q, k_cache and v_cache must be on the same "
                                 "device (q is on %s, %s on %s)" % (q.device, name, x.device))
        _check_devices(q, (("cache_seqlens", cache_seqlens), ("k", k), ("v", v),
                           ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                           ("cache_batch_idx", cache_batch_idx),
                           ("cache_leftpad", cache_leftpad), ("block_table", block_table),
                           ("alibi_slopes", alibi_slopes)))
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
        return torch.empty_like(q), lse
else:
    _fwd = _bwd = _kvcache = _unavailable

    def _is_compiling():
        return False

    _fast_fwd = _fast_bwd = _fast_kvcache = _not_taken


def _call(fast, op, args):
    # torch.compile traces the torch.ops call; eager calls take _C's entry when it can
    if not _is_compiling():
        r = fast(*args)
        if r is not NotImplemented:
            return r
    return op(*args)


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, block_mask,
              softmax_scale, causal, window_size, softcap, dropout_p, deterministic, algorithm,
              block_size, bhnd=False, block_table=None, num_splits=0, sm_margin=0):
    """The public functions' one call: (out, lse, rng_state), differentiable in q, k, v.
    bhnd: q, k, v are (batch, heads, seqlen, headdim) (out too; lse is the same).
    block_table: k and v are page pools (forward only: the backward raises)."""
    if window_size == _NO_WINDOW:
        left = right = -1
    else:
        left, right = window_bounds(window_size)
    bq, bk = (0, 0) if block_size is None else block_sizes(block_size)
    try:
        return _call(_fast_fwd, _fwd, (
            q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, block_mask,
            None if softmax_scale is None else float(softmax_scale), bool(causal), left, right,
            float(softcap) if softcap else 0.0, float(dropout_p) if dropout_p else 0.0, None,
            bool(deterministic), algorithm_code(algorithm), bq, bk, bhnd, -1, -1, block_table,
            _splits(num_splits), _margin(sm_margin)))
    except (RuntimeError, ValueError, TypeError) as e:
        _reraise(e)


def _margin(sm_margin):
    try:
        return operator.index(sm_margin or 0)
    except TypeError:
        raise TypeError("flashattn: sm_margin must be an int, got %r" % (sm_margin,)) from None


def _splits(num_splits):
    if num_splits is None:
        return 0
    try:
        return operator.index(num_splits)
    except TypeError:
        raise TypeError("flashattn: num_splits must be an int, got %r" % (num_splits,)) from None


def kvcache(q, k_cache, v_cache, cache_seqlens, k=None, v=None, rotary_cos=None,
            rotary_sin=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
            alibi_slopes=None, softmax_scale=None, causal=False, window_size=(-1, -1),
            softcap=0.0, rotary_interleaved=True, num_splits=0, algorithm="flash2"):
    """flashattn::kvcache: writes k and v (rotated) into k_cache and v_cache in place, then
    returns (out, lse) of q (rotated) against the caches (flash_attn_with_kvcache's
    arguments; cache_seqlens an int32 tensor (batch,) on q's device)."""
    left, right = window_bounds(window_size)
    try:
        return _call(_fast_kvcache, _kvcache, (
            q, k_cache, v_cache, cache_seqlens, k, v, rotary_cos, rotary_sin, cache_batch_idx,
            cache_leftpad, block_table, alibi_slopes,
            None if softmax_scale is None else float(softmax_scale), bool(causal), left, right,
            float(softcap or 0.0), bool(rotary_interleaved), _splits(num_splits),
            algorithm_code(algorithm)))
    except (RuntimeError, ValueError, TypeError) as e:
        _reraise(e)


def _rng_state(dropout_p, dropout_seed, dropout_offset):
    if not dropout_p:
        return None
    if dropout_seed is None:
        raise ValueError("dropout_p > 0 needs dropout_seed (and dropout_offset): pass the "
                         "same ones to fwd and bwd")
    return torch.tensor([dropout_seed, dropout_offset], dtype=torch.int64)


def fwd(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
        alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0,
        cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, block_mask=None,
        block_size=None, deterministic=False, algorithm="flash2", shard=None,
        block_table=None, num_splits=0, sm_margin=0):
    """Forward without autograd: returns (out, lse).

    q: (batch, seqlen_q, heads, headdim), k and v: (batch, seqlen_k, heads_k, headdim)
    (or (total, heads, headdim) with int32 cu_seqlens_q/_k), on one device, any strides
    with headdim contiguous. out is like q; lse is float32 (batch, heads, seqlen_q), or
    (heads, total_q) for variable-length batches, natural log; fully masked rows give
    out 0 and lse -inf. The options are flash_attn_func's; causal and window_size are
    aligned to the bottom-right corner. Dropout takes an explicit dropout_seed and
    dropout_offset (ints; pass the same ones to bwd). seqused_k: int32 (batch,), the
    keys each sequence uses. shard=(q_offset, k_offset): q and k are shards of one
    sequence whose rows and keys sit at those positions (masks, ALiBi and dropout at the
    sequence's positions; fa_params.shard_enabled). block_table: int32 (batch,
    max_num_blocks_per_seq), k and v then page pools (num_blocks, page_block_size, heads_k,
    headdim); num_splits: the CUDA forward's key splits (0: chosen); sm_margin: SMs the
    Hopper kernels leave to work running beside them (fa_params.sm_margin). Nothing here
    records autograd history.
    """
    left, right = window_bounds(window_size)
    bq, bk = block_sizes(block_size)
    rng = _rng_state(dropout_p, dropout_seed, dropout_offset)
    try:
        with torch.no_grad():
            out, lse, _ = _call(_fast_fwd, _fwd, (
                q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, block_mask,
                None if softmax_scale is None else float(softmax_scale), bool(causal), left,
                right, float(softcap or 0.0), float(dropout_p or 0.0), rng, bool(deterministic),
                algorithm_code(algorithm), bq, bk, False, *_shard(shard), block_table,
                _splits(num_splits), _margin(sm_margin)))
    except (RuntimeError, ValueError, TypeError) as e:
        _reraise(e)
    return out, lse


def bwd(dout, q, k, v, out, lse, *, softmax_scale=None, causal=False, window_size=(-1, -1),
        softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0,
        cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, block_mask=None,
        block_size=None, deterministic=False, algorithm="flash2", shard=None,
        block_table=None, sm_margin=0):
    """Backward given the forward's out and lse: returns (dq, dk, dv), like q, k, v.

    dout is like out (any strides; copied once if headdim is not contiguous). Pass the
    forward's options again, dropout_seed and dropout_offset included. dk and dv are
    summed over the query heads that share a K/V head. With shard, lse may be the whole
    sequence's (P = exp(S - lse)), so that the blocks' gradients add up to the sequence's.
    """
    left, right = window_bounds(window_size)
    bq, bk = block_sizes(block_size)
    rng = _rng_state(dropout_p, dropout_seed, dropout_offset)
    try:
        with torch.no_grad():
            return _call(_fast_bwd, _bwd, (
                dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes,
                block_mask, None if softmax_scale is None else float(softmax_scale),
                bool(causal), left, right, float(softcap or 0.0), float(dropout_p or 0.0), rng,
                bool(deterministic), algorithm_code(algorithm), bq, bk, False, *_shard(shard),
                block_table, 0, _margin(sm_margin)))
    except (RuntimeError, ValueError, TypeError) as e:
        _reraise(e)


def _shard(shard):
    if shard is None:
        return -1, -1
    q_offset, k_offset = shard
    if q_offset < 0 or k_offset < 0:
        raise ValueError("flashattn: shard offsets must be >= 0, got %r" % (shard,))
    return int(q_offset), int(k_offset)


def draw_seed():
    """A dropout seed from torch's default CPU generator (torch.manual_seed fixes it)."""
    return int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64).item())


__all__ = ["fwd", "bwd", "kvcache", "draw_seed", "AVAILABLE", "MISSING"]
