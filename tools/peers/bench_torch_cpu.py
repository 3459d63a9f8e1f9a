#!/usr/bin/env python3
"""Times torch.nn.functional.scaled_dot_product_attention on the CPU for one shape and
prints one JSON line per dtype in flashattn-bench's --json schema (impl "torch-sdpa").

The shape flags are flashattn-bench's (--headdim, --heads, --kv-heads, --seqlen,
--seqlen-k, --causal/--no-causal), so tools/peers/compare-cpu.sh passes the same words to
every tool. Tensors are (B=1, H, N, D) contiguous, uniform in (-1, 1). SDPA's FLASH_ATTENTION
backend (ATen's CPU flash kernel) is asked for first; if it refuses a case, SDPA's default
choice runs and "backend" says so. GQA (Hk < H) goes through enable_gqa=True. Causal is
bottom-right aligned as in flashattn-bench: is_causal=True when Nq == Nk, else the
causal_lower_right bias. FLOPs, the warmup/repeat/--max-time loop and the median are
flashattn-bench's: 4*D*H*Nq*Nk, halved when causal.
"""
import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=0, help="default: --heads")
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--seqlen-k", type=int, default=0, help="default: --seqlen")
    p.add_argument("--causal", dest="causal", action="store_true", default=True)
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--dtypes", default="f32,bf16",
                   help="comma list of f32, bf16, f16 (default f32,bf16; a dtype SDPA "
                        "cannot run is reported with status 'unsupported')")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--max-time", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    a.kv_heads = a.kv_heads or a.heads
    a.seqlen_k = a.seqlen_k or a.seqlen
    if a.heads % a.kv_heads:
        p.error("--kv-heads must divide --heads")
    for d in a.dtypes.split(","):
        if d not in DTYPES:
            p.error(f"--dtypes: unknown dtype {d!r}")
    return a


def sdpa_call(a, q, k, v):
    """The SDPA call for this case, and a name for what it asks of SDPA."""
    kw = {"enable_gqa": True} if a.kv_heads != a.heads else {}
    if a.causal and a.seqlen != a.seqlen_k:
        from torch.nn.attention.bias import causal_lower_right
        bias = causal_lower_right(a.seqlen, a.seqlen_k)
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, **kw)
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=a.causal, **kw)


def time_it(a, fn):
    """flashattn-bench's loop: warmups, then timed runs, cut short by --max-time."""
    budget_ms = 1e3 * a.max_time
    ms, warm_left, spent = [], a.warmup, 0.0
    while len(ms) < a.repeat:
        t0 = time.perf_counter()
        fn()
        t = 1e3 * (time.perf_counter() - t0)
        spent += t
        if warm_left > 0 and not (budget_ms > 0 and t >= budget_ms):
            warm_left -= 1
            continue
        warm_left = 0
        ms.append(t)
        if budget_ms > 0 and spent >= budget_ms:
            break
    ms.sort()
    n, h = len(ms), len(ms) // 2
    return (ms[h] if n % 2 else 0.5 * (ms[h - 1] + ms[h])), ms[0], n


def run_case(a, dname):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dt = DTYPES[dname]
    g = torch.Generator().manual_seed(a.seed)

    def rand(h, n):
        return (torch.rand(1, h, n, a.headdim, generator=g) * 2 - 1).to(dt)

    q, k, v = rand(a.heads, a.seqlen), rand(a.kv_heads, a.seqlen_k), rand(a.kv_heads, a.seqlen_k)
    call = sdpa_call(a, q, k, v)
    rec = {"status": "ok"}
    with torch.inference_mode():
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                call()
            backend = "flash"

            def fn():
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    call()
        except RuntimeError:
            backend, fn = "default", call
        try:
            rec["ms"], rec["ms_min"], rec["runs"] = time_it(a, fn)
        except RuntimeError as e:
            rec = {"status": "unsupported", "ms": None, "ms_min": None, "runs": 0,
                   "error": str(e).splitlines()[0][:300]}
    rec["backend"] = backend
    return rec


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    flops = 4.0 * a.headdim * a.heads * a.seqlen * a.seqlen_k * (0.5 if a.causal else 1.0)
    for dname in a.dtypes.split(","):
        r = run_case(a, dname)
        ok = r["status"] == "ok"
        out = {
            "record": "case", "impl": "torch-sdpa", "device": "cpu", "pass": "fwd",
            "B": 1, "H": a.heads, "Hk": a.kv_heads, "Nq": a.seqlen, "Nk": a.seqlen_k,
            "D": a.headdim, "dtype": dname, "layout": "bhnd", "causal": a.causal,
            "window_left": None, "window_right": None, "softcap": 0,
            "status": r["status"], "ms": r["ms"], "ms_min": r["ms_min"], "flops": flops,
            "gflops": flops / (r["ms"] * 1e-3) * 1e-9 if ok else None,
            "extra_bytes": None, "threads": torch.get_num_threads(), "runs": r["runs"],
            "repeat": a.repeat, "warmup": a.warmup, "max_time": a.max_time, "seed": a.seed,
            "backend": r["backend"], "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "version": f"torch {torch.__version__}",
        }
        if "error" in r:
            out["error"] = r["error"]
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
