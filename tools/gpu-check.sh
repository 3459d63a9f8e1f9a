#!/usr/bin/env bash
# The GPU machine's one check: builds the CUDA backend (sm_90, shared library,
# into build-gpu), runs test_cuda (forward and backward) against the float64
# CPU oracle, runs compute-sanitizer memcheck and racecheck on test_cuda
# --small, then the benchmarks against PyTorch SDPA (tools/bench_sdpa.py, then
# the decode shapes: tools/bench_decode.py), tables last. On Hopper test_cuda
# runs three times: as is, with FLASHATTN_CUDA_WGMMA=strict (the Hopper
# kernels, no fallback) and with FLASHATTN_CUDA_WGMMA=0 (every case on the
# sm_80 kernels, as an A100 runs them; --no-sm80 skips it). Logs and JSON go
# to $OUT (the device tool's output folder) or build-gpu/out; the *.log files
# end up in one $OUT/logs.tgz.
# Usage: tools/gpu-check.sh [--no-test] [--no-sm80] [--no-sanitize] [--no-bench] [--quick-bench]
#          [--fwd-only | --bwd-only] [--no-mem] [--tune NAME=FLAGS]... [--experiments]
#          [--prebuilt=TARBALL] [--build-only]
#   --experiments: also run tools/gpu_experiments.py (the papers' tables, CSV into
#   $OUT/gpu; plot them anywhere with --plot-only).
#   --prebuilt=TARBALL: skip the build and unpack build-gpu from TARBALL instead
#   (made here by tools/pack-gpu-build.sh, to spend no device time compiling).
#   --build-only: build build-gpu and stop (any machine with nvcc; what
#   tools/pack-gpu-build.sh packs).
#   --tune NAME=FLAGS: also build the library with CMAKE_CUDA_FLAGS=FLAGS (e.g.
#   "b128=-DFA_BWD128_BR=64 -DFA_BWD128_NW=8") into build-gpu-NAME and time
#   only ours with it (same grid), before the main benchmark.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/build-gpu/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
run_test=1 run_sm80=1 run_san=1 run_bench=1 run_exp=0 build_only=0 prebuilt= bench_args=() tunes=()
for a in "$@"; do
  case "$a" in
    --no-test) run_test=0 ;;
    --no-sm80) run_sm80=0 ;;
    --no-sanitize) run_san=0 ;;
    --no-bench) run_bench=0 ;;
    --quick-bench) bench_args+=(--quick) ;;
    --fwd-only) bench_args+=(--pass fwd) ;;
    --bwd-only) bench_args+=(--pass bwd) ;;
    --no-mem) bench_args+=(--no-mem) ;;
    --tune=*) tunes+=("${a#--tune=}") ;;
    --experiments) run_exp=1 ;;
    --prebuilt=*) prebuilt=${a#--prebuilt=} ;;
    --build-only) build_only=1 ;;
    *) echo "unknown option $a" >&2; exit 2 ;;
  esac
done
status=0
t0=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - t0 ))s] $*"; }

[ $build_only = 1 ] || nvidia-smi --query-gpu=name,driver_version,memory.total \
  --format=csv,noheader | tee "$OUT/gpu.txt"
# the C test suite and flashattn-bench only when their sources are there
tests=ON; ls tests/*.c >/dev/null 2>&1 || tests=OFF
bench=ON; ls bench/*.c >/dev/null 2>&1 || bench=OFF
build() { # dir, extra CUDA flags
  cmake -S . -B "$1" -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON -DFLASHATTN_CUDA_ARCHS=90 \
    -DBUILD_SHARED_LIBS=ON -DFLASHATTN_TESTS=$tests -DFLASHATTN_BENCH=$bench \
    "-DCMAKE_CUDA_FLAGS=$2" && cmake --build "$1" -j"$(nproc)" ${3:+--target $3}
}
if [ -n "$prebuilt" ]; then
  stamp "unpack $prebuilt (built elsewhere for sm_90)"
  rm -rf build-gpu && tar xzf "$prebuilt" || exit 1
  export LD_LIBRARY_PATH=$PWD/build-gpu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
else
  stamp "build (sm_90, Release, shared)"
  if ! build build-gpu "" >"$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"
    exit 1
  fi
fi
[ $build_only = 1 ] && exit 0

if [ $run_test = 1 ]; then
  if [ -x build-gpu/bin/test_wgmma ]; then
    stamp "test_wgmma (Hopper tile primitives)"
    ./build-gpu/bin/test_wgmma 2>&1 | tee "$OUT/test_wgmma.log" | tail -8
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  fi
  stamp "test_cuda"
  ./build-gpu/bin/test_cuda -v >"$OUT/test_cuda.log" 2>&1 || status=1
  grep -E "^FAIL|passed" "$OUT/test_cuda.log" | tail -30
  if [ -x build-gpu/bin/test_cuda_kv ]; then
    stamp "test_cuda_kv (paged KV caches, the KV-cache call)"
    ./build-gpu/bin/test_cuda_kv >"$OUT/test_cuda_kv.log" 2>&1 || status=1
    grep -E "^FAIL|passed" "$OUT/test_cuda_kv.log" | tail -30
  fi
  if [ -x build-gpu/bin/test_wgmma ] && nvidia-smi --query-gpu=compute_cap --format=csv,noheader |
    grep -q '^9\.0'; then
    # a refused tensor map is an error here, not a silent sm_80 fallback
    stamp "test_cuda with FLASHATTN_CUDA_WGMMA=strict (the Hopper kernels, no fallback)"
    FLASHATTN_CUDA_WGMMA=strict ./build-gpu/bin/test_cuda >"$OUT/test_strict.log" 2>&1 || status=1
    grep -E "^FAIL|passed" "$OUT/test_strict.log" | tail -30
    if [ -x build-gpu/bin/test_cuda_kv ]; then
      FLASHATTN_CUDA_WGMMA=strict ./build-gpu/bin/test_cuda_kv >"$OUT/test_kv_strict.log" 2>&1 ||
        status=1
      grep -E "^FAIL|passed" "$OUT/test_kv_strict.log" | tail -30
    fi
    if [ $run_sm80 = 1 ]; then
      stamp "test_cuda with FLASHATTN_CUDA_WGMMA=0 (the sm_80 kernels everywhere)"
      FLASHATTN_CUDA_WGMMA=0 ./build-gpu/bin/test_cuda >"$OUT/test_sm80.log" 2>&1 || status=1
      grep -E "^FAIL|passed" "$OUT/test_sm80.log" | tail -30
      if [ -x build-gpu/bin/test_cuda_kv ]; then
        FLASHATTN_CUDA_WGMMA=0 ./build-gpu/bin/test_cuda_kv >"$OUT/test_kv_sm80.log" 2>&1 ||
          status=1
        grep -E "^FAIL|passed" "$OUT/test_kv_sm80.log" | tail -30
      fi
    fi
  fi
fi

if [ $run_san = 1 ]; then
  for tool in memcheck racecheck; do
    stamp "compute-sanitizer --tool $tool test_cuda --small"
    compute-sanitizer --tool $tool --error-exitcode 3 ./build-gpu/bin/test_cuda --small \
      >"$OUT/$tool.log" 2>&1 || status=1
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|^FAIL|Error" "$OUT/$tool.log" | tail -5
    if [ -x build-gpu/bin/test_cuda_kv ]; then
      compute-sanitizer --tool $tool --error-exitcode 3 ./build-gpu/bin/test_cuda_kv --quick \
        >"$OUT/${tool}_kv.log" 2>&1 || status=1
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|^FAIL|Error" "$OUT/${tool}_kv.log" | tail -5
    fi
  done
fi

for t in "${tunes[@]}"; do
  name=${t%%=*} flags=${t#*=}
  stamp "tune $name: $flags"
  if build "build-gpu-$name" "$flags" flashattn >"$OUT/build-$name.log" 2>&1; then
    lib=$(ls build-gpu-$name/libflashattn.so* 2>/dev/null | head -1)
    python3 tools/bench_sdpa.py --lib "$lib" --only-ours "${bench_args[@]}" 2>/dev/null |
      tee "$OUT/tune-$name.txt"
  else
    grep -E "error|spill" "$OUT/build-$name.log" | head -5
  fi
done

if [ $run_bench = 1 ]; then
  stamp "bench_sdpa"
  lib=$(ls build-gpu/libflashattn.so* 2>/dev/null | head -1)
  python3 tools/bench_sdpa.py --lib "$lib" --json "$OUT/bench_sdpa.json" "${bench_args[@]}" \
    >"$OUT/bench_sdpa.txt" 2>"$OUT/bench_sdpa.err" || { status=1; tail -20 "$OUT/bench_sdpa.err"; }
  stamp "bench_decode"
  python3 -W ignore tools/bench_decode.py --lib "$lib" --json "$OUT/bench_decode.json" \
    >"$OUT/bench_decode.txt" 2>"$OUT/bench_decode.err" || { status=1; tail -20 "$OUT/bench_decode.err"; }
fi
if [ $run_exp = 1 ]; then
  stamp "gpu_experiments"
  python3 tools/gpu_experiments.py --lib build-gpu/libflashattn.so --bin build-gpu/bin \
    --out "$OUT/gpu" >"$OUT/experiments.log" 2>&1 || status=1
  grep -E "meta|done|failed|io |blocks" "$OUT/experiments.log" | cut -c1-400
fi
# the device tool returns a few files from $OUT: the logs go back as one
( cd "$OUT" && ls ./*.log >/dev/null 2>&1 && tar czf logs.tgz ./*.log && rm -f ./*.log )
stamp "done (status $status)"
[ $run_bench = 1 ] && cat "$OUT/bench_sdpa.txt" "$OUT/bench_decode.txt"
exit $status
