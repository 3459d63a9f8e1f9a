#!/usr/bin/env python3
"""Paged KV caches and the KV-cache call on one GPU: flashattn's forward over a
contiguous cache, the same keys in pages of 16 and 256 rows (--pages; each
sequence's pages in random order through a block table, or in order with
--in-order), and the KV-cache call that first
appends the new rows (and rotates them and q), beside PyTorch SDPA's cuDNN and
flash backends on the contiguous cache, in the same process. Decode (one query
row per head) and a causal prefill chunk against the cache. Times are
microseconds per call replayed from CUDA graphs of 20 calls (tools/bench_decode.py),
medians over --rounds rounds that time every column in turn (so that no column sees
the GPU only cold or only hot; --shuffle changes the order each round, --control times
the contiguous column a second time, last); ratios against our contiguous forward of the
same keys.

Usage: python3 tools/bench_paged.py --lib build-gpu/libflashattn.so [--json out.json]
           [--quick] [--pages 16,32,64,256] [--only decode|prefill] [--splits N] [--cold]
           [--rounds R] [--dense] [--in-order] [--kernels] [--control] [--shuffle]
"""
import argparse
import ctypes as C
import json
import os
import random
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
from bench_decode import capture, replay_us  # noqa: E402
from bench_sdpa import BACKENDS, FaParams, FaTensor, Ours  # noqa: E402


class FaKvcache(C.Structure):
    _fields_ = [("cache_seqlens", C.c_void_p), ("k_new", C.c_void_p), ("v_new", C.c_void_p),
                ("cache_batch_idx", C.c_void_p), ("cache_leftpad", C.c_void_p),
                ("rotary_cos", C.c_void_p), ("rotary_sin", C.c_void_p),
                ("rotary_seqlen", C.c_int64), ("rotary_dim", C.c_int64),
                ("rotary_stride", C.c_int64), ("rotary_interleaved", C.c_int)]


def bnhd(t, batch=None, seqlen=None):
    """Descriptor of a (B, N, H, D) tensor (flash-attn's layout)."""
    B, N, H, D = t.shape
    sb, sn, sh, sd = t.stride()
    assert sd == 1
    return FaTensor(t.data_ptr(), 2 if t.dtype == torch.bfloat16 else 1, B, N, H, D, sb, sn, sh)


class Case:
    """One shape: q (B, nq, H, D), a cache of Nk keys per sequence (contiguous and
    paged copies of the same keys), new rows and rotary tables for the call."""

    def __init__(self, lib, B, H, Hk, D, nq, Nk, causal, splits=0, copy=0, in_order=False):
        self.lib, self.B, self.nq, self.Nk, self.causal = lib, B, nq, Nk, causal
        self.in_order = in_order
        self.splits = splits
        self.copy = copy
        dt = torch.bfloat16
        self.q = torch.randn(B, nq, H, D, device="cuda", dtype=dt)
        self.o = torch.empty_like(self.q)
        self.lse = torch.empty(B * H * nq, device="cuda", dtype=torch.float32)
        self.k = torch.randn(B, Nk, Hk, D, device="cuda", dtype=dt)
        self.v = torch.randn(B, Nk, Hk, D, device="cuda", dtype=dt)
        self.used = torch.full((B,), Nk, dtype=torch.int32, device="cuda")
        self.cached = torch.full((B,), Nk - nq, dtype=torch.int32, device="cuda")
        self.k_new = torch.randn(B, nq, Hk, D, device="cuda", dtype=dt)
        self.v_new = torch.randn(B, nq, Hk, D, device="cuda", dtype=dt)
        pos = torch.arange(Nk + 256, device="cuda", dtype=torch.float32)[:, None]
        inv = 10000.0 ** (-torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D)
        self.cos, self.sin = torch.cos(pos * inv).to(dt), torch.sin(pos * inv).to(dt)
        self.pools = {}
        self.keep = []

    def pool(self, page):
        """The keys in pages of `page` rows, a random permutation of the pool."""
        if page not in self.pools:
            torch.manual_seed(1000 * self.copy + page)
            pps = (self.Nk + page - 1) // page
            n = self.B * pps
            perm = (torch.arange(n, device="cuda") if self.in_order else
                    torch.randperm(n, device="cuda")).to(torch.int32)
            table = perm.view(self.B, pps).contiguous()
            kp = torch.zeros(n, page, *self.k.shape[2:], device="cuda", dtype=self.k.dtype)
            vp = torch.zeros_like(kp)
            rows = torch.arange(self.Nk, device="cuda")
            for b in range(self.B):
                pg = table[b][rows // page].long()
                kp[pg, rows % page] = self.k[b]
                vp[pg, rows % page] = self.v[b]
            self.pools[page] = (kp, vp, table, pps)
        return self.pools[page]

    def params(self, page):
        p = FaParams()
        p.device, p.algorithm, p.causal = 1, 0, int(self.causal)
        p.num_splits = self.splits
        p.stream = torch.cuda.current_stream().cuda_stream
        k, v = self.k, self.v
        if page:
            k, v, table, pps = self.pool(page)
            p.block_table, p.max_pages_per_seq = table.data_ptr(), pps
        return p, bnhd(k), bnhd(v)

    def call(self, page, append, rotary, used=True):
        """A function running one call: fa_forward over the cache (all its keys;
        with seqused_k unless not used), or the KV-cache call appending nq rows
        to a cache of Nk - nq."""
        p, tk, tv = self.params(page)
        tq, to = bnhd(self.q), bnhd(self.o)
        kv = FaKvcache()
        nb = C.c_size_t(0)
        if append:
            tkn, tvn = bnhd(self.k_new), bnhd(self.v_new)
            self.keep += [tkn, tvn]
            kv.cache_seqlens = self.cached.data_ptr()
            kv.k_new, kv.v_new = C.addressof(tkn), C.addressof(tvn)
            if rotary:
                kv.rotary_cos, kv.rotary_sin = self.cos.data_ptr(), self.sin.data_ptr()
                kv.rotary_seqlen, kv.rotary_dim = self.cos.shape[0], 2 * self.cos.shape[1]
            st = self.lib.fa_kvcache_workspace_size(C.byref(p), C.byref(kv), C.byref(tq),
                                                    C.byref(tk), C.byref(tv), C.byref(nb))
        else:
            p.seqused_k = self.used.data_ptr() if used else None
            st = self.lib.fa_workspace_size(0, C.byref(p), C.byref(tq), C.byref(tk), C.byref(tv),
                                            C.byref(nb))
        if st:
            raise RuntimeError(self.lib.fa_last_error().decode())
        ws = torch.empty(max(nb.value, 1), dtype=torch.uint8, device="cuda")
        if nb.value:
            p.workspace, p.workspace_bytes = ws.data_ptr(), nb.value
        self.keep += [p, tq, tk, tv, to, kv, ws]
        lse = self.lse.data_ptr()

        def run():
            p.stream = torch.cuda.current_stream().cuda_stream  # the capture's stream
            if append:
                r = self.lib.fa_forward_kvcache(C.byref(p), C.byref(kv), C.byref(tq), C.byref(tk),
                                                C.byref(tv), C.byref(to), C.c_void_p(lse))
            else:
                r = self.lib.fa_forward(C.byref(p), C.byref(tq), C.byref(tk), C.byref(tv),
                                        C.byref(to), C.c_void_p(lse))
            if r:
                raise RuntimeError(self.lib.fa_last_error().decode())
        return run


def kernel_name(name):
    """A kernel's bare name: no return type, namespaces, template or parameter lists."""
    out, depth = [], 0
    for ch in name:
        depth += ch in "<("
        if depth == 0:
            out.append(ch)
        depth -= ch in ">)"
    return "".join(out).split()[-1].split("::")[-1] if out else name


def kernel_times(g, calls, reps=5):
    """The kernels of a graph of `calls` calls, replayed reps times under
    torch.profiler: each kernel's mean us per call, and the mean span per call
    from the first kernel's start to the last's end. A kernel launched as a
    programmatic dependent starts before the kernel it follows ends and waits
    for it, so durations overlap; the span is the call's time. The tracing
    itself moves the span by a few percent from the untraced replay's."""
    from torch.profiler import ProfilerActivity, profile
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not ev:
        return "no kernels recorded"
    tot = {}
    for e in ev:
        name = kernel_name(e.name)
        tot[name] = tot.get(name, 0.0) + e.time_range.elapsed_us()
    span = max(e.time_range.end for e in ev) - min(e.time_range.start for e in ev)
    per = calls * reps
    return (", ".join("%s %.1f" % (k, v / per) for k, v in tot.items()) +
            "; span %.1f" % (span / per))


def round_robin(fns):
    """A function calling fns[0], fns[1], ... in turn, one a call."""
    i = [0]

    def run():
        fns[i[0] % len(fns)]()
        i[0] += 1
    return run


class Cases:
    """Copies of one shape (--cold): each call of a captured graph reads the next
    copy's cache, so that the copies together outgrow the GPU's L2 and a cache
    is read from memory, as a model's layers leave it, not from the L2 the call
    before filled."""

    def __init__(self, n, *args, **kw):
        self.all = [Case(*args, **kw, copy=i) for i in range(n)]

    def __getattr__(self, name):
        return getattr(self.all[0], name)

    def call(self, page, append, rotary, used=True):
        return round_robin([c.call(page, append, rotary, used) for c in self.all])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", required=True, help="path of libflashattn.so")
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--pages", default="16,256",
                    help="page sizes timed (comma-separated; the first also with the append "
                    "and rotary)")
    ap.add_argument("--only", default="", help="decode or prefill: that kind of shape alone")
    ap.add_argument("--cold", action="store_true",
                    help="rotate over copies of each cache (128 MiB at least in all), so that "
                    "calls read their cache from memory, not from the L2 the last call filled")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds that time every column in turn; each column's median")
    ap.add_argument("--dense", action="store_true",
                    help="also our contiguous forward without seqused_k (every sequence's "
                    "keys all used, as SDPA reads them)")
    ap.add_argument("--in-order", action="store_true",
                    help="each sequence's pages in order in the pool (the table the identity "
                    "within a sequence), not shuffled: what the lookup costs apart from where "
                    "the pages lie")
    ap.add_argument("--kernels", action="store_true",
                    help="also each column's kernels (torch.profiler over graph replays): "
                    "mean us per call of each, and the call's span")
    ap.add_argument("--control", action="store_true",
                    help="also the contiguous column again as the last of ours (\"contig2\"): "
                    "what a column's place in the round alone moves")
    ap.add_argument("--shuffle", action="store_true",
                    help="each round times the columns in a fresh random order, not in the "
                    "table's")
    ap.add_argument("--splits", type=int, default=0,
                    help="our calls' params.num_splits (0: the library's choice; 1: no split)")
    a = ap.parse_args()
    ours = Ours(a.lib)
    lib = ours.lib
    lib.fa_forward_kvcache.restype = C.c_int
    lib.fa_kvcache_workspace_size.restype = C.c_int
    torch.manual_seed(0)
    print("bf16, D=128, H=32, Hk=8; us per call (CUDA graphs of 20 calls); ratio to contiguous")
    pages = [int(x) for x in a.pages.split(",") if x]
    # (name, page size, append, rotary, seqused_k)
    cols = ([("contig", 0, 0, 0, 1)] + [("page%d" % pg, pg, 0, 0, 1) for pg in pages] +
            [("append", 0, 1, 0, 1), ("rotary", 0, 1, 1, 1)] +
            [(n % pg, pg, 1, r, 1) for pg in pages[:1]
             for n, r in (("append%d", 0), ("rotary%d", 1))] +
            ([("dense", 0, 0, 0, 0)] if a.dense else []) +
            ([("contig2", 0, 0, 0, 1)] if a.control else []))
    print("| shape | B | Nk | " + " | ".join(c[0] for c in cols) + " | sdpa flash | sdpa cudnn |")
    print("|---|---|---|" + "---|" * (len(cols) + 2))
    rows = []
    shapes = [("decode", 1, 1, False), ("decode", 16, 1, False), ("prefill", 1, 256, True)]
    nks = (2048, 8192) if a.quick else (2048, 8192, 16384)
    for kind, B, nq, causal in shapes:
        if a.only and kind != a.only:
            continue
        for Nk in nks:
            cache_bytes = 2 * B * Nk * 8 * 128 * 2
            n = -(-(128 << 20) // cache_bytes) if a.cold else 1
            c = Cases(n, lib, B, 32, 8, 128, nq, Nk, causal, a.splits, in_order=a.in_order)
            r = {"shape": kind, "B": B, "nq": nq, "Nk": Nk, "causal": causal}
            graphs = {}
            for name, page, append, rotary, used in cols:
                try:
                    graphs[name] = capture(c.call(page, append, rotary, used), 20)
                except Exception as ex:
                    r[name] = None
                    print("  %s: %s" % (name, ex), file=sys.stderr)
            # peers on the contiguous cache (B, H, N, D); SDPA's causal is top-left
            # aligned, so a prefill chunk's peers run without a mask
            for name, be in BACKENDS[:2]:
                try:
                    def sdpa(cc):
                        qs, ks, vs = (x.transpose(1, 2) for x in (cc.q, cc.k, cc.v))

                        def one():
                            with sdpa_kernel([be]):
                                F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)
                        return one
                    fn = round_robin([sdpa(cc) for cc in c.all])
                    fn()
                    graphs[name] = capture(fn, 20)
                except Exception:
                    r[name] = None
            times = {name: [] for name in graphs}
            order = random.Random(Nk * 1000 + B)
            for _ in range(a.rounds):
                names = list(graphs)
                if a.shuffle:
                    order.shuffle(names)
                for name in names:
                    times[name].append(replay_us(graphs[name], 20, a.reps))
            r.update({name: statistics.median(t) for name, t in times.items()})
            if a.kernels:
                for name, g in graphs.items():
                    print("  %s %s %d: %s" % (kind, name, Nk, kernel_times(g, 20)))
            del graphs
            rows.append(r)
            base = r["contig"]

            def fmt(x):
                if x is None:
                    return "-"
                return "%.1f (%.3f)" % (x, x / base) if base else "%.1f" % x
            print("| %s | %d | %d | " % (kind, B, Nk) + " | ".join(fmt(r[n]) for n, *_ in cols) +
                  " | %s | %s |" % tuple("-" if r.get(n) is None else "%.1f" % r[n]
                                         for n, _ in BACKENDS[:2]))
            del c
            torch.cuda.empty_cache()
    if a.json:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(a.json, "w"),
                  indent=1)


if __name__ == "__main__":
    main()
