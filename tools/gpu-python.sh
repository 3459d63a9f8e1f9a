#!/usr/bin/env bash
# On the GPU machine, after tools/gpu-check.sh has built build-gpu/libflashattn.so:
# the Python package's test suite (CUDA tests included) against that library, whether
# the README's `pip install .` works there, and the GPT-2 example (ours vs torch's math
# attention: loss curves, step time, peak memory at seqlen 1024 and 4096).
# Logs and JSON go to $OUT (default build-gpu/out).
# Usage: tools/gpu-python.sh [--no-example] [--steps N]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/build-gpu/out}
mkdir -p "$OUT"
example=1 steps=300
while [ $# -gt 0 ]; do
  case "$1" in
    --no-example) example=0 ;;
    --steps) steps=$2; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
status=0
lib=$(ls build-gpu/libflashattn.so 2>/dev/null | head -1)
[ -n "$lib" ] || { echo "build-gpu/libflashattn.so missing: run tools/gpu-check.sh first" >&2; exit 1; }
export FLASHATTN_LIBRARY=$PWD/$lib PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}

echo "== pip install . (offline: --no-build-isolation) into a scratch prefix"
if python3 -m pip install -q --no-build-isolation --no-deps --target "$PWD/build-gpu/pip-target" . \
    >"$OUT/pip.log" 2>&1; then
  echo "pip install . works here"
else
  echo "pip install . failed here (tail of $OUT/pip.log):"; tail -5 "$OUT/pip.log"
fi

echo "== pytest python/tests (library: $lib)"
python3 -m pytest python/tests -q -p no:cacheprovider -x >"$OUT/pytest.log" 2>&1 || status=1
tail -3 "$OUT/pytest.log"

if [ $example = 1 ]; then
  echo "== examples/gpt2_train.py --device cuda --steps $steps"
  python3 examples/gpt2_train.py --device cuda --steps "$steps" --impl flashattn,sdpa-flash,math \
    --json "$OUT/gpt2.json" \
    >"$OUT/gpt2.log" 2>&1 || status=1
  tail -25 "$OUT/gpt2.log"
fi
exit $status
