#!/usr/bin/env bash
# The GPU's idle time inside `deltamoe bench` steps at the LAYERS depths (CUPTI activity records
# through kernel_trace.cc, no serialisation), and per added layer between the first and the last
# depth: the busy and idle time, and each kernel's time.
# Builds the tracer with the machine's compiler when CUPTI's header is there, else uses one carried
# in gpu_bundle/exp/libkernel_trace.so. Usage: bash tools/gpu/kernel_trace.sh
#   LAYERS (default "4 8"), STEPS (measured steps, default 4), BENCH_EXTRA (more bench flags).
# Output: $OUT/kernel_trace.tgz (per depth trace_L<n>.txt, kernel_trace.py's summary, trace_L<n>.csv.gz
# and the bench log) and between the first and last depth $OUT/trace_per_layer.txt
# (kernel_trace_diff.py: each kernel's ms per added layer).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
: "${OUT:?OUT must name the folder whose files come back}"
set +u
source gpu_bundle/env.sh
set -u
cupti=$( { python3 -c "import nvidia, os; print(list(nvidia.__path__)[0])" 2>/dev/null | xargs -I{} find {} -name 'libcupti.so.13*'; \
  find /usr/local/cuda/ -name 'libcupti.so.13*'; } 2>/dev/null | head -1)
[ -n "$cupti" ] || { echo "kernel_trace: no libcupti.so.13 on this machine"; exit 1; }
export LD_LIBRARY_PATH="$(dirname "$cupti"):$LD_LIBRARY_PATH"
lib=/tmp/libkernel_trace.so
header=$(find /usr/local/cuda/ -name cupti.h 2>/dev/null | head -1)
if [ -n "$header" ] && g++ -O2 -std=c++17 -shared -fPIC tools/gpu/kernel_trace.cc -I"$(dirname "$header")" \
     -L"$(dirname "$cupti")" -l:"$(basename "$cupti")" -o "$lib" 2>/tmp/kernel_trace_build.log; then
  echo "kernel_trace: tracer built here against $cupti"
else
  lib=$PWD/gpu_bundle/exp/libkernel_trace.so
  [ -f "$lib" ] || { echo "kernel_trace: cannot build the tracer and none was carried"; cat /tmp/kernel_trace_build.log; exit 1; }
  echo "kernel_trace: carried tracer, CUPTI from $cupti"
fi
status=0
for layers in ${LAYERS:-4 8}; do
  csv=/tmp/trace_L$layers.csv
  # shellcheck disable=SC2086
  KERNEL_TRACE_OUT=$csv LD_PRELOAD=$lib gpu_bundle/bin/deltamoe bench --layers "$layers" --tokens 8192 --seqs 2 \
    --steps "${STEPS:-4}" --warmup 1 ${BENCH_EXTRA:-} > "$OUT/trace_bench_L$layers.log" 2>&1 ||
    { echo "kernel_trace: bench L$layers failed"; tail -5 "$OUT/trace_bench_L$layers.log"; status=1; continue; }
  grep -E "step time|kernel_trace" "$OUT/trace_bench_L$layers.log"
  python3 tools/gpu/kernel_trace.py "$csv" "L$layers" > "$OUT/trace_L$layers.txt" || status=1
  head -25 "$OUT/trace_L$layers.txt"
  gzip -c "$csv" > "$OUT/trace_L$layers.csv.gz"
done
# Per added layer between the first and the last depth: busy and idle, then by kernel.
read -r -a depths <<< "${LAYERS:-4 8}"
first=${depths[0]} last=${depths[${#depths[@]}-1]}
if [ "$first" != "$last" ] && [ -f "$OUT/trace_L$first.txt" ] && [ -f "$OUT/trace_L$last.txt" ]; then
  python3 - "$OUT" "$first" "$last" <<'EOF'
import re, sys, os
out, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
vals = {}
for layers in (first, last):
    m = re.search(r"SUMMARY \S+ (.*)", open(os.path.join(out, f"trace_L{layers}.txt")).read())
    if m: vals[layers] = {k: float(v) for k, v in (kv.split("=") for kv in m.group(1).split())}
if len(vals) == 2:
    print(f"per added layer (L{last} - L{first}) / {last - first}, ms: " +
          ", ".join(f"{k[:-3]} {(vals[last][k] - vals[first][k]) / (last - first):.3f}" for k in vals[first]))
EOF
  python3 tools/gpu/kernel_trace_diff.py "$OUT/trace_L$first.csv.gz" "$OUT/trace_L$last.csv.gz" $((last - first)) \
    > "$OUT/trace_per_layer.txt" || status=1
  head -30 "$OUT/trace_per_layer.txt"
fi
# A device call brings back at most 8 files: everything but the per-layer table in one archive.
tar czf "$OUT/kernel_trace.tgz" -C "$OUT" $(cd "$OUT" && ls trace_L* trace_bench_L* 2>/dev/null) &&
  (cd "$OUT" && rm -f trace_L* trace_bench_L*)
exit $status
