#!/usr/bin/env bash
# LoRA on the GPU engine, in one call on the GPU machine (carry gpu_bundle): the GPU LoRA tests
# against the CPU reference (adapter products; the text model with adapters), the LoRA demo on CUDA
# (validation loss at most half its first value), and `deltamoe bench --tuner_type lora` on the full
# 40-layer Qwen3.5-35B-A3B (random weights, bf16 base frozen, 8,192 tokens per step) text-only and
# with images, each printing its memory plan. Targets: ms-swift's `--target_modules all-linear` (every
# Linear of the text model and the vision tower) plus the routed experts (--target_parameters), so
# the vlm40 stage trains the tower's adapters too (its backward runs). Each stage has a timeout; the
# whole stays under 9 minutes. Logs go to $OUT/lora_acceptance.tgz, the summary also to $OUT/lora_summary.txt.
# resume: a GPU LoRA run killed mid-step and resumed, byte-identical to an uninterrupted one.
# dropout40 (not in the default list): the text40 bench with --lora_dropout 0.05 on all-linear only
# (PEFT refuses dropout on the experts), against the same bench without dropout.
# Usage: [BUNDLE=gpu_bundle] STAGES="tests resume demo text40 vlm40 regress" bash tools/gpu/lora_acceptance.sh (regress: the
# full-tuning gpu_text_model_gpu_test, the shared expert kernel and the vision tower without
# adapters, since the shared expert kernel and the vision projections changed).
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must name the folder whose files come back}"
export PYTHONUNBUFFERED=1
bundle=${BUNDLE:-gpu_bundle}  # e.g. BUNDLE=gpu_bundle_lora for a branch's bundle carried beside main's
source $bundle/env.sh
bin=$PWD/$bundle/bin/deltamoe
work=${WORK:-/tmp/acceptance_lora}
logs=$work/logs
rm -rf "$work" && mkdir -p "$logs"
summary=$OUT/lora_summary.txt  # written as it goes: what a call cut short by its limit still returns
: > "$summary"
status=0
say() { echo "$*" | tee -a "$summary"; }
export DELTAMOE_SOURCE_DIR=$PWD DELTAMOE_BINARY=$bin

bench_lines() { grep -E "memory plan|^  [a-zA-Z].*GiB|tokens/s|step time|memory:|images:|trained parameters|BENCH_JSON|error|does not fit" "$1" | tee -a "$summary"; }

for stage in ${STAGES:-tests resume demo text40 vlm40 regress}; do
  say "################ $stage ($(date +%T))"
  case $stage in
  tests)
    # The vision tower's LoRA cases only (its other cases run in regress); the engine test holds the
    # VLM all-linear comparison with CpuEngine and the bit-exact LoRA resume.
    for t in lora_kernels_gpu_test gpu_text_model_lora_gpu_test "gpu_vision_model_gpu_test --gtest_filter=*Lora*" \
             gpu_engine_lora_gpu_test; do
      name=${t%% *}
      if timeout 200 $bundle/bin/$t > "$logs/$name.log" 2>&1; then say "PASS $t"; else say "FAIL $t (exit $?)"; status=1; fi
      grep -E "TIMING|ce loss|ce_sum|features rel|worst|adapter gradients|LoRA losses|dropout|FAILED|Failure|NOT FINITE|Expected|which is" \
        "$logs/$name.log" | head -60 | tee -a "$summary"
    done
    ;;
  demo)
    gunzip -c $bundle/qwen3_tokenizer.json.gz > "$work/qwen3_tokenizer.json"
    if DEMO_DEVICE=cuda DEMO_TUNER=lora DEMO_QWEN3_TOKENIZER=$work/qwen3_tokenizer.json \
        timeout 240 bash tools/demo/run_demo.sh "$bin" "$work/demo" > "$logs/demo.log" 2>&1; then
      say "PASS demo (LoRA, cuda)"
    else
      say "FAIL demo (exit $?)"; tail -20 "$logs/demo.log" | tee -a "$summary"; status=1
    fi
    grep -E "^demo:|GPU engine on|LoRA r|trainable tensors" "$logs/demo.log" | tee -a "$summary"
    ;;
  text40|vlm40)
    args=(bench --layers 40 --tokens 8192 --steps 5 --warmup 2 --tuner_type lora --lora_rank 8 --lora_alpha 32
          --target_modules all-linear --target_parameters mlp.experts.gate_up_proj mlp.experts.down_proj)
    if [ $stage = vlm40 ]; then
      args+=(--seqs 16 --images 16x16,15x20,18x24,20x15 --image_fraction 0.85)
    else
      args+=(--seqs 8)
    fi
    timeout 200 $bin "${args[@]}" > "$logs/$stage.log" 2>&1; rc=$?
    if [ $rc -ne 0 ] && grep -q "does not fit" "$logs/$stage.log"; then
      say "$stage: refused by the memory plan without --recompute; rerunning with --recompute selective"
      bench_lines "$logs/$stage.log"
      timeout 200 $bin "${args[@]}" --recompute selective > "$logs/${stage}_recompute.log" 2>&1; rc=$?
      mv "$logs/${stage}_recompute.log" "$logs/$stage.log"
    fi
    bench_lines "$logs/$stage.log"
    if [ $rc -ne 0 ]; then say "FAIL $stage (exit $rc)"; tail -15 "$logs/$stage.log" | tee -a "$summary"; status=1; continue; fi
    python3 - "$logs/$stage.log" <<'PY' | tee -a "$summary" || status=1
import json, sys
r = json.loads([l for l in open(sys.argv[1]) if l.startswith("BENCH_JSON ")][-1][len("BENCH_JSON "):])
ok = r["tokens_per_s"] >= 4779 and r["peak_mem_gib"] <= 137
print(f"{'PASS' if ok else 'FAIL'}: {r['tokens_per_s']:.0f} tokens/s (need >= 4779), peak {r['peak_mem_gib']:.2f} GiB "
      f"(need <= 137), planned {r['planned_mem_gib']:.2f} GiB, {r.get('images', 0)} images, components ms {r['components_ms']}")
sys.exit(0 if ok else 1)
PY
    ;;
  dropout40)
    # The same 40-layer text bench on all-linear, without and with --lora_dropout 0.05: the cost of
    # the masked x' and input gradient (both must fit and stay above the rate text40 asks for).
    for p in 0 0.05; do
      timeout 200 $bin bench --layers 40 --tokens 8192 --steps 5 --warmup 2 --seqs 8 --tuner_type lora --lora_rank 8 \
        --lora_alpha 32 --target_modules all-linear --lora_dropout $p > "$logs/dropout40_$p.log" 2>&1; rc=$?
      bench_lines "$logs/dropout40_$p.log"
      if [ $rc -ne 0 ]; then say "FAIL dropout40 p=$p (exit $rc)"; tail -15 "$logs/dropout40_$p.log" | tee -a "$summary"; status=1; continue; fi
      python3 - "$logs/dropout40_$p.log" "$p" <<'PY' | tee -a "$summary" || status=1
import json, sys
r = json.loads([l for l in open(sys.argv[1]) if l.startswith("BENCH_JSON ")][-1][len("BENCH_JSON "):])
ok = r["tokens_per_s"] >= 4779 and r["peak_mem_gib"] <= 137
print(f"{'PASS' if ok else 'FAIL'} dropout {sys.argv[2]}: {r['tokens_per_s']:.0f} tokens/s, peak {r['peak_mem_gib']:.2f} GiB, "
      f"planned {r['planned_mem_gib']:.2f} GiB")
sys.exit(0 if ok else 1)
PY
    done
    ;;
  resume)
    # A LoRA run (all-linear + routed experts on tiny-vl, image + text data) 8 steps straight, and
    # killed with step 6's backward on the device (DELTAMOE_KILL_AT=mid_step@6), then --resume auto
    # from checkpoint-4: checkpoint-8's adapter and optimizer files must be byte-identical. Our
    # attention kernel: cuDNN's backward adds dQ with atomics.
    gunzip -c $bundle/qwen3_tokenizer.json.gz > "$work/qwen3_tokenizer.json"
    $bin init --config tiny-vl --out "$work/tvl" > "$logs/resume_init.log" 2>&1
    python3 tools/demo/make_tokenizer.py "$work/qwen3_tokenizer.json" tests/tokenizer/qwen3_5_chat_template.jinja \
      "$work/tvl" >> "$logs/resume_init.log"
    python3 tools/gpu/make_vlm_dataset.py "$work/vdata" --samples 96 --image_sizes 64x64,96x64,128x64 \
      >> "$logs/resume_init.log"
    export DELTAMOE_ATTENTION=ours
    args=(train --model "$work/tvl" --dataset "$work/vdata/train.jsonl" --max_steps 8 --save_steps 4
          --micro_batch_tokens 512 --max_length 256 --gradient_accumulation_steps 2 --lr 1e-3 --tuner_type lora
          --lora_rank 8 --lora_alpha 16 --target_modules all-linear
          --target_parameters mlp.experts.gate_up_proj mlp.experts.down_proj --device cuda --seed 5)
    $bin "${args[@]}" --output_dir "$work/l_straight" > "$logs/resume_straight.log" 2>&1 || {
      say "FAIL straight run"; tail -15 "$logs/resume_straight.log" | tee -a "$summary"; status=1; }
    grep -E "GPU engine on|trainable tensors" "$logs/resume_straight.log" | head -3 | tee -a "$summary"
    DELTAMOE_KILL_AT=mid_step@6 $bin "${args[@]}" --output_dir "$work/l_killed" > "$logs/resume_killed.log" 2>&1
    rc=$?
    say "killed run exit $rc (137 = SIGKILL); checkpoints: $(ls "$work/l_killed" | tr '\n' ' ')"
    [ $rc -eq 137 ] || { say "  FAIL: the run was not killed mid-step"; status=1; }
    $bin "${args[@]}" --output_dir "$work/l_killed" --resume auto > "$logs/resume_resumed.log" 2>&1 || {
      say "FAIL resumed run"; status=1; }
    grep -E "resuming from" "$logs/resume_resumed.log" | tee -a "$summary"
    for f in adapter_model.safetensors optimizer.safetensors; do
      if cmp -s "$work/l_straight/checkpoint-8/$f" "$work/l_killed/checkpoint-8/$f"; then
        say "  $f byte-identical ($(stat -c %s "$work/l_straight/checkpoint-8/$f") bytes)"
      else
        say "  FAIL $f differs (or is missing)"; status=1
      fi
    done
    unset DELTAMOE_ATTENTION
    ;;
  regress)
    # The full-tuning text model path through the changed projection funnel and expert block.
    for t in gpu_text_model_gpu_test shared_expert_gpu_test "gpu_vision_model_gpu_test --gtest_filter=-*Lora*"; do
      name=${t%% *}
      if timeout 150 $bundle/bin/$t > "$logs/$name.log" 2>&1; then say "PASS $t"; else say "FAIL $t (exit $?)"; status=1; fi
      grep -E "FAILED|worst" "$logs/$name.log" | head -20 | tee -a "$summary"
    done
    ;;
  *) say "unknown stage $stage"; status=1 ;;
  esac
done
say "lora_acceptance: exit $status"
cp "$summary" "$logs/summary.txt"
tar czf "$OUT/lora_acceptance.tgz" -C "$logs" .
exit $status
