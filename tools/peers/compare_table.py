#!/usr/bin/env python3
"""The table of tools/peers/compare-cpu.sh: reads the run's JSON lines (flashattn-bench
--json, bench_ggml_fa, bench_torch_cpu.py) and prints Markdown: GFLOP/s per implementation
for each shape, ours/llama.cpp, ours/torch (the faster torch dtype) and ours as a fraction
of the FMA peak measured in the same run; for decode shapes (Nq = 1) also the K/V read
bandwidth against the measured DRAM read bandwidth.

    python3 tools/peers/compare_table.py build-peers/compare-cpu.jsonl [--threads 2]
"""
import argparse
import json
import sys

KV_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


def fmt(x, spec=".1f"):
    return "–" if x is None else format(x, spec)


def ratio(a, b):
    return a / b if a and b else None


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("jsonl")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)

    peak, peak_end, run, cases, loads = None, None, {}, [], []
    with open(a.jsonl) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if r.get("record") == "peak":
                peak = r
            elif r.get("record") == "peak_end":
                peak_end = r
            elif r.get("record") == "load":
                loads.append(float(r["loadavg"].split()[0]))
            elif r.get("record") in ("run", "end"):
                run.update(r)
            elif r.get("record") == "case":
                cases.append(r)

    shapes = []  # in the order of the run
    by = {}
    for c in cases:
        key = (c["D"], c["H"], c["Hk"], c["Nq"], c["Nk"], bool(c["causal"]))
        if key not in by:
            shapes.append(key)
            by[key] = {}
        name = c["impl"] if c["impl"] != "torch-sdpa" else "torch-" + c["dtype"]
        if c["impl"] in ("flash2", "standard"):
            name = c["impl"]
        gf = c.get("gflops") if c.get("status") == "ok" else None
        by[key][(name, c["threads"])] = (gf, c)

    T = a.threads
    pk = peak["fma_gflops"] if peak else None
    bw = peak["dram_read_gbps"] if peak else None
    if peak:
        print(f"Measured in the same run: float32 FMA peak {pk:.1f} GFLOP/s ({peak['isa']}, "
              f"{peak['threads']} threads), DRAM read {bw:.1f} GB/s"
              + (f"; at the end of the run {peak_end['fma_gflops']:.1f} GFLOP/s and "
                 f"{peak_end['dram_read_gbps']:.1f} GB/s." if peak_end else "."))
        print()
    scaling = any(t == 1 and T != 1 for v in by.values() for (_, t) in v)

    head = ["shape (D, H/Hk, Nq×Nk)", "causal", "ours dtype", "ours flash2", "ours standard",
            "llama.cpp", "torch f32", "torch bf16", "ours/llama.cpp", "ours/torch", "ours/peak"]
    if scaling:
        head += ["flash2 2T/1T" if T == 2 else f"flash2 {T}T/1T",
                 "llama.cpp 2T/1T" if T == 2 else f"llama.cpp {T}T/1T"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" if i < 3 else "---:" for i in range(len(head))) + "|")

    def g(v, name, t=T):
        return v.get((name, t), (None, None))[0]

    for key in shapes:
        D, H, Hk, Nq, Nk, causal = key
        v = by[key]
        ours, std, lcp = g(v, "flash2"), g(v, "standard"), g(v, "llamacpp")
        tf, tb = g(v, "torch-f32"), g(v, "torch-bf16")
        best_torch = max([x for x in (tf, tb) if x], default=None)
        odt = v.get(("flash2", T), (None, {}))[1] or {}
        heads = f"{H}" if H == Hk else f"{H}/{Hk}"
        row = [f"D={D}, H={heads}, {Nq}×{Nk}", "yes" if causal else "no", odt.get("dtype", "–"),
               fmt(ours), fmt(std), fmt(lcp), fmt(tf), fmt(tb),
               fmt(ratio(ours, lcp), ".2f"), fmt(ratio(ours, best_torch), ".2f"),
               fmt(ratio(ours, pk), ".2f")]
        if scaling:
            row += [fmt(ratio(ours, g(v, "flash2", 1)), ".2f"),
                    fmt(ratio(lcp, g(v, "llamacpp", 1)), ".2f")]
        print("| " + " | ".join(row) + " |")

    decode = [k for k in shapes if k[3] == 1]
    if decode:
        print()
        print("Decode (Nq = 1): K and V read once, GB/s = K/V bytes / time, against the "
              "measured DRAM read bandwidth:")
        print()
        print("| shape | impl | K/V dtype | ms | GB/s | of DRAM |")
        print("|---|---|---|---:|---:|---:|")
        for key in decode:
            D, H, Hk, Nq, Nk, _ = key
            for name in ("flash2", "standard", "llamacpp", "torch-f32", "torch-bf16"):
                gf, c = by[key].get((name, T), (None, None))
                if not c or c.get("status") != "ok":
                    continue
                kvt = c.get("kv_dtype", c["dtype"])
                gbs = 2 * Nk * Hk * D * KV_BYTES[kvt] / (c["ms"] * 1e-3) * 1e-9
                print(f"| D={D}, H={H}, Nk={Nk} | {name} | {kvt} | {c['ms']:.2f} | {gbs:.1f} "
                      f"| {fmt(ratio(gbs, bw), '.2f')} |")
    if run:
        print()
        print(f"Run: HEAD {run.get('commit')}, {run.get('date')}, {run.get('seconds')} s, "
              f"load average {run.get('loadavg_start')} at the start, {run.get('loadavg_end')} "
              f"at the end"
              + (f", 1-minute load average {min(loads):.2f}–{max(loads):.2f} at the shapes' "
                 f"starts." if loads else "."))
    return 0


if __name__ == "__main__":
    sys.exit(main())
