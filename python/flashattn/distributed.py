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

from . import _check_margin, _core
from . import _ops
from ._lib import Status, UnsupportedError

__all__ = ["ring_flash_attn_func", "ring_flash_attn_varlen_func", "shard", "unshard",
           "shard_positions", "LAYOUTS"]

LAYOUTS = ("zigzag", "contiguous")

# ---- the one adapter onto the library's attention (retarget here) -----------------------
# (out, lse) and (dq, dk, dv) of one block; `shard` = (q_offset, k_offset) places q and k
# in the sequence (None: plain call). lse is (batch, heads, rows), float32.


# Packed sequences (cu = (cu_seqlens_q, cu_seqlens_k)) travel as (1, total, heads, headdim)
# with lse (1, heads, total), so that the ring below treats both forms alike.


def _attn_kw(a, causal, shard, cu, beside):
    """beside: a transfer is in flight, whose kernels get a.sm_margin SMs."""
    return dict(softmax_scale=a.scale or None, causal=causal,
                window_size=(a.window[1], a.window[2]) if a.window[0] else (-1, -1),
                softcap=a.softcap, alibi_slopes=a.alibi, dropout_p=a.dropout_p,
                dropout_seed=a.seed, dropout_offset=a.offset, deterministic=a.deterministic,
                shard=shard, cu_seqlens_q=None if cu is None else cu[0],
                cu_seqlens_k=None if cu is None else cu[1],
                sm_margin=a.sm_margin if beside else 0)


def _attn_fwd(q, k, v, a, causal, shard, cu=None, beside=False):
    kw = _attn_kw(a, causal, shard, cu, beside)
    if cu is None:
        return _ops.fwd(q, k, v, **kw)
    out, lse = _ops.fwd(q[0], k[0], v[0], **kw)
    return out[None], lse[None]


def _attn_bwd(dout, q, k, v, out, lse, a, causal, shard, cu=None, beside=False):
    kw = _attn_kw(a, causal, shard, cu, beside)
    if cu is None:
        return _ops.bwd(dout, q, k, v, out, lse, **kw)
    grads = _ops.bwd(dout[0], q[0], k[0], v[0], out[0], lse[0], **kw)
    return tuple(g[None] for g in grads)


# ---- layout: where each rank's rows sit in the sequence ------------------------------------


def _chunks(layout, n, rank, world):
    """[(first local row, rows, first position)] of rank's shard of n rows."""
    if layout == "contiguous":
        return [(0, n, rank * n)]
    c = n // 2
    return [(0, c, rank * c), (c, c, (2 * world - 1 - rank) * c)]


def _offsets(cu_seqlens, name="cu_seqlens"):
    """A packed batch's offsets (a 1-D integer tensor or a sequence of ints) as ints."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
            raise ValueError("%s must be a 1-D integer tensor, got %s of shape %s"
                             % (name, cu_seqlens.dtype, tuple(cu_seqlens.shape)))
        cu = [int(x) for x in cu_seqlens.tolist()]
    else:
        cu = [int(x) for x in cu_seqlens]
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError("%s must start at 0 and never decrease, got %s" % (name, cu[:8]))
    return cu


def _pieces(layout, cu, rank, world):
    """[(first local row, rows, first row in the whole batch, first position in its
    sequence)] of rank's part of a packed batch with whole-batch offsets cu (one sequence:
    [0, n]). Every sequence is sharded alike, so rank's part is itself a packed batch."""
    if layout not in LAYOUTS:
        raise ValueError("layout must be one of %s (got %r)" % (LAYOUTS, layout))
    parts = 2 * world if layout == "zigzag" else world
    out = []
    for s in range(len(cu) - 1):
        n = cu[s + 1] - cu[s]
        if n % parts:
            raise ValueError("the sequence length %d%s is not a multiple of %d (layout %r, %d "
                             "ranks)" % (n, " (sequence %d)" % s if len(cu) > 2 else "", parts,
                                         layout, world))
        for first, m, p in _chunks(layout, n // world, rank, world):
            out.append((cu[s] // world + first, m, cu[s] + p, p))
    return out


def shard_positions(seqlen_local, rank, world_size, layout="zigzag", cu_seqlens=None):
    """Positions in the whole sequence of the rows of `rank`'s shard (a LongTensor). With
    cu_seqlens (a packed batch's whole offsets), each row's position in its own sequence
    (seqlen_local is then not used)."""
    if cu_seqlens is not None:
        pieces = _pieces(layout, _offsets(cu_seqlens), rank, world_size)
        return torch.cat([torch.arange(p, p + m) for _, m, _, p in pieces] or
                         [torch.zeros(0, dtype=torch.long)])
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


def shard(x, group=None, dim=None, layout="zigzag", cu_seqlens=None):
    """This rank's part of x (the whole sequence along `dim`, default 1), contiguous. The
    sequence length must be a multiple of the world size (zigzag: of twice the world size).
    With cu_seqlens, x is a packed batch along `dim` (default 0) with those offsets: every
    sequence is cut alike and this rank's part is the packed batch of its pieces, with
    offsets cu_seqlens // world_size."""
    world, rank = _group_size_rank(group)
    dim = (0 if cu_seqlens is not None else 1) if dim is None else dim
    n = x.shape[dim]
    cu = _offsets(cu_seqlens) if cu_seqlens is not None else [0, n]
    if cu[-1] != n:
        raise ValueError("shard: cu_seqlens ends at %d but x has %d rows along dim %d"
                         % (cu[-1], n, dim))
    pieces = _pieces(layout, cu, rank, world)
    return torch.cat([x.narrow(dim, g, m) for _, m, g, _ in pieces], dim).contiguous()


def unshard(x, group=None, dim=None, layout="zigzag", cu_seqlens=None):
    """The whole sequence (or packed batch, with its whole cu_seqlens) from every rank's
    part (all_gather; the inverse of shard)."""
    world, _ = _group_size_rank(group)
    dim = (0 if cu_seqlens is not None else 1) if dim is None else dim
    n = x.shape[dim]
    if cu_seqlens is None:
        _check_layout(layout, n)
    cu = _offsets(cu_seqlens) if cu_seqlens is not None else [0, n * world]
    if cu[-1] != n * world:
        raise ValueError("unshard: cu_seqlens ends at %d but the %d parts hold %d rows"
                         % (cu[-1], world, n * world))
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    out = x.new_empty(x.shape[:dim] + (n * world,) + x.shape[dim + 1:])
    for r, part in enumerate(parts):
        for first, m, g, _ in _pieces(layout, cu, r, world):
            out.narrow(dim, g, m).copy_(part.narrow(dim, first, m))
    return out


# ---- the schedule: which blocks of a step are computed, and how ----------------------------


class _Args:
    """The resolved options of one ring call, shared by forward and backward."""

    __slots__ = ("scale", "window", "softcap", "alibi", "dropout_p", "seed", "offset",
                 "deterministic", "threads", "causal", "layout", "positional", "packed",
                 "sm_margin")


class _Piece:
    """Rows rq of this rank against rows rk of the block held (each a slice, or an index
    tensor, along the sequence axis): causal (the diagonal of a self step) or full;
    shard = positions, or None; cu = the packed form's (cu_seqlens_q, cu_seqlens_k) of
    the rows taken, or None; whole = rq is every row, in order."""

    __slots__ = ("rq", "rk", "causal", "shard", "cu", "whole")

    def __init__(self, rq, rk, causal, shard=None, cu=None, whole=False):
        self.rq, self.rk, self.causal, self.shard, self.cu = rq, rk, causal, shard, cu
        self.whole = whole


def _span(q0, nq, k0, nk, n, causal, shard=None):
    return _Piece(slice(q0, q0 + nq), slice(k0, k0 + nk), causal, shard,
                  whole=q0 == 0 and nq == n)


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
    if a.packed is not None:
        return a.packed.plan(a, rank, src)
    mine = _chunks(a.layout, n, rank, world)
    theirs = _chunks(a.layout, n, src, world)
    if not a.positional:
        # masks are at most causal: a chunk pair is full (keys before), diagonal or hidden
        if not a.causal:
            return [_span(0, n, 0, n, n, False)]
        if src == rank:  # positions rise along the local rows: causal over the whole shard
            return [_span(0, n, 0, n, n, True)]
        rows = [(q0, m) for q0, m, qp in mine if any(kp < qp for _, _, kp in theirs)]
        keys = [(k0, m) for k0, m, kp in theirs if any(kp < qp for _, _, qp in mine)]
        if not rows or not keys:
            return []
        # the visible pairs form one rectangle of adjacent local rows and keys
        q0, k0 = rows[0][0], keys[0][0]
        return [_span(q0, sum(m for _, m in rows), k0, sum(m for _, m in keys), n, False)]
    return [_span(q0, mq, k0, mk, n, a.causal, (qp, kp))
            for q0, mq, qp in mine for k0, mk, kp in theirs if _visible(a, qp, mq, kp, mk)]


class _Packed:
    """Packed sequences on the ring: every sequence sharded alike, so this rank's shard is
    itself a packed batch (local offsets cu, each sequence's rows in position order). Under
    zig-zag a sequence's local rows are its chunk r, then its chunk 2W - 1 - r: `first` and
    `second` index those halves of every sequence, packed by `cu_half`."""

    def __init__(self, cu, layout, device):
        self.layout = layout
        lens = [cu[s + 1] - cu[s] for s in range(len(cu) - 1)]
        self.cu = torch.tensor(cu, dtype=torch.int32, device=device)
        self.all = slice(0, cu[-1])
        if layout == "zigzag":
            half = [m // 2 for m in lens]
            self.cu_half = torch.tensor([0] + [sum(half[:s + 1]) for s in range(len(half))],
                                        dtype=torch.int32, device=device)
            self.first = torch.cat([torch.arange(cu[s], cu[s] + half[s]) for s in
                                    range(len(lens))] or [torch.zeros(0, dtype=torch.long)])
            self.second = torch.cat([torch.arange(cu[s] + half[s], cu[s + 1]) for s in
                                     range(len(lens))] or [torch.zeros(0, dtype=torch.long)])
            self.first, self.second = self.first.to(device), self.second.to(device)

    def plan(self, a, rank, src):
        """As _plan: masks at most causal (positions differ between sequences)."""
        every = _Piece(self.all, self.all, False, cu=(self.cu, self.cu), whole=True)
        if not a.causal:
            return [every]
        if src == rank:
            every.causal = True
            return [every]
        if self.layout == "contiguous":
            return [every] if src < rank else []
        if src < rank:  # both chunks see the block's first chunk, and not its second
            return [_Piece(self.all, self.first, False, cu=(self.cu, self.cu_half), whole=True)]
        # only the second chunk (the late one) sees the block, all of it
        return [_Piece(self.second, self.all, False, cu=(self.cu_half, self.cu))]


# ---- the ring ------------------------------------------------------------------------------


class _Ring:
    """Point-to-point exchanges with the ring's neighbours (the next rank receives what
    this rank sends). All ranks issue the same sequence of exchanges."""

    def __init__(self, group):
        self.group = group
        self.world, self.rank = _group_size_rank(group)
        glob = dist.get_global_rank if group is not None else (lambda g, r: r)
        self.next_index = (self.rank + 1) % self.world  # in the group
        self.next = glob(group, self.next_index)
        self.prev = glob(group, (self.rank - 1) % self.world)

    def exchange(self, send, recv, backward=False):
        """Starts sending each tensor of send to the next rank and receiving each of recv
        from the previous one (backward: to the previous, from the next); returns the
        works to wait on."""
        to, frm = (self.prev, self.next) if backward else (self.next, self.prev)
        ops = [dist.P2POp(dist.isend, t, to, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, frm, self.group) for t in recv]
        return dist.batch_isend_irecv(ops)


# SMs the Hopper kernels leave free while a K/V or dK/dV transfer is in flight: they keep
# one CTA per SM for a whole call, so NCCL's kernels, queued beside them, would otherwise
# start only when the call ends (fa_params.sm_margin).
SM_MARGIN = 8

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

    def add(self, rows, x, last=False):
        """Adds x to the rows `rows` (a slice, or an index tensor of distinct rows)."""
        if self.t is None:
            if isinstance(rows, slice) and (rows.start or 0) == 0 and \
                    x.shape[1] == self.like.shape[1]:
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


def _merge_rows(acc, lse_acc, rows, o, lse, last):
    """_merge into the rows `rows` (a slice: in place; an index: gathered and put back)."""
    if isinstance(rows, slice):
        _merge(acc[:, rows], lse_acc[:, :, rows], o, lse, last)
        return
    a, la = acc[:, rows], lse_acc[:, :, rows]
    _merge(a, la, o, lse, last)
    acc[:, rows], lse_acc[:, :, rows] = a, la


def _rows_lse(lse, rows):
    return lse[:, :, rows].contiguous()


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
            o, lse = _attn_fwd(q[:, pc.rq], kv[0][:, pc.rk], kv[1][:, pc.rk], a, pc.causal,
                               pc.shard, pc.cu, works is not None)
            if acc is None and pc.whole:
                acc, lse_acc = o, lse
                continue
            if acc is None:
                acc = q.new_zeros((b, n, h, d), dtype=torch.float32)
                lse_acc = q.new_full((b, h, n), float("-inf"), dtype=torch.float32)
            elif acc.dtype != torch.float32 and i < len(steps):
                acc = acc.float()
            _merge_rows(acc, lse_acc, pc.rq, o, lse, i == len(steps))
        _wait(works)
        if nxt is not None:
            kv = nxt
    # kv: the block of rank r + 1, which the backward takes first
    if acc is None:  # every block hidden (a window shorter than the gap): rows masked
        acc = torch.zeros_like(q)
        lse_acc = q.new_full((b, h, n), float("-inf"), dtype=torch.float32)
    return acc.to(q.dtype), lse_acc, kv


def _wire_dtype(a, n, ring, t, rank, dtype):
    """The dtype of the dK/dV sums that `rank` sends after backward step t. At step 0 they
    hold that rank's own terms alone: the inputs' dtype for at most one term (no rounding),
    float32 for more; later they also hold the sums that came in, always float32. Every
    rank derives it from the plan alike, so each receives the dtype its neighbour sends
    (the number of terms differs between ranks)."""
    if t > 0:
        return torch.float32
    own = _plan(a, n, rank, (rank + 1) % ring.world, ring.world)
    return dtype if len(own) <= 1 else torch.float32


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
            rq, rk = pc.rq, pc.rk
            gq, gk, gv = _attn_bwd(dout[:, rq], q[:, rq], kv[0][:, rk], kv[1][:, rk],
                                   out[:, rq], _rows_lse(lse, rq), a, pc.causal, pc.shard,
                                   pc.cu, works is not None or dkv_works is not None)
            dq.add(rq, gq, last=i == len(steps))
            mine.append((rk, gk, gv))
        # this block's sums: what came from the ranks before, then this rank's terms
        dk, dv = _Sum(k), _Sum(v)
        if dkv_works is not None:
            _wait(dkv_works)
            every = slice(0, k.shape[1])
            dk.add(every, dkv_in[0]), dv.add(every, dkv_in[1])
        for j, (rk, gk, gv) in enumerate(mine):
            final = t == last and j == len(mine) - 1
            dk.add(rk, gk, last=final), dv.add(rk, gv, last=final)
        if t < last:  # on to the previous rank
            wire = _wire_dtype(a, n, ring, t, ring.rank, k.dtype)
            send = (dk.result(wire), dv.result(wire))
            if COMMUNICATE:
                wire = _wire_dtype(a, n, ring, t, ring.next_index, k.dtype)
                dkv_in = tuple(torch.empty_like(x, dtype=wire) for x in send)
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
                         dropout_offset=0, return_lse=False, sm_margin=None):
    """Ring attention of this rank's shard: flash_attn_func of the whole sequence,
    restricted to this rank's query rows.

    q: (batch, seqlen_local, nheads, headdim); k, v: (batch, seqlen_local, nheads_k,
    headdim), every rank of `group` (default: the world) with the same shapes, its
    shard laid out as `layout` says (see shard()). causal, window_size, softcap,
    alibi_slopes and dropout_p are those of flash_attn_func, applied at the whole
    sequence's positions. dropout_seed: the same on every rank (None: rank 0 draws one
    and broadcasts it); dropout_offset as in fa_params. deterministic: bitwise
    reproducible gradients. sm_margin: SMs the Hopper kernels leave to the transfers'
    kernels while a transfer is in flight (None: SM_MARGIN on CUDA tensors). Returns out
    (like q), and with return_lse also the float32 log-sum-exp (batch, nheads,
    seqlen_local). Differentiable in q, k and v.
    """
    _check_qkv(q, k, v, packed=False)
    _check_layout(layout, q.shape[1])
    a = _make_args(q, group, causal, softmax_scale, window_size, softcap, alibi_slopes,
                   dropout_p, deterministic, layout, dropout_seed, dropout_offset, sm_margin)
    ring = _Ring(group)
    if a.dropout_p > 0 and layout == "zigzag" and (q.shape[1] // 2) % 4:
        raise ValueError("dropout with layout 'zigzag' needs seqlen_local a multiple of 8 "
                         "(each chunk a multiple of 4 keys: one Philox draw covers four), "
                         "got %d" % q.shape[1])
    if a.dropout_p > 0 and layout == "contiguous" and q.shape[1] % 4:
        raise ValueError("dropout needs seqlen_local a multiple of 4 (one Philox draw covers "
                         "four keys), got %d" % q.shape[1])
    out, lse = _RingFlashAttn.apply(q.contiguous(), k.contiguous(), v.contiguous(), a, ring)
    return (out, lse) if return_lse else out


def _check_qkv(q, k, v, packed):
    """One rank's q, k, v: (batch, seqlen_local, heads, headdim), or packed (total_local,
    heads, headdim); k and v at q's rows, with heads_k dividing heads."""
    nd, rows = (3, 1) if packed else (4, 2)
    what = "total_local" if packed else "batch, seqlen_local"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != nd:
            raise ValueError("%s must be a %d-D torch.Tensor (%s, heads, headdim)"
                             % (name, nd, what))
    if k.shape != v.shape or k.shape[:rows] != q.shape[:rows] or k.shape[-1] != q.shape[-1]:
        raise ValueError("q %s, k %s and v %s: k and v must have q's %s and headdim (each "
                         "rank holds the same rows of all three)"
                         % (tuple(q.shape), tuple(k.shape), tuple(v.shape), what))
    if q.shape[-2] % k.shape[-2]:
        raise ValueError("the number of q heads (%d) must be a multiple of the number of "
                         "k/v heads (%d)" % (q.shape[-2], k.shape[-2]))


def _make_args(q, group, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
               deterministic, layout, dropout_seed, dropout_offset, sm_margin):
    """The resolved options of a ring call (validated)."""
    if sm_margin is None:
        sm_margin = SM_MARGIN if q.is_cuda else 0
    _check_margin(sm_margin)
    opts = _core.make_options(softmax_scale, causal, window_size, softcap, dropout_p,
                              deterministic)
    a = _Args()
    a.scale = opts.softmax_scale
    a.window = (opts.window_enabled, opts.window_left, opts.window_right)
    a.softcap = opts.softcap
    a.dropout_p = opts.dropout_p
    a.deterministic = opts.deterministic
    a.causal = bool(causal)
    a.layout = layout
    a.packed = None
    a.alibi = alibi_slopes
    if alibi_slopes is not None and alibi_slopes.dim() != 1:
        raise ValueError("alibi_slopes must have shape (nheads,) for ring attention")
    a.seed = _shared_seed(dropout_seed, q.device, group) if a.dropout_p > 0 else 0
    a.offset = int(dropout_offset)
    # positions matter to a window, ALiBi and dropout; plain causal needs only the order
    a.positional = bool(opts.window_enabled or a.alibi is not None or a.dropout_p > 0)
    a.sm_margin = sm_margin
    return a


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen=None, group=None, causal=False,
                                softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                                alibi_slopes=None, dropout_p=0.0, deterministic=False,
                                layout="zigzag", return_lse=False, sm_margin=None):
    """Ring attention of this rank's part of a packed batch: flash_attn_varlen_func of the
    whole batch (self-attention, each sequence on its own), restricted to this rank's rows.

    q: (total_local, nheads, headdim); k, v: (total_local, nheads_k, headdim): the packed
    batch of this rank's pieces of every sequence, as shard(x, cu_seqlens=...) cuts it.
    cu_seqlens: the local offsets (the whole batch's divided by the world size; an int32
    tensor or a list, the same on every rank); each local sequence has the positions
    `layout` gives it (zigzag: an even length). max_seqlen is accepted for compatibility.
    causal, softmax_scale, softcap and deterministic are flash_attn_varlen_func's, sm_margin
    ring_flash_attn_func's;
    window_size, alibi_slopes and dropout are not available on packed sequences
    (UnsupportedError). Returns out (like q), and with return_lse also the float32
    log-sum-exp (nheads, total_local). Differentiable in q, k and v. Reads cu_seqlens on
    the host once per call (a synchronisation when it is a CUDA tensor).
    """
    del max_seqlen
    _check_qkv(q, k, v, packed=True)
    cu = _offsets(cu_seqlens)
    if cu[-1] != q.shape[0]:
        raise ValueError("cu_seqlens ends at %d but q has %d rows" % (cu[-1], q.shape[0]))
    if layout not in LAYOUTS:
        raise ValueError("layout must be one of %s (got %r)" % (LAYOUTS, layout))
    if layout == "zigzag":
        odd = [s for s in range(len(cu) - 1) if (cu[s + 1] - cu[s]) % 2]
        if odd:
            raise ValueError("layout 'zigzag' needs every local sequence of even length (two "
                             "chunks per rank); sequence %d has %d rows"
                             % (odd[0], cu[odd[0] + 1] - cu[odd[0]]))
    a = _make_args(q, group, causal, softmax_scale, window_size, softcap, alibi_slopes,
                   dropout_p, deterministic, layout, 0, 0, sm_margin)
    if a.positional:
        raise UnsupportedError(
            Status.ERR_UNSUPPORTED, "window_size, alibi_slopes and dropout_p are not "
            "available on packed sequences (each sequence's pieces sit at positions of their "
            "own); use ring_flash_attn_func per sequence, or causal/full masks here",
            "ring_flash_attn_varlen_func")
    ring = _Ring(group)
    a.packed = _Packed(cu, layout, q.device)
    out, lse = _RingFlashAttn.apply(q.contiguous()[None], k.contiguous()[None],
                                    v.contiguous()[None], a, ring)
    return (out[0], lse[0]) if return_lse else out[0]
