#!/usr/bin/env bash
# The first multi-GPU run (design §4.5; issue "Multi-GPU validation run"), for a machine of 2-8 GPUs
# (run kinds nvidia-h200-x2/x4/x8; carry gpu_bundle; NCCL_NVLS_ENABLE=0 is kept by env.sh):
#   bringup      N ranks through `deltamoe launch` and through torchrun's variables (NPROC_PER_NODE):
#                NCCL version, rank table, bus ids, the conformance suite on NcclComm
#   bandwidth    the expert dispatch/combine at 8,192 tokens x 2,048 x top-8 per GPU beside ncclAlltoAll,
#                and the dense reduce-scatter / all-gather (comm-selftest --bench true)
#   correctness  train --device cuda on tiny-vl, EP = DP = N, against one GPU with N x the accumulation:
#                first loss bitwise, 10 losses within 1e-4 (tools/gpu/parallel_train_check.sh, NPROC=N)
#   throughput   the 40-layer Qwen3.5-35B-A3B at 8,192 tokens per GPU, text and images, on N GPUs
#                (`launch -- bench`) beside the one-GPU simulator's prediction for N (`bench
#                --simulate_expert_parallel N`): tokens/s per GPU, peak memory per rank, the gap
#   faults       rank 1 SIGKILLed at a step of a training run: every rank exits non-zero within 30 s
#                naming it; then --resume auto continues
#   scaling      8 layers at 8,192 tokens per GPU on 1, 2, 4, ... N GPUs
# Usage: STAGES="bringup bandwidth correctness throughput faults scaling" NPROC=8 bash tools/gpu/multi_gpu_validation.sh
# Results: $OUT/multi_gpu/summary.txt and one log per run.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must name the folder whose files come back}"
source gpu_bundle/env.sh
bin=$PWD/gpu_bundle/bin/deltamoe
gpus=$(nvidia-smi -L | wc -l)
nproc=${NPROC:-$gpus}
stages=${STAGES:-bringup bandwidth correctness throughput faults scaling}
logs=$OUT/multi_gpu
work=${WORK:-/tmp/multi_gpu}
mkdir -p "$logs" "$work"
summary=$logs/summary.txt
: > "$summary"
status=0
say() { echo "$*" | tee -a "$summary"; }
run() {  # name, then the command; its log under $logs
  local name=$1; shift
  local start=$SECONDS
  "$@" > "$logs/$name.log" 2>&1
  local rc=$?
  say "$name: exit $rc in $((SECONDS - start)) s"
  [ $rc -eq 0 ] || status=1
  return $rc
}
say "multi-GPU validation: $gpus GPU(s), $nproc ranks, stages: $stages; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
nvidia-smi --query-gpu=index,name,pci.bus_id,memory.total --format=csv | tee -a "$summary"
[ "$nproc" -ge 2 ] && [ "$nproc" -le "$gpus" ] || { say "FAIL: NPROC=$nproc needs 2..$gpus GPUs"; exit 1; }
bench_common=(bench --tokens 8192 --seqs 2 --steps 5 --warmup 2 --optimizer_state_dtype bf16)

for stage in $stages; do
  case $stage in
    bringup)
      run bringup_launch $bin launch --nproc_per_node "$nproc" -- comm-selftest --device cuda
      NPROC_PER_NODE=$nproc run bringup_nproc_env $bin comm-selftest --device cuda
      grep -h "NCCL\|rank .*: node" "$logs/bringup_launch.log" | head -$((nproc + 2)) | tee -a "$summary" ;;
    bandwidth)
      run bandwidth $bin launch --nproc_per_node "$nproc" -- comm-selftest --device cuda --bench true
      grep -h "GB/s" "$logs/bandwidth.log" | tee -a "$summary" ;;
    correctness)
      NPROC=$nproc WORK=$work/correctness run correctness bash tools/gpu/parallel_train_check.sh
      tail -n 6 "$OUT/parallel_train/summary.txt" 2>/dev/null | tee -a "$summary" ;;
    throughput)
      for kind in text images; do
        extra=()
        [ $kind = images ] && extra=(--seqs 16 --images 16x16,15x20,18x24,20x15 --image_fraction 0.5 --freeze_vit true)
        run "simulated_${kind}" $bin "${bench_common[@]}" --layers 40 --simulate_expert_parallel "$nproc" "${extra[@]}"
        run "measured_${kind}" $bin launch --nproc_per_node "$nproc" -- "${bench_common[@]}" --layers 40 "${extra[@]}"
        python3 - "$logs/simulated_${kind}.log" "$logs/measured_${kind}.log" <<'PY' | tee -a "$summary" || status=1
import json, sys
def bench(path):
    rows = [json.loads(l.split("BENCH_JSON ", 1)[1]) for l in open(path) if "BENCH_JSON " in l]
    return rows[-1] if rows else None
sim, real = bench(sys.argv[1]), bench(sys.argv[2])
if not sim or not real:
    print("throughput: a run printed no BENCH_JSON"); sys.exit(1)
gap = real["tokens_per_s"] / sim["predicted_tokens_per_s"] - 1
print(f"throughput {sys.argv[1].split('_')[-1][:-4]}: measured {real['tokens_per_s']:.0f} tokens/s per GPU, "
      f"peak {real['peak_mem_gib']:.1f} GiB (rank 0); simulator predicted {sim['predicted_tokens_per_s']:.0f} "
      f"(one rank measured {sim['tokens_per_s']:.0f}); gap {100 * gap:+.1f}% {'PASS' if abs(gap) <= 0.10 else 'MISS'}")
sys.exit(0 if abs(gap) <= 0.10 else 1)
PY
        grep -h "rank .*step median" "$logs/measured_${kind}.log" | tee -a "$summary"
      done ;;
    faults)
      gunzip -c gpu_bundle/qwen3_tokenizer.json.gz > "$work/qwen3_tokenizer.json"
      $bin init --config tiny-vl --out "$work/tvl" > "$logs/faults_init.log" 2>&1
      python3 tools/demo/make_tokenizer.py "$work/qwen3_tokenizer.json" tests/tokenizer/qwen3_5_chat_template.jinja \
        "$work/tvl" >> "$logs/faults_init.log" 2>&1
      python3 tools/demo/make_data.py "$work/data" --train 96 --val 0 --seed 3 >> "$logs/faults_init.log" 2>&1
      train=(train --device cuda --model "$work/tvl" --dataset "$work/data/train.jsonl" --max_steps 8 --save_steps 2
             --micro_batch_tokens 512 --max_length 256 --expert_model_parallel_size "$nproc"
             --use_distributed_optimizer true --output_dir "$work/faults")
      start=$SECONDS
      DELTAMOE_FAULT="rank:1,at:step 5,kind:kill" $bin launch --nproc_per_node "$nproc" -- "${train[@]}" \
        > "$logs/faults_kill.log" 2>&1
      rc=$?
      took=$((SECONDS - start))
      if [ $rc -ne 0 ] && grep -q "rank 1" "$logs/faults_kill.log"; then
        say "faults: SIGKILL of rank 1 -> exit $rc after $took s, message names rank 1"
      else
        say "faults: FAIL (exit $rc, $took s; $logs/faults_kill.log)"; status=1
      fi
      run faults_resume $bin launch --nproc_per_node "$nproc" -- "${train[@]}" --resume auto ;;
    scaling)
      n=1
      while [ $n -le "$nproc" ]; do
        if [ $n -eq 1 ]; then run "scaling_1" $bin "${bench_common[@]}" --layers 8
        else run "scaling_$n" $bin launch --nproc_per_node $n -- "${bench_common[@]}" --layers 8; fi
        grep -h "^tokens/s" "$logs/scaling_$n.log" | sed "s/^/scaling $n GPU(s): /" | tee -a "$summary"
        n=$((n * 2))
      done ;;
    *) say "unknown stage '$stage'"; status=1 ;;
  esac
done
[ $status -eq 0 ] && say "MULTI-GPU VALIDATION PASS" || say "MULTI-GPU VALIDATION FAIL"
exit $status
