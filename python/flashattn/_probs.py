"""return_attn_probs: the attention probabilities of a call, as flash-attn's S_dmask.

fa_attention_probs (C) writes P = softmax(scale q kᵀ + masks) of every (sequence, query
head) as float32, dropped elements with their sign flipped (flash-attn's convention:
negative means dropped); kept elements are not rescaled by 1 / (1 - p). Rows and columns
are padded to multiples of 128 with zeros, as flash-attn pads them. Slow: for tests on
small shapes. Called through ctypes on torch tensors (CPU or CUDA, the current stream).
"""
import ctypes

import torch

from . import _core, _lib

_DTYPES = {torch.float32: _lib.DType.F32, torch.float16: _lib.DType.F16,
           torch.bfloat16: _lib.DType.BF16, torch.float64: _lib.DType.F64}
_AUX = {"int32": torch.int32, "float32": torch.float32, "uint8": torch.uint8}


class _TorchAdapter:
    """What _core's validation and fa_params building read of a torch tensor."""
    array_name = "torch.Tensor"
    contiguous_hint = "%s.contiguous()"

    @staticmethod
    def is_array(x):
        return isinstance(x, torch.Tensor)

    @staticmethod
    def shape(x):
        return tuple(x.shape)

    @staticmethod
    def strides(x):
        return tuple(x.stride())

    @staticmethod
    def dtype_name(x):
        return str(x.dtype).replace("torch.", "")

    @staticmethod
    def dtype_code(x, name):
        dt = _DTYPES.get(x.dtype)
        if dt is None:
            raise TypeError("%s: unsupported dtype %s" % (name, x.dtype))
        return dt

    @staticmethod
    def device(x):
        if x.device.type == "cuda":
            return (_lib.Device.CUDA, x.device.index if x.device.index is not None
                    else torch.cuda.current_device())
        return (_lib.Device.CPU, 0)

    @staticmethod
    def device_name(x):
        return str(x.device)

    @staticmethod
    def device_name_of(dev):
        return "cpu" if dev[0] == _lib.Device.CPU else "cuda:%d" % dev[1]

    @staticmethod
    def ptr(x):
        return x.data_ptr()

    @staticmethod
    def aux_contiguous(x, kind, name):
        return x.to(_AUX[kind]).contiguous()


def _round_up(n, m):
    return (n + m - 1) // m * m


def attention_probs(q, k, rng_state, softmax_scale, causal, window_size, softcap, alibi_slopes,
                    dropout_p, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                    max_seqlen_k=None, block_mask=None, block_size=None, algorithm="flash2"):
    """S_dmask of a forward call made with these arguments and the forward's rng_state
    ((seed, offset), int64): (batch, nheads, round_up(seqlen_q, 128), round_up(seqlen_k,
    128)) in q's dtype."""
    A = _TorchAdapter
    opts = _core.make_options(softmax_scale, causal, window_size, softcap, dropout_p,
                              algorithm=algorithm, block_size=block_size)
    if dropout_p and rng_state is not None:
        opts.dropout_seed, opts.dropout_offset = (int(x) for x in rng_state.tolist())
    varlen = cu_seqlens_q is not None
    stream = torch.cuda.current_stream(q.device).cuda_stream if q.is_cuda else None
    if not q.is_cuda:
        opts.num_threads = torch.get_num_threads()
    if varlen:
        on_host = q.device.type != "meta"  # a meta tensor's lengths are unknown: the totals
        lq = max_seqlen_q if max_seqlen_q is not None else \
            (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item() if on_host else q.shape[0]
        lk = max_seqlen_k if max_seqlen_k is not None else \
            (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max().item() if on_host else k.shape[0]
        batch = cu_seqlens_q.shape[0] - 1
    else:
        batch, lq, lk = q.shape[0], q.shape[1], k.shape[1]
    rows, cols = _round_up(max(int(lq), 1), 128), _round_up(max(int(lk), 1), 128)
    probs = torch.zeros((batch, q.shape[-2], rows, cols), dtype=torch.float32, device=q.device)
    if q.device.type == "meta" or q.numel() == 0 or k.numel() == 0:
        return probs.to(q.dtype)  # shapes only, or no probability to write
    p, dt, dev, varlen, keep = _core._prepare(A, q, k, k, opts, cu_seqlens_q, cu_seqlens_k,
                                              alibi_slopes, block_mask, stream)
    tq, tk = _core.descriptor(A, q, dt, varlen), _core.descriptor(A, k, dt, varlen)
    ws = None
    n = _lib.workspace_size(_lib.Pass.PROBS, p, tq, tk, tk, "fa_attention_probs")
    if n:
        ws = torch.empty(n + _lib.WORKSPACE_ALIGN, dtype=torch.uint8, device=q.device)
        addr = ws.data_ptr()
        p.workspace = _round_up(addr, _lib.WORKSPACE_ALIGN)
        p.workspace_bytes = n
    _lib._check(_lib.lib.fa_attention_probs(ctypes.byref(p), ctypes.byref(tq), ctypes.byref(tk),
                                           rows, cols, ctypes.c_void_p(probs.data_ptr())),
                "fa_attention_probs")
    del keep, ws
    return probs.to(q.dtype)
