#!/usr/bin/env bash
# On the GPU machine, after tools/gpu-check.sh has built build-gpu/libflashattn.so:
# builds the compiled PyTorch operators (flashattn._C) against the machine's torch and
# that library (cmake -S python -B build-gpu-torch, about a minute), runs the Python
# suite (CUDA tests included) with them, the host-overhead table (ours beside SDPA's
# backends: tools/bench_overhead.py), the GPT-2 example (ours vs torch's SDPA: loss
# curves, step time, peak memory at seqlen 1024 and 4096) and the transformers example.
# --pip instead installs the package the way a user does (pip install
# --no-build-isolation . into build-gpu/pip-target: the CUDA backend built again by
# pip, sm_90 only) and tests that. Logs and JSON go to $OUT (default
# build-gpu/out).
# Usage: tools/gpu-python.sh [--pip] [--no-test] [--no-bench] [--no-example] [--steps N]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/build-gpu/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
example=1 bench=1 test=1 pip=0 steps=300
while [ $# -gt 0 ]; do
  case "$1" in
    --pip) pip=1 ;;
    --no-test) test=0 ;;
    --no-bench) bench=0 ;;
    --no-example) example=0 ;;
    --steps) steps=$2; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
status=0
py=$(command -v python3)

if [ $pip = 1 ]; then
  echo "== pip install --no-build-isolation . (CUDA backend for sm_90 and flashattn._C) into build-gpu/pip-target"
  rm -rf build-gpu/pip-target
  if ! SKBUILD_BUILD_DIR=build-gpu/pip-build \
      SKBUILD_CMAKE_DEFINE="FLASHATTN_CUDA=ON;FLASHATTN_CUDA_ARCHS=90;FLASHATTN_TORCH=ON" \
      "$py" -m pip install --no-build-isolation --no-deps --target build-gpu/pip-target . \
      >"$OUT/pip.log" 2>&1; then
    echo "pip install failed (tail of $OUT/pip.log):"; tail -30 "$OUT/pip.log"; exit 1
  fi
  export PYTHONPATH=$PWD/build-gpu/pip-target${PYTHONPATH:+:$PYTHONPATH}
else
  lib=$PWD/build-gpu/libflashattn.so
  [ -e "$lib" ] || { echo "build-gpu/libflashattn.so missing: run tools/gpu-check.sh first" >&2; exit 1; }
  echo "== flashattn._C against $lib and $("$py" -c 'import torch; print("torch", torch.__version__)')"
  if ! { cmake -S python -B build-gpu-torch -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_LIBRARY="$lib" \
         -DFLASHATTN_TORCH_PYTHON="$py" && cmake --build build-gpu-torch -j"$(nproc)"; } \
      >"$OUT/torch-build.log" 2>&1; then
    echo "build failed (tail of $OUT/torch-build.log):"; tail -30 "$OUT/torch-build.log"; exit 1
  fi
  grep "flashattn: PyTorch operators" "$OUT/torch-build.log"
  ext=$(ls build-gpu-torch/_C.*.so build-gpu-torch/libflashattn_ops.so 2>/dev/null | head -1)
  export FLASHATTN_LIBRARY=$lib FLASHATTN_TORCH_LIBRARY=$PWD/$ext
  export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
fi
"$py" -c "import flashattn; assert flashattn.torch_ops_available() and flashattn.cuda_available(), \
'operators %s, CUDA %s' % (flashattn.torch_ops_available(), flashattn.cuda_available()); \
print('flashattn', flashattn.version(), 'from', flashattn.__file__)" || exit 1

if [ $test = 1 ]; then
  echo "== pytest python/tests"
  "$py" -m pytest python/tests -q -p no:cacheprovider >"$OUT/pytest.log" 2>&1 || status=1
  tail -3 "$OUT/pytest.log"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
fi

if [ $bench = 1 ]; then
  echo "== tools/bench_overhead.py (host and whole-call µs per call)"
  "$py" tools/bench_overhead.py --json "$OUT/overhead.json" 2>&1 | tee "$OUT/overhead.md" || status=1
fi

if [ $example = 1 ]; then
  echo "== examples/gpt2_train.py --device cuda --steps $steps"
  "$py" examples/gpt2_train.py --device cuda --steps "$steps" --impl flashattn,sdpa-flash,math \
    --json "$OUT/gpt2.json" >"$OUT/gpt2.log" 2>&1 || status=1
  tail -25 "$OUT/gpt2.log"
  echo "== examples/transformers_train.py --device cuda"
  "$py" examples/transformers_train.py --device cuda --json "$OUT/transformers.json" \
    >"$OUT/transformers.log" 2>&1 || status=1
  tail -25 "$OUT/transformers.log"
fi
exit $status
