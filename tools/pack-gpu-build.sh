#!/usr/bin/env bash
# Builds the sm_90 shared library, tests and benchmarks into build-gpu with
# tools/gpu-check.sh --build-only (the GPU machine's own build) and packs what the GPU run needs
# into .gpu/build-gpu.tar.gz (about 15 MB), so a device call can skip compiling:
#   tools/pack-gpu-build.sh && device run, carry [".gpu"]:
#   tools/gpu-check.sh --prebuilt=.gpu/build-gpu.tar.gz ...
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/build-gpu-pack} tools/gpu-check.sh --build-only # the GPU run's own build
mkdir -p .gpu
ex=$(git rev-parse --git-path info/exclude) # a worktree's .git is a file
mkdir -p "$(dirname "$ex")"
grep -qx '/.gpu/' "$ex" 2>/dev/null || echo '/.gpu/' >>"$ex"
tmp=$(mktemp -d)
mkdir -p "$tmp/build-gpu/bin"
cp -a build-gpu/libflashattn.so* "$tmp/build-gpu/"
strip --strip-unneeded "$tmp"/build-gpu/libflashattn.so.*.*
cp build-gpu/bin/test_cuda build-gpu/bin/flashattn-bench build-gpu/bin/flashattn-block-sweep \
  "$tmp/build-gpu/bin/"
[ -x build-gpu/bin/test_wgmma ] && cp build-gpu/bin/test_wgmma "$tmp/build-gpu/bin/"
[ -x build-gpu/bin/test_cuda_kv ] && cp build-gpu/bin/test_cuda_kv "$tmp/build-gpu/bin/"
tar czf .gpu/build-gpu.tar.gz -C "$tmp" build-gpu
rm -rf "$tmp"
ls -la .gpu/build-gpu.tar.gz
