#!/usr/bin/env python3
"""Forward-pass benchmark on one GPU: flashattn's CUDA kernel (loaded with ctypes,
called in-process on torch-allocated tensors and torch's current stream) against
PyTorch SDPA's flash, cuDNN, memory-efficient and math backends, timed the same
way in the same process (CUDA events, median of --reps after --warmup).

Grid (FlashAttention-2 paper): bf16, B*N = 16384, H*D = 2048, N in 512..16k,
D in {64, 128}, causal and not; TFLOP/s = 4*B*H*N*N*D / t (halved for causal).
Then the seeds' configuration (B=32, N=512, H=16, D=64, f16, causal): time and
extra memory (torch.cuda.max_memory_allocated delta, outputs included).

Usage: python3 tools/bench_sdpa.py --lib build-gpu/libflashattn.so [--json out.json]
"""
import argparse
import ctypes as C
import datetime
import glob
import json
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


class FaTensor(C.Structure):
    _fields_ = [("data", C.c_void_p), ("dtype", C.c_int), ("batch", C.c_int64),
                ("seqlen", C.c_int64), ("heads", C.c_int64), ("headdim", C.c_int64),
                ("stride_batch", C.c_int64), ("stride_seq", C.c_int64),
                ("stride_head", C.c_int64)]


class FaParams(C.Structure):
    _fields_ = [("device", C.c_int), ("algorithm", C.c_int), ("softmax_scale", C.c_float),
                ("causal", C.c_int), ("window_enabled", C.c_int), ("window_left", C.c_int64),
                ("window_right", C.c_int64), ("softcap", C.c_float),
                ("alibi_slopes", C.c_void_p), ("alibi_stride_batch", C.c_int64),
                ("cu_seqlens_q", C.c_void_p), ("cu_seqlens_k", C.c_void_p),
                ("num_seqs", C.c_int64), ("dropout_p", C.c_float),
                ("dropout_seed", C.c_uint64), ("dropout_offset", C.c_uint64),
                ("block_mask", C.c_void_p), ("block_size_q", C.c_int64),
                ("block_size_k", C.c_int64), ("deterministic", C.c_int),
                ("num_threads", C.c_int), ("stream", C.c_void_p), ("workspace", C.c_void_p),
                ("workspace_bytes", C.c_size_t)]


FA_F16, FA_BF16 = 1, 2
FA_FLASH2, FA_STANDARD = 0, 2


class Ours:
    def __init__(self, path):
        self.lib = C.CDLL(path)
        self.lib.fa_forward.restype = C.c_int
        self.lib.fa_workspace_size.restype = C.c_int
        self.lib.fa_last_error.restype = C.c_char_p
        self.lib.fa_device_available.restype = C.c_int
        if not self.lib.fa_device_available(1):
            raise RuntimeError("libflashattn: no CUDA backend or device")

    @staticmethod
    def desc(t):  # t: (B, H, N, D) torch tensor, D contiguous
        B, H, N, D = t.shape
        sb, sh, sn, sd = t.stride()
        assert sd == 1
        dt = FA_BF16 if t.dtype == torch.bfloat16 else FA_F16
        return FaTensor(t.data_ptr(), dt, B, N, H, D, sb, sn, sh)

    def params(self, causal, algorithm=FA_FLASH2):
        p = FaParams()
        p.device, p.algorithm, p.causal = 1, algorithm, int(causal)
        p.stream = torch.cuda.current_stream().cuda_stream
        return p

    def forward(self, q, k, v, causal, algorithm=FA_FLASH2, out=None):
        B, H, N, D = q.shape
        o = torch.empty_like(q) if out is None else out
        lse = torch.empty(B * H * N, dtype=torch.float32, device=q.device)
        p = self.params(causal, algorithm)
        tq, tk, tv, to = self.desc(q), self.desc(k), self.desc(v), self.desc(o)
        ws = None
        if algorithm != FA_FLASH2:
            nb = C.c_size_t(0)
            st = self.lib.fa_workspace_size(0, C.byref(p), C.byref(tq), C.byref(tk),
                                            C.byref(tv), C.byref(nb))
            if st:
                raise RuntimeError(self.lib.fa_last_error().decode())
            if nb.value:
                ws = torch.empty(nb.value, dtype=torch.uint8, device=q.device)
                p.workspace, p.workspace_bytes = ws.data_ptr(), nb.value
        st = self.lib.fa_forward(C.byref(p), C.byref(tq), C.byref(tk), C.byref(tv),
                                 C.byref(to), C.c_void_p(lse.data_ptr()))
        if st:
            raise RuntimeError("fa_forward: %d: %s" % (st, self.lib.fa_last_error().decode()))
        return o


def time_ms(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


BACKENDS = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)]


def sdpa_fn(backend, q, k, v, causal):
    def fn():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fn


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", default=None, help="path of libflashattn.so")
    ap.add_argument("--json", default=None, help="write all numbers here")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="N in {512, 4k, 16k} only")
    ap.add_argument("--only-ours", action="store_true", help="time only flashattn (tuning)")
    a = ap.parse_args()
    lib = a.lib or next(iter(sorted(glob.glob("build-gpu/libflashattn.so*"))), None)
    ours = Ours(lib)
    dev = torch.cuda.get_device_name()
    torch.manual_seed(0)
    results = {"gpu": dev, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
               "grid": [], "seeds": []}
    Ns = [512, 4096, 16384] if a.quick else [512, 1024, 2048, 4096, 8192, 16384]
    rows = []
    for D in (64, 128):
        for causal in (False, True):
            for N in Ns:
                B, H = 16384 // N, 2048 // D
                q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                flops = 4 * B * H * N * N * D / (2 if causal else 1)
                r = {"N": N, "D": D, "B": B, "H": H, "causal": causal}
                ref = None
                for name, be in BACKENDS:
                    if (name == "math" and N > 4096) or a.only_ours:
                        r[name] = None
                        continue
                    try:
                        fn = sdpa_fn(be, q, k, v, causal)
                        out = fn()
                        if name == "flash":
                            ref = out
                        r[name] = flops / (time_ms(fn, a.warmup, a.reps) * 1e-3) / 1e12
                    except Exception as ex:  # backend not available for this shape
                        r[name] = None
                        r[name + "_error"] = str(ex).split("\n")[0][:120]
                    torch.cuda.empty_cache()
                out = ours.forward(q, k, v, causal)
                if ref is not None:
                    r["max_abs_diff_vs_flash"] = (out.float() - ref.float()).abs().max().item()
                r["ours"] = flops / (time_ms(lambda: ours.forward(q, k, v, causal), a.warmup,
                                             a.reps) * 1e-3) / 1e12
                rows.append(r)
                results["grid"].append(r)
                print("  D=%d causal=%d N=%5d: ours %.0f flash %s TFLOP/s" % (
                    D, causal, N, r["ours"], "%.0f" % r["flash"] if r["flash"] else "-"),
                    file=sys.stderr, flush=True)
                del q, k, v
                torch.cuda.empty_cache()

    if a.only_ours:
        for r in rows:
            print("ours D=%d causal=%d N=%5d: %.1f TFLOP/s" % (r["D"], r["causal"], r["N"], r["ours"]))
        return
    # seeds' configuration: time and extra memory
    B, N, H, D = 32, 512, 16, 64
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16) for _ in range(3))
    seeds = []
    impls = [("math", sdpa_fn(SDPBackend.MATH, q, k, v, True)),
             ("flash", sdpa_fn(SDPBackend.FLASH_ATTENTION, q, k, v, True)),
             ("ours standard", lambda: ours.forward(q, k, v, True, FA_STANDARD)),
             ("ours flash2", lambda: ours.forward(q, k, v, True))]
    for name, fn in impls:
        fn()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        del out
        t = time_ms(fn, a.warmup, a.reps)
        seeds.append({"impl": name, "ms": t, "extra_MiB": extra / 2**20})
    results["seeds"] = seeds

    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)

    def fmt(x):
        return "%6.0f" % x if x is not None else "     -"

    print()
    print("Forward, %s, torch %s, %s: TFLOP/s (bf16, B*N=16384, H*D=2048)" % (
        dev, torch.__version__, results["date"]))
    print("| D   | causal | N     |   ours |  flash |  cudnn |  effic |   math | ours/flash |")
    print("|-----|--------|-------|--------|--------|--------|--------|--------|------------|")
    for r in rows:
        ratio = "%.2f" % (r["ours"] / r["flash"]) if r["flash"] else "-"
        print("| %-3d | %-6s | %-5d | %s | %s | %s | %s | %s | %10s |" % (
            r["D"], "yes" if r["causal"] else "no", r["N"], fmt(r["ours"]), fmt(r["flash"]),
            fmt(r["cudnn"]), fmt(r["efficient"]), fmt(r["math"]), ratio))
    print()
    print("Seeds' configuration (B=32, N=512, H=16, D=64, f16, causal):")
    print("| impl          |    ms | extra MiB |")
    print("|---------------|-------|-----------|")
    for s in seeds:
        print("| %-13s | %5.3f | %9.1f |" % (s["impl"], s["ms"], s["extra_MiB"]))


if __name__ == "__main__":
    main()
