#!/usr/bin/env bash
# Issue 7's sparse backward cells for several libraries, interleaved in
# rounds so that they share the machine's state: N=4096 B=4 dense, s = 0,
# 1/16, 1/8; N=16384 B=1 s = 0, 1/16; the causal window 1024 (N=16384, B=2)
# natively and as a block mask is in tools/gpu-sparse.sh. bf16, D=128, H=16.
# Usage (GPU machine, after tools/gpu-ab.sh unpacked ab/NAME/ or any folders
# holding libflashattn.so): tools/gpu-sparse-ab.sh ROUNDS DIR... (bench from build-gpu/bin)
set -uo pipefail
cd "$(dirname "$0")/.."
rounds=$1
shift
dirs=("$@")
B=build-gpu/bin/flashattn-bench
C=(--device cuda --impl flash2 --dtype bf16 --headdim 128 --heads 16 --no-causal --repeat 10
  --warmup 2)
for r in $(seq "$rounds"); do
  for d in "${dirs[@]}"; do
    line="round $r $(basename "$d"):"
    for cell in "4096 4 - bwd" "4096 4 0 bwd" "4096 4 0.0625 bwd" "4096 4 0.125 bwd" \
      "16384 1 0 bwd" "16384 1 0.0625 bwd" "4096 4 0.0625 fwd"; do
      read -r n b s pass <<<"$cell"
      sp=(); [ "$s" = - ] || sp=(--block-sparse "$s,128")
      t=$(LD_LIBRARY_PATH=$d $B "${C[@]}" --pass "$pass" --seqlen "$n" --batch "$b" "${sp[@]}" |
        awk '/^flash2/ {print $(NF-3)}')
      line+=" N=$n/s=$s/$pass $t"
    done
    echo "$line"
  done
done
