"""Context parallelism: ring attention over torch.distributed.

Each rank of a process group holds a shard of one long sequence: q, k, v of shape
(batch, seqlen_local, heads, headdim), all ranks the same seqlen_local. The K/V shards
travel around the ring (rank r sends to r + 1 and receives from r - 1, as point-to-point
operations running while this step's attention runs); every rank attends its queries to
each block in turn and merges the partial results by their log-sum-exp into a float32
accumulator. The backward pass sends K/V around once more, with the dK/dV accumulators of
each block travelling behind it and arriving at their owner after the last step.

    q = flashattn.distributed.shard(q_full, group)     # this rank's part (zig-zag)
    out = flashattn.distributed.ring_flash_attn_func(q, k, v, group=group, causal=True)
    out_full = flashattn.distributed.unshard(out, group)

Layouts (how the ranks' shards tile the sequence, `layout=`):
  "zigzag"      the sequence cut into 2W chunks; rank r holds chunks r and 2W - 1 - r, so
                under a causal mask every rank does the same work (the default);
  "contiguous"  rank r holds positions [r n, (r + 1) n).

Masks, ALiBi and dropout are those of the whole sequence: each block is computed at its
positions (fa_params.shard_enabled), so the result equals flash_attn_func on the whole
sequence (dropout: with the same dropout_seed), and steps whose blocks are fully masked
(causal, sliding window) are skipped. Docs: docs/DISTRIBUTED.md.
"""
import torch
import torch.distributed as dist

from . import _core
from . import _ops

__all__ = ["ring_flash_attn_func", "shard", "unshard", "shard_positions", "LAYOUTS"]

LAYOUTS = ("zigzag", "contiguous")

# ---- the one adapter onto the library's attention (retarget here) -----------------------
# (out, lse) and (dq, dk, dv) of one block; `shard` = (q_offset, k_offset) places q and k
# in the sequence (None: plain call). lse is (batch, heads, rows), float32.


def _attn_kw(a, causal, shard):
    return dict(softmax_scale=a.scale or None, causal=causal,
                window_size=(a.window[1], a.window[2]) if a.window[0] else (-1, -1),
                softcap=a.softcap, alibi_slopes=a.alibi, dropout_p=a.dropout_p,
                dropout_seed=a.seed, dropout_offset=a.offset, deterministic=a.deterministic,
                shard=shard)


def _attn_fwd(q, k, v, a, causal, shard):
    return _ops.fwd(q, k, v, **_attn_kw(a, causal, shard))


def _attn_bwd(dout, q, k, v, out, lse, a, causal, shard):
    return _ops.bwd(dout, q, k, v, out, lse, **_attn_kw(a, causal, shard))


# ---- layout: where each rank's rows sit in the sequence ------------------------------------


def _chunks(layout, n, rank, world):
    """[(first local row, rows, first position)] of rank's shard of n rows."""
    if layout == "contiguous":
        return [(0, n, rank * n)]
    c = n // 2
    return [(0, c, rank * c), (c, c, (2 * world - 1 - rank) * c)]


def shard_positions(seqlen_local, rank, world_size, layout="zigzag"):
    """Positions in the whole sequence of the rows of `rank`'s shard (a LongTensor)."""
    _check_layout(layout, seqlen_local)
    return torch.cat([torch.arange(p, p + m) for _, m, p in
                      _chunks(layout, seqlen_local, rank, world_size)])


def _check_layout(layout, n):
    if layout not in LAYOUTS:
        raise ValueError("layout must be one of %s (got %r)" % (LAYOUTS, layout))
    if layout == "zigzag" and n % 2:
        raise ValueError("layout 'zigzag' needs an even seqlen_local (two chunks per rank), "
                         "got %d" % n)


def _group_size_rank(group):
    return dist.get_world_size(group), dist.get_rank(group)


def shard(x, group=None, dim=1, layout="zigzag"):
    """This rank's part of x (the whole sequence along `dim`), contiguous. The sequence
    length must be a multiple of the world size (zigzag: of twice the world size)."""
    world, rank = _group_size_rank(group)
    n = x.shape[dim]
    parts = 2 * world if layout == "zigzag" else world
    if layout not in LAYOUTS:
        raise ValueError("layout must be one of %s (got %r)" % (LAYOUTS, layout))
    if n % parts:
        raise ValueError("shard: the sequence length %d along dim %d is not a multiple of %d "
                         "(layout %r, %d ranks)" % (n, dim, parts, layout, world))
    pieces = [x.narrow(dim, p, m) for _, m, p in _chunks(layout, 2 * n // parts if
                                                          layout == "zigzag" else n // parts,
                                                          rank, world)]
    return torch.cat(pieces, dim).contiguous()


def unshard(x, group=None, dim=1, layout="zigzag"):
    """The whole sequence from every rank's part (all_gather; the inverse of shard)."""
    world, _ = _group_size_rank(group)
    n = x.shape[dim]
    _check_layout(layout, n)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    total = n * world
    out = x.new_empty(x.shape[:dim] + (total,) + x.shape[dim + 1:])
    for r, part in enumerate(parts):
        for first, m, p in _chunks(layout, n, r, world):
            out.narrow(dim, p, m).copy_(part.narrow(dim, first, m))
    return out


# ---- the schedule: which blocks of a step are computed, and how ----------------------------


class _Args:
    """The resolved options of one ring call, shared by forward and backward."""

    __slots__ = ("scale", "window", "softcap", "alibi", "dropout_p", "seed", "offset",
                 "deterministic", "threads", "causal", "layout", "positional")


class _Piece:
    """Rows [q0, q0 + nq) of this rank against rows [k0, k0 + nk) of the block held:
    causal (the diagonal of a self step) or full; shard = positions, or None."""

    __slots__ = ("q0", "nq", "k0", "nk", "causal", "shard")

    def __init__(self, q0, nq, k0, nk, causal, shard):
        self.q0, self.nq, self.k0, self.nk, self.causal, self.shard = q0, nq, k0, nk, causal, shard


def _visible(a, qp, nq, kp, nk):
    """Whether any query at positions [qp, qp + nq) sees a key at [kp, kp + nk)."""
    _, left, right = a.window
    if a.causal and (right < 0 or right > 0):
        right = 0
    if right >= 0 and qp + nq - 1 + right < kp:
        return False
    if left >= 0 and qp - left > kp + nk - 1:
        return False
    return True


def _plan(a, n, rank, src, world):
    """The pieces of the step where this rank holds the K/V block of rank src."""
    mine = _chunks(a.layout, n, rank, world)
    theirs = _chunks(a.layout, n, src, world)
    if not a.positional:
        # masks are at most causal: a chunk pair is full (keys before), diagonal or hidden
        if not a.causal:
            return [_Piece(0, n, 0, n, False, None)]
        if src == rank:  # positions rise along the local rows: causal over the whole shard
            return [_Piece(0, n, 0, n, True, None)]
        rows = [(q0, m) for q0, m, qp in mine if any(kp < qp for _, _, kp in theirs)]
        keys = [(k0, m) for k0, m, kp in theirs if any(kp < qp for _, _, qp in mine)]
        if not rows or not keys:
            return []
        # the visible pairs form one rectangle of adjacent local rows and keys
        q0, k0 = rows[0][0], keys[0][0]
        return [_Piece(q0, sum(m for _, m in rows), k0, sum(m for _, m in keys), False, None)]
    return [_Piece(q0, mq, k0, mk, a.causal, (qp, kp))
            for q0, mq, qp in mine for k0, mk, kp in theirs if _visible(a, qp, mq, kp, mk)]


# ---- the ring ------------------------------------------------------------------------------


class _Ring:
    """Point-to-point exchanges with the ring's neighbours (the next rank receives what
    this rank sends). All ranks issue the same sequence of exchanges."""

    def __init__(self, group):
        self.group = group
        self.world, self.rank = _group_size_rank(group)
        glob = dist.get_global_rank if group is not None else (lambda g, r: r)
        self.next = glob(group, (self.rank + 1) % self.world)
        self.prev = glob(group, (self.rank - 1) % self.world)

    def exchange(self, send, recv, backward=False):
        """Starts sending each tensor of send to the next rank and receiving each of recv
        from the previous one (backward: to the previous, from the next); returns the
        works to wait on."""
        to, frm = (self.prev, self.next) if backward else (self.next, self.prev)
        ops = [dist.P2POp(dist.isend, t, to, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, frm, self.group) for t in recv]
        return dist.batch_isend_irecv(ops)


# Benchmarks only: False skips every transfer (each step reuses the local K/V), which
# times the compute alone; results are then wrong.
COMMUNICATE = True


def _wait(works):
    for w in works or ():
        w.wait()


class _Sum:
    """A sum of tensors over ranges of rows (dim 1), rounded once: it keeps the terms'
    dtype while it holds one term, adds the last term in that dtype (torch adds 16-bit
    floats in float32 and rounds once), and goes to float32 when more terms follow."""

    def __init__(self, like):
        self.like, self.t = like, None

    def add(self, r0, x, last=False):
        rows = slice(r0, r0 + x.shape[1])
        if self.t is None:
            if r0 == 0 and x.shape[1] == self.like.shape[1]:
                self.t = x
            else:
                self.t = torch.zeros_like(self.like, dtype=x.dtype)
                self.t[:, rows] = x
            return
        if not last and self.t.dtype != torch.float32:
            self.t = self.t.float()
        self.t[:, rows] += x

    def result(self, dtype):
        return torch.zeros_like(self.like, dtype=dtype) if self.t is None else self.t.to(dtype)


def _merge(acc, lse_acc, o, lse, last):
    """(acc, lse_acc) rows <- their log-sum-exp merge with (o, lse). acc is float32, or q's
    dtype when it holds one block's out and this merge is the last (rounded once). Rows
    fully masked in both keep out 0, lse -inf."""
    new = torch.logaddexp(lse_acc, lse)
    w_acc = torch.exp(lse_acc - new).nan_to_num_(0.0).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(lse - new).nan_to_num_(0.0).transpose(1, 2).unsqueeze(-1)
    if acc.dtype == torch.float32:
        acc.mul_(w_acc).addcmul_(o, w_new)
    else:  # in float32, rounded once
        acc.copy_(torch.mul(acc, w_acc).addcmul_(o, w_new))
    lse_acc.copy_(new)


def _rows_lse(lse, q0, nq):
    return lse[:, :, q0:q0 + nq].contiguous()


def _steps(a, n, ring, backward=False):
    """[(step, piece)] of every step, in order. The forward's step t holds the K/V block of
    rank r - t; the backward's that of rank r + 1 + t (the forward's last block first,
    this rank's own last)."""
    src = (lambda t: (ring.rank + 1 + t) % ring.world) if backward else (
        lambda t: (ring.rank - t) % ring.world)
    return [(t, pc) for t in range(ring.world)
            for pc in _plan(a, n, ring.rank, src(t), ring.world)]


def _ring_forward(q, k, v, a, ring):
    b, n, h, d = q.shape
    steps = _steps(a, n, ring)
    acc, lse_acc, kv, i = None, None, (k, v), 0
    for t in range(ring.world):
        works, nxt = None, None
        if t + 1 < ring.world and COMMUNICATE:
            nxt = (torch.empty_like(k), torch.empty_like(v))
            works = ring.exchange(kv, nxt)
        while i < len(steps) and steps[i][0] == t:
            pc, i = steps[i][1], i + 1
            rows = slice(pc.q0, pc.q0 + pc.nq)
            o, lse = _attn_fwd(q[:, rows], kv[0][:, pc.k0:pc.k0 + pc.nk],
                               kv[1][:, pc.k0:pc.k0 + pc.nk], a, pc.causal, pc.shard)
            if acc is None and pc.nq == n:
                acc, lse_acc = o, lse
                continue
            if acc is None:
                acc = q.new_zeros((b, n, h, d), dtype=torch.float32)
                lse_acc = q.new_full((b, h, n), float("-inf"), dtype=torch.float32)
            elif acc.dtype != torch.float32 and i < len(steps):
                acc = acc.float()
            _merge(acc[:, rows], lse_acc[:, :, rows], o, lse, i == len(steps))
        _wait(works)
        if nxt is not None:
            kv = nxt
    # kv: the block of rank r + 1, which the backward takes first
    if acc is None:  # every block hidden (a window shorter than the gap): rows masked
        acc = torch.zeros_like(q)
        lse_acc = q.new_full((b, h, n), float("-inf"), dtype=torch.float32)
    return acc.to(q.dtype), lse_acc, kv


def _ring_backward(dout, q, k, v, kv, out, lse, a, ring):
    """The forward's steps in reverse ring order: step t holds the K/V block of rank
    r + 1 + t, starting from kv (the forward's last block: no transfer) and ending with
    this rank's own. Each block's dK/dV sums travel with it, from rank r + 1 to r, and
    the last rank they reach owns the block: no transfer after the last step."""
    n = q.shape[1]
    steps = _steps(a, n, ring, backward=True)
    dq = _Sum(q)
    i, last = 0, ring.world - 1
    dkv_in, dkv_works = None, None  # the sums of the block held, on their way here
    for t in range(ring.world):
        works, nxt = None, None
        if t + 1 < last and COMMUNICATE:
            nxt = (torch.empty_like(k), torch.empty_like(v))
            works = ring.exchange(kv, nxt, backward=True)
        elif t + 1 == last or not COMMUNICATE:
            nxt = (k, v)  # this rank's own block, last
        mine = []
        while i < len(steps) and steps[i][0] == t:
            pc, i = steps[i][1], i + 1
            rq = slice(pc.q0, pc.q0 + pc.nq)
            rk = slice(pc.k0, pc.k0 + pc.nk)
            gq, gk, gv = _attn_bwd(dout[:, rq], q[:, rq], kv[0][:, rk], kv[1][:, rk],
                                   out[:, rq], _rows_lse(lse, pc.q0, pc.nq), a, pc.causal,
                                   pc.shard)
            dq.add(pc.q0, gq, last=i == len(steps))
            mine.append((pc.k0, gk, gv))
        # this block's sums: what came from the ranks before, then this rank's terms
        dk, dv = _Sum(k), _Sum(v)
        if dkv_works is not None:
            _wait(dkv_works)
            dk.add(0, dkv_in[0]), dv.add(0, dkv_in[1])
        for j, (k0, gk, gv) in enumerate(mine):
            final = t == last and j == len(mine) - 1
            dk.add(k0, gk, last=final), dv.add(k0, gv, last=final)
        if t < last:  # on to the previous rank, in the sums' dtype
            send = (dk.result(dk.t.dtype if dk.t is not None else k.dtype),
                    dv.result(dv.t.dtype if dv.t is not None else v.dtype))
            if COMMUNICATE:
                dkv_in = tuple(torch.empty_like(x) for x in send)
                dkv_works = ring.exchange(send, dkv_in, backward=True)
            else:
                dkv_in, dkv_works = None, None
        _wait(works)
        if nxt is not None:
            kv = nxt
    return dq.result(q.dtype), dk.result(k.dtype), dv.result(v.dtype)


class _RingFlashAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, a, ring):
        out, lse, kv = _ring_forward(q, k, v, a, ring)
        # the last block held (rank r + 1's K/V) is the backward's first
        ctx.save_for_backward(q, k, v, kv[0], kv[1], out, lse)
        ctx.a, ctx.ring = a, ring
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, k1, v1, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, (k1, v1), out, lse, ctx.a,
                                    ctx.ring)
        return dq, dk, dv, None, None


def _shared_seed(dropout_seed, device, group):
    """Dropout's seed, the same on every rank: the caller's, or rank 0's draw."""
    if dropout_seed is not None:
        return int(dropout_seed)
    s = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        s = s.to(device)
    dist.broadcast(s, src=dist.get_global_rank(group, 0) if group is not None else 0,
                   group=group)
    return int(s.item())


def ring_flash_attn_func(q, k, v, group=None, causal=False, softmax_scale=None,
                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                         deterministic=False, layout="zigzag", dropout_seed=None,
                         dropout_offset=0, return_lse=False):
    """Ring attention of this rank's shard: flash_attn_func of the whole sequence,
    restricted to this rank's query rows.

    q: (batch, seqlen_local, nheads, headdim); k, v: (batch, seqlen_local, nheads_k,
    headdim), every rank of `group` (default: the world) with the same shapes, its
    shard laid out as `layout` says (see shard()). causal, window_size, softcap,
    alibi_slopes and dropout_p are those of flash_attn_func, applied at the whole
    sequence's positions. dropout_seed: the same on every rank (None: rank 0 draws one
    and broadcasts it); dropout_offset as in fa_params. deterministic: bitwise
    reproducible gradients. Returns out (like q), and with return_lse also the float32
    log-sum-exp (batch, nheads, seqlen_local). Differentiable in q, k and v.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError("%s must be a 4-D torch.Tensor (batch, seqlen_local, heads, "
                             "headdim)" % name)
    if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError("q %s, k %s and v %s: k and v must have q's batch, seqlen_local and "
                         "headdim (each rank holds the same positions of all three)"
                         % (tuple(q.shape), tuple(k.shape), tuple(v.shape)))
    if q.shape[2] % k.shape[2]:
        raise ValueError("the number of q heads (%d) must be a multiple of the number of "
                         "k/v heads (%d)" % (q.shape[2], k.shape[2]))
    _check_layout(layout, q.shape[1])
    opts = _core.make_options(softmax_scale, causal, window_size, softcap, dropout_p,
                              deterministic)
    ring = _Ring(group)
    a = _Args()
    a.scale = opts.softmax_scale
    a.window = (opts.window_enabled, opts.window_left, opts.window_right)
    a.softcap = opts.softcap
    a.dropout_p = opts.dropout_p
    a.deterministic = opts.deterministic
    a.causal = bool(causal)
    a.layout = layout
    a.alibi = alibi_slopes
    if alibi_slopes is not None and alibi_slopes.dim() != 1:
        raise ValueError("alibi_slopes must have shape (nheads,) for ring attention")
    a.seed = _shared_seed(dropout_seed, q.device, group) if a.dropout_p > 0 else 0
    a.offset = int(dropout_offset)
    # positions matter to a window, ALiBi and dropout; plain causal needs only the order
    a.positional = bool(opts.window_enabled or a.alibi is not None or a.dropout_p > 0)
    if a.dropout_p > 0 and layout == "zigzag" and (q.shape[1] // 2) % 4:
        raise ValueError("dropout with layout 'zigzag' needs seqlen_local a multiple of 8 "
                         "(each chunk a multiple of 4 keys: one Philox draw covers four), "
                         "got %d" % q.shape[1])
    if a.dropout_p > 0 and layout == "contiguous" and q.shape[1] % 4:
        raise ValueError("dropout needs seqlen_local a multiple of 4 (one Philox draw covers "
                         "four keys), got %d" % q.shape[1])
    out, lse = _RingFlashAttn.apply(q.contiguous(), k.contiguous(), v.contiguous(), a, ring)
    return (out, lse) if return_lse else out
