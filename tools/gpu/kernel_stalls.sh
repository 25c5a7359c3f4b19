#!/usr/bin/env bash
# SASS-level stall sampling of chosen kernels in one device call: for each kernel-name regex in
# KERNELS, Nsight Compute profiles one launch of PROGRAM (its arguments in ARGS) with the source
# counters, warp states, speed of light, occupancy and memory workload sections, and keeps the
# SASS source page as CSV, the details page as text and tools/gpu/sass_stalls.py's summary.
#   PROGRAM  the program to run (e.g. gpu_bundle/bin/gated_delta_rule_gpu_test)
#   ARGS     its arguments (e.g. --gtest_filter='*Qwen35BShapeTimed*')
#   KERNELS  kernel-name regexes, one launch each (the first that matches, after SKIP launches)
#   SKIP (default 0), PROF_S (default 240: no new kernel starts after that many seconds)
# Output: $OUT/stalls.tgz (NAME_sass.csv, NAME_details.txt, NAME_stalls.txt) and each summary's head on stdout.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
: "${OUT:?OUT must name the folder whose files come back}" "${PROGRAM:?}" "${KERNELS:?}"
ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || true)
[ -n "$ncu_bin" ] || { echo "kernel_stalls: no ncu on this machine"; exit 1; }
set -f  # ARGS (e.g. --gtest_filter=*Timed*) and KERNELS split on spaces, never globbed
work=/tmp/kernel_stalls
rm -rf "$work" && mkdir -p "$work"
start=$(date +%s)
for kernel in $KERNELS; do
  if [ $(( $(date +%s) - start )) -ge "${PROF_S:-240}" ]; then echo "kernel_stalls: NOT RUN $kernel (time)"; continue; fi
  name=$(echo "$kernel" | tr -c 'A-Za-z0-9_\n' '_')
  # shellcheck disable=SC2086
  timeout 120 "$ncu_bin" --section SourceCounters --section WarpStateStats --section SpeedOfLight \
    --section Occupancy --section MemoryWorkloadAnalysis -k "regex:$kernel" -s "${SKIP:-0}" -c 1 \
    -o "$work/$name" "$PROGRAM" ${ARGS:-} > "$work/$name.log" 2>&1 || echo "kernel_stalls: ncu failed for $kernel"
  [ -f "$work/$name.ncu-rep" ] || { tail -3 "$work/$name.log"; continue; }
  "$ncu_bin" -i "$work/$name.ncu-rep" --page source --csv --print-source sass > "$work/${name}_sass.csv" 2>&1
  "$ncu_bin" -i "$work/$name.ncu-rep" --page details > "$work/${name}_details.txt" 2>&1
  python3 "$here/sass_stalls.py" "$work/${name}_sass.csv" > "$work/${name}_stalls.txt" 2>&1
  echo "== $kernel: $(grep -m1 -E ' Duration ' "$work/${name}_details.txt" | tr -s ' ')"
  head -4 "$work/${name}_stalls.txt" | tail -3
  rm -f "$work/$name.ncu-rep"
done
tar czf "$OUT/stalls.tgz" -C "$work" --exclude='*.log' .
