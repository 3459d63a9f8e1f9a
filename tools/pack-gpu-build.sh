#!/usr/bin/env bash
# Builds the sm_90 shared library, tests and benchmarks into build-gpu (as
# tools/gpu-check.sh would on the GPU machine) and packs what the GPU run needs
# into .gpu/build-gpu.tar.gz (about 15 MB), so a device call can skip compiling:
#   tools/pack-gpu-build.sh && device run, carry [".gpu"]:
#   tools/gpu-check.sh --prebuilt=.gpu/build-gpu.tar.gz ...
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON -DFLASHATTN_CUDA_ARCHS=90 \
  -DBUILD_SHARED_LIBS=ON -DFLASHATTN_TESTS=ON -DFLASHATTN_BENCH=ON >/dev/null
cmake --build build-gpu -j"$(nproc)"
mkdir -p .gpu
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
tmp=$(mktemp -d)
mkdir -p "$tmp/build-gpu/bin"
cp -a build-gpu/libflashattn.so* "$tmp/build-gpu/"
strip --strip-unneeded "$tmp"/build-gpu/libflashattn.so.*.*
cp build-gpu/bin/test_cuda build-gpu/bin/flashattn-bench build-gpu/bin/flashattn-block-sweep \
  "$tmp/build-gpu/bin/"
tar czf .gpu/build-gpu.tar.gz -C "$tmp" build-gpu
rm -rf "$tmp"
ls -la .gpu/build-gpu.tar.gz
