#!/usr/bin/env bash
# One probe: the CPU reference of a probe build (README.md) on a golden case with bf16 rounding at
# the named activation points (DM_ROUND) and weight groups (DM_ROUNDW), scored against the golden.
# usage: tools/precision_probe/probe.sh CASE "POINTS" "WEIGHT_GROUPS"   (PROBE_BIN: the probe build's deltamoe)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
case_dir=$repo/tests/golden/$1
out=$(mktemp --suffix=.safetensors)
trap 'rm -f "$out"' EXIT
DM_ROUND="$2" DM_ROUNDW="$3" "${PROBE_BIN:?PROBE_BIN must name the deltamoe of a probe build}" parity \
  --model "$case_dir/model" --inputs "$case_dir/inputs.safetensors" --out "$out" > /dev/null 2>&1
printf "%-24s %-24s " "${2:0:24}" "${3:0:24}"
python3 "$here/compare_gradients.py" "$case_dir/expected.safetensors" "$out" 0
