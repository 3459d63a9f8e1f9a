"""flashattn: FlashAttention (exact, tiled, O(N) extra memory) from a C library with a
CPU and a CUDA backend, called through ctypes.

The functions mirror flash-attn 2's public API and take torch tensors (CPU or CUDA,
differentiable, torch.compile-friendly custom ops) or numpy arrays (CPU, forward; see
flashattn.numpy for the backward):

    out = flashattn.flash_attn_func(q, k, v, causal=True)       # q: (B, N, H, D)
    out = flashattn.scaled_dot_product_attention(q, k, v)       # q: (B, H, N, D)

Extra keyword-only options: algorithm="flash2" | "flash1" | "standard" (the last also
takes float64 on the CPU: the oracle, and what torch.autograd.gradcheck runs through),
and block_mask/block_size (block-sparse attention; like dropout, implemented by
every algorithm on the CPU so far, docs/DROPOUT.md).
"""
from . import _core, _lib
from ._lib import (Algorithm, DType, Device, FlashAttnError, Status, device_available,
                   version)

__version__ = "0.1.0"

try:
    import torch as _torch_pkg
except ImportError:  # numpy-only use
    _torch_pkg = None
    _torch = None
else:
    from . import _torch

try:
    from . import numpy  # noqa: F401  (flashattn.numpy)
    from .numpy import NumpyAdapter as _NumpyAdapter
    import numpy as _np
except ImportError:  # torch-only use
    _np = None

__all__ = [
    "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
    "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache",
    "scaled_dot_product_attention", "backward",
    "FlashAttnError", "Status", "DType", "Device", "Algorithm", "version",
    "device_available", "cuda_available", "LIBRARY_PATH",
]

LIBRARY_PATH = _lib.LIBRARY_PATH


def cuda_available():
    """True if the library was built with its CUDA backend and a GPU is visible."""
    return device_available("cuda")


def _kind(x):
    if _torch_pkg is not None and isinstance(x, _torch_pkg.Tensor):
        return "torch"
    if _np is not None and isinstance(x, _np.ndarray):
        return "numpy"
    raise TypeError("flashattn takes torch.Tensor or numpy.ndarray inputs, got %s"
                    % type(x).__name__)


def _options(dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
             algorithm, block_size):
    return _core.make_options(softmax_scale, causal, window_size, softcap, dropout_p,
                              deterministic, algorithm, block_size)


def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, block_mask, opts):
    if _kind(q) == "torch":
        return _torch.call(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, block_mask, opts)
    return _core.forward(_NumpyAdapter, q, k, v, opts, cu_seqlens_q, cu_seqlens_k,
                         alibi_slopes, block_mask)


def dropout_mask(dropout_p, seed, offset, nheads, seqlen_q, seqlen_k, batch=1):
    """Dropout's keep mask (uint8, (batch, nheads, seqlen_q, seqlen_k)) for a seed and
    offset, bit for bit what every backend draws (docs/DROPOUT.md); a numpy array."""
    import numpy as np
    raw = _lib.dropout_mask(dropout_p, seed, offset, nheads, seqlen_q, seqlen_k, batch)
    return np.frombuffer(raw, dtype=np.uint8).reshape(batch, nheads, seqlen_q, seqlen_k).copy()


def _result(out, lse, return_attn_probs):
    # flash-attn returns (out, softmax_lse, S_dmask); we never materialise P.
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, block_mask=None, *, block_size=None,
                    algorithm="flash2"):
    """softmax(q kᵀ · softmax_scale + masks) v.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim),
    nheads a multiple of nheads_k (GQA/MQA). causal is aligned to the bottom-right
    corner; window_size=(left, right), -1 = unlimited; softcap > 0 caps logits;
    alibi_slopes: float32 (nheads,) or (batch, nheads). Returns out (like q), or
    (out, softmax_lse (batch, nheads, seqlen_q) float32, None) with return_attn_probs.
    """
    opts = _options(dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                    algorithm, block_size)
    out, lse = _attention(q, k, v, None, None, alibi_slopes, block_mask, opts)
    return _result(out, lse, return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            alibi_slopes=None, return_softmax_lse=False, *, algorithm="flash2"):
    """Attention against a KV cache, for inference (no gradient).

    q: (batch, seqlen_q, nheads, headdim); k_cache, v_cache: (batch, seqlen_cache,
    nheads_k, headdim), of which sequence b uses its first cache_seqlens[b] keys
    (an int, or an int32 array/tensor (batch,); None: the whole cache). k, v: optional
    (batch, seqlen_new, nheads_k, headdim), written into the caches in place at rows
    cache_seqlens[b]... first, and attended to as well. Keys past the used ones are
    never read. causal aligns the last query row with the last used key. Returns out
    (like q), or (out, softmax_lse (batch, nheads, seqlen_q)) with return_softmax_lse.
    The CPU backend runs it; the CUDA backend does not take used lengths yet
    (FlashAttnError, FA_ERR_UNSUPPORTED).
    """
    kind = _kind(q)
    B, cap = q.shape[0], k_cache.shape[1]
    if cache_seqlens is None:
        used = [cap] * B
    elif isinstance(cache_seqlens, int):
        used = [cache_seqlens] * B
    else:
        used = [int(x) for x in (cache_seqlens.tolist() if hasattr(cache_seqlens, "tolist")
                                 else cache_seqlens)]
    if len(used) != B:
        raise ValueError("cache_seqlens must have batch_size = %d entries, got %d"
                         % (B, len(used)))
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    if k is not None:
        n = k.shape[1]
        for b in range(B):
            if not 0 <= used[b] <= cap - n:
                raise ValueError("cache row %d: %d used + %d new keys exceed the cache's %d"
                                 % (b, used[b], n, cap))
            k_cache[b, used[b]:used[b] + n] = k[b]
            v_cache[b, used[b]:used[b] + n] = v[b]
        used = [u + n for u in used]
    opts = _options(0.0, softmax_scale, causal, window_size, softcap, False, algorithm, None)
    if kind == "torch":
        A, dev = _torch.A, q.device
        seqused = _torch_pkg.tensor(used, dtype=_torch_pkg.int32, device=dev)
        stream, threads = _torch._stream_and_threads(q)
        opts.num_threads = threads
        with _torch_pkg.no_grad():
            out, lse = _core.forward(A, q, k_cache, v_cache, opts, None, None, alibi_slopes,
                                     None, stream, seqused)
    else:
        seqused = _np.asarray(used, dtype=_np.int32)
        out, lse = _core.forward(_NumpyAdapter, q, k_cache, v_cache, opts, None, None,
                                 alibi_slopes, None, None, seqused)
    return (out, lse) if return_softmax_lse else out


def _unbind(x, n, axis, name, layout):
    _kind(x)
    if len(x.shape) <= axis or x.shape[axis] != n:
        raise ValueError("%s must have shape %s, got %s" % (name, layout, tuple(x.shape)))
    return tuple(x[(slice(None),) * axis + (i,)] for i in range(n))


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, block_mask=None,
                              *, block_size=None, algorithm="flash2"):
    """qkv: (batch, seqlen, 3, nheads, headdim); q, k, v are read in place (strides)."""
    if len(qkv.shape) != 5:
        raise ValueError("qkv must have shape (batch, seqlen, 3, nheads, headdim), got %s"
                         % (tuple(qkv.shape),))
    q, k, v = _unbind(qkv, 3, 2, "qkv", "(batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, block_mask,
                           block_size=block_size, algorithm=algorithm)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, block_mask=None,
                             *, block_size=None, algorithm="flash2"):
    """q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_k, headdim)."""
    if len(kv.shape) != 5:
        raise ValueError("kv must have shape (batch, seqlen_k, 2, nheads_k, headdim), got %s"
                         % (tuple(kv.shape),))
    k, v = _unbind(kv, 2, 2, "kv", "(batch, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, block_mask,
                           block_size=block_size, algorithm=algorithm)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None,
                           block_mask=None, *, block_size=None, algorithm="flash2"):
    """Sequences packed along the first axis. q: (total_q, nheads, headdim), k, v:
    (total_k, nheads_k, headdim); cu_seqlens_q/_k: int32 (batch + 1,) offsets from 0,
    on q's device. max_seqlen_q/_k are accepted for compatibility (the library finds
    them itself). softmax_lse is (nheads, total_q)."""
    if block_table is not None:
        raise NotImplementedError("block_table (paged KV cache) is not supported by flashattn")
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError("flash_attn_varlen_func needs cu_seqlens_q and cu_seqlens_k")
    opts = _options(dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                    algorithm, block_size)
    out, lse = _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, block_mask, opts)
    return _result(out, lse, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, block_mask=None, *,
                                     block_size=None, algorithm="flash2"):
    """qkv: (total, 3, nheads, headdim); cu_seqlens: int32 (batch + 1,)."""
    if len(qkv.shape) != 4:
        raise ValueError("qkv must have shape (total, 3, nheads, headdim), got %s"
                         % (tuple(qkv.shape),))
    q, k, v = _unbind(qkv, 3, 1, "qkv", "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs, None,
                                  block_mask, block_size=block_size, algorithm=algorithm)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, block_mask=None, *,
                                    block_size=None, algorithm="flash2"):
    """q: (total_q, nheads, headdim); kv: (total_k, 2, nheads_k, headdim)."""
    if len(kv.shape) != 4:
        raise ValueError("kv must have shape (total_k, 2, nheads_k, headdim), got %s"
                         % (tuple(kv.shape),))
    k, v = _unbind(kv, 2, 1, "kv", "(total_k, 2, nheads_k, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs,
                                  None, block_mask, block_size=block_size,
                                  algorithm=algorithm)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 algorithm="flash2"):
    """torch.nn.functional.scaled_dot_product_attention's signature and semantics on
    (batch, heads, seqlen, headdim) (or unbatched (heads, seqlen, headdim)) inputs, read
    in place through strides. is_causal is aligned to the top-left corner as in torch.
    attn_mask is not supported (NotImplementedError)."""
    if attn_mask is not None:
        raise NotImplementedError(
            "flashattn.scaled_dot_product_attention: attn_mask is not supported; use "
            "is_causal, or flash_attn_func's window_size / alibi_slopes / softcap")
    _kind(query)
    nd = len(query.shape)
    if nd not in (3, 4) or len(key.shape) != nd or len(value.shape) != nd:
        raise ValueError("query, key and value must all be (batch, heads, seqlen, headdim) "
                         "or (heads, seqlen, headdim); got shapes %s, %s, %s"
                         % (tuple(query.shape), tuple(key.shape), tuple(value.shape)))
    if nd == 3:
        query, key, value = query[None], key[None], value[None]
    hq, hk = query.shape[1], key.shape[1]
    if hq != hk and not enable_gqa:
        raise ValueError("query has %d heads and key %d: pass enable_gqa=True for grouped-"
                         "query attention" % (hq, hk))
    q, k, v = (x.swapaxes(1, 2) for x in (query, key, value))  # (B, N, H, D) views
    nq, nk = q.shape[1], k.shape[1]
    window = (-1, -1)
    causal = False
    if is_causal:
        # torch aligns the causal mask top-left: row i sees keys j <= i.
        if nk > nq:  # keys past nq are never seen: drop them, then both corners agree
            k, v = k[:, :nq], v[:, :nq]
            causal = True
        elif nk == nq:
            causal = True
        else:  # bottom-right window shifted up by nq - nk: j <= i + nk - nq + (nq - nk)
            window = (-1, nq - nk)
    opts = _options(dropout_p, scale, causal, window, 0.0, False, algorithm, None)
    out, _ = _attention(q, k, v, None, None, None, None, opts)
    out = out.swapaxes(1, 2)
    return out[0] if nd == 3 else out


def backward(dout, q, k, v, out, lse, dropout_p=0.0, softmax_scale=None, causal=False,
             window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
             block_mask=None, *, cu_seqlens_q=None, cu_seqlens_k=None, block_size=None,
             algorithm="flash2"):
    """Gradients (dq, dk, dv) from dout and the forward's out and softmax_lse, without
    autograd (numpy arrays, or torch tensors). Pass the forward's options again."""
    opts = _options(dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                    algorithm, block_size)
    if _kind(q) == "torch":
        with _torch_pkg.no_grad():
            return _torch.backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                   alibi_slopes, block_mask, opts)
    return numpy.backward(dout, q, k, v, out, lse, dropout_p, softmax_scale, causal,
                          window_size, softcap, alibi_slopes, deterministic, block_mask,
                          cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                          block_size=block_size, algorithm=algorithm)
