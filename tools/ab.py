#!/usr/bin/env python3
"""A/B timing of builds: one command run against each build in interleaved rounds (round 1:
A, B, ...; round 2: A, B, ...), so that every build sees the machine in the same states, then
per line of output the median over the rounds of its time and its ratio to the first build.

Each build is a folder: a build tree (its bin/ and its libflashattn.so, built with
-DBUILD_SHARED_LIBS=ON to swap libraries under one binary) or any folder holding
libflashattn.so*. For each run the command sees that folder as '{}' in its arguments and in
the environment as AB_DIR, LD_LIBRARY_PATH (first) and FLASHATTN_LIBRARY (its libflashattn.so,
which the Python package and tools/peers/*.py load).

  tools/ab.py build-main build-new -- {}/bin/flashattn-bench --seqlen 4096 --batch 1
  tools/ab.py --rounds 5 base=build-gpu v2=../other/build-gpu -- \\
      build-gpu/bin/flashattn-bench --device cuda --pass bwd --block-sparse 0.0625,128
  tools/ab.py --rounds 3 build-gpu other/build-gpu -- \\
      python3 tools/peers/bench_sdpa.py --lib {}/libflashattn.so --only-ours --pass bwd
  tools/ab.py --rounds 1 build-gpu other/build-gpu -- \\
      env FLASHATTN_CUDA_WGMMA=strict build-gpu/bin/test_cuda     # tests of each library

Which number of a line is its time: flashattn-bench's table rows and --json records, their
median ms; any other line, its first decimal number (bench_sdpa's TFLOP/s: higher is better),
the line's other decimal numbers masked to tell lines apart. Lines without one (test counts,
headers) are shown as they come, prefixed with the round and the build's name.

Usage: tools/ab.py [--rounds N] [--log FILE] [NAME=]DIR... -- COMMAND...
"""
import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys

DECIMAL = re.compile(r"(?<![\d.])[-+]?\d+\.\d+(?:[eE][-+]?\d+)?(?![\d.])")  # not 0.1.0
BENCH_ROW = re.compile(r"^(standard|flash1|flash2)\s+(cpu|cuda)\s")
JSON_KEYS = ("impl", "device", "pass", "B", "H", "Hk", "Nq", "Nk", "D", "dtype", "causal",
             "window_left", "window_right", "softcap", "dropout", "block_density", "kv_used",
             "standard")


def timed(line):
    """(key, time) of an output line, or None when it carries no time."""
    if line.startswith("{"):
        try:
            d = json.loads(line)
        except ValueError:
            return None
        if d.get("record") != "case" or d.get("ms") is None:
            return None
        return " ".join("%s=%s" % (k, d[k]) for k in JSON_KEYS
                        if k in d and (d[k] not in (None, 0) or k == "causal")), float(d["ms"])
    if BENCH_ROW.match(line):
        tok = line.split()
        try:  # impl ... causal, then ms(median) runs GFLOP/s extra
            return " ".join(tok[:11]), float(tok[11])
        except (IndexError, ValueError):
            return None
    m = DECIMAL.search(line)
    if not m:
        return None
    return DECIMAL.sub("#", line).strip(), float(m.group(0))


def main():
    argv = sys.argv[1:]
    if "--" not in argv:
        sys.exit(__doc__)
    cut = argv.index("--")
    ap = argparse.ArgumentParser(usage=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--log", help="also write every output line here")
    ap.add_argument("builds", nargs="+", metavar="[NAME=]DIR")
    a = ap.parse_args(argv[:cut])
    command = argv[cut + 1:]
    if not command:
        sys.exit("tools/ab.py: no command after --")
    builds = []
    for b in a.builds:
        name, _, path = b.rpartition("=")
        path = os.path.abspath(path)
        if not os.path.isdir(path):
            sys.exit("tools/ab.py: %s is not a folder" % path)
        builds.append((name or os.path.basename(path.rstrip("/")), path))
    log = open(a.log, "w") if a.log else None
    times = collections.defaultdict(lambda: collections.defaultdict(list))
    order = []
    status = 0
    for r in range(1, a.rounds + 1):
        for name, path in builds:
            env = dict(os.environ, AB_DIR=path)
            env["LD_LIBRARY_PATH"] = path + (":" + env["LD_LIBRARY_PATH"]
                                             if env.get("LD_LIBRARY_PATH") else "")
            lib = os.path.join(path, "libflashattn.so")
            if os.path.exists(lib):
                env["FLASHATTN_LIBRARY"] = lib
            cmd = [c.replace("{}", path) for c in command]
            p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
            if p.returncode:
                status = 1
            for line in p.stdout.splitlines():
                tagged = "[round %d %s] %s" % (r, name, line)
                if log:
                    log.write(tagged + "\n")
                t = timed(line)
                if t is None:
                    print(tagged, flush=True)
                    continue
                key, value = t
                if key not in times:
                    order.append(key)
                times[key][name].append(value)
            if p.returncode:
                print("[round %d %s] exit status %d" % (r, name, p.returncode), flush=True)
    base = builds[0][0]
    print("== medians of %d round%s; ratio: the build's / %s's" % (
        a.rounds, "" if a.rounds == 1 else "s", base))
    width = max(len(n) for n, _ in builds)
    for key in order:
        print(key)
        ref = statistics.median(times[key][base]) if times[key][base] else None
        for name, _ in builds:
            v = times[key][name]
            if not v:
                print("  %-*s  -" % (width, name))
                continue
            med = statistics.median(v)
            ratio = "  x%.3f" % (med / ref) if ref and name != base else ""
            spread = "  (%g .. %g)" % (min(v), max(v)) if len(v) > 1 else ""
            print("  %-*s %12.4g%s%s" % (width, name, med, ratio, spread))
    sys.exit(status)


if __name__ == "__main__":
    main()
