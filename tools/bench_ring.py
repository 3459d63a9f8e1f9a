"""Ring attention on several GPUs: correctness against one GPU and the float64 reference,
then time against PyTorch's context parallelism, in one run.

    torchrun --nproc-per-node 2 tools/bench_ring.py [--check] [--seqlens 32768 131072 524288]

--check: for each case (causal, sliding window, dropout, GQA, both layouts), every rank's
out, dq, dk, dv from flashattn.distributed.ring_flash_attn_func against the float64
reference of the whole sequence (dropout: the library's own mask, fa_dropout_mask), within
twice the error of single-GPU flashattn plus a floor; and packed batches (causal, and full
with GQA; an empty sequence among them) from ring_flash_attn_varlen_func against each
sequence's float64 attention and single-GPU flash_attn_varlen_func; --check-drawn N adds
N drawn cases (masks, windows, GQA, dropout, lengths; the seed is printed, --seed replays).
Exits 1 on a failure.

Timing (B=1, H=16, D=128, bf16, causal, forward + backward, median of synchronised
iterations, the slowest rank's time): ours on all GPUs (zig-zag; also with each
--sm-margins value, the SMs our kernels leave to NCCL's while a transfer runs), ours with the
transfers skipped (compute alone) and the transfers alone (the same exchanges with no
attention), ours on one GPU (the whole sequence, rank 0), and the anchor: PyTorch's
torch.distributed.tensor.experimental.context_parallel around SDPA with the cuDNN and
the flash backends (its defaults: head-tail load balancing). Also the extra memory each
GPU's ring call took beyond its inputs and outputs.
"""
import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flashattn
from flashattn import distributed as fd


def log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def rel_err(a, b):
    a, b = a.double(), b.double()
    if torch.isnan(a).any():
        return float("inf")
    fin = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), fin):
        return float("inf")
    den = b[fin].norm().item()
    num = (a[fin] - b[fin]).norm().item()
    return num / den if den > 0 else num


# ---- correctness ---------------------------------------------------------------------------


def ref64(q, k, v, causal, window, scale, keep=None, p=0.0):
    """float64 attention of the whole sequence (B, N, H, D), optional dropout keep mask
    (H, N, N) bytes. Returns out."""
    q, k, v = (x.double() for x in (q, k, v))
    h, hk = q.shape[2], k.shape[2]
    k = k.repeat_interleave(h // hk, dim=2)
    v = v.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    n = q.shape[1]
    i = torch.arange(n, device=q.device)[:, None]
    j = torch.arange(n, device=q.device)[None, :]
    vis = torch.ones(n, n, dtype=torch.bool, device=q.device)
    left, right = window
    if causal:
        right = 0 if right < 0 or right > 0 else right
    if left >= 0:
        vis &= j >= i - left
    if right >= 0:
        vis &= j <= i + right
    s = s.masked_fill(~vis, float("-inf"))
    pr = torch.softmax(s, -1)
    if keep is not None:
        pr = pr * keep.to(pr.dtype)[None] / (1.0 - p)
    return torch.einsum("bhqk,bkhd->bqhd", pr, v)


CASES = [
    ("causal", dict(causal=True)),
    ("causal-gqa4", dict(causal=True, hk=1)),
    ("window", dict(causal=False, window_size=(700, 300))),
    ("causal-window", dict(causal=True, window_size=(900, -1))),
    ("causal-dropout", dict(causal=True, dropout_p=0.15)),
    ("full", dict(causal=False)),
]

# packed sequences (ring_flash_attn_varlen_func): masks at most causal; an empty sequence
VARLEN_CASES = [
    ("varlen-causal", dict(causal=True)),
    ("varlen-full-gqa4", dict(causal=False, hk=1)),
]
VARLEN_LENS = (300, 100, 0, 212)  # x 2 x world rows each


def compare(name, layout, rank, got, single, ref, mine):
    """out, dq, dk, dv of the ring (this rank's rows) against float64 (mine(ref): the same
    rows), within twice the single-GPU error plus a floor; prints, returns the failures."""
    failures, line = 0, []
    for nm, x, s, r in zip(("out", "dq", "dk", "dv"), got, single, ref):
        e, base = rel_err(x, mine(r)), rel_err(mine(s), mine(r))  # over the same rows
        lim = 2 * base + (2e-3 if nm == "out" else 4e-3)
        ok = e <= lim
        failures += not ok
        line.append("%s %.2e/%.2e%s" % (nm, e, lim, "" if ok else " FAIL"))
    if rank == 0 or failures:
        print("check %-17s %-10s rank %d: %s" % (name, layout, rank, ", ".join(line)),
              flush=True)
    return failures


def check_varlen(dev, world, rank):
    """Packed batches on the ring against each whole sequence's float64 attention and
    against flash_attn_varlen_func of the whole batch on one GPU."""
    failures = 0
    h, d = 4, 128
    lens = [2 * world * m for m in VARLEN_LENS]
    cu = [0]
    for m in lens:
        cu.append(cu[-1] + m)
    for layout in ("zigzag", "contiguous"):
        for name, kw in VARLEN_CASES:
            kw = dict(kw)
            hk = kw.pop("hk", 4)
            g = torch.Generator(device=dev).manual_seed(13)
            mk = lambda heads: torch.randn(cu[-1], heads, d, device=dev, generator=g,  # noqa: E731
                                           dtype=torch.bfloat16)
            q, k, v, do = mk(h), mk(hk), mk(hk), mk(h)
            ql, kl, vl = (fd.shard(x, layout=layout, cu_seqlens=cu).requires_grad_()
                          for x in (q, k, v))
            cul = torch.tensor(cu, dtype=torch.int32) // world
            out = fd.ring_flash_attn_varlen_func(ql, kl, vl, cul, layout=layout, **kw)
            got = (out,) + torch.autograd.grad(out, (ql, kl, vl),
                                               fd.shard(do, layout=layout, cu_seqlens=cu))
            # one GPU, the whole batch
            sq, sk, sv = (x.detach().clone().requires_grad_() for x in (q, k, v))
            cut = torch.tensor(cu, dtype=torch.int32, device=dev)
            so = flashattn.flash_attn_varlen_func(sq, sk, sv, cut, cut, max(lens), max(lens),
                                                  **kw)
            sg = torch.autograd.grad(so, (sq, sk, sv), do)
            # float64, sequence by sequence
            rq, rk, rv = (x.double().requires_grad_() for x in (q, k, v))
            ro = torch.cat([ref64(rq[None, a:b], rk[None, a:b], rv[None, a:b], kw["causal"],
                                  (-1, -1), d ** -0.5)[0]
                            for a, b in zip(cu, cu[1:]) if b > a])
            rg = torch.autograd.grad(ro, (rq, rk, rv), do.double())
            rows = torch.cat([torch.arange(gr, gr + m) for _, m, gr, _ in
                              fd._pieces(layout, cu, rank, world)]).to(dev)
            failures += compare(name, layout, rank, got, (so,) + tuple(sg), (ro,) + tuple(rg),
                                lambda ref: ref[rows])
    return failures


def check_case(dev, world, rank, name, kw, layout, rows=1024):
    """One case (a sequence of rows * world tokens) on the ring against one GPU and
    float64; returns the failures."""
    kw = dict(kw)
    hk = kw.pop("hk", 4)
    b, n, h, d = 1, rows * world, 4, 128
    g = torch.Generator(device=dev).manual_seed(11)
    q = torch.randn(b, n, h, d, device=dev, generator=g, dtype=torch.bfloat16)
    k = torch.randn(b, n, hk, d, device=dev, generator=g, dtype=torch.bfloat16)
    v = torch.randn(b, n, hk, d, device=dev, generator=g, dtype=torch.bfloat16)
    do = torch.randn(b, n, h, d, device=dev, generator=g, dtype=torch.bfloat16)
    p = kw.get("dropout_p", 0.0)
    seed = 77 if p else None
    ql, kl, vl = (fd.shard(x, layout=layout).requires_grad_() for x in (q, k, v))
    out = fd.ring_flash_attn_func(ql, kl, vl, layout=layout, dropout_seed=seed, **kw)
    got = (out,) + torch.autograd.grad(out, (ql, kl, vl), fd.shard(do, layout=layout))
    # single GPU, the whole sequence, the same seed
    a = fd._Args()
    opts = flashattn._core.make_options(None, kw.get("causal", False),
                                        kw.get("window_size", (-1, -1)), 0.0, p)
    a.scale, a.softcap, a.dropout_p, a.alibi = opts.softmax_scale, 0.0, p, None
    a.window = (opts.window_enabled, opts.window_left, opts.window_right)
    a.seed, a.offset, a.deterministic, a.threads = seed or 0, 0, False, 0
    so, sl = fd._attn_fwd(q, k, v, a, kw.get("causal", False), None)
    sg = fd._attn_bwd(do, q, k, v, so, sl, a, kw.get("causal", False), None)
    # float64 reference, dropout through the library's mask
    keep = None
    if p:
        keep = torch.from_numpy(flashattn.dropout_mask(p, seed, 0, h, n, n)[0]).to(dev)
    rq, rk, rv = (x.double().requires_grad_() for x in (q, k, v))
    ro = ref64(rq, rk, rv, kw.get("causal", False), kw.get("window_size", (-1, -1)),
               d ** -0.5, keep, p)
    rg = torch.autograd.grad(ro, (rq, rk, rv), do.double())
    pos = fd.shard_positions(n // world, rank, world, layout).to(dev)
    return compare(name, layout, rank, got, (so,) + tuple(sg), (ro,) + tuple(rg),
                   lambda ref: ref[:, pos])


def drawn_cases(seed, count):
    """(name, options, layout, rows a rank) drawn from seed: masks, windows, GQA, dropout
    and lengths in combinations the table does not list."""
    r = random.Random(seed)
    for i in range(count):
        rows = 16 * r.randint(1, 48)  # zig-zag chunks of 8 rows or more
        causal = r.random() < 0.6
        kw = dict(causal=causal, hk=r.choice((1, 2, 4)))
        if r.random() < 0.4:
            kw["window_size"] = (r.choice((-1, r.randrange(0, 3 * rows))),
                                 -1 if causal else r.choice((-1, r.randrange(0, rows))))
        if r.random() < 0.2:
            kw["dropout_p"] = r.uniform(0.05, 0.2)
        yield "drawn-%d-%d" % (seed, i), kw, r.choice(("zigzag", "contiguous")), rows


def check(args):
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    failures = 0
    for layout in ("zigzag", "contiguous"):
        for name, kw in CASES:
            failures += check_case(dev, world, rank, name, kw, layout)
    if args.check_drawn:
        seed = torch.tensor([args.seed if args.seed is not None else time.time_ns() % 1000003],
                            device=dev)
        dist.broadcast(seed, 0)  # every rank draws the same cases
        log("drawn cases: --seed %d" % seed.item())
        for name, kw, layout, rows in drawn_cases(seed.item(), args.check_drawn):
            failures += check_case(dev, world, rank, name, kw, layout, rows)
    failures += check_varlen(dev, world, rank)
    fails = torch.tensor([failures], device=dev)
    dist.all_reduce(fails)
    log("check: %s" % ("all cases pass" if fails.item() == 0 else "%d FAILURES" % fails.item()))
    return fails.item() == 0


# ---- timing --------------------------------------------------------------------------------


def timed(fn, iters, warmup):
    """Median over iterations of the slowest rank's time (ms); all ranks start together."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        t = torch.tensor([e0.elapsed_time(e1)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ts.append(t.item())
    return statistics.median(ts), ts


def one_gpu(n, h, d, dev, iters, warm):
    """Median ms of ours on this GPU over the whole sequence; None when it does not fit."""
    try:
        g1 = torch.Generator(device=dev).manual_seed(9)
        q1, k1, v1, do1 = (torch.randn(1, n, h, d, device=dev, generator=g1,
                                       dtype=torch.bfloat16) for _ in range(4))
        q1.requires_grad_(), k1.requires_grad_(), v1.requires_grad_()

        def single():
            o = flashattn.flash_attn_func(q1, k1, v1, causal=True)
            o.backward(do1)

        for _ in range(warm):
            single()
        ts = []
        for _ in range(iters):
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            single()
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1))
        return statistics.median(ts)
    except torch.OutOfMemoryError as e:
        log("N=%d on one GPU: out of memory: %s" % (n, str(e).splitlines()[0][:200]))
        return None
    finally:
        torch.cuda.empty_cache()


def bench(args, n, results):
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    h, d, b = args.heads, args.headdim, 1
    nl = n // world
    flop = 4 * b * h * n * n * d / 2 * 3.5  # causal forward + backward (2.5x)
    est_ms = flop / world / 4e14 * 1e3  # at ~400 TFLOP/s: picks the iteration count
    iters = max(3, min(args.iters, int(20000 / max(est_ms, 1))))
    warm = 1 if est_ms > 1000 else 3
    row = {"seqlen": n, "gpus": world, "iters": iters}
    g = torch.Generator(device=dev).manual_seed(1 + rank)
    mk = lambda m: torch.randn(b, m, h, d, device=dev, generator=g, dtype=torch.bfloat16)  # noqa
    ql, kl, vl, dol = (mk(nl) for _ in range(4))
    ql.requires_grad_(), kl.requires_grad_(), vl.requires_grad_()

    margin, group = None, None

    def ours():
        out = fd.ring_flash_attn_func(ql, kl, vl, group=group, causal=True, sm_margin=margin)
        out.backward(dol)

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    row["ours_ms"], row["ours_all"] = timed(ours, iters, warm)
    # extra memory of one call beyond inputs (q, k, v, dout) and outputs (out, dq, dk, dv)
    ql.grad = kl.grad = vl.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ours()
    torch.cuda.synchronize()
    io = 4 * ql.numel() * ql.element_size()  # out, dq, dk, dv
    row["extra_mib"] = (torch.cuda.max_memory_allocated() - base - io) / 2 ** 20
    row["peak_mib"] = torch.cuda.max_memory_allocated() / 2 ** 20  # inputs included
    row["qkv_shard_mib"] = ql.numel() * ql.element_size() / 2 ** 20
    ql.grad = kl.grad = vl.grad = None

    # the SMs left to the transfers' kernels (fd.SM_MARGIN above)
    row["sm_margin"] = fd.SM_MARGIN
    row["by_sm_margin"] = {}
    for margin in args.sm_margins:
        row["by_sm_margin"][margin], _ = timed(ours, iters, 1)
    margin = None

    # NCCL's kernels on a high-priority stream: their CTAs go ahead of the queued CTAs
    # of a non-persistent attention grid (the backward's) as SMs free up
    if args.high_priority:
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = True
        group = dist.new_group(backend="nccl", pg_options=opts)
        row["ours_high_priority_ms"], _ = timed(ours, iters, warm)
        dist.destroy_process_group(group)
        group = None

    fd.COMMUNICATE = False
    row["compute_ms"], _ = timed(ours, iters, 1)
    fd.COMMUNICATE = True

    # the transfers alone: the forward's W-1 K/V exchanges; the backward's W-2 K/V and W-1
    # dK/dV exchanges (the first in bf16, one term; the others float32 sums)
    ring = fd._Ring(None)
    kv = (kl.detach(), vl.detach())
    kv32 = tuple(x.float() for x in kv)

    def transfers():
        for t in range(world - 1):
            fd._wait(ring.exchange(kv, tuple(torch.empty_like(x) for x in kv)))
        for t in range(world - 2):
            fd._wait(ring.exchange(kv, tuple(torch.empty_like(x) for x in kv), True))
        for t in range(world - 1):
            x = kv if t == 0 else kv32
            fd._wait(ring.exchange(x, tuple(torch.empty_like(y) for y in x), True))

    row["comm_ms"], _ = timed(transfers, iters, 1)
    kvb = 2 * kl.numel() * kl.element_size()
    row["fwd_bytes_per_step"] = kvb  # W-1 steps
    row["bwd_bytes"] = (world - 2) * kvb + kvb + (world - 2) * 2 * kvb
    del ring, kv, kv32

    # the anchor: PyTorch context parallelism around SDPA (each GPU first holds the whole
    # q, k, v and dout, 4 GiB each at 1M: our cached blocks are released first)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    mesh = init_device_mesh("cuda", (world,))
    torch.cuda.empty_cache()
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("flash", SDPBackend.FLASH_ATTENTION)):
        if name not in args.anchors:
            continue
        gq = torch.Generator(device=dev).manual_seed(5)
        bufs = [torch.randn(b, h, n, d, device=dev, generator=gq, dtype=torch.bfloat16)
                for _ in range(4)]
        try:
            with sdpa_kernel(backend), context_parallel(mesh, buffers=bufs,
                                                        buffer_seq_dims=[2, 2, 2, 2],
                                                        no_restore_buffers=set(bufs)):
                qa, ka, va = (x.detach().requires_grad_() for x in bufs[:3])

                def anchor():
                    o = F.scaled_dot_product_attention(qa, ka, va, is_causal=True)
                    o.backward(bufs[3])

                row["torch_cp_%s_ms" % name], _ = timed(anchor, iters, warm)
        except Exception as e:  # noqa: BLE001 (a backend missing on this build: recorded)
            row["torch_cp_%s_ms" % name] = None
            log("anchor %s failed: %s" % (name, str(e).splitlines()[0][:200]))
        del bufs
        torch.cuda.empty_cache()

    # ours on one GPU, the whole sequence (rank 0; the others wait)
    torch.cuda.empty_cache()
    one = None
    if rank == 0 and not args.skip_one_gpu:
        one = one_gpu(n, h, d, dev, iters, warm)
    dist.barrier()
    row["ours_1gpu_ms"] = one
    if one:
        row["scaling"] = one / (world * row["ours_ms"])
    row["exposed_comm_ms"] = row["ours_ms"] - row["compute_ms"]
    row["hidden_frac"] = 1 - max(0.0, row["exposed_comm_ms"]) / row["comm_ms"]
    results.append(row)
    log(json.dumps(row))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--seqlens", type=int, nargs="*", default=[32768, 131072, 524288])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--skip-one-gpu", action="store_true")
    ap.add_argument("--sm-margins", type=int, nargs="*", default=[0, 2, 4, 16],
                    help="also time ours with these sm_margin values")
    ap.add_argument("--check-drawn", type=int, default=0, metavar="N",
                    help="--check also runs N drawn cases (printed seed; --seed replays)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--high-priority", action="store_true",
                    help="also time ours over a group whose NCCL stream has high priority")
    ap.add_argument("--anchors", nargs="*", default=["cudnn", "flash"],
                    help="PyTorch CP backends to time (cudnn, flash)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu", action="store_true", help="--check on CPU processes (gloo)")
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    if args.cpu:
        dist.init_process_group("gloo")
        args.no_bench = True
    else:
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    ok = True
    if args.check:
        ok = check(args)
    results = []
    if not args.no_bench:
        for n in args.seqlens:
            try:
                bench(args, n, results)
            except torch.OutOfMemoryError as e:
                log("N=%d: out of memory: %s" % (n, str(e).splitlines()[0][:200]))
            torch.cuda.empty_cache()
    if dist.get_rank() == 0 and results:
        print("\n%s, %d GPUs, B1 H%d D%d bf16 causal fwd+bwd, %s" % (
            torch.cuda.get_device_name(), dist.get_world_size(), args.heads, args.headdim,
            time.strftime("%Y-%m-%d")))
        print("| N | ours ms | ours, NCCL high priority | torch CP cuDNN | torch CP flash | "
              "ours 1 GPU | scaling | compute only | transfers alone | exposed | hidden | "
              "extra MiB/GPU | peak MiB/GPU |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        f = lambda x: "-" if x is None else "%.1f" % x  # noqa: E731
        for r in results:
            print("| %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %.2f | %.0f | %.0f |" % (
                r["seqlen"], f(r["ours_ms"]), f(r.get("ours_high_priority_ms")),
                f(r.get("torch_cp_cudnn_ms")), f(r.get("torch_cp_flash_ms")),
                f(r.get("ours_1gpu_ms")),
                "-" if r.get("scaling") is None else "%.2f" % r["scaling"],
                f(r["compute_ms"]), f(r["comm_ms"]), f(r["exposed_comm_ms"]),
                r["hidden_frac"], r["extra_mib"], r["peak_mib"]))
        if args.sm_margins:
            print("\nours (ms) by sm_margin (the default, %d, in the table above):"
                  % fd.SM_MARGIN)
            for r in results:
                print("N=%d: %s" % (r["seqlen"], ", ".join(
                    "%d: %.1f" % (m, t) for m, t in sorted(r["by_sm_margin"].items()))))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
