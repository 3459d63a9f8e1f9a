#!/usr/bin/env python3
"""Sliding-window attention as a block mask: flashattn (CUDA) against FlexAttention with the
same BlockMask, in one run.

FlexAttention gets create_block_mask(sliding-window causal mask_mod) and runs compiled
(torch.compile, warmed up); flashattn gets the same BlockMask as a dense byte mask
(its full and partial blocks, FlexAttention's own block size) plus causal and a window of
the same width, which masks the partial blocks element by element. flashattn's native
window (no block mask) is timed too.

Every impl and pass is timed two ways, the same way for all of them (ms per call):
  synchronised  fwd / fwd+bwd / bwd: event a, one call, event b, synchronize; the median of
                --repeat calls. The GPU is idle when a is recorded, so the host (Python)
                time before the first kernel launch counts as GPU time: this is the time
                of one isolated call, host overhead included.
  queued        fwd / fwd+bwd / bwd: one call to fill the queue, then event a, --queue
                calls back to back with no synchronisation, event b, synchronize; (b - a) /
                calls, the median of QUEUE_BLOCKS (3) such blocks. As in a training loop
                the GPU queue stays full, so host time is hidden wherever it is shorter
                than the GPU time: this is the GPU time per call (or the host time, if that
                is longer).
  host          fwd / fwd+bwd: perf_counter around the --queue queued calls (before the
                final synchronize), per call: the host's time to issue one call. A queued
                time marked * is within 10% of this: that impl is host-bound there, and
                its queued time is host time, not GPU time.
bwd ms is fwd+bwd minus fwd for both methods. --json writes the same numbers (rows: fwd_ms,
fwdbwd_ms, bwd_ms synchronised; queued_fwd_ms, queued_fwdbwd_ms, queued_bwd_ms;
host_fwd_ms, host_fwdbwd_ms).

Usage: FLASHATTN_LIBRARY=build-gpu/libflashattn.so PYTHONPATH=python \
         python3 tools/peers/bench_flex.py [--seqlen 16384] [--window 1024] [--batch 2] [--heads 16]
                                     [--headdim 128] [--repeat 20] [--queue 20] [--json FILE]"""
import argparse
import json
import statistics
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import flashattn

QUEUE_BLOCKS = 3  # queued blocks per impl and pass (median)


def timed(fn, repeat, warmup=3):
    """Synchronised: the median over `repeat` calls of event, call, event, synchronize."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def timed_queued(fn, calls, blocks=QUEUE_BLOCKS, warmup=3):
    """Queued: `calls` calls back to back between two events, no synchronisation in
    between, after one call that fills the queue. Returns (GPU ms per call, host ms per
    call), each the median over `blocks` blocks; host ms is perf_counter around the
    calls, before the final synchronize."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(blocks):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()  # the GPU is busy with this one when a is recorded
        a.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        b.record()
        b.synchronize()
        gpu.append(a.elapsed_time(b) / calls)
        host.append((t1 - t0) * 1e3 / calls)
    return statistics.median(gpu), statistics.median(host)


def measure(f, fb, repeat, calls):
    """Both methods for one impl: f is its forward call, fb forward + autograd backward."""
    t_f = timed(f, repeat)
    t_fb = timed(fb, repeat)
    q_f, h_f = timed_queued(f, calls)
    q_fb, h_fb = timed_queued(fb, calls)
    return dict(fwd_ms=t_f, fwdbwd_ms=t_fb, bwd_ms=t_fb - t_f,
                queued_fwd_ms=q_f, queued_fwdbwd_ms=q_fb, queued_bwd_ms=q_fb - q_f,
                host_fwd_ms=h_f, host_fwdbwd_ms=h_fb)


def _mark(queued, host):
    """A queued time within 10% of the host time is host-bound: marked *."""
    return "*" if host >= 0.9 * queued else " "


def table(rows):
    """The rows (measure()'s dicts plus impl) as text lines, ms per call."""
    groups = (("synchronised", 3), ("queued (* host-bound)", 3), ("host", 2))
    cols = ("fwd", "fwd+bwd", "bwd", "fwd", "fwd+bwd", "bwd", "fwd", "fwd+bwd")
    w = 9  # one column: a number and its mark
    lines = ["%-22s" % "ms per call" + "".join(" | %-*s" % (w * n, g) for g, n in groups),
             "%-22s" % "impl" + "".join(
                 " | " + "".join("%*s " % (w - 1, c) for c in cols[i:i + n])
                 for i, n in ((0, 3), (3, 3), (6, 2)))]
    for r in rows:
        mf = _mark(r["queued_fwd_ms"], r["host_fwd_ms"])
        mfb = _mark(r["queued_fwdbwd_ms"], r["host_fwdbwd_ms"])
        vals = ((r["fwd_ms"], " "), (r["fwdbwd_ms"], " "), (r["bwd_ms"], " "),
                (r["queued_fwd_ms"], mf), (r["queued_fwdbwd_ms"], mfb),
                (r["queued_bwd_ms"], " "), (r["host_fwd_ms"], " "),
                (r["host_fwdbwd_ms"], " "))
        cells = ["%*.3f%s" % (w - 1, x, m) for x, m in vals]
        lines.append("%-22s" % r["impl"] + "".join(
            " | " + "".join(cells[i:i + n]) for i, n in ((0, 3), (3, 3), (6, 2))))
    return [line.rstrip() for line in lines]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=20,
                    help="synchronised calls per impl and pass (median)")
    ap.add_argument("--queue", type=int, default=20,
                    help="calls per queued block (median of QUEUE_BLOCKS blocks)")
    ap.add_argument("--json")
    a = ap.parse_args()
    B, H, N, D, W = a.batch, a.heads, a.seqlen, a.headdim, a.window
    dt = torch.bfloat16
    torch.manual_seed(0)
    # (B, H, N, D) storage, as FlexAttention wants; flashattn reads it through strides
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dt, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(B, H, N, D, device="cuda", dtype=dt)

    def sliding(b, h, qi, kj):
        return (qi >= kj) & (qi - kj <= W)

    bm = create_block_mask(sliding, None, None, N, N, device="cuda")
    bq, bk = bm.BLOCK_SIZE
    dense = bm.to_dense()[0, 0].to(torch.uint8).contiguous()  # (query blocks, key blocks)
    density = dense.float().mean().item()
    flex = torch.compile(flex_attention)

    def flex_fwd():
        return flex(q, k, v, block_mask=bm)

    def ours_fwd(block=True):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # (B, N, H, D) views
        kw = dict(block_mask=dense[None, None], block_size=(bq, bk)) if block else {}
        return flashattn.flash_attn_func(qt, kt, vt, causal=True, window_size=(W, 0),
                                         **kw).transpose(1, 2)

    # same result first (window W keys left of the diagonal: qi - kj <= W)
    ref = flex_fwd()
    got = ours_fwd()
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()

    def fwdbwd(f):
        def run():
            out = f()
            torch.autograd.grad(out, (q, k, v), dout)
        return run

    rows = []
    for name, f in (("flex", flex_fwd), ("flashattn block mask", ours_fwd),
                    ("flashattn window", lambda: ours_fwd(False))):
        rows.append(dict(impl=name, **measure(f, fwdbwd(f), a.repeat, a.queue)))
    print("B=%d H=%d N=%d D=%d bf16, causal sliding window %d, BlockMask %dx%d, %.1f%% of blocks "
          "visible; flashattn vs flex rel. error %.2g"
          % (B, H, N, D, W, bq, bk, 100 * density, err))
    print("synchronised: median of %d single calls; queued: %d calls back to back, median of "
          "%d blocks" % (a.repeat, a.queue, QUEUE_BLOCKS))
    for line in table(rows):
        print(line)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(B=B, H=H, N=N, D=D, window=W, block=[bq, bk], density=density,
                           rel_err=err, repeat=a.repeat, queue=a.queue,
                           queue_blocks=QUEUE_BLOCKS, rows=rows,
                           gpu=torch.cuda.get_device_name()), fh)


if __name__ == "__main__":
    main()
