#!/usr/bin/env bash
# Block-sparse and sliding-window times on the CPU: flash2 time against block density s (--block-sparse S,128: every
# 128-row block keeps round(S * 32) random 128-key blocks; S = 0 hides them all, the call's
# fixed cost T0), checked against the bound time(s) <= 1.1 * s * time(dense) + T0, then the
# sliding-window shape (B=2, H=16, N=16384, D=128, bf16, causal, window 1024) against the
# dense causal run. B=1, H=16, N=4096, D=64, f32, 2 threads. docs/PERF.md, "Dropout and
# block-sparse (CPU)".   tools/perf/sparse-cpu.sh [--no-window]   (BENCH=... for another build)
set -uo pipefail
cd "$(dirname "$0")/../.."
# the README's build (build/) unless a CPU-only build-cpu/ is there
B=${BENCH:-./build-cpu/bin/flashattn-bench}
[ -n "${BENCH:-}" ] || [ -x "$B" ] || B=./build/bin/flashattn-bench
C=(--impl flash2 --pass fwd,bwd --batch 1 --heads 16 --seqlen 4096 --headdim 64 --dtype f32
  --no-causal --repeat 3 --max-time 4 --json)
for s in 1 0.5 0.25 0.125 0.0625 0; do
  $B "${C[@]}" --block-sparse "$s,128" 2>/dev/null | sed "s/^/$s /"
done | python3 -c "
import sys, json
t = {}
for line in sys.stdin:
    s, rec = line.split(' ', 1)
    d = json.loads(rec)
    if d.get('record') == 'case': t[(d['pass'], float(s))] = d['ms']
for p in ('fwd', 'bwd'):
    dense, t0 = t[(p, 1.0)], t[(p, 0.0)]
    print('%s: s=1 %.1f ms, s=0 (T0) %.1f ms' % (p, dense, t0))
    for s in (0.5, 0.25, 0.125, 0.0625):
        b = 1.1 * s * dense + t0
        print('  s=%-6g %8.1f ms  bound %8.1f  %s  time/(s*dense) %.2f' %
              (s, t[(p, s)], b, 'holds' if t[(p, s)] <= b else 'OVER', t[(p, s)] / (s * dense)))
"
[ "${1:-}" = --no-window ] && exit 0
W=(--impl flash2 --pass fwd,bwd --batch 2 --heads 16 --seqlen 16384 --headdim 128 --dtype bf16
  --causal --repeat 1)
echo "== sliding window 1024 (causal, B=2, H=16, N=16384, D=128, bf16) against dense causal"
$B "${W[@]}" --peak | grep -E '^(peak|flash2)'
$B "${W[@]}" --window 1024,0 | grep -E '^flash2'
