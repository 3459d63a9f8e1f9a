#!/usr/bin/env bash
# Installs the library from a build folder into BUILD/install, then builds the
# README's C example against it twice, as a user would: with pkg-config and
# with CMake's find_package. Fails if either does not compile, link or run.
# Usage: tools/check-install.sh [BUILD]   (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
prefix=$PWD/$build/install
work=$PWD/$build/consumer
rm -rf "$prefix" "$work"
mkdir -p "$work"
cmake --install "$build" --prefix "$prefix" >/dev/null
# the first ```c block of README.md is the example
awk '/^```c$/{f=1;next} /^```$/{if(f)exit} f' README.md >"$work/example.c"
[ -s "$work/example.c" ] || { echo "no C example found in README.md" >&2; exit 1; }

export PKG_CONFIG_PATH=$prefix/lib/pkgconfig:$prefix/lib64/pkgconfig
# shellcheck disable=SC2046
cc -std=c11 -Wall -Werror "$work/example.c" -o "$work/example-pc" \
  $(pkg-config --cflags --libs --static flashattn)
"$work/example-pc"

cmake -S tests/consumer -B "$work/cmake" -DCMAKE_PREFIX_PATH="$prefix" \
  -DEXAMPLE_SOURCE="$work/example.c" >/dev/null
cmake --build "$work/cmake" >/dev/null
"$work/cmake/readme_example"
echo "install check: README example built with pkg-config and find_package, both ran"
