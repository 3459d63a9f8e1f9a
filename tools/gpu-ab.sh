#!/usr/bin/env bash
# A/B of library variants on the GPU machine, in one device call. Unpacks the
# prebuilt build-gpu (tools/pack-gpu-build.sh: tests, bench, baseline library),
# then for every variant library in VARIANTS (a tarball of NAME/libflashattn.so*,
# built here from other worktrees; the baseline "base" was checked by gpu-check.sh):
#   test_cuda under FLASHATTN_CUDA_WGMMA=strict (the Hopper kernels, no fallback),
#   memcheck and racecheck on test_cuda --small (--no-race skips them),
# then the timings of base and each variant: tools/bench_sdpa.py --only-ours
# BENCH_ARGS (--no-bench skips it), once with the peers (base) with --peers, and
# tools/gpu-sparse.sh for the libraries named by --sparse=NAME,NAME. Logs go to $OUT,
# as one ab-logs.tgz at the end. tools/ab-summary.sh condenses its output (the sparse sweep as
# one line per library, N and pass).
# Usage: tools/gpu-ab.sh --prebuilt=TARBALL --variants=TARBALL [--no-test] [--no-race]
#          [--no-bench] [--sparse=NAMES] [--peers] [-- BENCH_ARGS...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/build-gpu/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
prebuilt= variants= run_test=1 run_race=1 run_bench=1 sparse= peers=0 bench=()
while [ $# -gt 0 ]; do
  case "$1" in
    --prebuilt=*) prebuilt=${1#--prebuilt=} ;;
    --variants=*) variants=${1#--variants=} ;;
    --no-test) run_test=0 ;;
    --no-race) run_race=0 ;;
    --no-bench) run_bench=0 ;;
    --sparse=*) sparse=${1#--sparse=} ;;
    --peers) peers=1 ;;
    --) shift; bench=("$@"); break ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$prebuilt" ] && [ -n "$variants" ] || { echo "need --prebuilt= and --variants=" >&2; exit 2; }
t0=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - t0 ))s] $*"; }
rm -rf build-gpu ab && tar xzf "$prebuilt" && mkdir ab && tar xf "$variants" -C ab || exit 1
mkdir -p ab/base && cp -a build-gpu/libflashattn.so* ab/base/
names=(base $(cd ab && ls -d */ | tr -d / | grep -vx base))
status=0
for n in "${names[@]:1}"; do
  lib=$PWD/ab/$n
  if [ $run_test = 1 ]; then
    stamp "$n: test_cuda (strict)"
    FLASHATTN_CUDA_WGMMA=strict LD_LIBRARY_PATH=$lib build-gpu/bin/test_cuda >"$OUT/test-$n.log" 2>&1 ||
      status=1
    tail -1 "$OUT/test-$n.log"
  fi
  if [ $run_race = 1 ]; then
    stamp "$n: memcheck, racecheck --small"
    LD_LIBRARY_PATH=$lib compute-sanitizer --tool memcheck build-gpu/bin/test_cuda --small \
      >"$OUT/mem-$n.log" 2>&1 || status=1
    grep -E "ERROR SUMMARY" "$OUT/mem-$n.log"
    LD_LIBRARY_PATH=$lib compute-sanitizer --tool racecheck build-gpu/bin/test_cuda --small \
      >"$OUT/race-$n.log" 2>&1 || status=1
    grep -E "RACECHECK SUMMARY|passed" "$OUT/race-$n.log"
  fi
done
for n in "${names[@]}"; do
  [ $run_bench = 1 ] || break
  stamp "$n: bench_sdpa --only-ours ${bench[*]}"
  python3 tools/bench_sdpa.py --lib "$(ls ab/$n/libflashattn.so.*.* | head -1)" --only-ours \
    "${bench[@]}" 2>&1 | grep -E '^(fwd|bwd) ours'
done
if [ $peers = 1 ]; then
  stamp "base with the peers: bench_sdpa ${bench[*]}"
  python3 tools/bench_sdpa.py --lib "$(ls ab/base/libflashattn.so.*.* | head -1)" "${bench[@]}" \
    2>&1 | tail -40
fi
if [ -n "$sparse" ]; then
  for n in ${sparse//,/ }; do
    stamp "$n: gpu-sparse"
    rm -f build-gpu/libflashattn.so* && cp -a ab/$n/libflashattn.so* build-gpu/
    tools/gpu-sparse.sh 2>&1 | tail -60
  done
fi
( cd "$OUT" && ls ./*.log >/dev/null 2>&1 && tar czf ab-logs.tgz ./*.log && rm -f ./*.log )
stamp "done (status $status)"
exit $status
