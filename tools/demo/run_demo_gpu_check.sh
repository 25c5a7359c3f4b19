#!/usr/bin/env bash
# The demo trained twice with one deltamoe program, on the GPU engine and on the CPU reference (same
# model, data, seed and flags), then tools/demo/compare_loss_curves.py: the GPU's loss curve must
# follow the CPU's within bf16 noise. Builds nothing. Writes both metrics files, both logs and the
# comparison to RESULT_DIR. Needs a CUDA build and a GPU (tools/gpu/session_checks.sh demo_gpu).
# usage: tools/demo/run_demo_gpu_check.sh DELTAMOE_BINARY RESULT_DIR   (run from the repository root)
# DEMO_STEPS (default 60) and DEMO_WORK (default /tmp/deltamoe_demo_gpu) as for run_demo.sh.
set -uo pipefail
bin=$1
results=$2
work=${DEMO_WORK:-/tmp/deltamoe_demo_gpu}
mkdir -p "$results"
status=0
python3 --version
for device in cuda cpu; do
  echo "== demo on $device"
  start=$(date +%s)
  DEMO_DEVICE=$device bash tools/demo/run_demo.sh "$bin" "$work/$device" > "$results/demo_$device.log" 2>&1
  code=$?
  echo "demo on $device: exit $code after $(( $(date +%s) - start )) s (log: demo_$device.log)"
  grep -E "^(step|eval)|demo:|train: GPU engine|train summary|error|Error" "$results/demo_$device.log" | tail -25
  [ "$code" -eq 0 ] || status=1
  [ -f "$work/$device/run/metrics.jsonl" ] && cp "$work/$device/run/metrics.jsonl" "$results/demo_${device}_metrics.jsonl"
done
if [ -f "$results/demo_cpu_metrics.jsonl" ] && [ -f "$results/demo_cuda_metrics.jsonl" ]; then
  python3 tools/demo/compare_loss_curves.py "$results/demo_cpu_metrics.jsonl" "$results/demo_cuda_metrics.jsonl" \
    2>&1 | tee "$results/demo_compare.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
  echo "demo_gpu: a run wrote no metrics; nothing to compare"
  status=1
fi
exit $status
