#!/usr/bin/env python3
"""Decode-shape forward on one GPU (one query row per head, or --nq rows as in
speculative decoding, against a long K/V cache):
flashattn's CUDA forward against PyTorch SDPA's flash, cuDNN and memory-efficient
backends in the same process, timed as tools/peers/bench_sdpa.py times (CUDA events,
median). Reports microseconds and the K/V bytes read per second (the decode is
bound by reading K and V once).

Usage: python3 tools/peers/bench_decode.py --lib build-gpu/libflashattn.so [--nq N] [--headdim D]
       [--json out.json]
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sdpa import BACKENDS, Ours, time_ms  # noqa: E402


def capture(fn, calls):
    """A CUDA graph of `calls` calls of fn (warmed up off the capture, as torch requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g


def replay_us(g, calls, reps):
    """Microseconds per call of a CUDA graph g of `calls` calls, median of reps replays."""
    return time_ms(g.replay, 3, reps) * 1e3 / calls


def graph_us(fn, calls, reps):
    """Microseconds per call of fn replayed from a CUDA graph of `calls` calls: without
    the host's per-call cost (~50 us through Python, more than a short decode's kernel),
    as a serving loop that captures its decode step runs it."""
    return replay_us(capture(fn, calls), calls, reps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", required=True, help="path of libflashattn.so")
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--no-graph", action="store_true",
                    help="time each call from Python (host-bound below ~100 us) instead of "
                         "replaying CUDA graphs of 20 calls")
    ap.add_argument("--nq", type=int, default=1,
                    help="query rows per head (non-causal for every library: SDPA's is_causal is "
                         "top-left aligned, ours bottom-right; the band differs by nq-1 keys)")
    a = ap.parse_args()
    ours = Ours(a.lib)
    torch.manual_seed(0)
    D, rows = a.headdim, []
    print("nq=%d rows per head, D=%d, bf16, %s" % (
        a.nq, D, "per call from Python" if a.no_graph else "CUDA graphs of 20 calls"))

    def timed(fn):
        return time_ms(fn, 10, a.reps) * 1e3 if a.no_graph else graph_us(fn, 20, a.reps)

    print("| B | H | Hk | Nk | ours us | flash us | cudnn us | effic us | ours GB/s | best peer GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for B, H, Hk in ((1, 32, 32), (8, 32, 32), (1, 32, 8), (8, 32, 8)):
        for Nk in (4096, 16384, 65536):
            q = torch.randn(B, H, a.nq, D, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(B, Hk, Nk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            kv_bytes = 2 * B * Hk * Nk * D * 2
            r = {"B": B, "H": H, "Hk": Hk, "Nk": Nk, "nq": a.nq}
            r["ours"] = timed(lambda: ours.forward(q, k, v, False))
            for name, be in BACKENDS[:3]:
                try:
                    def fn():
                        with sdpa_kernel([be]):
                            return F.scaled_dot_product_attention(q, k, v, enable_gqa=Hk != H)
                    fn()
                    r[name] = timed(fn)
                except Exception as ex:  # backend not available for this shape
                    r[name] = None
                    r[name + "_error"] = str(ex).split("\n")[0][:120]
            peers = [r[n] for n, _ in BACKENDS[:3] if r[n]]
            best = min(peers) if peers else None
            rows.append(r)
            f = lambda x: "%.1f" % x if x else "-"  # noqa: E731
            print("| %d | %d | %d | %d | %s | %s | %s | %s | %.0f | %s |" % (
                B, H, Hk, Nk, f(r["ours"]), f(r["flash"]), f(r["cudnn"]), f(r["efficient"]),
                kv_bytes / (r["ours"] * 1e-6) / 1e9,
                "%.0f" % (kv_bytes / (best * 1e-6) / 1e9) if best else "-"), flush=True)
            del q, k, v
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
