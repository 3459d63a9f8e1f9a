#!/usr/bin/env bash
# The project's test command: builds the library (with the CUDA backend when
# nvcc is present, so a broken kernel never lands), runs the test suite, then
# runs it again under AddressSanitizer + UndefinedBehaviorSanitizer.
# Then builds and installs the Python package into a venv (build-py/venv) and runs
# its tests (python/tests).
# Usage: tools/test.sh [--quick] [--no-python]
#   --quick: skip the sanitizer build; --no-python: skip the Python package tests
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)
quick=0
python=1
for arg in "$@"; do
  case "$arg" in
    --quick) quick=1 ;;
    --no-python) python=0 ;;
    *) echo "usage: tools/test.sh [--quick] [--no-python]" >&2; exit 2 ;;
  esac
done

need() { command -v "$1" >/dev/null 2>&1; }
if ! need cmake || ! need cc; then
  echo "== installing build tools (cmake, gcc)"
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq cmake gcc make >/dev/null
  else sudo apt-get update -qq && sudo apt-get install -y -qq cmake gcc make >/dev/null; fi
fi

cuda=OFF
if need nvcc || [ -x /usr/local/cuda/bin/nvcc ]; then
  cuda=ON
  need nvcc || export PATH=/usr/local/cuda/bin:$PATH
fi

echo "== release build (CUDA backend: $cuda)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=$cuda >/dev/null
cmake --build build -j"$jobs"
echo "== test suite (release)"
./build/bin/test_flashattn
echo "== test suite (release, AVX2 CPU kernels where the default is their AVX-512VL build)"
FLASHATTN_CPU_ISA=avx2 ./build/bin/test_flashattn --quick
echo "== test suite (release, portable CPU kernels instead of AVX2)"
FLASHATTN_CPU_ISA=portable ./build/bin/test_flashattn --quick
echo "== install, then build the README's example against it (pkg-config, find_package)"
tools/check-install.sh build

if [ "$quick" = 0 ]; then
  echo "== sanitizer build (ASan + UBSan, CPU backend)"
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DFLASHATTN_CUDA=OFF -DFLASHATTN_SANITIZE=ON \
    -DFLASHATTN_BENCH=OFF -DCMAKE_C_FLAGS="-O1" >/dev/null
  cmake --build build-asan -j"$jobs"
  echo "== test suite (sanitizers)"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ./build-asan/bin/test_flashattn
fi

# ---- Python package: pip install . into a venv, then pytest python/tests ------------
# torch comes from PyPI (its Linux wheel is the CUDA build: ~3 GB of downloads, ~5.4 GB
# installed, 1.5 minutes cold; pip's cache in ~/.cache/pip makes reruns fast), with
# transformers for the integration tests. `pip install .` builds the compiled PyTorch
# operators against that torch (FLASHATTN_TORCH=ON: a build that misses them fails). The
# wheel is built CPU-only unless a GPU is visible (nvcc alone would compile kernels no
# test here can run); set FLASHATTN_PY_CUDA=AUTO|ON|OFF to choose.
if [ "$python" = 1 ]; then
  echo "== python package (pip install . into build-py/venv, pytest python/tests)"
  py_start=$SECONDS
  venv=build-py/venv
  if [ ! -x "$venv/bin/python" ]; then
    if ! python3 -m venv "$venv" >/dev/null 2>&1; then
      rm -rf "$venv"
      echo "== installing python3-venv"
      if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
      else sudo apt-get update -qq && sudo apt-get install -y -qq python3-venv >/dev/null; fi
      python3 -m venv "$venv"
    fi
  fi
  "$venv/bin/python" -m pip install -q --disable-pip-version-check numpy pytest ml_dtypes torch \
    transformers
  py_cuda=${FLASHATTN_PY_CUDA:-}
  if [ -z "$py_cuda" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then py_cuda=AUTO; else py_cuda=OFF; fi
  fi
  echo "== pip install . (FLASHATTN_CUDA=$py_cuda)"
  SKBUILD_CMAKE_DEFINE="FLASHATTN_CUDA=$py_cuda;FLASHATTN_TORCH=ON" \
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps .
  echo "== python tests (venv and install took $((SECONDS - py_start)) s)"
  # from the repository root, so `import flashattn` is the installed package
  "$venv/bin/python" -m pytest python/tests -q -p no:cacheprovider
fi
