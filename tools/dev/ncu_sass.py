#!/usr/bin/env python3
"""Where a kernel's warps wait, instruction by instruction, from an ncu report's source page.

Export the page once, then read it here (no GPU needed):

  ncu --set full --import-source no --launch-skip 3 -c 1 -k regex:fwd_kernel -o short \\
      python3 tools/dev/gpu_case.py short
  ncu -i short.ncu-rep --page source --csv --print-source sass > short.csv
  python3 tools/dev/ncu_sass.py short.csv [--top 30] [--grep SYNCS,UTMALDG]

Prints the kernel, its stall samples and executed warp instructions in all, the stall
reasons summed over the kernel, then the instructions with the most samples (address,
samples, times executed, the instruction, its three largest stall reasons). With --grep,
every executed instruction whose text holds one of the comma-separated strings instead,
in address order with its index (waits, copies and barriers: how often each spun).
Two reports side by side (`ncu_sass.py a.csv b.csv`) print one after the other.
"""
import argparse
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def load(path):
    """The kernel's name, the stall-reason columns and one dict per instruction."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    kernel, header = rows[0][1], rows[1]
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    insts = [dict(zip(header, r)) for r in rows[2:] if len(r) >= len(header)]
    return kernel, stalls, insts


def top_stalls(inst, stalls, n=3):
    reasons = sorted(((num(inst[s]), s[len("stall_"):]) for s in stalls), reverse=True)[:n]
    return " ".join(f"{name}={v:.0f}" for v, name in reasons if v)


def report(path, top, grep):
    kernel, stalls, insts = load(path)
    total = sum(num(i[SAMPLES]) for i in insts)
    executed = sum(num(i[EXECUTED]) for i in insts)
    print(f"{path}: {kernel}")
    print(f"samples {total:.0f}, warp instructions executed {executed:.0f}")
    summed = sorted(((sum(num(i[s]) for i in insts), s) for s in stalls), reverse=True)
    print(" ".join(f"{s[len('stall_'):]}={v:.0f}" for v, s in summed if v))
    if grep:
        keys = grep.split(",")
        chosen = [(k, i) for k, i in enumerate(insts)
                  if num(i[EXECUTED]) > 0 and any(key in i["Source"] for key in keys)]
    else:
        ranked = sorted(enumerate(insts), key=lambda ki: -num(ki[1][SAMPLES]))[:top]
        chosen = ranked
    for k, i in chosen:
        print(f"{k:5d} {i['Address'][-6:]:>6} {num(i[SAMPLES]):6.0f} {num(i[EXECUTED]):9.0f}  "
              f"{i['Source'].strip()[:64]:64s} {top_stalls(i, stalls)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="+", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=25, help="instructions with the most samples")
    ap.add_argument("--grep", default="", help="comma-separated instruction substrings")
    a = ap.parse_args()
    for n, path in enumerate(a.csv):
        if n:
            print()
        report(path, a.top, a.grep)


if __name__ == "__main__":
    main()
