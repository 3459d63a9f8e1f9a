#!/usr/bin/env bash
# On a machine with several GPUs: builds the CUDA library (sm_90, shared) into build-gpu
# (or unpacks --prebuilt=TARBALL: a build-gpu-lib.tar.xz this script left in $OUT, or the
# tarball tools/gpu-check.sh --pack made, whose tests then run too), runs
# test_cuda --small (the kernels against the float64 oracle), then, one process a GPU,
# tools/bench_ring.py --check (ring attention against one GPU and float64) and its
# benchmark against PyTorch's context parallelism; the table comes last. Logs, JSON and
# the packed library go to $OUT (default build-gpu/out).
# Usage: tools/gpu-ring.sh [--prebuilt=TARBALL] [--no-test] [--gpus=N] [bench_ring.py args]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/build-gpu/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
prebuilt= run_test=1 gpus=$(nvidia-smi -L | wc -l) args=()
for a in "$@"; do
  case "$a" in
    --prebuilt=*) prebuilt=${a#--prebuilt=} ;;
    --no-test) run_test=0 ;;
    --gpus=*) gpus=${a#--gpus=} ;;
    *) args+=("$a") ;;
  esac
done
t0=$(date +%s)
stamp() { echo "== [$(($(date +%s) - t0))s] $*"; }
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if [ -n "$prebuilt" ]; then
  stamp "unpacking $prebuilt"
  case "$prebuilt" in
    *.tgz | *.tar.gz) # gpu-check.sh --pack: build-gpu/ with the library, tests and benchmarks
      rm -rf build-gpu && tar xzf "$prebuilt" || exit 1
      [ -x build-gpu/bin/test_cuda ] || run_test=0 ;;
    *)
      mkdir -p build-gpu && tar xJf "$prebuilt" -C build-gpu || exit 1
      run_test=0 ;;
  esac
  export LD_LIBRARY_PATH=$PWD/build-gpu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
else
  stamp "building build-gpu (sm_90)"
  # NCCL for the C adapter: the toolkit's, else the nvidia-nccl wheel PyTorch brings
  if [ -z "${NCCL_ROOT:-}" ] && ! ls /usr/local/cuda/include/nccl.h >/dev/null 2>&1; then
    NCCL_ROOT=$(python3 -c "import nvidia.nccl as n; print(list(n.__path__)[0])" 2>/dev/null) &&
      export NCCL_ROOT
  fi
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON -DFLASHATTN_CUDA_ARCHS=90 \
    -DBUILD_SHARED_LIBS=ON -DFLASHATTN_TESTS=$([ $run_test = 1 ] && echo ON || echo OFF) \
    -DFLASHATTN_BENCH=OFF >"$OUT/build.log" 2>&1 &&
    cmake --build build-gpu -j"$(nproc)" >>"$OUT/build.log" 2>&1 || {
    tail -30 "$OUT/build.log"
    exit 1
  }
  (cd build-gpu && tar cJf "$OUT/build-gpu-lib.tar.xz" libflashattn.so* libflashattn_nccl.so* 2>/dev/null)
fi
if [ $run_test = 1 ]; then
  stamp "test_cuda --small"
  timeout 150 ./build-gpu/bin/test_cuda --small >"$OUT/test_cuda.log" 2>&1 || status=1
  tail -3 "$OUT/test_cuda.log"
  if [ -x build-gpu/bin/test_ring_nccl ]; then
    stamp "test_ring_nccl (the C ring over NCCL, every GPU)"
    timeout 120 ./build-gpu/bin/test_ring_nccl 2>&1 | tee "$OUT/test_ring_nccl.log" || status=1
  fi
fi
export FLASHATTN_LIBRARY=$PWD/build-gpu/libflashattn.so PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
# the PyTorch operators (flashattn._C) the Python ring calls, against this machine's torch
stamp "building flashattn._C"
if ! { cmake -S python -B build-gpu-torch -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_LIBRARY="$FLASHATTN_LIBRARY" \
  -DFLASHATTN_TORCH_PYTHON="$(command -v python3)" && cmake --build build-gpu-torch -j"$(nproc)"; } \
  >"$OUT/torch-build.log" 2>&1; then
  tail -20 "$OUT/torch-build.log"
  exit 1
fi
FLASHATTN_TORCH_LIBRARY=$PWD/$(ls build-gpu-torch/_C.*.so build-gpu-torch/libflashattn_ops.so 2>/dev/null | head -1)
export FLASHATTN_TORCH_LIBRARY
stamp "bench_ring.py on $gpus GPUs ${args[*]:-}"
torchrun --nproc-per-node "$gpus" tools/bench_ring.py --json "$OUT/ring.json" "${args[@]}" \
  2>&1 | tee "$OUT/ring.log" || status=1
stamp "done (status $status)"
exit $status
