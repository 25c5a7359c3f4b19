#!/usr/bin/env bash
# Issue #7's acceptance checks in one device call: the named gpu tests (the CPU-bound ones in the
# background, since the machine has 16 cores and their CPU references dominate), parity --device
# cuda on the golden cases, the demo on GPU and CPU with the loss-curve comparison, then the
# benchmark side by side with transformers once the GPU is otherwise idle. The device returns at
# most 8 files, so every log is packed into $OUT/acceptance.tgz; the summary also goes to stdout.
# Usage (carry gpu_bundle; put the Qwen3 tokenizer.json, gzipped, at gpu_bundle/qwen3_tokenizer.json.gz):
#   BACKGROUND_TESTS="moe_experts_gpu_test" TESTS="gpu_text_model_gpu_test" STEPS="parity demo_gpu bench" \
#     bash tools/gpu/acceptance.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must name the folder whose files come back}"
results=/tmp/acceptance
rm -rf "$results" && mkdir -p "$results"
source gpu_bundle/env.sh
if [ -f gpu_bundle/qwen3_tokenizer.json.gz ]; then
  gunzip -c gpu_bundle/qwen3_tokenizer.json.gz > /tmp/qwen3_tokenizer.json
  export DEMO_QWEN3_TOKENIZER=/tmp/qwen3_tokenizer.json
fi
status=0

run_test() {  # name: runs one test program from the repository root, log in $results
  local name=$1 start
  start=$(date +%s)
  if DELTAMOE_SOURCE_DIR=$PWD DELTAMOE_BINARY=$PWD/gpu_bundle/bin/deltamoe timeout 420 "gpu_bundle/bin/$name" \
      > "$results/$name.log" 2>&1; then
    echo "PASS $name ($(( $(date +%s) - start )) s)"
  else
    echo "FAIL $name ($(( $(date +%s) - start )) s)"; grep -E "Failure|Expected|actual|FAILED" "$results/$name.log" | head -20
    return 1
  fi
}

pids=()
for name in ${BACKGROUND_TESTS:-}; do
  run_test "$name" > "$results/$name.status" 2>&1 &
  pids+=($!)
done
for name in ${TESTS:-}; do run_test "$name" || status=1; done
for step in ${STEPS:-}; do
  [ "$step" = bench ] && continue  # after the background tests, on an idle GPU
  echo "################ $step"
  OUT=$results bash tools/gpu/session_checks.sh "$step" > "$results/step_$step.log" 2>&1 || status=1
  grep -E "PASS|FAIL|worst|ratio|loss|demo on|exit" "$results/step_$step.log" | tail -30
done
run_bench_step() {
  echo "################ bench"
  # shellcheck disable=SC2086
  OUT=$results bash tools/gpu/run_bench.sh ${BENCH_LAYERS:-4 8} > "$results/step_bench.log" 2>&1 || status=1
  cat "$results/bench_table.md" 2>/dev/null
}
# BENCH_WAIT=0 benches while the background tests still run their CPU references (their GPU use
# is brief bursts; saves their remaining minutes of a scarce device call).
wants_bench=0; [[ " ${STEPS:-} " == *" bench "* ]] && wants_bench=1
[ "$wants_bench" = 1 ] && [ "${BENCH_WAIT:-1}" = 0 ] && run_bench_step
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for name in ${BACKGROUND_TESTS:-}; do cat "$results/$name.status"; done
[ "$wants_bench" = 1 ] && [ "${BENCH_WAIT:-1}" != 0 ] && run_bench_step
tar czf "$OUT/acceptance.tgz" -C "$results" .
echo "acceptance: exit $status"
exit $status
