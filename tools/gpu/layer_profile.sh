#!/usr/bin/env bash
# Per-kernel times of one training step of `deltamoe bench` (default 4 layers: 3 GDN + 1 attention,
# each with its MoE block; 8,192 tokens as 2 x 4,096) through Nsight Compute, one metric
# (gpu__time_duration.sum), clocks and caches left alone. Every kernel of the run is timed; the
# summary (layer_profile.py) keeps the last step: from the last embedding forward to the end.
# Usage: DELTAMOE=path/to/deltamoe bash tools/gpu/layer_profile.sh [name]
#   BENCH_ARGS (default "--layers 4 --tokens 8192 --seqs 2 --steps 1 --warmup 1")
# Output: $OUT/<name>_ncu.csv.gz (every kernel), $OUT/<name>_profile.txt (the last step: per kernel
# name, and per launch in order).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)  # run from the repository root; layer_profile.py sits beside this script
name=${1:-profile}
out=${OUT:-/tmp}
DELTAMOE=${DELTAMOE:-gpu_bundle/bin/deltamoe}
# The bundle's program needs the bundle's library paths (image codecs, CUDA's libraries there).
if [ "$DELTAMOE" = gpu_bundle/bin/deltamoe ] && [ -f gpu_bundle/env.sh ]; then
  set +u
  source gpu_bundle/env.sh
  set -u
fi
BENCH_ARGS=${BENCH_ARGS:---layers 4 --tokens 8192 --seqs 2 --steps 1 --warmup 1}
ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || true)
[ -n "$ncu_bin" ] || { echo "layer_profile: no ncu on this machine"; exit 1; }
[ -x "$DELTAMOE" ] || { echo "layer_profile: no deltamoe program at '$DELTAMOE'"; exit 1; }
csv=/tmp/${name}_ncu.csv
# shellcheck disable=SC2086
"$ncu_bin" --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \
  --print-units base --log-file "$csv" "$DELTAMOE" bench $BENCH_ARGS > "/tmp/${name}_bench.log" 2>&1 ||
  { echo "layer_profile: ncu run failed"; tail -20 "/tmp/${name}_bench.log"; exit 1; }
python3 "$here/layer_profile.py" "$csv" > "$out/${name}_profile.txt"
gzip -c "$csv" > "$out/${name}_ncu.csv.gz"
head -60 "$out/${name}_profile.txt"
