#!/usr/bin/env bash
# The project's test command: builds the library (with the CUDA backend when
# nvcc is present, so a broken kernel never lands), runs the test suite, then
# runs it again under AddressSanitizer + UndefinedBehaviorSanitizer.
# Usage: tools/test.sh [--quick]   (--quick: skip the sanitizer build)
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)

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

if [ "${1:-}" != "--quick" ]; then
  echo "== sanitizer build (ASan + UBSan, CPU backend)"
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DFLASHATTN_CUDA=OFF -DFLASHATTN_SANITIZE=ON \
    -DFLASHATTN_BENCH=OFF -DCMAKE_C_FLAGS="-O1" >/dev/null
  cmake --build build-asan -j"$jobs"
  echo "== test suite (sanitizers)"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ./build-asan/bin/test_flashattn
fi
