#!/usr/bin/env bash
# Compact view of a tools/gpu-ab.sh log (stdin): test/sanitizer lines, the bench lines, and per
# library the block-sparse sweep as "N pass: dense | s=1 ... s=0" in ms, the window sweep and Flex.
awk '
/^== \[/ { if ($3 ~ /:$/) lib = $3; print; next }
/passed|ERROR SUMMARY|RACECHECK/ { print; next }
/^(fwd|bwd) ours/ { print; next }
/^== N=/ { next }
/^flash2 / { key = $8 " " $4; row[lib key] = row[lib key] " dense " $12; keys[lib key] = 1; next }
/^s=/ { key = $8 " " $4; row[lib key] = row[lib key] " " $1 " " $13; keys[lib key] = 1; next }
/^w=/ { win[lib $4] = win[lib $4] " " $1 " " $13; wk[lib $4] = 1; next }
/^(flex|flashattn) / { print lib " " $0; next }
END {
  for (k in keys) print "sparse " k ":" row[k];
  for (k in wk) print "window " k ":" win[k];
}'
