#!/usr/bin/env bash
# Block-sparse and sliding-window times on the GPU (needs build-gpu, e.g. from
# tools/gpu-check.sh): flash2 time against block density s (--block-sparse S,128,
# every row block keeps round(S * key blocks) random 128-key blocks; S = 0 hides
# them all: the launch's fixed cost) next to the dense plain kernel, then the
# sliding-window shape against FlexAttention (tools/peers/bench_flex.py), after a
# window-width sweep (time against steps per block: the intercept is the
# per-block cost). bf16, D=128, H=16, non-causal; N=4096 B=4, N=16384 B=1.
set -uo pipefail
cd "$(dirname "$0")/../.."
# build-gpu's library unless LD_LIBRARY_PATH names another first (tools/ab.py does)
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$PWD/build-gpu
B=build-gpu/bin/flashattn-bench
C=(--device cuda --impl flash2 --pass fwd,bwd --dtype bf16 --headdim 128 --heads 16 --no-causal
  --repeat 10 --warmup 2)
for nb in 4096:4 16384:1; do
  n=${nb%:*} b=${nb#*:}
  echo "== N=$n B=$b dense (plain kernel), then s = 1 1/2 1/4 1/8 1/16 0 (0: every block hidden)"
  $B "${C[@]}" --seqlen "$n" --batch "$b" | grep -E '^flash2'
  for s in 1 0.5 0.25 0.125 0.0625 0; do
    $B "${C[@]}" --seqlen "$n" --batch "$b" --block-sparse "$s,128" | grep -E '^flash2' |
      sed "s/^/s=$s /"
  done
done
echo "== native window (causal, N=16384, B=2): time against window width, per-block cost = intercept"
for w in 512 1024 2048 4096 8192 -1; do
  $B "${C[@]/--no-causal/--causal}" --seqlen 16384 --batch 2 --window "$w,0" | grep -E '^flash2' |
    sed "s/^/w=$w /"
done
echo "== sliding window 1024, causal, N=16384, B=2, H=16, D=128, bf16: FlexAttention vs ours"
FLASHATTN_LIBRARY=${FLASHATTN_LIBRARY:-build-gpu/libflashattn.so} PYTHONPATH=python python3 tools/peers/bench_flex.py "$@"
