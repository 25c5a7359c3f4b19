#!/usr/bin/env bash
# Which attention the text model runs at a micro-batch's planned sequence counts, what it costs, and
# whether its steps stay steady: cudnn_sdpa_gpu_test (its workspace case prints the plans' WORKSPACE
# need by sequence count), then `deltamoe bench --layers 4 --vary_lengths true` at each of SEQS
# sequences a micro-batch (a train run plans for up to max_tokens / 8 of them), printing the choice
# it logged, the attention component's time and the steady-step line (with the back-to-back share and
# the step that moved the memory in use). Carry gpu_bundle (with cudnn_sdpa_gpu_test).
#   SEQS (default "8 64 1024"), STEPS (default 6). Output: $OUT/attention_path/*.log; summary on stdout.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
: "${OUT:?OUT must name the folder whose files come back}"
out=$OUT/attention_path
mkdir -p "$out"
source gpu_bundle/env.sh
export DELTAMOE_SOURCE_DIR=$PWD
status=0
if [ -x gpu_bundle/bin/cudnn_sdpa_gpu_test ]; then
  timeout 300 gpu_bundle/bin/cudnn_sdpa_gpu_test --gtest_filter='-*Timing*' > "$out/cudnn_sdpa_gpu_test.log" 2>&1 ||
    { echo "FAILED cudnn_sdpa_gpu_test"; status=1; }
  grep -E "WORKSPACE|^\[  (PASSED|FAILED)" "$out/cudnn_sdpa_gpu_test.log"
else
  echo "cudnn_sdpa_gpu_test not in the bundle"; status=1
fi
for seqs in ${SEQS:-8 64 1024}; do
  log=$out/bench_seqs$seqs.log
  timeout 200 gpu_bundle/bin/deltamoe bench --layers 4 --tokens 8192 --seqs "$seqs" --vary_lengths true \
    --steps "${STEPS:-6}" --warmup 1 > "$log" 2>&1 || { echo "FAILED bench --seqs $seqs (exit $?)"; status=1; }
  echo "== --seqs $seqs"
  grep -E "text model attention|^  attention |after step 1|back-to-back step|tokens/s:" "$log"
done
exit $status
