"""flashattn on torch tensors: custom ops flashattn::fwd / flashattn::bwd with
autograd and fake (meta) kernels, so torch.compile keeps each call one graph node.
Plain eager calls skip the custom-op machinery (host time) through an autograd.Function
running the same implementation (see _FlashAttnFunction).

Outputs and the workspace are allocated with torch (the caching allocator on CUDA);
CUDA calls run on the tensor's current stream.
"""
import contextlib
from typing import Optional, Tuple

import torch

from . import _core
from ._lib import Device, DType

_DTYPES = {torch.float32: DType.F32, torch.float16: DType.F16, torch.bfloat16: DType.BF16,
           torch.float64: DType.F64}
_AUX = {"int32": torch.int32, "float32": torch.float32, "uint8": torch.uint8}
_CPU = (Device.CPU, 0)


class TorchAdapter:
    array_name = "torch.Tensor"

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
            raise TypeError("%s: unsupported dtype %s; flashattn takes float32 (CPU), float16, "
                            "bfloat16 and (CPU standard algorithm only) float64"
                            % (name, x.dtype))
        return dt

    @staticmethod
    def device(x):
        d = x.device
        if d.type == "cpu":
            return _CPU
        if d.type == "cuda":
            return (Device.CUDA, d.index if d.index is not None else torch.cuda.current_device())
        if d.type == "meta":  # shapes only (the fake kernels); never reaches the library
            return ("meta", 0)
        raise ValueError("flashattn runs on cpu and cuda tensors, not on %s" % d)

    @staticmethod
    def device_name(x):
        return str(x.device)

    @staticmethod
    def device_name_of(dev):
        return "cpu" if dev[0] == Device.CPU else "cuda:%d" % dev[1]

    @staticmethod
    def ptr(x):
        return x.data_ptr()

    @staticmethod
    def empty_like(x):
        return torch.empty_like(x)

    @staticmethod
    def empty(shape, dtype, like):
        return torch.empty(shape, dtype=_AUX[dtype], device=like.device)

    @staticmethod
    def fill_(x, value):
        x.fill_(value)

    @staticmethod
    def aux_contiguous(x, kind, name):
        want = _AUX[kind]
        if kind == "int32" and x.dtype != want and (x.dtype.is_floating_point or x.is_complex()):
            raise TypeError("%s must be an integer tensor (int32), got %s" % (name, x.dtype))
        return x.detach().to(want).contiguous()

    @staticmethod
    def workspace(nbytes, like):
        buf = torch.empty(nbytes + 64, dtype=torch.uint8, device=like.device)
        addr = buf.data_ptr()
        return (addr + 63) & ~63, buf


A = TorchAdapter


def _stream_and_threads(q):
    if q.device.type == "cuda":
        return torch.cuda.current_stream(q.device).cuda_stream, 0
    return None, torch.get_num_threads()


def _opts(softmax_scale, causal, window_enabled, window_left, window_right, softcap,
          dropout_p, dropout_seed, deterministic, algorithm, block_size_q, block_size_k,
          num_threads):
    return _core.Options(softmax_scale=softmax_scale, causal=causal,
                         window_enabled=window_enabled, window_left=window_left,
                         window_right=window_right, softcap=softcap, dropout_p=dropout_p,
                         dropout_seed=dropout_seed, deterministic=deterministic,
                         algorithm=algorithm, block_size_q=block_size_q,
                         block_size_k=block_size_k, num_threads=num_threads)


_NO_GUARD = contextlib.nullcontext()  # reusable: entering it does nothing


def _device_guard(q):
    if q.device.type == "cuda":
        return torch.cuda.device(q.device)
    return _NO_GUARD


# ---- the ops --------------------------------------------------------------------
# Scalar arguments are the resolved fa_params fields (see _core.Options).


def _fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
              alibi_slopes: Optional[torch.Tensor], block_mask: Optional[torch.Tensor],
              softmax_scale: float, causal: bool, window_enabled: bool, window_left: int,
              window_right: int, softcap: float, dropout_p: float, dropout_seed: int,
              deterministic: bool, algorithm: int, block_size_q: int,
              block_size_k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    with _device_guard(q):
        stream, threads = _stream_and_threads(q)
        opts = _opts(softmax_scale, causal, window_enabled, window_left, window_right, softcap,
                     dropout_p, dropout_seed, deterministic, algorithm, block_size_q,
                     block_size_k, threads)
        return _core.forward(A, q, k, v, opts, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                             block_mask, stream)


def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, block_mask, softmax_scale,
              causal, window_enabled, window_left, window_right, softcap, dropout_p,
              dropout_seed, deterministic, algorithm, block_size_q, block_size_k):
    varlen = cu_seqlens_q is not None
    _core.check_qkv(A, q, k, v, varlen)
    out = torch.empty_like(q)
    lse = q.new_empty(_core.lse_shape(tuple(q.shape), varlen), dtype=torch.float32)
    return out, lse


def _bwd_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
              cu_seqlens_k: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
              block_mask: Optional[torch.Tensor], softmax_scale: float, causal: bool,
              window_enabled: bool, window_left: int, window_right: int, softcap: float,
              dropout_p: float, dropout_seed: int, deterministic: bool, algorithm: int,
              block_size_q: int, block_size_k: int
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with _device_guard(q):
        stream, threads = _stream_and_threads(q)
        opts = _opts(softmax_scale, causal, window_enabled, window_left, window_right, softcap,
                     dropout_p, dropout_seed, deterministic, algorithm, block_size_q,
                     block_size_k, threads)
        return _core.backward(A, dout, q, k, v, out, lse, opts, cu_seqlens_q, cu_seqlens_k,
                              alibi_slopes, block_mask, stream)


def _bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, block_mask,
              softmax_scale, causal, window_enabled, window_left, window_right, softcap,
              dropout_p, dropout_seed, deterministic, algorithm, block_size_q, block_size_k):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_SCALARS = ("softmax_scale", "causal", "window_enabled", "window_left", "window_right",
            "softcap", "dropout_p", "dropout_seed", "deterministic", "algorithm",
            "block_size_q", "block_size_k")


def _unit_last_stride(t):
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        return t.contiguous()
    return t


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, alibi, block_mask = inputs[:7]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, alibi, block_mask)
    ctx.scalars = tuple(inputs[7:])
    ctx.mark_non_differentiable(lse)


def _grads(bwd, ctx, dout):
    q, k, v, out, lse, cu_q, cu_k, alibi, block_mask = ctx.saved_tensors
    dout = _unit_last_stride(dout)
    dq, dk, dv = bwd(dout, q, k, v, out, lse, cu_q, cu_k, alibi, block_mask, *ctx.scalars)
    return (dq, dk, dv) + (None,) * (4 + len(_SCALARS))


def _backward(ctx, dout, dlse):
    """flashattn::fwd's registered derivative: always the flashattn::bwd op (it is traced
    under torch.compile)."""
    return _grads(_bwd_op, ctx, dout)


# ---- two paths to the same implementation ---------------------------------------
# The custom ops are what torch.compile, export, tracers, functorch transforms and
# dispatch modes see. In plain eager mode their machinery (schema defaults, dispatch,
# generated autograd glue) costs more host time per call than the attention itself for
# small shapes, so there call() runs _fwd_impl through this autograd.Function, whose
# derivative runs _bwd_impl: the same code, context and gradients as the ops'
# registration above. It is also the only path on torch < 2.4 (no custom_op).


class _FlashAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *args):
        out, lse = _fwd_impl(*args)
        _setup_context(ctx, args, (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        # The op, as the custom op's derivative calls it, when create_graph=True (grad
        # mode is on here; a second backward then fails as it always did, flashattn::bwd
        # having no derivative) or when something watches (compiled autograd traces this).
        fast = not torch.is_grad_enabled() and _fast((dout,))
        return _grads(_bwd_impl if fast else _bwd_op, ctx, dout)


HAS_CUSTOM_OP = hasattr(torch, "library") and hasattr(torch.library, "custom_op") \
    and hasattr(torch.library, "register_autograd")

# Set to False to send every eager call through the custom ops (tests compare the paths).
EAGER_FAST_PATH = True

if HAS_CUSTOM_OP:
    _fwd_op = torch.library.custom_op("flashattn::fwd", mutates_args=())(_fwd_impl)
    _fwd_op.register_fake(_fwd_fake)
    _bwd_op = torch.library.custom_op("flashattn::bwd", mutates_args=())(_bwd_impl)
    _bwd_op.register_fake(_bwd_fake)
    _fwd_op.register_autograd(_backward, setup_context=_setup_context)

    def _probe(module, name):
        f = getattr(module, name, None)
        return f if callable(f) else None

    # Each says "something other than plain eager execution is looking"; a torch too old
    # to have one of them never takes the fast path.
    _WATCHERS = (_probe(getattr(torch, "compiler", None), "is_compiling"),
                 _probe(torch.jit, "is_tracing"),
                 _probe(torch._C, "_are_functorch_transforms_active"),
                 _probe(torch._C, "_len_torch_dispatch_stack"))
    _FUNCTION_MODES = (_probe(torch._C, "_is_torch_function_mode_enabled"),
                       _probe(torch._C, "_len_torch_function_stack"),
                       _probe(torch._C, "_get_function_stack_at"))
    try:
        from torch.utils._device import DeviceContext as _DeviceContext
    except ImportError:
        _DeviceContext = ()  # isinstance(x, ()) is False
    # forward-mode AD (torch.autograd.forward_ad.dual_level): the op passes no tangent on,
    # where the autograd.Function, having no jvp, would raise
    _forward_ad = getattr(torch.autograd, "forward_ad", None)
    _CAN_TELL = (all(_WATCHERS) and all(_FUNCTION_MODES)
                 and hasattr(_forward_ad, "_current_level"))

    def _function_modes_watch():
        # torch.set_default_device (and `with torch.device(...)`) keep a DeviceContext
        # torch-function mode: harmless here (every tensor we allocate names its
        # device), so it alone keeps the fast path; any other mode gets the op.
        enabled, depth, mode_at = _FUNCTION_MODES
        return enabled() and not all(isinstance(mode_at(i), _DeviceContext)
                                     for i in range(depth()))

    def _watched():
        """True unless plain eager: compiling, jit tracing, a functorch transform, a
        dispatch mode (fake tensors, make_fx, export), forward-mode AD or a torch-function
        mode."""
        if not _CAN_TELL:
            return True
        compiling, tracing, functorch, dispatch_modes = _WATCHERS
        if compiling() or tracing() or functorch() or dispatch_modes():
            return True
        return _forward_ad._current_level >= 0 or _function_modes_watch()
else:  # torch < 2.4: the autograd.Function only (no torch.compile integration)
    _fwd_op = _FlashAttnFunction.apply
    _bwd_op = _bwd_impl

    def _watched():
        return False


_TENSOR = (torch.Tensor, torch.nn.Parameter)  # exact types: no subclass redirects torch ops


def _fast(tensors, optional=()):
    """The eager fast path applies: plain CPU/CUDA tensors (no subclass; no meta tensor,
    the fake kernel's job; a non-tensor gets the op schema's error) and nothing watching."""
    if not EAGER_FAST_PATH or _watched():
        return False
    for t in tensors:
        if type(t) not in _TENSOR or t.is_meta:
            return False
    for t in optional:
        if t is not None and (type(t) not in _TENSOR or t.is_meta):
            return False
    return True


def _dropout_seed(dropout_p):
    if dropout_p > 0:
        return int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64).item())
    return 0


def call(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, block_mask, opts):
    """Runs the op with resolved options; returns (out, lse)."""
    # checked here too so that bad input fails with our message, not the op schema's
    _core.check_qkv(A, q, k, v, cu_seqlens_q is not None)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, block_mask,
            opts.softmax_scale, opts.causal, opts.window_enabled, opts.window_left,
            opts.window_right, opts.softcap, opts.dropout_p, _dropout_seed(opts.dropout_p),
            opts.deterministic, opts.algorithm, opts.block_size_q, opts.block_size_k)
    if _fast(args[:3], args[3:7]):
        return _FlashAttnFunction.apply(*args)
    return _fwd_op(*args)


def backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, block_mask,
             opts):
    """The backward called directly (no autograd): returns (dq, dk, dv)."""
    # before any dispatch: a tensor on another device (meta, say) would pick that
    # device's kernel, and a non-tensor would fail on an attribute
    for name, t in (("dout", dout), ("out", out), ("lse", lse)):
        if not isinstance(t, torch.Tensor):
            raise TypeError("%s must be a torch.Tensor like q, got %s" % (name, type(t).__name__))
        if t.device != q.device:
            raise ValueError("%s must be on q's device (%s), got %s" % (name, q.device, t.device))
    args = (_unit_last_stride(dout), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
            alibi_slopes, block_mask, opts.softmax_scale, opts.causal, opts.window_enabled,
            opts.window_left, opts.window_right, opts.softcap, opts.dropout_p,
            opts.dropout_seed, opts.deterministic, opts.algorithm, opts.block_size_q,
            opts.block_size_k)
    return (_bwd_impl if _fast(args[:6], args[6:10]) else _bwd_op)(*args)


__all__ = ["call", "backward", "TorchAdapter", "HAS_CUSTOM_OP"]
