#!/usr/bin/env bash
# Fetches ggml (llama.cpp's tensor library, vendored in the llama-cpp-python sdist on
# PyPI) at a pinned version, checks its sha256, and builds only ggml's CPU backend plus
# tools/peers/llamacpp/bench_ggml_fa.c against it (tools/peers/llamacpp/CMakeLists.txt).
# Idempotent: a second run downloads and rebuilds nothing that is already there.
#
#   tools/peers/llamacpp/fetch-build.sh      # prints build-peers/llamacpp/build/bin/bench_ggml_fa
#
# Environment: PYTHON (a python with pip; default /tmp/venv/bin/python, else
# build-peers/venv/bin/python, else python3), JOBS (parallel compile jobs, default 2).
# The build runs under nice -n 19 so it yields to benchmarks running beside it.
set -euo pipefail

# llama-cpp-python 0.3.36 vendors llama.cpp at commit 0c1e57098 (ggml 0.25.3).
LCP_VERSION=0.3.36
LCP_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LLAMACPP_COMMIT=0c1e57098
GGML_VERSION=0.25.3

ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
PEERS=$ROOT/build-peers
OUT=$PEERS/llamacpp
SDIST=$OUT/llama_cpp_python-$LCP_VERSION.tar.gz
SRC=$OUT/src/llama_cpp_python-$LCP_VERSION/vendor/llama.cpp
JOBS=${JOBS:-2}

if [ -z "${PYTHON:-}" ]; then
  for p in /tmp/venv/bin/python "$PEERS/venv/bin/python" python3; do
    if command -v "$p" >/dev/null 2>&1 && "$p" -m pip --version >/dev/null 2>&1; then PYTHON=$p; break; fi
  done
fi

[ -n "${PYTHON:-}" ] || { echo "fetch-build: no python with pip; set PYTHON" >&2; exit 1; }
mkdir -p "$OUT"

# 1. The sdist, hash-pinned: pip refuses a file whose sha256 differs from the pin.
if [ ! -f "$SDIST" ] || ! echo "$LCP_SHA256  $SDIST" | sha256sum -c --status; then
  echo "fetch-build: downloading llama-cpp-python==$LCP_VERSION (sdist) from PyPI with pip" >&2
  req=$OUT/requirements.txt
  echo "llama-cpp-python==$LCP_VERSION --hash=sha256:$LCP_SHA256" > "$req"
  "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: --require-hashes \
    -r "$req" -d "$OUT" >&2
fi
echo "$LCP_SHA256  $SDIST" | sha256sum -c --quiet || { echo "fetch-build: sha256 mismatch" >&2; exit 1; }

# 2. Only ggml (and llama.cpp's licence) out of the 76 MB sdist.
if [ ! -f "$SRC/ggml/CMakeLists.txt" ]; then
  rm -rf "$OUT/src" && mkdir -p "$OUT/src"
  tar -xzf "$SDIST" -C "$OUT/src" \
    "llama_cpp_python-$LCP_VERSION/vendor/llama.cpp/ggml" \
    "llama_cpp_python-$LCP_VERSION/vendor/llama.cpp/LICENSE"
fi

# 3. ggml (CPU backend only, tuned for this CPU, static, no tests/examples, nothing
#    fetched) and bench_ggml_fa, from tools/peers/llamacpp/CMakeLists.txt.
#    GIT_CEILING_DIRECTORIES keeps ggml's CMake from taking our repository's commit as its own.
BUILD=$OUT/build
BIN=$BUILD/bin/bench_ggml_fa
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  GIT_CEILING_DIRECTORIES=$PEERS nice -n 19 cmake -S "$ROOT/tools/peers/llamacpp" -B "$BUILD" \
    -DGGML_SOURCE_DIR="$SRC/ggml" \
    -DPEER_VERSION="ggml $GGML_VERSION (llama.cpp $LLAMACPP_COMMIT, llama-cpp-python $LCP_VERSION sdist)" \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON -DGGML_CPU=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
    -DGGML_BLAS=OFF -DGGML_OPENMP=ON -DGGML_OPENMP_FETCH=OFF -DGGML_CPU_KLEIDIAI=OFF \
    -DGGML_BACKEND_DL=OFF -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF -DGGML_CCACHE=OFF \
    >"$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log" >&2; exit 1; }
fi
# make's own dependency tracking: a second run with nothing changed builds nothing
nice -n 19 cmake --build "$BUILD" --target bench_ggml_fa -j "$JOBS" >"$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log" >&2; exit 1; }
echo "$BIN"
