#!/usr/bin/env bash
# The CPU headline table in one pass: every row one flashattn-bench invocation with its own
# --peak (FMA peak and DRAM read), printed as fractions of them: the 4096 shapes (D=64/128,
# f32/f16, causal or not; forward and backward), llama.cpp's two prefill shapes and the
# decode at Nk=16384 (64 MiB of K/V, twice a 32 MiB L3) and Nk=65536, whose K/V rate is given
# from the median run and from the best run (like --peak's DRAM figure,
# the best of its passes). docs/PERF.md, "CPU: against the FMA peak".
#   tools/perf/cpu-table.sh            (BENCH=path/to/flashattn-bench to time another build)
#   tools/perf/cpu-table.sh --decode   (the two decode rows alone)
set -uo pipefail
decode_only=0
[ "${1:-}" = --decode ] && decode_only=1
cd "$(dirname "$0")/../.."
# the README's build (build/) unless a CPU-only build-cpu/ is there
B=${BENCH:-./build-cpu/bin/flashattn-bench}
[ -n "${BENCH:-}" ] || [ -x "$B" ] || B=./build/bin/flashattn-bench
run() { # label, args...
  label=$1; shift
  $B --peak --impl flash2 "$@" --json 2>/dev/null | python3 -c "
import sys,json
pk=None; dr=None; out=[]
for l in sys.stdin:
  d=json.loads(l)
  if d.get('record')=='peak': pk=d['fma_gflops']; dr=d['dram_read_gbps']
  if d.get('record')=='case': out.append(d)
for d in out:
  if d['Nq']==1:
    b=d['Nk']*d['Hk']*d['D']*2*2/1e9; g=b/(d['ms']*1e-3); gb=b/(d['ms_min']*1e-3)
    print('$label', d['pass'], 'peak %.1f dram %.1f | %.3f ms = %.1f GB/s K/V, %.2f of DRAM (best run %.3f ms: %.2f)' % (pk, dr, d['ms'], g, g/dr, d['ms_min'], gb/dr))
  else:
    print('$label', d['pass'], 'peak %.1f | %.2f GFLOP/s, %.3f of peak' % (pk, d['gflops'], d['gflops']/pk))
"
}
[ $decode_only = 1 ] || for D in 64 128; do for T in f32 f16; do for C in --no-causal --causal; do
  run "D=$D $T $C" --pass fwd,bwd --batch 1 --heads 16 --seqlen 4096 --headdim $D --dtype $T $C --repeat 3 --max-time 4
done; done; done
[ $decode_only = 1 ] || run "D=72 H=16 N=5776" --pass fwd --dtype f16 --no-causal --batch 1 --heads 16 --seqlen 5776 --headdim 72 --repeat 2 --max-time 2
[ $decode_only = 1 ] || run "D=256 32/2 512x10000" --pass fwd --dtype f16 --no-causal --batch 1 --heads 32 --kv-heads 2 --seqlen 512 --seqlen-k 10000 --headdim 256 --repeat 2 --max-time 2
run "decode Nk=16384" --pass fwd --dtype f16 --no-causal --batch 1 --heads 8 --seqlen 1 --seqlen-k 16384 --headdim 128 --repeat 30 --max-time 2
run "decode Nk=65536" --pass fwd --dtype f16 --no-causal --batch 1 --heads 8 --seqlen 1 --seqlen-k 65536 --headdim 128 --repeat 10 --max-time 2
