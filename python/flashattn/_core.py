"""The ctypes path (numpy arrays): argument checks, descriptors, params.

An adapter (numpy's in flashattn/numpy.py) says how to read an array's pointer, dtype,
strides and device and how to allocate; this module does the rest. torch tensors go
through the compiled operators instead (flashattn/_ops.py).
"""
import ctypes
import math
import operator

from . import _lib
from ._lib import Algorithm, Device, DType

# ---- plain-python argument normalisation ---------------------------------------


class Options:
    """The attention variant, resolved to what fa_params wants."""

    __slots__ = ("softmax_scale", "causal", "window_enabled", "window_left", "window_right",
                 "softcap", "dropout_p", "dropout_seed", "dropout_offset", "deterministic",
                 "algorithm", "block_size_q", "block_size_k", "num_threads", "shard")

    def __init__(self, softmax_scale=0.0, causal=False, window_enabled=False, window_left=-1,
                 window_right=-1, softcap=0.0, dropout_p=0.0, dropout_seed=0,
                 dropout_offset=0, deterministic=False, algorithm=int(Algorithm.FLASH2),
                 block_size_q=0, block_size_k=0, num_threads=0, shard=None):
        self.softmax_scale = float(softmax_scale)
        self.causal = bool(causal)
        self.window_enabled = bool(window_enabled)
        self.window_left = int(window_left)
        self.window_right = int(window_right)
        self.softcap = float(softcap)
        self.dropout_p = float(dropout_p)
        self.dropout_seed = int(dropout_seed)
        self.dropout_offset = int(dropout_offset)
        self.deterministic = bool(deterministic)
        self.algorithm = int(algorithm)
        self.block_size_q = int(block_size_q)
        self.block_size_k = int(block_size_k)
        self.num_threads = int(num_threads)
        # (q_offset, k_offset): q and k are shards of one sequence at these positions
        # (fa_params.shard_enabled); None: a whole sequence
        self.shard = None if shard is None else (int(shard[0]), int(shard[1]))


# The C library reads softmax_scale == 0 as "use 1/sqrt(D)"; an explicit 0 (uniform
# attention) becomes the smallest positive float, which gives the same result.
_TINY_SCALE = 1.401298464324817e-45


def resolve_scale(softmax_scale):
    if softmax_scale is None:
        return 0.0
    s = float(softmax_scale)
    if not math.isfinite(s):
        raise ValueError("softmax_scale must be finite (got %r)" % (softmax_scale,))
    return _TINY_SCALE if s == 0.0 else s


def int_pair(pair, name, what):
    try:
        a, b = pair
        return operator.index(a), operator.index(b)
    except (TypeError, ValueError):
        raise TypeError("%s must be a pair of ints %s, got %r" % (name, what, pair)) from None


def resolve_window(window_size):
    """flash-attn's window_size=(left, right): (-1, -1) is no window; a negative
    side is unlimited. Returns (enabled, left, right)."""
    if window_size is None:
        return False, -1, -1
    left, right = int_pair(window_size, "window_size", "(left, right), -1 = unlimited")
    if left < 0 and right < 0:
        return False, -1, -1
    return True, (left if left >= 0 else -1), (right if right >= 0 else -1)


def resolve_algorithm(algorithm):
    if isinstance(algorithm, str):
        try:
            return int(_lib.ALGORITHMS[algorithm.lower()])
        except KeyError:
            pass
    elif isinstance(algorithm, int) and algorithm in set(int(a) for a in Algorithm):
        return int(algorithm)
    raise ValueError("algorithm must be one of %s (got %r)"
                     % (", ".join(repr(a) for a in _lib.ALGORITHMS), algorithm))


def resolve_block_size(block_size):
    if block_size is None:
        return 0, 0
    return int_pair(block_size, "block_size", "(block_q, block_k)")


def make_options(softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                 dropout_p=0.0, deterministic=False, algorithm="flash2", block_size=None,
                 dropout_seed=0, num_threads=0):
    enabled, left, right = resolve_window(window_size)
    if softcap is None:
        softcap = 0.0
    softcap = float(softcap)
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError("softcap must be finite and >= 0 (got %r)" % (softcap,))
    dropout_p = float(dropout_p or 0.0)
    if not (0.0 <= dropout_p < 1.0):
        raise ValueError("dropout_p must be in [0, 1) (got %r)" % (dropout_p,))
    bq, bk = resolve_block_size(block_size)
    return Options(softmax_scale=resolve_scale(softmax_scale), causal=causal,
                   window_enabled=enabled, window_left=left, window_right=right,
                   softcap=softcap, dropout_p=dropout_p, dropout_seed=dropout_seed,
                   deterministic=deterministic, algorithm=resolve_algorithm(algorithm),
                   block_size_q=bq, block_size_k=bk, num_threads=num_threads)


# ---- validation ----------------------------------------------------------------


def check_qkv(A, q, k, v, varlen, paged=False, cache=False):
    """Types, ranks, dtypes, devices and strides of q, k, v. Returns (dtype, device).
    paged: k and v are page pools (num_blocks, page_block_size, heads_k, headdim);
    cache: k and v are a KV cache (k_cache, v_cache), whose batch may differ from q's."""
    # Called on every forward and backward: each shape is read once, and the checks run
    # in a fixed order (the first failing one is the error raised).
    kn, vn = ("k_cache", "v_cache") if cache else ("k", "v")
    for name, x in (("q", q), (kn, k), (vn, v)):
        if not A.is_array(x):
            raise TypeError("%s must be a %s (got %s); q, k and v must be of one kind"
                            % (name, A.array_name, type(x).__name__))
    qs, ks, vs = A.shape(q), A.shape(k), A.shape(v)
    for name, s, is_kv in (("q", qs, False), (kn, ks, True), (vn, vs, True)):
        if is_kv and paged:
            nd, layout = 4, "(num_blocks, page_block_size, nheads_k, headdim)"
        elif varlen:
            nd, layout = 3, "(total_tokens, heads, headdim)"
        else:
            nd, layout = 4, "(batch, seqlen, heads, headdim)"
        if len(s) != nd:
            raise ValueError("%s must have %d dimensions %s, got shape %s"
                             % (name, nd, layout, tuple(s)))
    dt = A.dtype_code(q, "q")
    qdt = A.dtype_name(q)
    for name, x in ((kn, k), (vn, v)):
        xdt = A.dtype_name(x)
        if xdt != qdt:
            raise TypeError("q, k and v must have the same dtype (q is %s, %s is %s)"
                            % (qdt, name, xdt))
    dev = A.device(q)
    for name, x in ((kn, k), (vn, v)):
        if A.device(x) != dev:
            raise ValueError("q, k and v must be on the same device (q is on %s, %s is on %s)"
                             % (A.device_name(q), name, A.device_name(x)))
    _check_strides(A.strides(q), qs, "q", A.contiguous_hint)
    _check_strides(A.strides(k), ks, kn, A.contiguous_hint)
    _check_strides(A.strides(v), vs, vn, A.contiguous_hint)
    if tuple(ks) != tuple(vs):
        raise ValueError("%s and %s must have the same shape (%s %s, %s %s)"
                         % (kn, vn, kn, tuple(ks), vn, tuple(vs)))
    if qs[-1] != ks[-1]:
        raise ValueError("q and %s must have the same head dimension (q %d, %s %d)"
                         % (kn, qs[-1], kn, ks[-1]))
    if not varlen and not paged and not cache and qs[0] != ks[0]:
        raise ValueError("q and k must have the same batch size (q %d, k %d)" % (qs[0], ks[0]))
    if ks[-2] > 0 and qs[-2] % ks[-2]:
        raise ValueError("the number of q heads (%d) must be a multiple of the number of "
                         "k/v heads (%d)" % (qs[-2], ks[-2]))
    return dt, dev


def _check_strides(st, shape, name, hint):
    if 0 in tuple(shape):  # no elements: strides say nothing (numpy gives them all 0)
        return
    if shape[-1] > 1 and st[-1] != 1:
        raise ValueError("%s: the last dimension (headdim) must be contiguous (stride 1), "
                         "got strides %s; pass %s" % (name, tuple(st), hint % name))
    for s in st:
        if s < 0:
            raise ValueError("%s: negative strides are not supported (strides %s); pass %s"
                             % (name, tuple(st), hint % name))


def check_like(A, x, name, ref, ref_name):
    """x must be an array like ref: same kind, shape, dtype, device, unit last stride."""
    if not A.is_array(x):
        raise TypeError("%s must be a %s (got %s)" % (name, A.array_name, type(x).__name__))
    xs, rs = tuple(A.shape(x)), tuple(A.shape(ref))
    if xs != rs:
        raise ValueError("%s must have the shape of %s %s, got %s" % (name, ref_name, rs, xs))
    xdt, rdt = A.dtype_name(x), A.dtype_name(ref)
    if xdt != rdt:
        raise TypeError("%s must have the dtype of %s (%s), got %s" % (name, ref_name, rdt, xdt))
    if A.device(x) != A.device(ref):
        raise ValueError("%s must be on the device of %s (%s), got %s"
                         % (name, ref_name, A.device_name(ref), A.device_name(x)))
    _check_strides(A.strides(x), xs, name, A.contiguous_hint)


def _aux(A, x, name, dev, kind):
    """cu_seqlens (int32), alibi slopes (float32), block mask (uint8): 1 or 2-D,
    on q's device, made contiguous of the wanted dtype (they are small)."""
    if x is None:
        return None
    if not A.is_array(x):
        raise TypeError("%s must be a %s (got %s)" % (name, A.array_name, type(x).__name__))
    if A.device(x) != dev:
        raise ValueError("%s must be on the same device as q (%s), got %s"
                         % (name, A.device_name_of(dev), A.device_name(x)))
    return A.aux_contiguous(x, kind, name)


def lse_shape(q_shape, varlen):
    if varlen:
        return (q_shape[1], q_shape[0])  # (heads, total_q)
    return (q_shape[0], q_shape[2], q_shape[1])  # (batch, heads, seqlen_q)


def descriptor(A, x, dt, varlen):
    shape = A.shape(x)
    st = A.strides(x)
    if varlen:
        return _lib.make_tensor(A.ptr(x), dt, (1,) + tuple(shape), (0, st[0], st[1]))
    return _lib.make_tensor(A.ptr(x), dt, shape, st[:3])


def _prepare(A, q, k, v, opts, cu_seqlens_q, cu_seqlens_k, alibi_slopes, block_mask, stream,
             seqused_k=None, block_table=None, num_splits=0, cache=False):
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen and (cu_seqlens_q is None or cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    paged = block_table is not None
    dt, dev = check_qkv(A, q, k, v, varlen, paged, cache)
    keep = []
    p = _lib.FaParams()
    p.device = int(dev[0])
    p.algorithm = opts.algorithm
    p.softmax_scale = opts.softmax_scale
    p.causal = int(opts.causal)
    p.window_enabled = int(opts.window_enabled)
    p.window_left = opts.window_left
    p.window_right = opts.window_right
    p.softcap = opts.softcap
    p.dropout_p = opts.dropout_p
    p.dropout_seed = opts.dropout_seed & 0xFFFFFFFFFFFFFFFF
    p.dropout_offset = opts.dropout_offset & 0xFFFFFFFFFFFFFFFF
    p.deterministic = int(opts.deterministic)
    p.num_threads = max(0, opts.num_threads)
    p.block_size_q = opts.block_size_q
    p.block_size_k = opts.block_size_k
    if opts.shard is not None:
        p.shard_enabled = 1
        p.shard_q_offset, p.shard_k_offset = opts.shard
    p.stream = stream
    qs = A.shape(q)
    num_seqs = qs[0]
    if varlen:
        cq = _aux(A, cu_seqlens_q, "cu_seqlens_q", dev, "int32")
        ck = _aux(A, cu_seqlens_k, "cu_seqlens_k", dev, "int32")
        for name, c in (("cu_seqlens_q", cq), ("cu_seqlens_k", ck)):
            if len(A.shape(c)) != 1 or A.shape(c)[0] < 2:
                raise ValueError("%s must be 1-D with batch_size + 1 >= 2 entries, got shape %s"
                                 % (name, tuple(A.shape(c))))
        if A.shape(cq)[0] != A.shape(ck)[0]:
            raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length (%d, %d)"
                             % (A.shape(cq)[0], A.shape(ck)[0]))
        num_seqs = A.shape(cq)[0] - 1
        p.cu_seqlens_q = A.ptr(cq)
        p.cu_seqlens_k = A.ptr(ck)
        p.num_seqs = num_seqs
        keep += [cq, ck]
    if alibi_slopes is not None:
        a = _aux(A, alibi_slopes, "alibi_slopes", dev, "float32")
        hq = qs[-2]
        ash = tuple(A.shape(a))
        if ash == (hq,):
            p.alibi_stride_batch = 0
        elif ash == (num_seqs, hq):
            p.alibi_stride_batch = hq
        else:
            raise ValueError("alibi_slopes must have shape (nheads,) = (%d,) or (batch_size, "
                             "nheads) = (%d, %d), got %s" % (hq, num_seqs, hq, ash))
        p.alibi_slopes = A.ptr(a)
        keep.append(a)
    if block_mask is not None:
        m = _aux(A, block_mask, "block_mask", dev, "uint8")
        sh = tuple(A.shape(m))
        hq = qs[-2]
        bq, bk = opts.block_size_q, opts.block_size_k
        if bq < 1 or bk < 1:
            raise ValueError("block_mask needs block_size=(block_q, block_k), the query rows "
                             "and keys each mask entry covers (got block_size (%d, %d))"
                             % (bq, bk))
        # rows the mask must cover: the sequence length (varlen: the total, a bound)
        nq = qs[0] if varlen else qs[1]
        nk = A.shape(k)[0] if varlen and not paged else A.shape(k)[1]
        need = (-(-nq // bq), -(-nk // bk))
        if (len(sh) != 4 or sh[0] not in (1, num_seqs) or sh[1] not in (1, hq)
                or sh[2] < need[0] or sh[3] < need[1]):
            raise ValueError("block_mask must have shape (batch_size or 1, nheads or 1, >= %d "
                             "query blocks, >= %d key blocks), got %s" % (need[0], need[1], sh))
        p.block_mask_stride_row = sh[3]
        p.block_mask_stride_head = 0 if sh[1] == 1 else sh[2] * sh[3]
        p.block_mask_stride_batch = 0 if sh[0] == 1 else sh[1] * sh[2] * sh[3]
        p.block_mask = A.ptr(m)
        keep.append(m)
    if seqused_k is not None:
        u = _aux(A, seqused_k, "seqused_k", dev, "int32")
        if tuple(A.shape(u)) != (num_seqs,):
            raise ValueError("seqused_k must have shape (batch_size,) = (%d,), got %s"
                             % (num_seqs, tuple(A.shape(u))))
        p.seqused_k = A.ptr(u)
        keep.append(u)
    if paged:
        t = _aux(A, block_table, "block_table", dev, "int32")
        sh = tuple(A.shape(t))
        if len(sh) != 2 or sh[0] != num_seqs or sh[1] < 1:
            raise ValueError("block_table must have shape (batch_size, max_num_blocks_per_seq) "
                             "= (%d, >= 1), got %s" % (num_seqs, sh))
        p.block_table = A.ptr(t)
        p.block_table_stride = sh[1]
        p.max_pages_per_seq = sh[1]
        keep.append(t)
    num_splits = operator.index(num_splits or 0)
    if not 0 <= num_splits <= 128:
        raise ValueError("num_splits must be in [0, 128] (0: chosen by the library), got %d"
                         % num_splits)
    p.num_splits = num_splits
    return p, dt, dev, varlen, keep


def _empty_problem(A, q, k, varlen, paged=False):
    """0: normal; 1: no query rows (empty output); 2: no keys (every row masked). A paged
    problem's keys are in its table: the library sees it whatever k's shape."""
    qs, ks = A.shape(q), A.shape(k)
    if varlen:
        if qs[0] == 0 or qs[1] == 0:
            return 1
        return 2 if ks[0] == 0 and not paged else 0
    if qs[0] == 0 or qs[1] == 0 or qs[2] == 0:
        return 1
    return 2 if ks[1] == 0 and not paged else 0


def forward(A, q, k, v, opts, cu_seqlens_q=None, cu_seqlens_k=None, alibi_slopes=None,
            block_mask=None, stream=None, seqused_k=None, block_table=None, num_splits=0):
    """Returns (out, lse): out like q, lse float32 (batch, heads, seqlen_q) or, for
    variable-length batches, (heads, total_q). seqused_k: int32 (batch,), the keys each
    sequence uses (a KV cache). block_table: int32 (batch, max_num_blocks_per_seq), k and
    v then page pools (num_blocks, page_block_size, heads_k, headdim)."""
    p, dt, dev, varlen, keep = _prepare(A, q, k, v, opts, cu_seqlens_q, cu_seqlens_k,
                                        alibi_slopes, block_mask, stream, seqused_k,
                                        block_table, num_splits)
    paged = block_table is not None
    out = A.empty_like(q)
    lse = A.empty(lse_shape(A.shape(q), varlen), "float32", q)
    empty = _empty_problem(A, q, k, varlen, paged)
    if empty:
        if empty == 2:
            A.fill_(out, 0.0)
            A.fill_(lse, float("-inf"))
        return out, lse
    tq = descriptor(A, q, dt, varlen)
    tk, tv = (descriptor(A, x, dt, varlen and not paged) for x in (k, v))
    to = descriptor(A, out, dt, varlen)
    _lib.forward(p, tq, tk, tv, to, A.ptr(lse), alloc=lambda n: A.workspace(n, q))
    del keep
    return out, lse


def _per_sequence(A, x, name, dev, batch):
    x = _aux(A, x, name, dev, "int32")
    if tuple(A.shape(x)) != (batch,):
        raise ValueError("%s must have shape (batch_size,) = (%d,), got %s"
                         % (name, batch, tuple(A.shape(x))))
    return x


def _rotary_table(A, t, name, q, dev):
    if not A.is_array(t):
        raise TypeError("%s must be a %s (got %s)" % (name, A.array_name, type(t).__name__))
    sh = tuple(A.shape(t))
    if len(sh) != 2 or sh[0] < 1 or sh[1] < 1:
        raise ValueError("%s must have shape (seqlen_ro, rotary_dim / 2), got %s" % (name, sh))
    if A.dtype_name(t) != A.dtype_name(q):
        raise TypeError("%s must have q's dtype (%s), got %s"
                        % (name, A.dtype_name(q), A.dtype_name(t)))
    if A.device(t) != dev:
        raise ValueError("%s must be on q's device (%s), got %s"
                         % (name, A.device_name(q), A.device_name(t)))
    st = A.strides(t)
    if sh[1] > 1 and st[1] != 1:
        raise ValueError("%s: the last dimension must be contiguous (stride 1), got strides "
                         "%s; pass %s" % (name, st, A.contiguous_hint % name))
    if st[0] < 0:
        raise ValueError("%s: negative strides are not supported (strides %s)" % (name, st))
    return sh, st


def forward_kvcache(A, q, k_cache, v_cache, opts, cache_seqlens, k=None, v=None,
                    rotary_cos=None, rotary_sin=None, cache_batch_idx=None, cache_leftpad=None,
                    block_table=None, alibi_slopes=None, rotary_interleaved=True, num_splits=0,
                    stream=None):
    """fa_forward_kvcache: writes k and v (rotated with rotary_cos/_sin) into the caches
    at rows cache_seqlens[b]... in place, then returns (out, lse) of q (rotated) attending
    to each batch entry's cache rows [cache_leftpad[b], cache_seqlens[b] + seqlen_new)."""
    p, dt, dev, _, keep = _prepare(A, q, k_cache, v_cache, opts, None, None, alibi_slopes,
                                   None, stream, None, block_table, num_splits, cache=True)
    if p.dropout_p:
        raise ValueError("flash_attn_with_kvcache is inference only: dropout_p must be 0")
    batch = A.shape(q)[0]
    kv = _lib.FaKvcache()
    seqlens = _per_sequence(A, cache_seqlens, "cache_seqlens", dev, batch)
    kv.cache_seqlens = A.ptr(seqlens)
    keep.append(seqlens)
    if cache_batch_idx is not None:
        idx = _per_sequence(A, cache_batch_idx, "cache_batch_idx", dev, batch)
        kv.cache_batch_idx = A.ptr(idx)
        keep.append(idx)
    if cache_leftpad is not None:
        pad = _per_sequence(A, cache_leftpad, "cache_leftpad", dev, batch)
        kv.cache_leftpad = A.ptr(pad)
        keep.append(pad)
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    if k is not None:
        for name, x in (("k", k), ("v", v)):
            if not A.is_array(x):
                raise TypeError("%s must be a %s (got %s)"
                                % (name, A.array_name, type(x).__name__))
            if len(A.shape(x)) != 4:
                raise ValueError("%s must have 4 dimensions (batch, seqlen_new, nheads_k, "
                                 "headdim), got shape %s" % (name, tuple(A.shape(x))))
        check_like(A, v, "v", k, "k")
        if A.dtype_name(k) != A.dtype_name(q):
            raise TypeError("k and v must have q's dtype (%s), got %s"
                            % (A.dtype_name(q), A.dtype_name(k)))
        if A.device(k) != dev:
            raise ValueError("k and v must be on q's device (%s), got %s"
                             % (A.device_name(q), A.device_name(k)))
        if A.shape(k)[1] > 0:  # no new rows: nothing appended
            for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
                if not A.writable(c):
                    raise ValueError("%s must be writable: the new keys and values are "
                                     "written into it" % name)
            tkn, tvn = descriptor(A, k, dt, False), descriptor(A, v, dt, False)
            kv.k_new = ctypes.pointer(tkn)
            kv.v_new = ctypes.pointer(tvn)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        csh, cst = _rotary_table(A, rotary_cos, "rotary_cos", q, dev)
        ssh, sst = _rotary_table(A, rotary_sin, "rotary_sin", q, dev)
        if csh != ssh or cst[0] != sst[0]:
            raise ValueError("rotary_cos and rotary_sin must have the same shape and row "
                             "stride (rotary_cos %s, stride %d; rotary_sin %s, stride %d)"
                             % (csh, cst[0], ssh, sst[0]))
        if k is None:
            raise ValueError("rotary_cos: rotary embedding needs k and v (the new keys it "
                             "rotates)")
        kv.rotary_cos = A.ptr(rotary_cos)
        kv.rotary_sin = A.ptr(rotary_sin)
        kv.rotary_seqlen = csh[0]
        kv.rotary_dim = 2 * csh[1]
        kv.rotary_stride = cst[0]
        kv.rotary_interleaved = int(bool(rotary_interleaved))
    out = A.empty_like(q)
    lse = A.empty(lse_shape(A.shape(q), False), "float32", q)
    if batch == 0 or (A.shape(q)[1] == 0 and k is None):
        return out, lse  # no batch entry, or no query row and nothing to append
    tq, to = descriptor(A, q, dt, False), descriptor(A, out, dt, False)
    tk, tv = descriptor(A, k_cache, dt, False), descriptor(A, v_cache, dt, False)
    _lib.forward_kvcache(p, kv, tq, tk, tv, to, A.ptr(lse),
                         alloc=lambda n: A.workspace(n, q))
    del keep
    return out, lse


def backward(A, dout, q, k, v, out, lse, opts, cu_seqlens_q=None, cu_seqlens_k=None,
             alibi_slopes=None, block_mask=None, stream=None):
    """Returns (dq, dk, dv) for the forward that produced out and lse."""
    p, dt, dev, varlen, keep = _prepare(A, q, k, v, opts, cu_seqlens_q, cu_seqlens_k,
                                        alibi_slopes, block_mask, stream)
    check_like(A, out, "out", q, "q")
    check_like(A, dout, "dout", q, "q")
    want = lse_shape(A.shape(q), varlen)
    if not A.is_array(lse) or tuple(A.shape(lse)) != want:
        raise ValueError("lse must be the forward's log-sum-exp, float32 of shape %s, got %s"
                         % (want, tuple(A.shape(lse)) if A.is_array(lse) else type(lse)))
    if A.device(lse) != dev:
        raise ValueError("lse must be on the same device as q")
    lse = A.aux_contiguous(lse, "float32", "lse")
    dq, dk, dv = A.empty_like(q), A.empty_like(k), A.empty_like(v)
    if _empty_problem(A, q, k, varlen):
        for g in (dq, dk, dv):
            A.fill_(g, 0.0)
        return dq, dk, dv
    tq, tk, tv, to, tdo = (descriptor(A, x, dt, varlen) for x in (q, k, v, out, dout))
    tdq, tdk, tdv = (descriptor(A, x, dt, varlen) for x in (dq, dk, dv))
    _lib.backward(p, tq, tk, tv, to, tdo, A.ptr(lse), tdq, tdk, tdv,
                  alloc=lambda n: A.workspace(n, q))
    del keep
    return dq, dk, dv


DEVICE_NAMES = {Device.CPU: "cpu", Device.CUDA: "cuda"}
__all__ = ["Options", "make_options", "forward", "backward", "DType"]
