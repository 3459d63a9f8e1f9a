#!/usr/bin/env python3
"""Host cost of one attention call from PyTorch: flashattn beside torch's SDPA.

For each shape, per call: host µs (N calls issued back to back without synchronising,
the CPU time the caller spends) and whole-call µs (the same N calls, then a
synchronisation: what a step costs when the kernel is short). Candidates:

    flashattn       flashattn.flash_attn_func on (B, N, H, D) tensors (decode:
                    flash_attn_with_kvcache); flashattn-sdpa: flashattn's
                    scaled_dot_product_attention on (B, H, N, D); flashattn-bhnd
                    (decode): the KV-cache call on the cache SDPA reads, each K/V
                    head's keys contiguous (flash-attn's own cache layout is
                    (B, N, H, D), where a tile of keys is a strided read)
    sdpa            F.scaled_dot_product_attention, default backend selection, no
                    context manager
    sdpa-flash      SDPA inside sdpa_kernel(FLASH_ATTENTION) (entered once per batch of
    sdpa-cudnn      calls), SDPA inside sdpa_kernel(CUDNN_ATTENTION) (CUDA only)

Shapes: the seeds' (B32 N512 H16 D64 f16 causal), a GPT-2-small layer (B8 N1024 H12
D64 causal bf16, forward and forward+backward), decode steps (B1 and B16, 32 query heads
over 8 K/V heads, D128, 2k/4k/8k cached keys). On the CPU (--device cpu, or no GPU) the
same cases run with small sizes (--small, the default there), so that the host cost,
not the arithmetic, is what is measured; CUDA-only backends are skipped.

Rounds alternate the candidates (noise on a shared machine hits all of them alike);
the table shows the median over rounds and, in brackets, the best.

    python tools/bench_overhead.py                          # CUDA if available
    python tools/bench_overhead.py --device cpu --rounds 15
    python tools/bench_overhead.py --json results.json --only gpt2
"""
import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

try:
    import flashattn
except ImportError:  # a checkout without `pip install .`
    import os
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
    import flashattn

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # torch < 2.3
    SDPBackend = sdpa_kernel = None


# ---- cases ------------------------------------------------------------------------------

def cases(small):
    """(name, kind, dict): kind is "fwd", "fwdbwd" or "decode"."""
    if small:  # float32: the CPU's arithmetic in it is short, the host cost shows
        seeds = dict(b=1, n=16, h=2, d=32, dtype="f32", causal=True)
        gpt2 = dict(b=1, n=16, h=2, d=32, dtype="f32", causal=True)
        dec = [dict(b=b, keys=n, hq=4, hk=1, d=32, dtype="f32") for b in (1, 2) for n in (32, 64)]
    else:
        seeds = dict(b=32, n=512, h=16, d=64, dtype="f16", causal=True)
        gpt2 = dict(b=8, n=1024, h=12, d=64, dtype="bf16", causal=True)
        dec = [dict(b=b, keys=n, hq=32, hk=8, d=128) for b in (1, 16) for n in (2048, 4096, 8192)]
    out = [("seeds B%(b)d N%(n)d H%(h)d D%(d)d %(dtype)s causal" % seeds, "fwd", seeds),
           ("gpt2 B%(b)d N%(n)d H%(h)d D%(d)d %(dtype)s causal" % gpt2, "fwd", gpt2),
           ("gpt2 B%(b)d N%(n)d H%(h)d D%(d)d %(dtype)s causal" % gpt2, "fwdbwd", gpt2)]
    for c in dec:
        c.setdefault("dtype", "f16")
        out.append(("decode B%(b)d H%(hq)d/%(hk)d D%(d)d keys %(keys)d %(dtype)s" % c, "decode", c))
    return out


DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def _dtype(name, device):
    # the CPU runs every dtype; its SDPA flash kernel takes f16/bf16 as well
    return DTYPES[name]


def candidates(kind, c, device, splits=()):
    """{name: (callable, setup_context)} for one case; the callable makes one call."""
    dt = _dtype(c.get("dtype", "f16"), device)
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, grad=False):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dt).requires_grad_(grad)

    backends = {}
    if sdpa_kernel is not None:
        backends["sdpa-flash"] = SDPBackend.FLASH_ATTENTION
        if device == "cuda" and hasattr(SDPBackend, "CUDNN_ATTENTION"):
            backends["sdpa-cudnn"] = SDPBackend.CUDNN_ATTENTION
    res = {}
    if kind in ("fwd", "fwdbwd"):
        grad = kind == "fwdbwd"
        b, n, h, d = c["b"], c["n"], c["h"], c["d"]
        q, k, v = (rand(b, n, h, d, grad=grad) for _ in range(3))          # (B, N, H, D)
        qs, ks, vs = (rand(b, h, n, d, grad=grad) for _ in range(3))       # (B, H, N, D)
        dout, douts = torch.randn_like(q), torch.randn_like(qs)
        causal = c["causal"]

        def step(f, inputs, g_out):
            if not grad:
                return lambda: f(*inputs)
            return lambda: torch.autograd.grad(f(*inputs), inputs, g_out)

        res["flashattn"] = (step(lambda q, k, v: flashattn.flash_attn_func(q, k, v, causal=causal),
                                 (q, k, v), dout), None)
        res["flashattn-sdpa"] = (step(lambda q, k, v: flashattn.scaled_dot_product_attention(
            q, k, v, is_causal=causal), (qs, ks, vs), douts), None)
        sd = step(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                  (qs, ks, vs), douts)
        res["sdpa"] = (sd, None)
        for name, be in backends.items():
            res[name] = (sd, be)
    else:
        b, L, hq, hk, d = c["b"], c["keys"], c["hq"], c["hk"], c["d"]
        q = rand(b, 1, hq, d)
        kc, vc = rand(b, L, hk, d), rand(b, L, hk, d)
        lens = torch.full((b,), L, dtype=torch.int32, device=device)
        res["flashattn"] = (lambda: flashattn.flash_attn_with_kvcache(q, kc, vc,
                                                                      cache_seqlens=lens), None)
        for sp in splits:  # the keys split over sp blocks a head, as asked
            res["flashattn-splits%d" % sp] = (
                lambda sp=sp: flashattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                                num_splits=sp), None)
        qs = q.transpose(1, 2).contiguous()
        ks, vs = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
        # ours on the memory SDPA reads: each K/V head's keys contiguous (B, H, N, D),
        # as views made once (outside the timing, like the cache itself)
        kb, vb = ks.transpose(1, 2), vs.transpose(1, 2)
        res["flashattn-bhnd"] = (lambda: flashattn.flash_attn_with_kvcache(
            q, kb, vb, cache_seqlens=lens), None)
        # K/V heads repeated for backends without grouped-query support (outside the timing)
        kr, vr = ks.repeat_interleave(hq // hk, 1), vs.repeat_interleave(hq // hk, 1)
        res["sdpa"] = (_gqa_call(qs, ks, vs, kr, vr, None), None)
        for name, be in backends.items():
            res[name] = (_gqa_call(qs, ks, vs, kr, vr, be), be)
    return res


def _gqa_call(qs, ks, vs, kr, vr, backend):
    """SDPA with enable_gqa where the backend takes it, else on repeated K/V heads."""
    def gqa():
        return F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)

    def rep():
        return F.scaled_dot_product_attention(qs, kr, vr)

    try:
        with _ctx(backend):
            gqa()
        return gqa
    except (RuntimeError, TypeError):
        return rep


class _ctx:
    def __init__(self, backend):
        self.cm = sdpa_kernel(backend) if backend is not None else None

    def __enter__(self):
        if self.cm is not None:
            self.cm.__enter__()

    def __exit__(self, *exc):
        if self.cm is not None:
            return self.cm.__exit__(*exc)


# ---- timing -----------------------------------------------------------------------------

def measure(fn, backend, calls, device):
    """(host µs per call, whole-call µs per call) for `calls` calls."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with _ctx(backend):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


def run_case(kind, c, device, calls, rounds, warmup, splits=()):
    cands = candidates(kind, c, device, splits)
    usable = {}
    for name, (fn, be) in cands.items():
        try:
            with _ctx(be):
                for _ in range(warmup):
                    fn()
            usable[name] = (fn, be)
        except Exception as e:  # a backend that does not take this case
            print("  %-15s skipped: %s" % (name, str(e).splitlines()[0][:100]), file=sys.stderr)
    samples = {name: ([], []) for name in usable}
    for _ in range(rounds):
        for name, (fn, be) in usable.items():
            host, whole = measure(fn, be, calls, device)
            samples[name][0].append(host)
            samples[name][1].append(whole)
    return {name: dict(host_median=statistics.median(h), host_best=min(h),
                       whole_median=statistics.median(w), whole_best=min(w))
            for name, (h, w) in samples.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"],
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=200, help="calls per timed batch")
    ap.add_argument("--rounds", type=int, default=7, help="timed batches per candidate")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--small", action="store_true", default=None,
                    help="small shapes (the default on the CPU)")
    ap.add_argument("--full", action="store_false", dest="small", help="the full shapes")
    ap.add_argument("--only", default="", help="comma-separated substrings of case names")
    ap.add_argument("--threads", type=int, default=0, help="CPU: torch.set_num_threads")
    ap.add_argument("--decode-splits", default="",
                    help="decode steps: also ours with these num_splits (comma-separated)")
    ap.add_argument("--json", default="", help="write the results here")
    a = ap.parse_args()
    small = a.small if a.small is not None else a.device == "cpu"
    if a.threads:
        torch.set_num_threads(a.threads)
    dev_name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu (%d threads)" % (
        torch.get_num_threads())
    print("# flashattn %s, torch %s, %s; %d calls x %d rounds; median [best] µs per call"
          % (flashattn.__version__, torch.__version__, dev_name, a.calls, a.rounds))
    only = [s for s in a.only.split(",") if s]
    results = []
    for name, kind, c in cases(small):
        label = "%s %s" % (name, {"fwd": "forward", "fwdbwd": "forward+backward",
                                  "decode": "decode step"}[kind])
        if only and not any(s in label for s in only):
            continue
        splits = [int(x) for x in a.decode_splits.split(",") if x]
        r = run_case(kind, c, a.device, a.calls, a.rounds, a.warmup, splits)
        print("\n## %s" % label)
        print("| impl | host µs/call | whole-call µs/call |")
        print("| --- | ---: | ---: |")
        for impl, m in r.items():
            print("| %s | %.1f [%.1f] | %.1f [%.1f] |" % (impl, m["host_median"], m["host_best"],
                                                        m["whole_median"], m["whole_best"]))
        sys.stdout.flush()
        results.append(dict(case=label, kind=kind, shape=c, results=r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=dev_name, torch=torch.__version__, calls=a.calls,
                           rounds=a.rounds, cases=results), f, indent=1)


if __name__ == "__main__":
    main()
