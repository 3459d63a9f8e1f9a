#!/usr/bin/env bash
# The check of a GPU machine: builds the CUDA backend (sm_90, shared library,
# into build-gpu), runs test_cuda (forward and backward) against the float64
# CPU oracle, runs compute-sanitizer memcheck and racecheck on test_cuda
# --small, then the benchmarks against PyTorch SDPA (tools/peers/bench_sdpa.py, then
# the decode shapes: tools/peers/bench_decode.py), tables last. On Hopper test_cuda
# runs three times: as is, with FLASHATTN_CUDA_WGMMA=strict (the Hopper
# kernels, no fallback) and with FLASHATTN_CUDA_WGMMA=0 (every case on the
# sm_80 kernels, as an A100 runs them; --no-sm80 skips it). fa_fuzz --cuda runs
# 10,000 random cases against the CPU oracle and the device properties
# (tests/fuzz), and the sanitizers run over 300 of them too. Logs and JSON go
# to $OUT (default build-gpu/out), the *.log files packed into one logs.tgz.
# Usage: tools/gpu-check.sh [--no-test] [--no-sm80] [--no-sanitize] [--no-bench] [--quick-bench]
#          [--fwd-only | --bwd-only] [--no-mem] [--tune NAME=FLAGS]... [--experiments]
#          [--prebuilt=TARBALL | --build-only | --pack=TARBALL]
#   --experiments: also run tools/gpu_experiments.py (the papers' tables, CSV into
#   $OUT/gpu; plot them anywhere with --plot-only).
#   --build-only: build build-gpu and stop (any machine with nvcc, no GPU needed).
#   --pack=TARBALL: that, then pack what a run needs (library, tests, benchmarks: ~25 MB;
#   the NCCL adapter and its test too where NCCL was found) into TARBALL, so that a GPU
#   machine spends no time compiling (tools/gpu-ring.sh takes it as well):
#   --prebuilt=TARBALL: skip the build and unpack build-gpu from TARBALL instead.
#   --tune NAME=FLAGS: also build the library with CMAKE_CUDA_FLAGS=FLAGS (e.g.
#   "b128=-DFA_BWD128_BR=64 -DFA_BWD128_NW=8") into build-gpu-NAME and time
#   only ours with it (same grid), before the main benchmark.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/build-gpu/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
run_test=1 run_sm80=1 run_san=1 run_bench=1 run_exp=0 build_only=0 prebuilt='' pack='' bench_args=() tunes=()
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
    --pack=*) pack=${a#--pack=} build_only=1 ;;
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
if [ -n "$pack" ]; then # the run's files: the library, the test and bench binaries
  tmp=$(mktemp -d)
  mkdir -p "$tmp/build-gpu/bin" "$(dirname "$pack")"
  cp -a build-gpu/libflashattn.so* build-gpu/libflashattn_nccl.so* "$tmp/build-gpu/" 2>/dev/null
  strip --strip-unneeded "$tmp"/build-gpu/libflashattn*.so.*.*
  for b in test_cuda test_cuda_kv test_wgmma test_ring_nccl fa_fuzz flashattn-bench \
    flashattn-block-sweep; do
    [ -x "build-gpu/bin/$b" ] && cp "build-gpu/bin/$b" "$tmp/build-gpu/bin/"
  done
  tar czf "$pack" -C "$tmp" build-gpu && rm -rf "$tmp" && ls -la "$pack"
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

# ---- randomized differential testing on the GPU (tests/fuzz) ------------------------------
# fa_fuzz --cuda: random cases run on the GPU against the float64 CPU oracle (every failure
# prints its seed and a one-line repro), then from 4 host threads with a stream each, on
# the sm_80 kernels too where Hopper's are the default; --cuda-properties: streams at once,
# the deterministic backward bit for bit, allocation failure, tensors past 2^31 elements.
fuzz_seed=${FA_FUZZ_SEED:-$(date -u +%Y%m%d)}
if [ $run_test = 1 ] && [ -x build-gpu/bin/fa_fuzz ]; then
  export OMP_WAIT_POLICY=passive
  stamp "fa_fuzz --cuda: 10000 random valid and 2000 invalid cases (seed $fuzz_seed)"
  ./build-gpu/bin/fa_fuzz --cuda --seed "$fuzz_seed" --valid 10000 --invalid 2000 \
    >"$OUT/fuzz.log" 2>&1 || status=1
  stamp "fa_fuzz --cuda from 4 host threads, a stream each"
  ./build-gpu/bin/fa_fuzz --cuda --seed "$((fuzz_seed + 1))" --valid 2000 --invalid 500 \
    --concurrent 4 >>"$OUT/fuzz.log" 2>&1 || status=1
  if nvidia-smi --query-gpu=compute_cap --format=csv,noheader | grep -q '^9\.0'; then
    stamp "fa_fuzz --cuda with FLASHATTN_CUDA_WGMMA=0 (the sm_80 kernels)"
    FLASHATTN_CUDA_WGMMA=0 ./build-gpu/bin/fa_fuzz --cuda --seed "$((fuzz_seed + 2))" \
      --valid 2000 >>"$OUT/fuzz.log" 2>&1 || status=1
  fi
  stamp "fa_fuzz --cuda-properties"
  ./build-gpu/bin/fa_fuzz --cuda-properties --seed "$fuzz_seed" >>"$OUT/fuzz.log" 2>&1 ||
    status=1
  grep -E "^(FAIL|  repro|valid|invalid|streams|deterministic|allocation|big|fa_fuzz)" \
    "$OUT/fuzz.log" | cut -c1-300 | tail -40
fi

if [ $run_san = 1 ]; then
  for tool in memcheck racecheck; do
    stamp "compute-sanitizer --tool $tool test_cuda --small"
    compute-sanitizer --tool $tool --error-exitcode 3 ./build-gpu/bin/test_cuda --small \
      >"$OUT/$tool.log" 2>&1 || status=1
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|^FAIL|Error" "$OUT/$tool.log" | tail -5
    if [ -x build-gpu/bin/fa_fuzz ]; then
      stamp "compute-sanitizer --tool $tool fa_fuzz --cuda (300 random cases)"
      OMP_WAIT_POLICY=passive compute-sanitizer --tool $tool --error-exitcode 3 \
        ./build-gpu/bin/fa_fuzz --cuda --seed "$((fuzz_seed + 3))" --valid 300 --invalid 100 \
        >"$OUT/fuzz-$tool.log" 2>&1 || status=1
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^valid|^invalid|^FAIL|^fa_fuzz" \
        "$OUT/fuzz-$tool.log" | cut -c1-300 | tail -6
    fi
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
    python3 tools/peers/bench_sdpa.py --lib "$lib" --only-ours "${bench_args[@]}" 2>/dev/null |
      tee "$OUT/tune-$name.txt"
  else
    grep -E "error|spill" "$OUT/build-$name.log" | head -5
  fi
done

if [ $run_bench = 1 ]; then
  stamp "bench_sdpa"
  lib=$(ls build-gpu/libflashattn.so* 2>/dev/null | head -1)
  python3 tools/peers/bench_sdpa.py --lib "$lib" --json "$OUT/bench_sdpa.json" "${bench_args[@]}" \
    >"$OUT/bench_sdpa.txt" 2>"$OUT/bench_sdpa.err" || { status=1; tail -20 "$OUT/bench_sdpa.err"; }
  stamp "bench_decode"
  python3 -W ignore tools/peers/bench_decode.py --lib "$lib" --json "$OUT/bench_decode.json" \
    >"$OUT/bench_decode.txt" 2>"$OUT/bench_decode.err" || { status=1; tail -20 "$OUT/bench_decode.err"; }
fi
if [ $run_exp = 1 ]; then
  stamp "gpu_experiments"
  python3 tools/gpu_experiments.py --lib build-gpu/libflashattn.so --bin build-gpu/bin \
    --out "$OUT/gpu" >"$OUT/experiments.log" 2>&1 || status=1
  grep -E "meta|done|failed|io |blocks" "$OUT/experiments.log" | cut -c1-400
fi
# the logs as one file, to copy off the machine
( cd "$OUT" && ls ./*.log >/dev/null 2>&1 && tar czf logs.tgz ./*.log && rm -f ./*.log )
stamp "done (status $status)"
[ $run_bench = 1 ] && cat "$OUT/bench_sdpa.txt" "$OUT/bench_decode.txt"
exit $status
