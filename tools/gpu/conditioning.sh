#!/usr/bin/env bash
# Runs on the GPU machine: how far bf16 alone moves the golden gradients, measured with
# transformers itself (tools/golden/bf16_floor.py), beside `deltamoe parity --device cuda` on the
# same cases: the committed *_router_margin cases and any cases named in CANDIDATES (generated
# here on the CPU first). Packs everything into $OUT/conditioning.tgz.
# Usage (carry gpu_bundle with bin/deltamoe): CANDIDATES="a,b" bash tools/gpu/conditioning.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must name the folder whose files come back}"
export PYTHONUNBUFFERED=1
results=/tmp/conditioning
rm -rf "$results" && mkdir -p "$results/cases"
cp -r tests/golden/text_router_margin tests/golden/vlm_router_margin "$results/cases/"
if [ -n "${CANDIDATES:-}" ]; then
  CUDA_VISIBLE_DEVICES="" python3 tools/golden/make_golden.py --out "$results/cases" --cases all \
    --only "$CANDIDATES" > "$results/make_golden.log" 2>&1 || echo "make_golden failed (see make_golden.log)"
  grep -E "^== case|smallest|wrote|Error|error" "$results/make_golden.log" | grep -v "is falling back" | head -40
fi
source gpu_bundle/env.sh
GOLDEN_ROOT="$results/cases" OUT="$results" bash tools/gpu/session_checks.sh parity > "$results/parity_step.log" 2>&1
grep -E "^---|rel|OVER|worst|PASS|FAIL" "$results/parity.log"
# shellcheck disable=SC2046
python3 tools/golden/bf16_floor.py --show "${SHOW:-dt_bias,A_log,in_proj_a,in_proj_b,shared_expert_gate}" \
  --deltamoe "$results/parity" --json "$results/bf16_floor.json" $(ls -d "$results"/cases/*/) 2>&1 |
  grep -v -i "warn\|falling back" | tee "$results/bf16_floor.log"
tar czf "$OUT/conditioning.tgz" -C "$results" .
