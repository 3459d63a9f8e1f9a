#!/usr/bin/env bash
# The project's test command. Builds the library (with the CUDA backend for every
# default arch when nvcc is present, so a broken kernel never lands, GPU or not),
# runs the test suite on each CPU kernel set, checks the install, runs the suite
# again under AddressSanitizer + UndefinedBehaviorSanitizer, then installs the
# Python package into a venv (build-py/venv) and runs its tests (python/tests).
# Every stage's counts add up to the closing line "N passed, N failed"; a stage
# that crashes counts as failed; the exit status is non-zero if anything failed.
# Usage: tools/test.sh [--quick] [--no-python]
#   --quick: skip the sanitizer build; --no-python: skip the Python package tests
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
quick=0
python=1
for arg in "$@"; do
  case "$arg" in
    --quick) quick=1 ;;
    --no-python) python=0 ;;
    *) echo "usage: tools/test.sh [--quick] [--no-python]" >&2; exit 2 ;;
  esac
done

# ---- stages: each adds its counts to the closing line ----------------------------------
# stage NAME CMD...   runs CMD; its counts are those of its last "N passed" / "N failed"
#                     (/ "N error") line (the C suites' and pytest's closing lines), or one
#                     check when it prints none; a non-zero exit with no failure counted
#                     (a crash) counts one failure; exit 77 (no device) counts nothing.
# step NAME CMD...    a build or setup step: counts nothing unless it fails (one failure);
#                     returns CMD's status, so the stages that need it can be skipped.
logs=build-logs
mkdir -p "$logs"
total_pass=0 total_fail=0 summary=()
record() { # name, passed, failed, note
  total_pass=$((total_pass + $2)) total_fail=$((total_fail + $3))
  summary+=("$(printf '  %-34s %5d passed, %d failed%s' "$1" "$2" "$3" "${4:+ ($4)}")")
}
logname() { echo "$logs/${1//[^A-Za-z0-9._-]/_}.log"; }
run_logged() { # name, cmd...: the output shown and kept in $(logname NAME); returns CMD's status
  local log
  log=$(logname "$1")
  shift
  "$@" 2>&1 | tee "$log"
  return "${PIPESTATUS[0]}"
}
stage() {
  local name=$1 rc p f line
  shift
  echo "== $name"
  run_logged "$name" "$@"
  rc=$?
  line=$(grep -E '[0-9]+ (passed|failed|errors?)\b' "$(logname "$name")" | tail -1)
  if [ "$rc" = 77 ]; then
    record "$name" 0 0 "skipped: $(tail -1 "$(logname "$name")")"
    return 0
  elif [ -n "$line" ]; then
    p=$(grep -oE '[0-9]+ passed' <<<"$line" | grep -oE '[0-9]+' || echo 0)
    f=$(($(grep -oE '[0-9]+ (failed|errors?)' <<<"$line" | grep -oE '[0-9]+' | paste -sd+ -) + 0))
  else
    p=$((rc == 0)) f=0
  fi
  if [ "$rc" != 0 ] && [ "$f" = 0 ]; then
    f=1
    record "$name" "$p" "$f" "exit status $rc"
  else
    record "$name" "$p" "$f"
  fi
  return "$rc"
}
step() {
  local name=$1 rc
  shift
  echo "== $name"
  run_logged "$name" "$@"
  rc=$?
  [ "$rc" = 0 ] || record "$name" 0 1 "exit status $rc, see $(logname "$name")"
  return "$rc"
}
skip() { # name, why: a stage that could not run counts as failed
  record "$1" 0 1 "not run: $2"
}
finish() {
  echo "== summary (logs in $logs/)"
  printf '%s\n' "${summary[@]}"
  echo "$total_pass passed, $total_fail failed"
  [ "$total_fail" = 0 ]
  exit $?
}

need() { command -v "$1" >/dev/null 2>&1; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
if ! need cmake || ! need cc; then
  echo "== installing build tools (cmake, gcc)"
  as_root apt-get update -qq && as_root apt-get install -y -qq cmake gcc make >/dev/null
fi
# parallel jobs: the cores, at most one per 2 GiB of memory (a CUDA compile takes ~1.5 GiB)
jobs=$(nproc 2>/dev/null || echo 2)
mem_jobs=$(awk '/^MemAvailable:/ {print int($2 / 2097152)}' /proc/meminfo 2>/dev/null || echo "$jobs")
[ "${mem_jobs:-0}" -ge 1 ] && [ "$mem_jobs" -lt "$jobs" ] && jobs=$mem_jobs

# The CUDA backend whenever nvcc is there, GPU or not, for every default arch
# (FLASHATTN_CUDA=ON; the default AUTO would skip it without a GPU).
cuda=OFF
if need nvcc || [ -x /usr/local/cuda/bin/nvcc ]; then
  cuda=ON
  need nvcc || export PATH=/usr/local/cuda/bin:$PATH
fi

# ---- C library: release build, suites, install check ----------------------------------
if step "release build (CUDA backend: $cuda)" \
  bash -c "cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=$cuda >/dev/null &&
           cmake --build build -j$jobs"; then
  stage "test suite (release)" ./build/bin/test_flashattn
  stage "deterministic dQ order" ./build/bin/test_dq_order
  stage "CPU kernel tables alike" ./build/bin/test_kern_tables
  stage "test suite (AVX2 kernels)" env FLASHATTN_CPU_ISA=avx2 ./build/bin/test_flashattn --quick
  stage "test suite (portable kernels)" env FLASHATTN_CPU_ISA=portable ./build/bin/test_flashattn --quick
  [ "$cuda" = ON ] && stage "CUDA tests (vs the CPU oracle)" ./build/bin/test_cuda
  # installs, then builds the README's example against it (pkg-config, find_package)
  stage "install check" tools/check-install.sh build
else
  skip "test suites" "the release build failed"
fi

# ---- sanitizers ------------------------------------------------------------------------
if [ "$quick" = 0 ]; then
  if step "sanitizer build (ASan + UBSan, CPU backend)" \
    bash -c "cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DFLASHATTN_CUDA=OFF \
               -DFLASHATTN_SANITIZE=ON -DFLASHATTN_BENCH=OFF -DCMAKE_C_FLAGS=-O1 >/dev/null &&
             cmake --build build-asan -j$jobs"; then
    stage "test suite (sanitizers)" env ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
      UBSAN_OPTIONS=print_stacktrace=1 ./build-asan/bin/test_flashattn
    stage "deterministic dQ order (sanitizers)" env ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
      UBSAN_OPTIONS=print_stacktrace=1 ./build-asan/bin/test_dq_order
  else
    skip "test suite (sanitizers)" "the sanitizer build failed"
  fi
fi

# ---- randomized differential testing (tests/fuzz) -------------------------------------
# fa_fuzz draws valid cases (checked against the float64 oracle) and invalid ones (each
# must be refused with a message, writing nothing), single-threaded and from 4 host
# threads at once, then one tensor past 2^31 elements where memory allows; with the
# sanitizers (not --quick) it runs again under ASan/UBSan, and the libFuzzer target
# (clang) runs for 60 s. The seed changes daily (FA_FUZZ_SEED=S to choose); every
# failure prints its case's seed and the command that reruns it alone. The cases are
# small: idle OpenMP threads must not spin (OMP_WAIT_POLICY=passive).
fuzz_seed=${FA_FUZZ_SEED:-$(date -u +%Y%m%d)}
fuzz() { env OMP_WAIT_POLICY=passive "$@"; }
fuzz_build() { # clang with OpenMP and its libFuzzer runtime (whose package name varies)
  fuzzer_ok() {
    echo 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { return d && n; }' |
      clang -x c - -fsanitize=fuzzer,address -fopenmp -o /dev/null 2>/dev/null
  }
  if ! need clang || ! fuzzer_ok; then
    as_root apt-get update -qq && as_root apt-get install -y -qq clang libomp-dev >/dev/null
    local v p
    v=$(clang -dumpversion | cut -d. -f1)
    for p in "libclang-rt-$v-dev" libclang-rt-dev "libclang-common-$v-dev"; do
      fuzzer_ok || as_root apt-get install -y -qq "$p" >/dev/null 2>&1 || true
    done
  fi
  CC=clang cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS="-O1" \
    -DFLASHATTN_CUDA=OFF -DFLASHATTN_LIBFUZZER=ON -DFLASHATTN_TESTS=OFF -DFLASHATTN_BENCH=OFF \
    >/dev/null && cmake --build build-fuzz -j"$jobs" --target fa_libfuzzer
}
fuzz_run() {
  mkdir -p build-fuzz/corpus
  if ! LSAN_OPTIONS=suppressions=$PWD/tests/fuzz/lsan.supp UBSAN_OPTIONS=print_stacktrace=1 \
    fuzz ./build-fuzz/bin/fa_libfuzzer -max_total_time=60 -max_len=256 -len_control=0 \
    -print_final_stats=1 -artifact_prefix=build-fuzz/ build-fuzz/corpus tests/fuzz/regress \
    >build-fuzz/libfuzzer.log 2>&1; then
    tail -60 build-fuzz/libfuzzer.log
    echo "libFuzzer failed: the input is in build-fuzz/ (crash-*, leak-*, timeout-*);" \
      "rerun it with ./build-fuzz/bin/fa_libfuzzer FILE"
    return 1
  fi
  grep -E "^(Done|stat::(number_of_executed_units|average_exec_per_sec|new_units_added))" \
    build-fuzz/libfuzzer.log
}
if [ -x build/bin/fa_fuzz ]; then
  stage "fuzz (seed $fuzz_seed)" fuzz ./build/bin/fa_fuzz --seed "$fuzz_seed" --valid 3000 \
    --invalid 3000
  stage "fuzz, 4 host threads at once" fuzz ./build/bin/fa_fuzz --seed "$((fuzz_seed + 1))" \
    --valid 500 --invalid 500 --concurrent 4
  stage "fuzz, a tensor past 2^31 elements" fuzz ./build/bin/fa_fuzz --big
else
  skip "fuzz" "the release build failed"
fi
if [ "$quick" = 0 ]; then
  if [ -x build-asan/bin/fa_fuzz ]; then
    stage "fuzz (sanitizers)" env ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
      UBSAN_OPTIONS=print_stacktrace=1 OMP_WAIT_POLICY=passive ./build-asan/bin/fa_fuzz \
      --seed "$((fuzz_seed + 2))" --valid 1500 --invalid 2000
  else
    skip "fuzz (sanitizers)" "the sanitizer build failed"
  fi
  if step "libFuzzer build (clang, ASan/UBSan)" fuzz_build; then
    stage "libFuzzer over the arguments, 60 s" fuzz_run
  else
    skip "libFuzzer over the arguments, 60 s" "its build failed"
  fi
fi

# ---- Python package: pip install . into a venv, then pytest python/tests ------------
# torch comes from PyPI (its Linux wheel is the CUDA build: ~3 GB of downloads, ~5.4 GB
# installed, 1.5 minutes cold; pip's cache in ~/.cache/pip makes reruns fast), with
# transformers for the integration tests. `pip install .` builds the compiled PyTorch
# operators against that torch (FLASHATTN_TORCH=ON: a build that misses them fails). The
# wheel gets the CUDA backend only where a GPU is visible (pyproject's FLASHATTN_CUDA=AUTO);
# set FLASHATTN_PY_CUDA=AUTO|ON|OFF to choose.
python_env() {
  local venv=build-py/venv
  if [ ! -x "$venv/bin/python" ]; then
    if ! python3 -m venv "$venv" >/dev/null 2>&1; then
      rm -rf "$venv"
      echo "installing python3-venv"
      as_root apt-get update -qq && as_root apt-get install -y -qq python3-venv >/dev/null
      python3 -m venv "$venv" || return 1
    fi
  fi
  "$venv/bin/python" -m pip install -q --disable-pip-version-check numpy pytest ml_dtypes torch \
    transformers &&
    SKBUILD_CMAKE_DEFINE="FLASHATTN_CUDA=${FLASHATTN_PY_CUDA:-AUTO};FLASHATTN_TORCH=ON" \
      "$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps .
}
if [ "$python" = 1 ]; then
  py_start=$SECONDS
  if step "python package (pip install . into build-py/venv)" python_env; then
    echo "(venv and install took $((SECONDS - py_start)) s)"
    # from the repository root, so `import flashattn` is the installed package
    stage "python tests (pytest)" build-py/venv/bin/python -m pytest python/tests -q -p no:cacheprovider
  else
    skip "python tests (pytest)" "the package did not install"
  fi
fi

finish
