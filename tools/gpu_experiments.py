#!/usr/bin/env python3
"""The papers' experiments on one GPU, ours against PyTorch SDPA's backends in the same
process: one CSV per experiment (and a PNG each with --plot-only, here or on the GPU machine).

  seeds   B=32, N=512, H=16, D=64, f16, causal: time and extra memory of the forward and of
          forward+backward for ours (standard, flash1, flash2) and SDPA (math, efficient, flash,
          cudnn). flash1 runs the FlashAttention-2 kernel on the GPU (src/cuda/forward.cu);
          ours standard is forward-only on the GPU (cuBLAS; no CUDA backward)
  fig3    FlashAttention Figure 3: fwd, bwd, fwd+bwd runtime and peak memory vs N = 128 ...
          65536, B = max(1, 16384 / N), H=16, D=64, f16, not causal; "oom" where it ran out
  io      the IO table (GPT-2 medium: B=64, N=1024, H=16, D=64, f16, fwd+bwd): GFLOP, HBM
          bytes counted analytically with our tile sizes and measured by ncu
          (dram__bytes_read.sum + dram__bytes_write.sum, one call between cudaProfilerStart/Stop)
  blocks  FlashAttention Figure 2 (middle): forward runtime and HBM bytes vs block size
          (flashattn-block-sweep, analytic and ncu)
  grid    FlashAttention-2's grid (tools/peers/bench_sdpa.py's, bf16, B*N=16384, H*D=2048) with the
          measured bf16 matmul peak (8192^3) as the roof

Usage: python3 tools/gpu_experiments.py --lib build-gpu/libflashattn.so --bin build-gpu/bin
           [--only seeds,fig3,io,blocks,grid] [--quick] [--out results/gpu] [--no-ncu]
       python3 tools/gpu_experiments.py --plot-only | --tables [--out results/gpu]
"""
import argparse
import csv
import datetime
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "peers"))  # bench_sdpa
from experiments import io_bytes, log_ticks, md_table, num, plt_or_none, read_rows, write_csv  # noqa: E402

T0 = time.time()


def log(msg):
    sys.stderr.write("[%.0f s] %s\n" % (time.time() - T0, msg))
    sys.stderr.flush()


# ---------------------------------------------------------------- measuring (needs torch)

def torch_env():
    global torch, F, SDPBackend, sdpa_kernel, bs
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import bench_sdpa as bs


SDPA = ["math", "efficient", "flash", "cudnn"]


def backend(name):
    return {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[name]


ALGO = {"standard": 2, "flash1": 1, "flash2": 0}


def make_fns(impl, q, k, v, do, causal, ours):
    """(fwd, bwd, fwd_bwd) closures; None where the implementation has no such pass."""
    if impl.startswith("sdpa "):  # bench_sdpa's closures (its bwd runs the forward once now)
        be = backend(impl[5:])
        fwd = bs.sdpa_fn(be, q, k, v, causal)
        return (lambda: torch.no_grad()(fwd)(),) + bs.sdpa_grad_fns(be, q, k, v, do, causal)
    algo = ALGO[impl.split()[1]]
    B, H, N, D = q.shape

    def fwd():
        return ours.forward(q, k, v, causal, algo)
    if algo == ALGO["standard"]:
        return fwd, None, None
    o = torch.empty_like(q)
    lse = torch.empty(B * H * N, dtype=torch.float32, device="cuda")
    state = {}

    def bwd():
        if "fn" not in state:
            ours.forward_lse(q, k, v, causal, o, lse)
            state["fn"] = ours.backward_fn(q, k, v, o, do, lse, causal)
        return state["fn"]()

    def fwd_bwd():
        o2 = torch.empty_like(q)
        l2 = torch.empty(B * H * N, dtype=torch.float32, device="cuda")
        ours.forward_lse(q, k, v, causal, o2, l2)
        return ours.backward_fn(q, k, v, o2, do, l2, causal)()
    return fwd, bwd, fwd_bwd


def timed(fn, budget_ms=300.0):
    """Median ms; repetitions scaled so a case takes about budget_ms."""
    torch.cuda.synchronize()
    t = time.time()
    fn()
    torch.cuda.synchronize()
    first = (time.time() - t) * 1e3
    reps = int(max(3, min(20, budget_ms / max(first, 1e-3))))
    return bs.time_ms(fn, 1 if first > 50 else 3, reps)


def failure(ex):
    """A run's status from its exception: "oom" when memory ran out."""
    msg = str(ex).split("\n")[0]
    low = msg.lower()
    oom = isinstance(ex, torch.OutOfMemoryError) or "out of memory" in low or "alloc" in low
    return "oom" if oom else "error: " + msg[:100]


def measure(impl, q, k, v, do, causal, ours, passes, want_mem):
    """Rows (impl, pass, ms, extra_MiB or status) for one shape."""
    rows = []
    try:
        fns = dict(zip(("fwd", "bwd", "fwdbwd"), make_fns(impl, q, k, v, do, causal, ours)))
    except Exception as ex:  # e.g. out of memory in SDPA's eager forward
        return [dict(impl=impl, status=failure(ex))]
    for ps in passes:
        fn = fns[ps]
        if fn is None:
            continue
        r = dict(impl=impl, **{"pass": ps})
        try:
            if want_mem and ps != "bwd":
                r["extra_MiB"] = round(bs.peak_extra(fn) / 2 ** 20, 2)
            r["ms"] = timed(fn)
            r["status"] = "ok"
        except RuntimeError as ex:
            r["status"] = failure(ex)
        rows.append(r)
        torch.cuda.empty_cache()
    del fns
    torch.cuda.empty_cache()
    return rows


def tensors(B, H, N, D, dtype):
    return [torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(4)]


def flops_fwd(B, H, N, D, causal):
    return 4.0 * B * H * N * N * D / (2 if causal else 1)


MULT = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
FIELDS = ["impl", "pass", "B", "H", "N", "D", "dtype", "causal", "status", "ms", "tflops",
          "extra_MiB"]
OURS = ["ours standard", "ours flash1", "ours flash2"]


def exp_seeds(a, ours, meta):
    B, N, H, D = 32, 512, 16, 64
    q, k, v, do = tensors(B, H, N, D, torch.float16)
    rows = []
    for impl in OURS + ["sdpa " + s for s in SDPA]:
        for r in measure(impl, q, k, v, do, True, ours, ("fwd", "fwdbwd"), True):
            r.update(B=B, H=H, N=N, D=D, dtype="f16", causal=True)
            if r.get("status") == "ok":
                r["tflops"] = round(MULT[r["pass"]] * flops_fwd(B, H, N, D, True) / r["ms"] / 1e9, 1)
            rows.append(r)
            log("seeds %s %s: %s" % (impl, r.get("pass"), r.get("ms", r.get("status"))))
    write_csv(os.path.join(a.out, "seeds.csv"), rows, FIELDS)


def exp_fig3(a, ours, meta):
    ns = [128, 1024, 8192, 65536] if a.quick else [128 << i for i in range(10)]
    rows = []
    for i, N in enumerate(ns):
        B, H, D = max(1, 16384 // N), 16, 64
        q, k, v, do = tensors(B, H, N, D, torch.float16)
        for impl in ["ours standard", "ours flash2"] + ["sdpa " + s for s in SDPA]:
            for r in measure(impl, q, k, v, do, False, ours, ("fwd", "bwd", "fwdbwd"), True):
                r.update(B=B, H=H, N=N, D=D, dtype="f16", causal=False)
                if r.get("status") == "ok":
                    r["tflops"] = round(MULT[r["pass"]] * flops_fwd(B, H, N, D, False) / r["ms"]
                                        / 1e9, 1)
                rows.append(r)
        log("fig3 N=%d (%d of %d) done" % (N, i + 1, len(ns)))
        del q, k, v, do
        torch.cuda.empty_cache()
    write_csv(os.path.join(a.out, "fig3.csv"), rows, FIELDS)


# ---- IO: one fwd+bwd between cudaProfilerStart/Stop, read by ncu in a child process

IO_SHAPE = dict(B=64, H=16, N=1024, D=64)
IO_IMPLS = [("sdpa math", "fwdbwd"), ("sdpa flash", "fwdbwd"), ("ours flash2", "fwdbwd"),
            ("sdpa math", "fwd"), ("ours standard", "fwd"), ("ours flash2", "fwd")]


def probe(a, ours):
    """Child under ncu: warm up, then profile exactly one call of a.probe's pass."""
    impl, ps = a.probe.split(":")
    s = IO_SHAPE
    q, k, v, do = tensors(s["B"], s["H"], s["N"], s["D"], torch.float16)
    fns = dict(zip(("fwd", "bwd", "fwdbwd"), make_fns(impl, q, k, v, do, False, ours)))
    fns[ps]()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fns[ps]()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


NCU_METRICS = "dram__bytes_read.sum,dram__bytes_write.sum"


def ncu_kernels(args):
    """ncu's DRAM bytes (read + written) of each kernel it profiled, in launch order."""
    full = ["ncu", "--clock-control", "none", "--metrics", NCU_METRICS, "--csv", "--print-units",
            "base"] + args
    out = subprocess.run(full, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith('"')]
    if not lines:
        raise RuntimeError("ncu printed no CSV: " + (out.stderr or out.stdout)[-300:])
    per = {}
    for row in csv.DictReader(lines):
        try:
            val = float(str(row.get("Metric Value", "")).replace(",", ""))
            per[int(row["ID"])] = per.get(int(row["ID"]), 0.0) + val
        except (ValueError, KeyError):
            continue
    return [per[i] for i in sorted(per)]


def exp_io(a, ours, meta):
    s = IO_SHAPE
    q, k, v, do = tensors(s["B"], s["H"], s["N"], s["D"], torch.float16)
    rows = []
    fl = flops_fwd(s["B"], s["H"], s["N"], s["D"], False)
    for impl, ps in IO_IMPLS:
        r = dict(impl=impl, **{"pass": ps}, **s)
        m = measure(impl, q, k, v, do, False, ours, (ps,), False)[0]
        r["ms"] = m.get("ms")
        r["status"] = m.get("status")
        # forward+backward recomputes S in the backward: 2 matmuls forward, 5 backward
        r["gflop"] = round(fl * (1 if ps == "fwd" else 3.5) / 1e9, 1)
        kind = "standard" if impl in ("sdpa math", "ours standard") else "flash"
        # our tile sizes at D=64: forward Br=128, backward Bc=128 (src/cuda/*_kernel.cuh)
        b = io_bytes(kind, s["N"], s["D"], s["H"], s["B"], 2, 128, 128, backward=ps != "fwd")
        r["hbm_gb_analytic"] = round(b / 1e9, 3)
        if not a.no_ncu:
            try:
                ks = ncu_kernels(["--profile-from-start", "off", sys.executable,
                                  os.path.abspath(__file__), "--lib", a.lib, "--probe",
                                  "%s:%s" % (impl, ps)])
                r["hbm_gb_ncu"] = round(sum(ks) / 1e9, 3)
                r["kernels"] = len(ks)
            except Exception as ex:  # no counters here (gVisor) or ncu missing
                r["ncu_error"] = str(ex)[:200]
        rows.append(r)
        log("io %s %s: %s" % (impl, ps, r))
    write_csv(os.path.join(a.out, "io.csv"), rows,
              ["impl", "pass", "B", "H", "N", "D", "gflop", "hbm_gb_analytic", "hbm_gb_ncu",
               "kernels", "ms", "status", "ncu_error"])


def exp_blocks(a, ours, meta):
    exe = os.path.join(a.bin, "flashattn-block-sweep")
    out = subprocess.run([exe], capture_output=True, text=True, timeout=300)
    if out.returncode:
        raise SystemExit("block sweep failed: " + out.stderr)
    rows = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
    if not a.no_ncu:
        try:
            vals = ncu_kernels(["--kernel-name", "regex:flash_fwd_kernel", exe, "--once"])
            if len(vals) == len(rows):  # one launch per configuration, in order
                for r, b in zip(rows, vals):
                    r["hbm_bytes_ncu"] = b
            else:
                log("blocks: ncu saw %d launches for %d configurations" % (len(vals), len(rows)))
        except Exception as ex:
            log("blocks: ncu failed: %s" % ex)
    for r in rows:
        r["hbm_gb_analytic"] = round(r["hbm_bytes_analytic"] / 1e9, 3)
        if "hbm_bytes_ncu" in r:
            r["hbm_gb_ncu"] = round(r["hbm_bytes_ncu"] / 1e9, 3)
    write_csv(os.path.join(a.out, "blocks.csv"), rows,
              ["Bc", "Br", "MT", "NW", "B", "H", "N", "D", "ms", "tflops", "hbm_gb_analytic",
               "hbm_gb_ncu", "max_abs_diff_vs_library"])


def exp_grid(a, ours, meta):
    ns = argparse.Namespace(quick=a.quick, warmup=3, reps=10, only_ours=False, headdim=(64, 128))
    res = {}
    bs.fwd_grid(ns, ours, res)
    bs.bwd_grid(ns, ours, res)
    rows = []
    for r in res["grid"]:
        for impl in ("ours", "flash", "cudnn", "efficient", "math"):
            rows.append(dict(impl=impl, **{"pass": "fwd"}, N=r["N"], D=r["D"], B=r["B"],
                             H=r["H"], causal=r["causal"], tflops=r.get(impl)))
    for r in res["bwd_grid"]:
        for impl in ("ours", "ours_det", "flash", "cudnn", "efficient"):
            rows.append(dict(impl=impl, **{"pass": "bwd"}, N=r["N"], D=r["D"], B=r["B"],
                             H=r["H"], causal=r["causal"], tflops=r.get(impl)))
        for impl in ("ours", "flash", "cudnn", "efficient"):
            rows.append(dict(impl=impl, **{"pass": "fwdbwd"}, N=r["N"], D=r["D"], B=r["B"],
                             H=r["H"], causal=r["causal"], tflops=r.get(impl + "_fb")))
    for r in rows:
        if r["tflops"] is not None:
            r["tflops"] = round(r["tflops"], 1)
    write_csv(os.path.join(a.out, "grid.csv"), rows,
              ["impl", "pass", "N", "D", "B", "H", "causal", "tflops"])


def matmul_peak():
    x, y = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = bs.time_ms(lambda: x @ y, 3, 10)
    return 2 * 8192 ** 3 / ms / 1e9


# ---------------------------------------------------------------- plots (CSV only)

STYLE = {"ours flash2": "C0", "ours": "C0", "ours standard": "C1", "ours flash1": "C9",
         "sdpa flash": "C2", "flash": "C2", "sdpa cudnn": "C3", "cudnn": "C3",
         "sdpa efficient": "C4", "efficient": "C4", "sdpa math": "C5", "math": "C5",
         "ours_det": "C8"}


def for_pass(r, ps):
    """r belongs to pass ps; a row with no pass is a failure before any pass ran (measure's
    make_fns, e.g. out of memory building SDPA math's graph) and stands for every pass."""
    return r["pass"] == ps or r["pass"] in ("", None)


def plot_all(out, plt):
    meta = {}
    if os.path.exists(os.path.join(out, "meta.json")):
        meta = json.load(open(os.path.join(out, "meta.json")))
    gpu = meta.get("gpu", "GPU")
    p = os.path.join(out, "seeds.csv")
    if os.path.exists(p):
        rows = [r for r in read_rows(p) if r["status"] == "ok"]
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        names = ["%s %s" % (r["impl"], r["pass"]) for r in rows]
        ax[0].barh(names, [r["ms"] for r in rows], color=[STYLE[r["impl"]] for r in rows])
        ax[0].set_xlabel("time (ms)")
        mem = [r for r in rows if r.get("extra_MiB") not in ("", None)]
        ax[1].barh(["%s %s" % (r["impl"], r["pass"]) for r in mem], [r["extra_MiB"] for r in mem],
                   color=[STYLE[r["impl"]] for r in mem])
        ax[1].set_xlabel("extra memory (MiB)")
        fig.suptitle("Seeds' comparison on %s (B=32, N=512, H=16, D=64, f16, causal)" % gpu)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "seeds.png"), dpi=110)
    p = os.path.join(out, "fig3.csv")
    if os.path.exists(p):
        rows = read_rows(p)
        ns = sorted({r["N"] for r in rows})
        fig, ax = plt.subplots(1, 4, figsize=(18, 4.2))
        impls = [i for i in STYLE if i.startswith(("ours ", "sdpa "))]
        for i, ps in enumerate(("fwd", "bwd", "fwdbwd")):
            for impl in impls:
                pts = [(r["N"], r["ms"]) for r in rows
                       if r["impl"] == impl and r["pass"] == ps and r["status"] == "ok"]
                if pts:
                    ax[i].plot(*zip(*pts), marker="o", label=impl, color=STYLE[impl])
                oom = [r["N"] for r in rows
                       if r["impl"] == impl and for_pass(r, ps) and r["status"] == "oom"]
                if oom and pts:
                    ax[i].plot([min(oom)], [pts[-1][1]], marker="x", ms=10, color=STYLE[impl])
            ax[i].set(xscale="log", yscale="log", xlabel="sequence length", ylabel="ms",
                      title=ps + " (x: out of memory)")
            log_ticks(ax[i], ns)
            ax[i].legend(fontsize=7)
        for impl in impls:
            ps = "fwd" if impl == "ours standard" else "fwdbwd"
            pts = [(r["N"], r["extra_MiB"]) for r in rows if r["impl"] == impl and
                   r["pass"] == ps and r["status"] == "ok" and r.get("extra_MiB") not in ("", None)]
            if pts:
                ax[3].plot(*zip(*pts), marker="o", color=STYLE[impl],
                           label=impl + (" (fwd)" if ps == "fwd" else ""))
        ax[3].set(xscale="log", yscale="log", xlabel="sequence length",
                  ylabel="peak extra MiB (fwd+bwd)", title="memory")
        log_ticks(ax[3], ns)
        ax[3].legend(fontsize=7)
        fig.suptitle("Figure 3 on %s: B = max(1, 16384/N), H=16, D=64, f16, not causal" % gpu)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "fig3.png"), dpi=110)
    p = os.path.join(out, "blocks.csv")
    if os.path.exists(p):
        rows = read_rows(p)
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        for br in sorted({r["Br"] for r in rows}):
            sel = sorted((r for r in rows if r["Br"] == br), key=lambda r: r["Bc"])
            ax[0].plot([r["Bc"] for r in sel], [r["ms"] for r in sel], marker="o",
                       label="Br=%d" % br)
            ax[1].plot([r["Bc"] for r in sel], [r["hbm_gb_analytic"] for r in sel], ls="--",
                       marker=".", label="Br=%d analytic" % br)
            if all(r.get("hbm_gb_ncu") not in ("", None) for r in sel):
                ax[1].plot([r["Bc"] for r in sel], [r["hbm_gb_ncu"] for r in sel], marker="o",
                           label="Br=%d ncu" % br)
        ax[0].set(xscale="log", xlabel="key block size Bc", ylabel="forward ms", title="runtime")
        ax[1].set(xscale="log", xlabel="key block size Bc", ylabel="HBM GB", title="HBM traffic")
        for x in ax:
            log_ticks(x, sorted({r["Bc"] for r in rows}))
            x.legend(fontsize=7)
        r0 = rows[0]
        fig.suptitle("Figure 2 (middle) on %s: forward, B=%d N=%d H=%d D=%d f16" % (
            gpu, r0["B"], r0["N"], r0["H"], r0["D"]))
        fig.tight_layout()
        fig.savefig(os.path.join(out, "blocks.png"), dpi=110)
    p = os.path.join(out, "grid.csv")
    if os.path.exists(p):
        rows = read_rows(p)
        fig, ax = plt.subplots(4, 3, figsize=(16, 13), sharey=True)
        for i, (d, causal) in enumerate(((64, False), (64, True), (128, False), (128, True))):
            for j, ps in enumerate(("fwd", "bwd", "fwdbwd")):
                x = ax[i][j]
                sel = [r for r in rows if r["D"] == d and r["causal"] == causal and r["pass"] == ps]
                ns = sorted({r["N"] for r in sel})
                impls = [m for m in ("ours", "ours_det", "flash", "cudnn", "efficient", "math")
                         if any(r["impl"] == m for r in sel)]
                w = 0.8 / max(1, len(impls))
                for k, m in enumerate(impls):
                    vals = {r["N"]: r["tflops"] for r in sel if r["impl"] == m}
                    x.bar([t + (k - (len(impls) - 1) / 2) * w for t in range(len(ns))],
                          [vals.get(n) or 0 for n in ns], width=w, label=m, color=STYLE[m])
                x.set_xticks(range(len(ns)), [str(n) for n in ns])
                if meta.get("matmul_tflops"):
                    x.axhline(meta["matmul_tflops"], color="k", ls="--", label="bf16 matmul")
                x.set(title="%s, D=%d, %s" % (ps, d, "causal" if causal else "not causal"),
                      xlabel="sequence length", ylabel="TFLOP/s")
                x.legend(fontsize=6, ncol=2)
        fig.suptitle("FlashAttention-2 grid on %s (bf16, B*N=16384, H*D=2048)" % gpu)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "grid.png"), dpi=100)


# cheapest first: the ncu runs (io) last
def tables(out):
    """Markdown tables of --out's CSVs (what docs/RESULTS.md shows)."""
    res = []

    def val(r, key, fmt="%.2f"):
        return num(r.get(key), fmt) if r.get("status", "ok") == "ok" else r.get("status", "-")
    p = os.path.join(out, "seeds.csv")
    if os.path.exists(p):
        rows = read_rows(p)
        res.append("Seeds' comparison\n\n" + md_table(
            ["impl", "pass", "ms", "TFLOP/s", "extra MiB"],
            [[r["impl"], r["pass"], val(r, "ms", "%.3f"), val(r, "tflops", "%.1f"),
              val(r, "extra_MiB", "%.1f")] for r in rows]))
    p = os.path.join(out, "fig3.csv")
    if os.path.exists(p):
        rows = read_rows(p)
        impls = list(dict.fromkeys(r["impl"] for r in rows))
        for ps in ("fwd", "bwd", "fwdbwd"):
            body = []
            for n in sorted({r["N"] for r in rows}):
                line = [n]
                for i in impls:
                    m = [r for r in rows if r["N"] == n and r["impl"] == i and for_pass(r, ps)]
                    line.append(val(m[0], "ms", "%.3f") if m else "-")
                body.append(line)
            res.append("Figure 3, %s ms\n\n" % ps + md_table(["N"] + impls, body))
        body = []
        for n in sorted({r["N"] for r in rows}):
            line = [n]
            for i in impls:
                ps = "fwd" if i == "ours standard" else "fwdbwd"
                m = [r for r in rows if r["N"] == n and r["impl"] == i and for_pass(r, ps)]
                line.append(val(m[0], "extra_MiB", "%.0f") if m else "-")
            body.append(line)
        res.append("Figure 3, peak extra MiB of forward+backward (ours standard: forward)\n\n"
                   + md_table(["N"] + impls, body))
    p = os.path.join(out, "io.csv")
    if os.path.exists(p):
        rows = read_rows(p)
        res.append("IO table\n\n" + md_table(
            ["impl", "pass", "GFLOP", "HBM GB analytic", "HBM GB ncu", "kernels", "ms"],
            [[r["impl"], r["pass"], r["gflop"], r["hbm_gb_analytic"], num(r.get("hbm_gb_ncu"), "%.3f"),
              r.get("kernels", "-"), val(r, "ms", "%.3f")] for r in rows]))
    p = os.path.join(out, "blocks.csv")
    if os.path.exists(p):
        rows = read_rows(p)
        res.append("Block sizes (forward)\n\n" + md_table(
            ["Br", "Bc", "ms", "TFLOP/s", "HBM GB analytic", "HBM GB ncu"],
            [[r["Br"], r["Bc"], num(r["ms"], "%.3f"), r["tflops"], r["hbm_gb_analytic"],
              num(r.get("hbm_gb_ncu"), "%.3f")] for r in rows]))
    p = os.path.join(out, "grid.csv")
    if os.path.exists(p):
        rows = read_rows(p)
        impls = list(dict.fromkeys(r["impl"] for r in rows))
        mp = os.path.join(out, "meta.json")
        peak = json.load(open(mp)).get("matmul_tflops") if os.path.exists(mp) else None
        for ps in ("fwd", "bwd", "fwdbwd"):
            sel = [r for r in rows if r["pass"] == ps]
            im = [i for i in impls if any(r["impl"] == i for r in sel)]
            body = []
            for d in sorted({r["D"] for r in sel}):
                for c in (False, True):
                    for n in sorted({r["N"] for r in sel}):
                        line = [d, "yes" if c else "no", n]
                        t = {}
                        for i in im:
                            m = [r for r in sel if r["D"] == d and r["causal"] == c and
                                 r["N"] == n and r["impl"] == i]
                            t[i] = m[0]["tflops"] if m and m[0]["tflops"] != "" else None
                            line.append(num(t[i], "%.0f"))
                        # ours against SDPA's FlashAttention-2, and the shares of the matmul peak
                        line.append(num(t["ours"] / t["flash"], "%.2f")
                                    if t.get("ours") and t.get("flash") else "-")
                        if peak:
                            line += [num(t[i] / peak, "%.2f") if t.get(i) else "-"
                                     for i in ("ours", "flash", "cudnn")]
                        body.append(line)
            extra = ["ours/flash"] + (["ours/peak", "flash/peak", "cudnn/peak"] if peak else [])
            res.append("Grid, %s TFLOP/s%s\n\n" % (ps, " (peak: %.0f TFLOP/s bf16 matmul)" % peak
                                                     if peak else "")
                       + md_table(["D", "causal", "N"] + im + extra, body))
    return "\n\n".join(res)


EXPERIMENTS = {"seeds": exp_seeds, "blocks": exp_blocks, "fig3": exp_fig3, "grid": exp_grid,
               "io": exp_io}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", default="build-gpu/libflashattn.so")
    ap.add_argument("--bin", default="build-gpu/bin")
    ap.add_argument("--only", default=",".join(EXPERIMENTS))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-ncu", action="store_true", help="skip the hardware-counter columns")
    ap.add_argument("--out", default="results/gpu")
    ap.add_argument("--plot-only", action="store_true")
    ap.add_argument("--tables", action="store_true", help="print --out's CSVs as Markdown")
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.tables:
        return print(tables(a.out))
    if a.plot_only:
        plt = plt_or_none()
        if plt is None:
            raise SystemExit("--plot-only needs matplotlib")
        return plot_all(a.out, plt)
    names = [n for n in a.only.split(",") if n]
    for n in names:
        if n not in EXPERIMENTS:
            ap.error("unknown experiment %r (have: %s)" % (n, ", ".join(EXPERIMENTS)))
    torch_env()
    ours = bs.Ours(os.path.abspath(a.lib))
    if a.probe:
        return probe(a, ours)
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(0)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "matmul_tflops": round(matmul_peak(), 1)}
    log("meta %s" % meta)
    for i, n in enumerate(names):
        log("experiment %s (%d of %d)" % (n, i + 1, len(names)))
        try:
            EXPERIMENTS[n](a, ours, meta)
        except Exception as ex:  # keep the other experiments' results
            log("experiment %s failed: %r" % (n, ex))
            meta.setdefault("failed", {})[n] = repr(ex)[:300]
        with open(os.path.join(a.out, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
    meta["matmul_tflops_end"] = round(matmul_peak(), 1)
    with open(os.path.join(a.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    log("done -> %s" % a.out)


if __name__ == "__main__":
    main()
