#!/usr/bin/env python3
"""Forward and backward benchmark on one GPU: flashattn's CUDA kernels (loaded with
ctypes, called in-process on torch-allocated tensors and torch's current stream)
against PyTorch SDPA's flash, cuDNN, memory-efficient and math backends, timed the
same way in the same process (CUDA events, median of --reps after --warmup).

Grid (FlashAttention-2 paper): bf16, B*N = 16384, H*D = 2048, N in 512..16k,
D in {64, 128}, causal and not. Forward TFLOP/s = 4*B*H*N*N*D / t (halved for
causal); backward counted as 2.5x and forward+backward as 3.5x the forward FLOPs.
SDPA's backward is torch.autograd.grad of its output (fresh gradients, nothing
accumulated); ours is fa_backward with a preallocated workspace, in the default
(atomic dQ) and the deterministic mode.
Then (forward pass) the seeds' configuration (B=32, N=512, H=16, D=64, f16, causal):
time and extra memory; (backward pass) peak memory of forward+backward against N
(B=1, H=16, D=128, bf16, N 1k..64k) for ours, SDPA flash and SDPA math.

Usage: python3 tools/peers/bench_sdpa.py --lib build-gpu/libflashattn.so [--pass fwd|bwd|all]
       [--quick] [--json out.json]
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


def _params_fields():
    """fa_params' fields, read from include/flashattn.h so the ctypes layout
    follows the header (it grows as features land)."""
    import re
    hdr = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "include", "flashattn.h")
    text = open(hdr).read()
    body = text[text.index("typedef struct fa_params {"):text.index("} fa_params;")]
    body = re.sub(r"/\*.*?\*/", "", body.split("{", 1)[1], flags=re.S)
    types = {"int": C.c_int, "float": C.c_float, "int64_t": C.c_int64, "uint64_t": C.c_uint64,
             "size_t": C.c_size_t, "fa_device": C.c_int, "fa_algorithm": C.c_int}
    fields = []
    for decl in body.split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        m = re.match(r"(const )?(\w+)\s*(.*)", decl)
        base, names = m.group(2), m.group(3)
        for nm in names.split(","):
            nm = nm.strip()
            fields.append((nm.lstrip("*"), C.c_void_p if nm.startswith("*") else types[base]))
    return fields


class FaParams(C.Structure):
    _fields_ = _params_fields()


FA_F16, FA_BF16 = 1, 2
FA_FLASH2, FA_STANDARD = 0, 2


class Ours:
    def __init__(self, path):
        self.lib = C.CDLL(path)
        self.lib.fa_forward.restype = C.c_int
        self.lib.fa_backward.restype = C.c_int
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

    def workspace(self, pass_, p, tq, tk, tv, q):
        """A torch buffer of the bytes fa_workspace_size asks for the pass (0 forward, 1
        backward), set in p (so it counts in peak memory), or None. The flash forward
        needs a few bytes on CUDA (the Hopper kernel's block counter): without them the
        library would allocate and free a workspace inside every timed call."""
        nb = C.c_size_t(0)
        st = self.lib.fa_workspace_size(pass_, C.byref(p), C.byref(tq), C.byref(tk), C.byref(tv),
                                        C.byref(nb))
        if st:
            raise RuntimeError(self.lib.fa_last_error().decode())
        if not nb.value:
            return None
        ws = torch.empty(nb.value, dtype=torch.uint8, device=q.device)
        p.workspace, p.workspace_bytes = ws.data_ptr(), nb.value
        return ws

    def forward(self, q, k, v, causal, algorithm=FA_FLASH2, out=None):
        B, H, N, D = q.shape
        o = torch.empty_like(q) if out is None else out
        lse = torch.empty(B * H * N, dtype=torch.float32, device=q.device)
        p = self.params(causal, algorithm)
        tq, tk, tv, to = self.desc(q), self.desc(k), self.desc(v), self.desc(o)
        ws = self.workspace(0, p, tq, tk, tv, q)  # kept alive until the call returns
        st = self.lib.fa_forward(C.byref(p), C.byref(tq), C.byref(tk), C.byref(tv),
                                 C.byref(to), C.c_void_p(lse.data_ptr()))
        if st:
            raise RuntimeError("fa_forward: %d: %s" % (st, self.lib.fa_last_error().decode()))
        return o

    def forward_lse(self, q, k, v, causal, o, lse):
        p = self.params(causal)
        tq, tk, tv = self.desc(q), self.desc(k), self.desc(v)
        ws = self.workspace(0, p, tq, tk, tv, q)  # kept alive until the call returns
        st = self.lib.fa_forward(C.byref(p), C.byref(tq), C.byref(tk), C.byref(tv),
                                 C.byref(self.desc(o)), C.c_void_p(lse.data_ptr()))
        if st:
            raise RuntimeError("fa_forward: %d: %s" % (st, self.lib.fa_last_error().decode()))

    def backward_fn(self, q, k, v, o, do, lse, causal, deterministic=False):
        """A closure running fa_backward into fresh dq, dk, dv with a workspace
        allocated once (by torch, so peak-memory numbers count it)."""
        p = self.params(causal)
        p.deterministic = int(deterministic)
        t = [self.desc(x) for x in (q, k, v, o, do)]
        grads = [torch.empty_like(x) for x in (q, k, v)]
        tg = [self.desc(x) for x in grads]
        ws = self.workspace(1, p, t[0], t[1], t[2], q)
        lp = C.c_void_p(lse.data_ptr())

        def fn():
            st = self.lib.fa_backward(C.byref(p), *[C.byref(x) for x in t], lp,
                                      *[C.byref(x) for x in tg])
            if st:
                raise RuntimeError("fa_backward: %d: %s" % (st, self.lib.fa_last_error().decode()))
            return grads
        fn.workspace = ws
        return fn


def peak_extra(fn):
    """Peak bytes allocated during one call of fn above what was allocated before it (the
    inputs); outputs and workspace count."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    r = fn()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    del r
    return extra


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


def fmt(x):
    return "%6.0f" % x if x is not None else "     -"


def grid_shapes(quick, dims=(64, 128)):
    Ns = [512, 4096, 16384] if quick else [512, 1024, 2048, 4096, 8192, 16384]
    for D in dims:
        for causal in (False, True):
            for N in Ns:
                yield D, causal, N, 16384 // N, 2048 // D


def fwd_grid(a, ours, results):
    rows = []
    for D, causal, N, B, H in grid_shapes(a.quick, a.headdim):
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
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
        print("  fwd D=%d causal=%d N=%5d: ours %.0f flash %s TFLOP/s" % (
            D, causal, N, r["ours"], "%.0f" % r["flash"] if r["flash"] else "-"),
            file=sys.stderr, flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    results["grid"] = rows
    if a.only_ours:
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
        extra = peak_extra(fn)
        t = time_ms(fn, a.warmup, a.reps)
        seeds.append({"impl": name, "ms": t, "extra_MiB": extra / 2**20})
    results["seeds"] = seeds


def print_fwd(results):
    print()
    print("Forward, %s, torch %s, %s: TFLOP/s (bf16, B*N=16384, H*D=2048)" % (
        results["gpu"], results["torch"], results["date"]))
    print("| D   | causal | N     |   ours |  flash |  cudnn |  effic |   math | ours/flash |")
    print("|-----|--------|-------|--------|--------|--------|--------|--------|------------|")
    for r in results["grid"]:
        ratio = "%.2f" % (r["ours"] / r["flash"]) if r["flash"] else "-"
        print("| %-3d | %-6s | %-5d | %s | %s | %s | %s | %s | %10s |" % (
            r["D"], "yes" if r["causal"] else "no", r["N"], fmt(r["ours"]), fmt(r["flash"]),
            fmt(r["cudnn"]), fmt(r["efficient"]), fmt(r["math"]), ratio))
    if results.get("seeds"):
        print()
        print("Seeds' configuration (B=32, N=512, H=16, D=64, f16, causal):")
        print("| impl          |    ms | extra MiB |")
        print("|---------------|-------|-----------|")
        for s in results["seeds"]:
            print("| %-13s | %5.3f | %9.1f |" % (s["impl"], s["ms"], s["extra_MiB"]))


def sdpa_grad_fns(be, q, k, v, do, causal):
    """(backward only, forward+backward) closures for one SDPA backend."""
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

    def fwd():
        with sdpa_kernel([be]):
            return F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
    out = fwd()

    def bwd():
        return torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)

    def fwd_bwd():
        return torch.autograd.grad(fwd(), (qg, kg, vg), do)
    return bwd, fwd_bwd


def bwd_grid(a, ours, results):
    rows = []
    for D, causal, N, B, H in grid_shapes(a.quick, a.headdim):
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))
        fl = 4 * B * H * N * N * D / (2 if causal else 1)
        r = {"N": N, "D": D, "B": B, "H": H, "causal": causal}
        ref = None
        for name, be in BACKENDS[:3]:
            if a.only_ours:
                r[name] = r[name + "_fb"] = None
                continue
            try:
                bwd, fwd_bwd = sdpa_grad_fns(be, q, k, v, do, causal)
                g = bwd()
                if name == "flash":
                    ref = [x.float() for x in g]
                r[name] = 2.5 * fl / (time_ms(bwd, a.warmup, a.reps) * 1e-3) / 1e12
                r[name + "_fb"] = 3.5 * fl / (time_ms(fwd_bwd, a.warmup, a.reps) * 1e-3) / 1e12
                del bwd, fwd_bwd, g
            except Exception as ex:  # backend not available for this shape
                r[name] = r[name + "_fb"] = None
                r[name + "_error"] = str(ex).split("\n")[0][:120]
            torch.cuda.empty_cache()
        o = torch.empty_like(q)
        lse = torch.empty(B * H * N, dtype=torch.float32, device="cuda")
        ours.forward_lse(q, k, v, causal, o, lse)
        for det in (False, True):
            bwd = ours.backward_fn(q, k, v, o, do, lse, causal, det)
            g = bwd()
            key = "ours_det" if det else "ours"
            if ref is not None:
                r[key + "_max_rel_diff_vs_flash"] = max(
                    ((x.float() - y).abs().max() / y.abs().max()).item() for x, y in zip(g, ref))
            r[key] = 2.5 * fl / (time_ms(bwd, a.warmup, a.reps) * 1e-3) / 1e12
            if not det:
                def fwd_bwd():
                    ours.forward_lse(q, k, v, causal, o, lse)
                    return bwd()
                r["ours_fb"] = 3.5 * fl / (time_ms(fwd_bwd, a.warmup, a.reps) * 1e-3) / 1e12
            del bwd, g
        rows.append(r)
        print("  bwd D=%d causal=%d N=%5d: ours %.0f (det %.0f) flash %s TFLOP/s" % (
            D, causal, N, r["ours"], r["ours_det"], "%.0f" % r["flash"] if r["flash"] else "-"),
            file=sys.stderr, flush=True)
        del q, k, v, do, o, lse
        torch.cuda.empty_cache()
    results["bwd_grid"] = rows


def mem_table(a, ours, results):
    """Peak memory of forward+backward (inputs excluded, outputs and workspace in)."""
    B, H, D = 1, 16, 128
    Ns = [1024, 4096, 16384, 65536] if a.quick else [1024, 2048, 4096, 8192, 16384, 32768, 65536]
    rows = []
    for N in Ns:
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))
        r = {"N": N}

        def ours_fb():
            o = torch.empty_like(q)
            lse = torch.empty(B * H * N, dtype=torch.float32, device="cuda")
            ours.forward_lse(q, k, v, False, o, lse)
            return ours.backward_fn(q, k, v, o, do, lse, False)()

        impls = [("ours", ours_fb)]
        for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("math", SDPBackend.MATH)):
            def sd(be=be):
                qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
                with sdpa_kernel([be]):
                    out = F.scaled_dot_product_attention(qg, kg, vg)
                return torch.autograd.grad(out, (qg, kg, vg), do)
            impls.append((name, sd))
        for name, fn in impls:
            try:
                r[name] = peak_extra(fn) / 2**20
            except torch.OutOfMemoryError:
                r[name] = None
            torch.cuda.empty_cache()
        rows.append(r)
        print("  mem N=%d: %s" % (N, r), file=sys.stderr, flush=True)
        del q, k, v, do
        torch.cuda.empty_cache()
    results["mem"] = rows


def print_bwd(results):
    print()
    print("Backward and forward+backward, %s, torch %s, %s: TFLOP/s (bf16, B*N=16384, "
          "H*D=2048; backward = 2.5x, fwd+bwd = 3.5x the forward FLOPs)" % (
              results["gpu"], results["torch"], results["date"]))
    print("| D   | causal | N     | bwd ours | ours det |  flash |  cudnn |  effic | ours/flash "
          "| det/ours | f+b ours | f+b flash | f+b cudnn | f+b ours/flash |")
    print("|-----|--------|-------|----------|----------|--------|--------|--------|------------"
          "|----------|----------|-----------|-----------|----------------|")
    for r in results["bwd_grid"]:
        ratio = "%.2f" % (r["ours"] / r["flash"]) if r["flash"] else "-"
        fb = "%.2f" % (r["ours_fb"] / r["flash_fb"]) if r["flash_fb"] else "-"
        print("| %-3d | %-6s | %-5d |   %s |   %s | %s | %s | %s | %10s | %8.2f |   %s |    %s |"
              "    %s | %14s |" % (
                  r["D"], "yes" if r["causal"] else "no", r["N"], fmt(r["ours"]),
                  fmt(r["ours_det"]), fmt(r["flash"]), fmt(r["cudnn"]), fmt(r["efficient"]),
                  ratio, r["ours_det"] / r["ours"], fmt(r["ours_fb"]), fmt(r["flash_fb"]),
                  fmt(r["cudnn_fb"]), fb))
    if results.get("mem"):
        print()
        print("Peak extra memory of forward+backward, MiB (B=1, H=16, D=128, bf16, non-causal; "
              "outputs, gradients and workspace included, inputs not; - = out of memory):")
        print("| N     |     ours |    flash |     math |")
        print("|-------|----------|----------|----------|")
        for r in results["mem"]:
            print("| %-5d | %s | %s | %s |" % tuple(
                [r["N"]] + ["%8.0f" % r[x] if r[x] is not None else "       -"
                            for x in ("ours", "flash", "math")]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", default=None, help="path of libflashattn.so")
    ap.add_argument("--json", default=None, help="write all numbers here")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="N in {512, 4k, 16k} only")
    ap.add_argument("--pass", dest="which", choices=("fwd", "bwd", "all"), default="all")
    ap.add_argument("--no-mem", action="store_true", help="skip the memory-vs-N table")
    ap.add_argument("--only-ours", action="store_true", help="time only flashattn (tuning)")
    ap.add_argument("--headdim", type=int, nargs="+", choices=(32, 64, 72, 80, 96, 128, 192, 256),
                    default=(64, 128),
                    help="head dims of the grids (both by default)")
    a = ap.parse_args()
    lib = a.lib or next(iter(sorted(glob.glob("build-gpu/libflashattn.so*"))), None)
    ours = Ours(lib)
    torch.manual_seed(0)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "date": datetime.date.today().isoformat()}
    if a.which in ("fwd", "all"):
        fwd_grid(a, ours, results)
    if a.which in ("bwd", "all"):
        bwd_grid(a, ours, results)
        if not a.no_mem and not a.only_ours:
            mem_table(a, ours, results)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if a.only_ours:
        for r in results.get("grid", []):
            print("fwd ours D=%d causal=%d N=%5d: %.1f TFLOP/s" % (r["D"], r["causal"], r["N"], r["ours"]))
        for r in results.get("bwd_grid", []):
            print("bwd ours D=%d causal=%d N=%5d: %.1f (det %.1f) TFLOP/s" % (
                r["D"], r["causal"], r["N"], r["ours"], r["ours_det"]))
        return
    if "grid" in results:
        print_fwd(results)
    if "bwd_grid" in results:
        print_bwd(results)


if __name__ == "__main__":
    main()
