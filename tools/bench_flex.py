#!/usr/bin/env python3
"""Sliding-window attention as a block mask: flashattn (CUDA) against FlexAttention with the
same BlockMask, in one run (issue 7).

FlexAttention gets create_block_mask(sliding-window causal mask_mod) and runs compiled
(torch.compile, warmed up); flashattn gets the same BlockMask as a dense byte mask
(its full and partial blocks, FlexAttention's own block size) plus causal and a window of
the same width, which masks the partial blocks element by element. flashattn's native
window (no block mask) is timed too. Times are medians of CUDA-event timings.

Usage: FLASHATTN_LIBRARY=build-gpu/libflashattn.so PYTHONPATH=python \
         python3 tools/bench_flex.py [--seqlen 16384] [--window 1024] [--batch 2] [--heads 16]
                                     [--headdim 128] [--repeat 20] [--json FILE]"""
import argparse
import json
import statistics

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import flashattn


def timed(fn, repeat, warmup=3):
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=20)
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
        t_f = timed(f, a.repeat)
        t_fb = timed(fwdbwd(f), a.repeat)
        rows.append(dict(impl=name, fwd_ms=t_f, fwdbwd_ms=t_fb, bwd_ms=t_fb - t_f))
    print("B=%d H=%d N=%d D=%d bf16, causal sliding window %d, BlockMask %dx%d, %.1f%% of blocks "
          "visible; flashattn vs flex rel. error %.2g"
          % (B, H, N, D, W, bq, bk, 100 * density, err))
    print("%-22s %10s %12s %10s" % ("impl", "fwd ms", "fwd+bwd ms", "bwd ms"))
    for r in rows:
        print("%-22s %10.3f %12.3f %10.3f" % (r["impl"], r["fwd_ms"], r["fwdbwd_ms"], r["bwd_ms"]))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(B=B, H=H, N=N, D=D, window=W, block=[bq, bk], density=density,
                           rel_err=err, rows=rows, gpu=torch.cuda.get_device_name()), fh)


if __name__ == "__main__":
    main()
