"""flashattn: FlashAttention (exact, tiled, O(N) extra memory) from a C library with a
CPU and a CUDA backend.

The functions mirror flash-attn 2's public API and take torch tensors (CPU or CUDA,
differentiable, through the compiled operators flashattn::fwd / flashattn::bwd, which
torch.compile keeps as one graph node each) or numpy arrays (CPU, through ctypes; see
flashattn.numpy for the backward):

    out = flashattn.flash_attn_func(q, k, v, causal=True)       # q: (B, N, H, D)
    out = flashattn.scaled_dot_product_attention(q, k, v)       # q: (B, H, N, D)

Extra keyword-only options: algorithm="flash2" | "flash1" | "standard" (the last also
takes float64 on the CPU: the oracle, and what torch.autograd.gradcheck runs through),
and block_mask/block_size (block-sparse attention, docs/DROPOUT.md for dropout).
flashattn.transformers registers the attention with Hugging Face transformers.
"""
from . import _core, _lib
from ._lib import (Algorithm, DType, Device, FlashAttnError, InvalidArgumentError, Status,
                   UnsupportedError, device_available, version)

__version__ = "0.1.0"

try:
    import torch as _torch_pkg
except ImportError:  # numpy-only use
    _torch_pkg = None
    _ops = None

    class _Tensor:  # isinstance(x, _Tensor) is never true
        pass
else:
    from . import _ops
    from ._probs import attention_probs as _attn_probs
    _Tensor = _torch_pkg.Tensor

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
    "scaled_dot_product_attention", "backward", "dropout_mask",
    "FlashAttnError", "InvalidArgumentError", "UnsupportedError", "Status", "DType", "Device",
    "Algorithm", "version", "device_available", "cuda_available", "torch_ops_available",
    "LIBRARY_PATH",
]

LIBRARY_PATH = _lib.LIBRARY_PATH


def cuda_available():
    """True if the library was built with its CUDA backend and a GPU is visible."""
    return device_available("cuda")


def torch_ops_available():
    """True if the compiled PyTorch operators are loaded (else torch tensors raise, saying
    how to get them; numpy arrays work either way)."""
    return _ops is not None and _ops.AVAILABLE


def _not_an_array(x):
    kinds = "torch.Tensor or numpy.ndarray" if _torch_pkg is not None else "numpy.ndarray"
    return TypeError("flashattn takes %s inputs, got %s" % (kinds, type(x).__name__))


def _numpy_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, block_mask, dropout_p,
                   softmax_scale, causal, window_size, softcap, deterministic, algorithm,
                   block_size, seqused_k=None, block_table=None):
    if _np is None or not isinstance(q, _np.ndarray):
        raise _not_an_array(q)
    opts = _core.make_options(softmax_scale, causal, window_size, softcap, dropout_p,
                              deterministic, algorithm, block_size)
    return _core.forward(_NumpyAdapter, q, k, v, opts, cu_seqlens_q, cu_seqlens_k,
                         alibi_slopes, block_mask, None, seqused_k, block_table)


def dropout_mask(dropout_p, seed, offset, nheads, seqlen_q, seqlen_k, batch=1):
    """Dropout's keep mask (uint8, (batch, nheads, seqlen_q, seqlen_k)) for a seed and
    offset, bit for bit what every backend draws (docs/DROPOUT.md); a numpy array."""
    import numpy as np
    raw = _lib.dropout_mask(dropout_p, seed, offset, nheads, seqlen_q, seqlen_k, batch)
    return np.frombuffer(raw, dtype=np.uint8).reshape(batch, nheads, seqlen_q, seqlen_k).copy()


def _check_margin(sm_margin):
    if isinstance(sm_margin, bool) or not isinstance(sm_margin, int) or \
            not 0 <= sm_margin <= 1024:
        raise ValueError("sm_margin must be an int in [0, 1024], got %r" % (sm_margin,))


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, block_mask=None, *, block_size=None,
                    algorithm="flash2", sm_margin=0):
    """softmax(q kᵀ · softmax_scale + masks) v.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim),
    nheads a multiple of nheads_k (GQA/MQA). causal is aligned to the bottom-right
    corner; window_size=(left, right) ints, -1 = unlimited; softcap > 0 caps logits;
    alibi_slopes: float32 (nheads,) or (batch, nheads); block_mask: uint8 or bool
    (batch or 1, nheads or 1, query blocks, key blocks) with block_size=(block_q,
    block_k). sm_margin (CUDA, flash-attn 3's): SMs the Hopper kernels leave to work
    running beside the call, e.g. a collective's kernels on another stream (0: all).
    Returns out (like q), or (out, softmax_lse (batch, nheads, seqlen_q) float32, None)
    with return_attn_probs.
    """
    _check_margin(sm_margin)
    if isinstance(q, _Tensor):
        out, lse, rng = _ops.attention(q, k, v, None, None, None, alibi_slopes, block_mask,
                                       softmax_scale, causal, window_size, softcap, dropout_p,
                                       deterministic, algorithm, block_size,
                                       sm_margin=sm_margin)
        if return_attn_probs:  # flash-attn's (out, softmax_lse, S_dmask)
            return out, lse, _attn_probs(q, k, rng, softmax_scale, causal, window_size, softcap,
                                         alibi_slopes, dropout_p, block_mask=block_mask,
                                         block_size=block_size, algorithm=algorithm)
    else:
        out, lse = _numpy_forward(q, k, v, None, None, alibi_slopes, block_mask, dropout_p,
                                  softmax_scale, causal, window_size, softcap, deterministic,
                                  algorithm, block_size)
    return (out, lse, None) if return_attn_probs else out


def _check_int32(x, name):
    """Host integers (an int, an array or a CPU tensor) must fit int32: converting them
    would wrap silently."""
    if isinstance(x, int):
        lo = hi = x
    elif isinstance(x, (list, tuple)):
        ints = [v for v in x if isinstance(v, int)]
        if not ints:
            return
        lo, hi = min(ints), max(ints)
    elif getattr(x, "dtype", None) is None or not len(x.shape) or not x.shape[0] or \
            str(x.dtype) in ("int32", "torch.int32"):  # fits already (and costs no scan)
        return
    else:
        if getattr(x.dtype, "is_floating_point", False) or (
                _np is not None and isinstance(x, _np.ndarray) and x.dtype.kind not in "iu"):
            return  # the type check that follows names the dtype
        lo, hi = int(x.min()), int(x.max())
    if lo < -2 ** 31 or hi >= 2 ** 31:
        raise ValueError("%s has values outside int32 (min %d, max %d)" % (name, lo, hi))


def _cache_lengths(cache_seqlens, q, appending):
    """cache_seqlens as an int32 tensor (numpy: array) of q's batch on q's device, or None
    (no append: the whole cache). An int, a list or a tensor/array (batch,) of any integer
    dtype; the library checks the shape and the values (on the CPU)."""
    batch, is_torch = q.shape[0], isinstance(q, _Tensor)
    if cache_seqlens is None:
        if appending:
            raise ValueError("k and v need cache_seqlens (the rows to write them at)")
        return None
    if isinstance(cache_seqlens, bool) or not isinstance(
            cache_seqlens, (int, list, tuple, _Tensor) + ((_np.ndarray, _np.integer)
                                                          if _np is not None else ())):
        raise TypeError("cache_seqlens must be an int or an int32 tensor/array (batch_size,), "
                        "got %s" % type(cache_seqlens).__name__)
    if _np is not None and isinstance(cache_seqlens, _np.integer):
        cache_seqlens = int(cache_seqlens)
    if not isinstance(cache_seqlens, _Tensor) or cache_seqlens.device.type == "cpu":
        _check_int32(cache_seqlens, "cache_seqlens")
    if is_torch:
        if isinstance(cache_seqlens, int):
            return _torch_pkg.full((batch,), cache_seqlens, dtype=_torch_pkg.int32,
                                   device=q.device)
        if not isinstance(cache_seqlens, _Tensor):
            cache_seqlens = _torch_pkg.as_tensor(cache_seqlens)
            if cache_seqlens.is_floating_point() or cache_seqlens.is_complex():
                raise TypeError("cache_seqlens must be an integer tensor (int32), got %s"
                                % cache_seqlens.dtype)
            cache_seqlens = cache_seqlens.to(_torch_pkg.int32)
        if cache_seqlens.device != q.device:  # a host tensor for a device q: copied over
            cache_seqlens = cache_seqlens.to(q.device, non_blocking=True)
        return cache_seqlens
    if isinstance(cache_seqlens, int):
        return _np.full((batch,), cache_seqlens, dtype=_np.int32)
    return _np.asarray(cache_seqlens)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, algorithm="flash2"):
    """Attention against a KV cache, for inference (flash-attn 2's signature).

    q: (batch, seqlen_q, nheads, headdim). k_cache, v_cache: (batch_cache, seqlen_cache,
    nheads_k, headdim), or with block_table (int32 (batch, max_num_blocks_per_seq)) page
    pools (num_blocks, page_block_size, nheads_k, headdim) in which batch entry b's cache
    row j is row j % page_block_size of page block_table[b, j // page_block_size].
    cache_seqlens: the rows already in each cache (an int, or an int32 tensor/array
    (batch,); None: the whole cache). k, v: optional (batch, seqlen_new, nheads_k,
    headdim), written into the caches in place at rows cache_seqlens[b]... (k rotated
    first when rotary_cos/rotary_sin, (seqlen_ro, rotary_dim / 2) in q's dtype, are given:
    GPT-J pairs when rotary_interleaved, else GPT-NeoX halves; q is rotated too, at
    positions cache_seqlens[b] + i with a causal mask or a window, else at
    cache_seqlens[b]), then attended to. cache_batch_idx: int32 (batch,), the cache row
    of each batch entry; cache_leftpad: int32 (batch,), the first cache row each entry
    attends to. causal aligns the last query row with the last key. num_splits: the CUDA
    forward's key splits (0: chosen by the library; the CPU ignores it). Returns out (like
    q), or (out, softmax_lse (batch, nheads, seqlen_q)) with return_softmax_lse. Torch
    tensors (CPU, CUDA) run the flashattn::kvcache operator (k_cache and v_cache marked
    as mutated); nothing here synchronises with the GPU.
    """
    is_torch = isinstance(q, _Tensor)
    if not is_torch and (_np is None or not isinstance(q, _np.ndarray)):
        raise _not_an_array(q)
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    lengths = _cache_lengths(cache_seqlens, q, k is not None)
    if (k is None and rotary_cos is None and cache_batch_idx is None
            and cache_leftpad is None and is_torch):
        # attention alone: the forward operator, each batch entry's first cache_seqlens[b]
        # keys (seqused_k)
        try:
            out, lse, _ = _ops.attention(q, k_cache, v_cache, None, None, lengths,
                                         alibi_slopes, None, softmax_scale, causal, window_size,
                                         softcap, 0.0, False, algorithm, None, False,
                                         block_table, num_splits)
        except FlashAttnError as e:  # the library names cache_seqlens by its role there
            raise FlashAttnError(e.status, e.message.replace("params.seqused_k",
                                                             "cache_seqlens"),
                                 "flash_attn_with_kvcache") from None
        except (ValueError, TypeError) as e:
            if "seqused_k" not in str(e):
                raise
            raise type(e)(str(e).replace("seqused_k", "cache_seqlens")) from None
        return (out, lse) if return_softmax_lse else out
    if lengths is None:  # the whole cache
        cap = k_cache.shape[1] * (1 if block_table is None else block_table.shape[-1])
        lengths = _cache_lengths(int(cap), q, False)
    if is_torch:
        out, lse = _ops.kvcache(q, k_cache, v_cache, lengths, k, v, rotary_cos, rotary_sin,
                                cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
                                softmax_scale, causal, window_size, softcap, rotary_interleaved,
                                num_splits, algorithm)
    else:
        opts = _core.make_options(softmax_scale, causal, window_size, softcap, 0.0, False,
                                  algorithm)
        out, lse = _core.forward_kvcache(_NumpyAdapter, q, k_cache, v_cache, opts, lengths, k,
                                         v, rotary_cos, rotary_sin, cache_batch_idx,
                                         cache_leftpad, block_table, alibi_slopes,
                                         rotary_interleaved, num_splits)
    return (out, lse) if return_softmax_lse else out


def _unpack(x, n, axis, name, layout):
    if len(x.shape) != axis + 3 or x.shape[axis] != n:
        raise ValueError("%s must have shape %s, got %s" % (name, layout, tuple(x.shape)))
    if isinstance(x, _Tensor):
        return x.unbind(axis)  # one view op (and one gradient buffer) for all of them
    if _np is not None and isinstance(x, _np.ndarray):
        return tuple(x[(slice(None),) * axis + (i,)] for i in range(n))
    raise _not_an_array(x)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, block_mask=None,
                              *, block_size=None, algorithm="flash2"):
    """qkv: (batch, seqlen, 3, nheads, headdim); q, k, v are read in place (strides)."""
    q, k, v = _unpack(qkv, 3, 2, "qkv", "(batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, block_mask,
                           block_size=block_size, algorithm=algorithm)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, block_mask=None,
                             *, block_size=None, algorithm="flash2"):
    """q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_k, headdim)."""
    k, v = _unpack(kv, 2, 2, "kv", "(batch, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, block_mask,
                           block_size=block_size, algorithm=algorithm)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                           max_seqlen_k=None, dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None,
                           block_mask=None, *, block_size=None, algorithm="flash2",
                           sm_margin=0):
    """Sequences packed along the first axis. q: (total_q, nheads, headdim), k, v:
    (total_k, nheads_k, headdim); cu_seqlens_q/_k: int32 (batch + 1,) offsets from 0,
    on q's device. max_seqlen_q/_k are accepted for compatibility (the library finds
    them itself). softmax_lse is (nheads, total_q). block_table: a paged KV cache, int32
    (batch, max_num_blocks_per_seq), k and v then page pools (num_blocks,
    page_block_size, nheads_k, headdim) and cu_seqlens_k's offsets count each sequence's
    keys (read through its row of the table); forward only (the backward raises
    UnsupportedError), without dropout or return_attn_probs. sm_margin: as in
    flash_attn_func."""
    _check_margin(sm_margin)
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError("flash_attn_varlen_func needs cu_seqlens_q and cu_seqlens_k")
    if block_table is not None and return_attn_probs:
        raise UnsupportedError(Status.ERR_UNSUPPORTED, "return_attn_probs is not supported "
                               "with a block_table (paged KV cache)", "flash_attn_varlen_func")
    if isinstance(q, _Tensor):
        out, lse, rng = _ops.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, None, alibi_slopes,
                                       block_mask, softmax_scale, causal, window_size, softcap,
                                       dropout_p, deterministic, algorithm, block_size, False,
                                       block_table, sm_margin=sm_margin)
        if return_attn_probs:
            return out, lse, _attn_probs(q, k, rng, softmax_scale, causal, window_size, softcap,
                                         alibi_slopes, dropout_p, cu_seqlens_q, cu_seqlens_k,
                                         max_seqlen_q, max_seqlen_k, block_mask, block_size,
                                         algorithm)
    else:
        out, lse = _numpy_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, block_mask,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  deterministic, algorithm, block_size, None, block_table)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen=None, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, block_mask=None, *,
                                     block_size=None, algorithm="flash2"):
    """qkv: (total, 3, nheads, headdim); cu_seqlens: int32 (batch + 1,)."""
    q, k, v = _unpack(qkv, 3, 1, "qkv", "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs, None,
                                  block_mask, block_size=block_size, algorithm=algorithm)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                                    max_seqlen_k=None, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, block_mask=None, *,
                                    block_size=None, algorithm="flash2"):
    """q: (total_q, nheads, headdim); kv: (total_k, 2, nheads_k, headdim)."""
    k, v = _unpack(kv, 2, 1, "kv", "(total_k, 2, nheads_k, headdim)")
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
    nd = query.ndim
    if nd != 4:
        if nd != 3 or key.ndim != 3 or value.ndim != 3:
            raise ValueError("query, key and value must all be (batch, heads, seqlen, headdim) "
                             "or (heads, seqlen, headdim); got shapes %s, %s, %s"
                             % (tuple(query.shape), tuple(key.shape), tuple(value.shape)))
        return scaled_dot_product_attention(query[None], key[None], value[None], None,
                                            dropout_p, is_causal, scale, enable_gqa,
                                            algorithm=algorithm)[0]
    if not enable_gqa and key.ndim == 4 and query.shape[1] != key.shape[1]:
        raise ValueError("query has %d heads and key %d: pass enable_gqa=True for grouped-"
                         "query attention" % (query.shape[1], key.shape[1]))
    window = (-1, -1)
    if is_causal:
        # torch aligns the causal mask top-left (row i sees keys j <= i), the library
        # bottom-right: equal when nq == nk
        nq, nk = query.shape[2], key.shape[2]
        if nk > nq:  # keys past nq are never seen: drop them
            key, value = key[:, :, :nq], value[:, :, :nq]
        elif nk < nq:  # the bottom-right window shifted up by nq - nk
            window, is_causal = (-1, nq - nk), False
    if isinstance(query, _Tensor):
        return _ops.attention(query, key, value, None, None, None, None, None, scale, is_causal,
                              window, 0.0, dropout_p, False, algorithm, None, True)[0]
    q, k, v = query.swapaxes(1, 2), key.swapaxes(1, 2), value.swapaxes(1, 2)  # (B, N, H, D)
    out, _ = _numpy_forward(q, k, v, None, None, None, None, dropout_p, scale, is_causal, window,
                            0.0, False, algorithm, None)
    return out.swapaxes(1, 2)


def backward(dout, q, k, v, out, lse, dropout_p=0.0, softmax_scale=None, causal=False,
             window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
             block_mask=None, *, cu_seqlens_q=None, cu_seqlens_k=None, block_size=None,
             algorithm="flash2", dropout_seed=None, dropout_offset=0):
    """Gradients (dq, dk, dv) from dout and the forward's out and softmax_lse, without
    autograd (numpy arrays, or torch tensors). Pass the forward's options again; with
    dropout, the seed and offset of its mask (as flashattn.numpy.forward and
    flashattn._ops.fwd take them)."""
    if isinstance(q, _Tensor):
        for name, t in (("dout", dout), ("out", out), ("lse", lse)):
            if not isinstance(t, _Tensor):
                raise TypeError("%s must be a torch.Tensor like q, got %s"
                                % (name, type(t).__name__))
            if t.device != q.device:
                raise ValueError("%s must be on q's device (%s), got %s"
                                 % (name, q.device, t.device))
        return _ops.bwd(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                        dropout_p=dropout_p, dropout_seed=dropout_seed,
                        dropout_offset=dropout_offset, cu_seqlens_q=cu_seqlens_q,
                        cu_seqlens_k=cu_seqlens_k, block_mask=block_mask,
                        block_size=block_size, deterministic=deterministic,
                        algorithm=algorithm)
    if _np is None or not isinstance(q, _np.ndarray):
        raise _not_an_array(q)
    return numpy.backward(dout, q, k, v, out, lse, dropout_p, softmax_scale, causal,
                          window_size, softcap, alibi_slopes, deterministic, block_mask,
                          cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                          block_size=block_size, algorithm=algorithm,
                          dropout_seed=dropout_seed or 0, dropout_offset=dropout_offset)
