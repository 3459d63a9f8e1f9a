#!/usr/bin/env bash
# Our CPU forward against llama.cpp's CPU kernel (ggml_flash_attn_ext) and PyTorch's
# CPU SDPA, one after the other in one run on this machine, then a table of GFLOP/s and
# ratios (ours = flashattn-bench's flash2; peak = the FMA peak and DRAM read bandwidth
# flashattn-bench --peak measures at the start of the run).
#
#   tools/peers/compare-cpu.sh [--threads N] [--scaling] [--max-time S] [--out FILE] [--quick]
#
#   --threads N    threads for every tool (default 2)
#   --scaling      also run flash2 and llama.cpp with 1 thread: the 2-thread/1-thread speedup
#   --max-time S   passed to every tool: a case stops after S seconds of runs (default 2)
#   --out FILE     the JSON lines of the run (default build-peers/compare-cpu.jsonl)
#   --quick        small shapes of the same kinds, to check the pipeline in seconds
#
# Builds what is missing, all under build-peers/ (gitignored), at nice -n 19:
#   - ggml and bench_ggml_fa: tools/peers/llamacpp/fetch-build.sh
#   - flashattn-bench from the committed HEAD (git archive, so uncommitted work in the tree
#     is not measured): build-peers/fa/<commit>/
# Python: $PYTHON, else /tmp/venv/bin/python, else build-peers/venv (created with torch and
# numpy from PyPI when none of these has torch).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PEERS=$ROOT/build-peers
THREADS=2
SCALING=0
QUICK=0
MAX_TIME=2
OUTFILE=$PEERS/compare-cpu.jsonl
while [ $# -gt 0 ]; do
  case $1 in
    --threads) THREADS=$2; shift 2 ;;
    --scaling) SCALING=1; shift ;;
    --max-time) MAX_TIME=$2; shift 2 ;;
    --out) OUTFILE=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "compare-cpu: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$PEERS"
log() { echo "compare-cpu: $*" >&2; }

# ---- Python with torch --------------------------------------------------------------
if [ -z "${PYTHON:-}" ]; then
  for p in /tmp/venv/bin/python "$PEERS/venv/bin/python"; do
    if [ -x "$p" ] && "$p" -c 'import torch' 2>/dev/null; then PYTHON=$p; break; fi
  done
fi
if [ -z "${PYTHON:-}" ]; then
  log "creating build-peers/venv with torch and numpy (pip, PyPI)"
  python3 -m venv "$PEERS/venv"
  "$PEERS/venv/bin/python" -m pip install --quiet torch numpy >&2
  PYTHON=$PEERS/venv/bin/python
fi
export PYTHON

# ---- builds ---------------------------------------------------------------------------
GGML_BENCH=$("$ROOT/tools/peers/llamacpp/fetch-build.sh")

COMMIT=$(git -C "$ROOT" rev-parse --short=12 HEAD)
FA_DIR=$PEERS/fa/$COMMIT
FA_BENCH=$FA_DIR/build/bin/flashattn-bench
if [ ! -x "$FA_BENCH" ]; then
  log "building flashattn-bench at HEAD $COMMIT in ${FA_DIR#$ROOT/}"
  rm -rf "$FA_DIR" && mkdir -p "$FA_DIR/src"
  git -C "$ROOT" archive HEAD | tar -x -C "$FA_DIR/src"
  nice -n 19 cmake -S "$FA_DIR/src" -B "$FA_DIR/build" -DCMAKE_BUILD_TYPE=Release \
    -DFLASHATTN_CUDA=OFF -DFLASHATTN_TESTS=OFF -DFLASHATTN_BENCH=ON >"$FA_DIR/configure.log" 2>&1 \
    || { tail -30 "$FA_DIR/configure.log" >&2; exit 1; }
  nice -n 19 cmake --build "$FA_DIR/build" --target flashattn-bench -j 2 >"$FA_DIR/build.log" 2>&1 \
    || { tail -30 "$FA_DIR/build.log" >&2; exit 1; }
fi

# ---- the shapes: flashattn-bench's shape flags, then our storage dtype --------
# llama.cpp always runs Q f32 with K/V f16; torch runs f32 and bf16.
SHAPES=(
  "--headdim 72 --heads 16 --seqlen 5776 --no-causal|f16"
  "--headdim 256 --heads 32 --kv-heads 2 --seqlen 512 --seqlen-k 10000 --no-causal|f16"
  "--headdim 64 --heads 16 --seqlen 4096 --no-causal|f32"
  "--headdim 64 --heads 16 --seqlen 4096 --causal|f32"
  "--headdim 128 --heads 16 --seqlen 4096 --no-causal|f32"
  "--headdim 128 --heads 16 --seqlen 4096 --causal|f32"
  "--headdim 128 --heads 8 --seqlen 1 --seqlen-k 16384 --no-causal|f16"
)
if [ "$QUICK" = 1 ]; then
  SHAPES=(
    "--headdim 72 --heads 2 --seqlen 300 --no-causal|f16"
    "--headdim 256 --heads 4 --kv-heads 2 --seqlen 64 --seqlen-k 700 --no-causal|f16"
    "--headdim 64 --heads 2 --seqlen 256 --causal|f32"
    "--headdim 128 --heads 8 --seqlen 1 --seqlen-k 2048 --no-causal|f16"
  )
fi
COMMON=(--threads "$THREADS" --repeat 3 --warmup 1 --max-time "$MAX_TIME")

: > "$OUTFILE"
start=$(date +%s)
log "run at $(date -u +%FT%TZ), HEAD $COMMIT, load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "{\"record\":\"run\",\"commit\":\"$COMMIT\",\"date\":\"$(date -u +%FT%TZ)\",\"threads\":$THREADS,\"loadavg_start\":\"$(cut -d' ' -f1-3 /proc/loadavg)\",\"cpu\":\"$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')\"}" >> "$OUTFILE"

log "peak (flashattn-bench --peak-only)"
"$FA_BENCH" --peak-only --json --threads "$THREADS" | tee -a "$OUTFILE" >&2

for entry in "${SHAPES[@]}"; do
  read -r -a shape <<< "${entry%|*}"
  dtype=${entry#*|}
  log "${shape[*]} (load average $(cut -d' ' -f1 /proc/loadavg))"
  echo "{\"record\":\"load\",\"shape\":\"${shape[*]}\",\"loadavg\":\"$(cut -d' ' -f1-3 /proc/loadavg)\"}" >> "$OUTFILE"
  "$FA_BENCH" --batch 1 --impl flash2,standard --pass fwd --dtype "$dtype" --json "${shape[@]}" "${COMMON[@]}" \
    | grep '"record":"case"' | tee -a "$OUTFILE" >&2
  "$GGML_BENCH" "${shape[@]}" "${COMMON[@]}" | tee -a "$OUTFILE" >&2
  "$PYTHON" "$ROOT/tools/peers/bench_torch_cpu.py" "${shape[@]}" "${COMMON[@]}" --dtypes f32,bf16 \
    | tee -a "$OUTFILE" >&2
  if [ "$SCALING" = 1 ] && [ "$THREADS" != 1 ]; then
    one=(--threads 1 --repeat 3 --warmup 1 --max-time "$MAX_TIME")
    "$FA_BENCH" --batch 1 --impl flash2 --pass fwd --dtype "$dtype" --json "${shape[@]}" "${one[@]}" \
      | grep '"record":"case"' | tee -a "$OUTFILE" >&2
    "$GGML_BENCH" "${shape[@]}" "${one[@]}" | tee -a "$OUTFILE" >&2
  fi
done
# the peak again: a lower number here means something else ran on the machine meanwhile
log "peak again"
"$FA_BENCH" --peak-only --json --threads "$THREADS" | sed 's/"record":"peak"/"record":"peak_end"/' \
  | tee -a "$OUTFILE" >&2
echo "{\"record\":\"end\",\"seconds\":$(( $(date +%s) - start )),\"loadavg_end\":\"$(cut -d' ' -f1-3 /proc/loadavg)\"}" >> "$OUTFILE"
log "done in $(( $(date +%s) - start )) s; JSON lines in $OUTFILE"

"$PYTHON" "$ROOT/tools/peers/compare_table.py" "$OUTFILE" --threads "$THREADS"
