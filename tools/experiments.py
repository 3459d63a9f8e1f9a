#!/usr/bin/env python3
"""The papers' experiments from one command, on the CPU: runs flashattn-bench with a preset
per experiment, writes one CSV per experiment and, when matplotlib is importable, a PNG.

  seeds  the seeds' comparison: B=32, N=512, H=16, D=64, causal; standard vs flash1 vs
         flash2, time and extra memory (the bench's default run)
  fig3   FlashAttention Figure 3: fwd, bwd, fwd+bwd runtime and extra memory vs sequence
         length, B*N fixed, H=16, D=64; each implementation until it runs out of memory
  io     the IO table (GPT-2 medium: N=1024, D=64, H=16, fwd+bwd): GFLOPs, memory traffic
         counted analytically with our tile sizes, and measured runtime
  grid   FlashAttention-2's grid: GFLOP/s of fwd, bwd, fwd+bwd, causal and not, D 64/128,
         against the machine's FMA peak measured by the bench in the same run

CPU sizes are scaled down from the GPU papers' (this is a 2-core machine); every CSV row
carries the exact shape, and the bench command is printed on stderr with progress.
GPU experiments with PyTorch SDPA peers are tools/peers/bench_sdpa.py's job (tools/gpu-check.sh).

Usage: tools/experiments.py [--only seeds,fig3,io,grid] [--quick] [--out results/cpu]
                            [--bench build/bin/flashattn-bench] [--threads N]
       tools/experiments.py --plot-only | --tables [--out results/cpu]  (from the CSVs)
"""
import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(bench, args, log):
    cmd = [bench, "--json"] + args
    log("$ " + " ".join(cmd[0:1] + [a for a in cmd[1:]]))
    out = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if out.returncode not in (0,):
        sys.stderr.write(out.stderr)
        raise SystemExit("flashattn-bench failed (exit %d)" % out.returncode)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def write_csv(path, rows, fields):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)


def plt_or_none():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


CASE_FIELDS = ["impl", "pass", "B", "H", "Hk", "Nq", "Nk", "D", "dtype", "causal", "status",
               "ms", "gflops", "extra_bytes", "threads"]


class Runner:
    def __init__(self, opts):
        self.o = opts
        self.t0 = time.time()
        self.done = 0
        self.total = 0

    def log(self, msg):
        el = time.time() - self.t0
        eta = ""
        if self.done and self.total > self.done:
            eta = ", ~%.0f s left" % (el / self.done * (self.total - self.done))
        sys.stderr.write("[%d/%d, %.0f s%s] %s\n" % (self.done, self.total, el, eta, msg))

    def bench(self, args):
        rows = run_bench(self.o.bench, args + ["--threads", str(self.o.threads)], self.log)
        self.done += 1
        return rows

    def cases(self, rows):
        return [r for r in rows if r.get("record") == "case"]


def exp_seeds(R, out, plt):
    rows = R.cases(R.bench(["--repeat", "3" if not R.o.quick else "1"]))
    write_csv(os.path.join(out, "seeds.csv"), rows, CASE_FIELDS)
    plot_seeds(rows, out, plt)
    return rows


def plot_seeds(rows, out, plt):
    if plt:
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
        for i, (key, label) in enumerate((("ms", "time (ms)"), ("extra_bytes", "extra memory (MiB)"))):
            names = ["%s %s" % (r["impl"], r["pass"]) for r in rows if r["status"] == "ok"]
            vals = [r[key] / (2 ** 20 if key == "extra_bytes" else 1) for r in rows if r["status"] == "ok"]
            ax[i].barh(names, vals)
            ax[i].set_xlabel(label)
        fig.suptitle("Seeds' comparison (B=32, N=512, H=16, D=64, causal, f32, CPU)")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "seeds.png"), dpi=110)


def exp_fig3(R, out, plt):
    bn = 4096 if R.o.quick else 16384
    ns = [n for n in (128, 256, 512, 1024, 2048, 4096, 8192, 16384) if n <= bn]
    rows = []
    for n in ns:
        rows += R.cases(R.bench(["--impl", "all", "--pass", "fwd,bwd,fwdbwd", "--batch",
                                 str(bn // n), "--heads", "16", "--headdim", "64", "--seqlen",
                                 str(n), "--no-causal", "--repeat", "1", "--warmup", "0",
                                 "--max-time", "1"]))
    write_csv(os.path.join(out, "fig3.csv"), rows, CASE_FIELDS)
    plot_fig3(rows, out, plt)
    return rows


def log_ticks(ax, xs):
    ax.set_xticks(xs, [str(x) for x in xs], rotation=45 if len(xs) > 6 else 0)
    ax.minorticks_off()


def plot_fig3(rows, out, plt):
    if plt:
        ns = sorted({r["Nq"] for r in rows})
        bn = rows[0]["Nq"] * rows[0]["B"] if rows else 0
        fig, ax = plt.subplots(1, 4, figsize=(16, 3.8))
        for i, ps in enumerate(("fwd", "bwd", "fwdbwd")):
            for impl in ("standard", "flash1", "flash2"):
                pts = [(r["Nq"], r["ms"]) for r in rows
                       if r["impl"] == impl and r["pass"] == ps and r["status"] == "ok"]
                if pts:
                    ax[i].plot(*zip(*pts), marker="o", label=impl)
            ax[i].set(xscale="log", yscale="log", xlabel="sequence length", ylabel="ms",
                      title=ps)
            log_ticks(ax[i], ns)
            ax[i].legend()
        for impl in ("standard", "flash1", "flash2"):
            mine = [r for r in rows if r["impl"] == impl and r["pass"] == "fwdbwd"
                    and r.get("extra_bytes")]
            pts = [(r["Nq"], r["extra_bytes"] / 2 ** 20) for r in mine if r["status"] == "ok"]
            if pts:
                line, = ax[3].plot(*zip(*pts), marker="o", label=impl)
                # what a case that ran out of memory would have needed, marked apart
                need = [(r["Nq"], r["extra_bytes"] / 2 ** 20) for r in mine
                        if r["status"] != "ok"]
                if need:
                    ax[3].plot(*zip(*need), marker="x", linestyle="none", color=line.get_color(),
                               label="%s: needed, out of memory" % impl)
        ax[3].set(xscale="log", yscale="log", xlabel="sequence length",
                  ylabel="extra MiB (fwd+bwd)", title="memory")
        log_ticks(ax[3], ns)
        ax[3].legend()
        fig.suptitle("Figure 3 on the CPU: B·N = %d, H=16, D=64, f32" % bn)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "fig3.png"), dpi=110)


def io_bytes(impl, n, d, h, b, es, br, bc, backward=True):
    """Analytic memory traffic (bytes) of forward (+ backward), per the papers' counting:
    standard reads/writes S and P (Theorem 2: Θ(Nd + N²)); flash re-reads K, V once per
    query block in the forward, Q, dO, O once per key block in the backward (Θ(N²d²/M))."""
    nd, nn = n * d, n * n
    if impl == "standard":
        fwd = 2 * nd + nn + nn + nn + nn + nd + nd  # Q,K; write S; read S, write P; read P, V; O
        bwd = 4 * nd + 6 * nn + 3 * nd  # Q,K,V,dO; P,dP,dS traffic; dQ,dK,dV
    else:
        tr, tc = math.ceil(n / br), math.ceil(n / bc)
        fwd = nd + tr * 2 * nd + nd  # Q once, K and V per query block, O
        bwd = 2 * nd + tc * 4 * nd + 3 * nd  # K,V; Q,dO,O,dQ per key block; dQ,dK,dV
    return (fwd + (bwd if backward else 0)) * es * b * h


def exp_io(R, out, plt):
    b = 2 if R.o.quick else 8
    rows = R.cases(R.bench(["--impl", "standard,flash2", "--pass", "fwdbwd", "--batch", str(b),
                            "--heads", "16", "--headdim", "64", "--seqlen", "1024",
                            "--no-causal", "--repeat", "1", "--warmup", "0"]))
    tab = []
    for r in rows:
        if r["status"] != "ok":
            continue
        es = 4 if r["dtype"] == "f32" else 2
        gb = io_bytes(r["impl"], r["Nq"], r["D"], r["H"], r["B"], es, 128, 128) / 1e9
        tab.append(dict(impl=r["impl"], B=r["B"], N=r["Nq"], H=r["H"], D=r["D"],
                        gflop=round(r["flops"] / 1e9, 2), traffic_gb_analytic=round(gb, 3),
                        ms=r["ms"]))
    write_csv(os.path.join(out, "io.csv"), tab, ["impl", "B", "N", "H", "D", "gflop",
                                                 "traffic_gb_analytic", "ms"])
    return tab


def exp_grid(R, out, plt):
    ns = (512, 1024, 2048) if R.o.quick else (512, 1024, 2048, 4096)
    total = 16384 if not R.o.quick else 4096
    rows, peak = [], None
    first = True
    # the peak is measured first and last; the higher one is kept (a busy machine measures low)
    last = [(d, n, c) for d in (64, 128) for n in ns for c in ("--no-causal", "--causal")][-1]
    for d in (64, 128):
        for n in ns:
            args = ["--impl", "flash2", "--pass", "fwd,bwd,fwdbwd", "--batch",
                    str(max(1, total // n)), "--heads", str(2048 // d // 8), "--headdim", str(d),
                    "--seqlen", str(n), "--repeat", "1", "--warmup", "0", "--max-time", "1"]
            for causal in ("--no-causal", "--causal"):
                want_peak = first or (d, n, causal) == last
                got = R.bench(args + [causal] + (["--peak"] if want_peak else []))
                first = False
                for r in got:
                    if r.get("record") == "peak" and (
                            peak is None or r["fma_gflops"] > peak["fma_gflops"]):
                        peak = r
                rows += R.cases(got)
    write_csv(os.path.join(out, "grid.csv"), rows, CASE_FIELDS)
    if peak:
        with open(os.path.join(out, "peak.json"), "w") as f:
            json.dump(peak, f)
    plot_grid(rows, peak, out, plt)
    return rows


def plot_grid(rows, peak, out, plt):
    if plt:
        fig, ax = plt.subplots(2, 3, figsize=(14, 6.5), sharey=True)
        for i, d in enumerate((64, 128)):
            for j, ps in enumerate(("fwd", "bwd", "fwdbwd")):
                a = ax[i][j]
                for k, causal in enumerate((False, True)):
                    pts = [(r["Nq"], r["gflops"]) for r in rows if r["D"] == d and
                           r["pass"] == ps and r["causal"] == causal and r["status"] == "ok"]
                    if pts:
                        xs = [x + (k - 0.5) * 0.35 for x in range(len(pts))]
                        a.bar(xs, [p[1] for p in pts], width=0.35,
                              label="causal" if causal else "non-causal")
                        a.set_xticks(range(len(pts)), [str(p[0]) for p in pts])
                pk = peak and (peak.get("gflops") or peak.get("fma_gflops"))
                if pk:
                    a.axhline(pk, color="k", ls="--", label="FMA peak")
                a.set(title="%s, D=%d" % (ps, d), xlabel="sequence length", ylabel="GFLOP/s")
                a.legend(fontsize=7)
        fig.suptitle("FlashAttention-2 grid on the CPU (flash2, f32)")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "grid.png"), dpi=110)


EXPERIMENTS = {"seeds": exp_seeds, "fig3": exp_fig3, "io": exp_io, "grid": exp_grid}


def read_rows(path):
    """A CSV written above, numbers and booleans restored."""
    rows = []
    with open(path) as f:
        for r in csv.DictReader(f):
            for key, val in r.items():
                if val in ("True", "False"):
                    r[key] = val == "True"
                else:
                    try:
                        r[key] = int(val)
                    except ValueError:
                        try:
                            r[key] = float(val)
                        except ValueError:
                            pass
            rows.append(r)
    return rows


def replot(out, names, plt):
    for n in names:
        path = os.path.join(out, n + ".csv")
        if not os.path.exists(path) or n == "io":
            continue
        rows = read_rows(path)
        if n == "seeds":
            plot_seeds(rows, out, plt)
        elif n == "fig3":
            plot_fig3(rows, out, plt)
        elif n == "grid":
            pk = os.path.join(out, "peak.json")
            plot_grid(rows, json.load(open(pk)) if os.path.exists(pk) else None, out, plt)
def md_table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def num(x, fmt="%.1f"):
    return fmt % x if isinstance(x, (int, float)) else "-"


def tables(out):
    """Markdown tables of --out's CSVs (what docs/RESULTS.md shows)."""
    res = []
    p = os.path.join(out, "seeds.csv")
    if os.path.exists(p):
        rows = read_rows(p)
        res.append("Seeds' comparison\n\n" + md_table(
            ["impl", "pass", "ms", "GFLOP/s", "extra MiB"],
            [[r["impl"], r["pass"], num(r["ms"]), num(r["gflops"]),
              num(r["extra_bytes"] / 2 ** 20, "%.2f") if r["status"] == "ok" else r["status"]]
             for r in rows]))
    p = os.path.join(out, "fig3.csv")
    if os.path.exists(p):
        rows = read_rows(p)
        impls = [i for i in ("standard", "flash1", "flash2") if any(r["impl"] == i for r in rows)]
        body = []
        for n in sorted({r["Nq"] for r in rows}):
            line = [n, next(r["B"] for r in rows if r["Nq"] == n)]
            for ps in ("fwd", "bwd", "fwdbwd"):
                for i in impls:
                    m = [r for r in rows if r["Nq"] == n and r["impl"] == i and r["pass"] == ps]
                    line.append(num(m[0]["ms"]) if m and m[0]["status"] == "ok" else
                                (m[0]["status"] if m else "-"))
            for i in impls:
                m = [r for r in rows if r["Nq"] == n and r["impl"] == i and r["pass"] == "fwdbwd"]
                line.append(num(m[0]["extra_bytes"] / 2 ** 20, "%.2f")
                            if m and m[0]["status"] == "ok" else "-")
            body.append(line)
        head = ["N", "B"] + ["%s %s ms" % (ps, i) for ps in ("fwd", "bwd", "fwd+bwd")
                             for i in impls] + ["%s extra MiB" % i for i in impls]
        res.append("Figure 3 (runtime and extra memory vs N)\n\n" + md_table(head, body))
    p = os.path.join(out, "io.csv")
    if os.path.exists(p):
        rows = read_rows(p)
        res.append("IO table (forward + backward)\n\n" + md_table(
            ["impl", "B", "N", "H", "D", "GFLOP", "traffic GB (analytic)", "ms"],
            [[r["impl"], r["B"], r["N"], r["H"], r["D"], r["gflop"], r["traffic_gb_analytic"],
              num(r["ms"])] for r in rows]))
    p = os.path.join(out, "grid.csv")
    if os.path.exists(p):
        rows = read_rows(p)
        pk = os.path.join(out, "peak.json")
        peak = json.load(open(pk))["fma_gflops"] if os.path.exists(pk) else None
        body = []
        for d in sorted({r["D"] for r in rows}):
            for c in (False, True):
                for n in sorted({r["Nq"] for r in rows}):
                    line = [d, "yes" if c else "no", n]
                    for ps in ("fwd", "bwd", "fwdbwd"):
                        m = [r for r in rows if r["D"] == d and r["causal"] == c and
                             r["Nq"] == n and r["pass"] == ps and r["status"] == "ok"]
                        g = m[0]["gflops"] if m else None
                        line.append(num(g))
                        line.append(num(g / peak, "%.2f") if g and peak else "-")
                    body.append(line)
        res.append("FlashAttention-2 grid, flash2 GFLOP/s and share of the %s GFLOP/s FMA peak\n\n"
                   % num(peak) + md_table(["D", "causal", "N", "fwd", "/peak", "bwd", "/peak",
                                           "fwd+bwd", "/peak"], body))
    return "\n\n".join(res)


STEPS = {"seeds": lambda q: 1, "fig3": lambda q: 6 if q else 8, "io": lambda q: 1,
         "grid": lambda q: 12 if q else 16}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="seeds,fig3,io,grid")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a few minutes)")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "cpu"))
    ap.add_argument("--bench", default=os.path.join(ROOT, "build", "bin", "flashattn-bench"))
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNGs from --out's CSVs")
    ap.add_argument("--tables", action="store_true", help="print --out's CSVs as Markdown tables")
    o = ap.parse_args()
    names = [n for n in o.only.split(",") if n]
    for n in names:
        if n not in EXPERIMENTS:
            ap.error("unknown experiment %r (have: %s)" % (n, ", ".join(EXPERIMENTS)))
    if o.tables:
        return print(tables(o.out))
    if o.plot_only:
        plt = plt_or_none()
        if plt is None:
            raise SystemExit("--plot-only needs matplotlib")
        return replot(o.out, names, plt)
    if not os.access(o.bench, os.X_OK):
        ap.error("%s not found: build first (cmake -S . -B build && cmake --build build -j)"
                 % o.bench)
    os.makedirs(o.out, exist_ok=True)
    plt = plt_or_none()
    if plt is None:
        sys.stderr.write("matplotlib not importable: writing CSV only\n")
    R = Runner(o)
    R.total = sum(STEPS[n](o.quick) for n in names)
    for n in names:
        EXPERIMENTS[n](R, o.out, plt)
        R.log("%s done -> %s" % (n, o.out))


if __name__ == "__main__":
    main()
