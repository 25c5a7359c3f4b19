#!/usr/bin/env bash
# The GPU parallel step on one H200 (issue "Parallel training, part 2"): the N-rank tests
# (DeviceLoopbackComm N = 2, 4 against one rank, NcclComm with one rank, MirrorComm, the expert
# exchange, recompute) and `deltamoe bench --simulate_expert_parallel 8` on the full 40-layer
# Qwen3.5-35B-A3B at 8,192 tokens per GPU: the 141 GB layout (bf16 moments, no recompute), the 80 GB
# layout (bf16 moments, full recompute), and images with the vision tower frozen and trained (recompute
# auto: the fewest vision blocks, then text layers, recomputed that make the run fit).
# Usage: STAGES="tests simulate" bash tools/gpu/parallel_step_acceptance.sh   (carry gpu_bundle)
# Results: $OUT/parallel_step/summary.txt and one log per program.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must name the folder whose files come back}"
source gpu_bundle/env.sh
export DELTAMOE_SOURCE_DIR=$PWD DELTAMOE_BINARY=$PWD/gpu_bundle/bin/deltamoe
bin=gpu_bundle/bin
logs=$OUT/parallel_step
mkdir -p "$logs"
summary=$logs/summary.txt
: > "$summary"
status=0
say() { echo "$*" | tee -a "$summary"; }
for stage in ${STAGES:-tests simulate}; do
  case $stage in
    tests)
      for t in ${TESTS:-gpu_engine_parallel_gpu_test gpu_text_model_expert_parallel_gpu_test mirror_comm_gpu_test \
                 device_expert_dispatch_gpu_test device_comm_gpu_test}; do
        start=$SECONDS
        timeout 300 $bin/$t > "$logs/$t.log" 2>&1
        rc=$?
        say "$t: $([ $rc -eq 0 ] && echo PASS || echo "FAIL rc=$rc") in $((SECONDS - start)) s"
        [ $rc -eq 0 ] || { status=1; grep -h "Failure\|FAILED\|error" "$logs/$t.log" | head -8 | tee -a "$summary"; }
      done ;;
    simulate)
      common=(bench --layers 40 --tokens 8192 --steps 5 --warmup 2 --simulate_expert_parallel 8 --optimizer_state_dtype bf16)
      # One image per 512-token sample. Image tokens route alike, and a mirror world multiplies this
      # rank's share by 8: the frozen-tower run received 3.07x tokens x top-k rows.
      images=(--seqs 16 --images 16x16,15x20,18x24,20x15 --image_fraction 0.85 --expert_recv_headroom 4)
      for run in "b_141gb_text:--seqs 2 --recompute none" "a_80gb_text:--seqs 2 --recompute full" \
                 "b_141gb_images_vit_frozen:${images[*]} --freeze_vit true --recompute auto" \
                 "b_141gb_images_vit_trained:${images[*]} --freeze_vit false --recompute auto"; do
        name=${run%%:*}
        [[ "$name" == *"${ONLY:-}"* ]] || continue  # ONLY=images runs the image runs only
        read -r -a extra <<< "${run#*:}"
        start=$SECONDS
        $bin/deltamoe "${common[@]}" "${extra[@]}" > "$logs/$name.log" 2>&1
        rc=$?
        [ $rc -eq 0 ] || status=1
        line=$(grep -h "BENCH_JSON" "$logs/$name.log" | tail -1 | sed 's/^BENCH_JSON //')
        if [ -n "$line" ]; then
          python3 -c "import json,sys; r=json.loads(sys.argv[1]); print(f\"$name: {r['tokens_per_s']:.0f} tokens/s per GPU, step {r['step_ms']:.1f} ms, MFU {100*r['mfu_peak']:.1f}% of 989, peak {r['peak_mem_gib']:.2f} GiB (planned {r['planned_mem_gib']:.2f}), predicted 8-GPU {r['predicted_tokens_per_s']:.0f} tokens/s per GPU\")" "$line" | tee -a "$summary"
        else
          say "$name: FAIL rc=$rc in $((SECONDS - start)) s"; tail -5 "$logs/$name.log" | tee -a "$summary"
        fi
        grep -h "^predicted\|^simulated" "$logs/$name.log" >> "$summary"
      done ;;
    *) say "unknown stage $stage"; status=1 ;;
  esac
done
[ $status -eq 0 ] && say "PARALLEL STEP ACCEPTANCE PASS" || say "PARALLEL STEP ACCEPTANCE FAIL"
exit $status
