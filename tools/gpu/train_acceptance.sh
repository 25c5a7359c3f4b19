#!/usr/bin/env bash
# The training-state acceptance runs on the GPU machine, in one call: `deltamoe train` against
# `deltamoe bench` at full widths (4 text layers + the whole vision tower on image + text data, all
# trained and with the vision tower frozen; 8 text layers on text), the host memory and the
# host<->device bytes of those runs, a run that cannot fit refused before step 1, and kill -9 in the
# middle of a GPU step then --resume auto, byte-identical to an uninterrupted run. Logs and a summary
# go to $OUT/train_acceptance.tgz; the summary also to stdout.
# Usage (carry gpu_bundle): STAGES="kill_resume refuse vlm4 vlm4_frozen text8" bash tools/gpu/train_acceptance.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must name the folder whose files come back}"
export PYTHONUNBUFFERED=1
source gpu_bundle/env.sh
bin=$PWD/gpu_bundle/bin/deltamoe
work=${WORK:-/tmp/acceptance_train}
logs=$work/logs
mkdir -p "$logs"
summary=$logs/summary.txt
: > "$summary"
status=0
say() { echo "$*" | tee -a "$summary"; }
gunzip -c gpu_bundle/qwen3_tokenizer.json.gz > "$work/qwen3_tokenizer.json"
template=tests/tokenizer/qwen3_5_chat_template.jinja
workers=$(( $(nproc) > 4 ? $(nproc) - 2 : 2 ))

# Runs a command, sampling its resident set size; prints "max RSS <GiB>" into $2.rss.
with_rss() {
  local log=$1; shift
  "$@" > "$log" 2>&1 &
  local pid=$! peak=0 rss
  while kill -0 "$pid" 2> /dev/null; do
    rss=$(awk '/VmRSS/ {print $2}' "/proc/$pid/status" 2> /dev/null || echo 0)
    [ -n "$rss" ] && [ "$rss" -gt "$peak" ] && peak=$rss
    sleep 0.5
  done
  wait "$pid"
  local rc=$?
  echo "$peak" > "$log.rss"
  return $rc
}

# Median tokens/s of the train steps after the first three (steady state), from metrics.jsonl.
steady_tokens_per_s() {
  python3 - "$1" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
steps = [r for r in rows if r.get("type") == "train" and r["step"] > 3]
med = lambda key: statistics.median(r.get(key, 0) for r in steps)
print(f"{med('tokens_per_s'):.1f} {med('h2d_bytes'):.0f} {med('tokens'):.0f} {med('step_s'):.4f} "
      f"{med('images'):.0f} {med('image_tokens'):.0f} {med('data_wait_s'):.4f}")
PY
}

bench_tokens_per_s() { sed -n 's/^BENCH_JSON //p' "$1" | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print(f\"{r['tokens_per_s']:.1f} {r['h2d_bytes']}\")"; }

compare() {  # name train_log bench_log rss_file
  local name=$1 train bench rss
  read -r train_tps train_h2d train_tokens train_step_s train_images train_image_tokens train_wait_s \
    < <(steady_tokens_per_s "$2/metrics.jsonl")
  read -r bench_tps bench_h2d < <(bench_tokens_per_s "$3")
  rss=$(awk '{printf "%.2f", $1 / 1048576}' "$4")
  local ratio
  ratio=$(python3 -c "print(f'{$train_tps / $bench_tps:.3f}')")
  say "$name: train $train_tps tokens/s (step $train_step_s s of which data wait $train_wait_s s, $train_tokens tokens, $train_images images, $train_image_tokens image tokens, h2d $train_h2d B/step), bench $bench_tps tokens/s (h2d $bench_h2d B/step): ratio $ratio; train max RSS $rss GiB"
  python3 -c "import sys; sys.exit(0 if $train_tps >= 0.9 * $bench_tps else 1)" || { say "  FAIL: train below 90% of bench"; status=1; }
}

for stage in ${STAGES:-kill_resume refuse vlm4 vlm4_frozen text8}; do
  say "################ $stage ($(date +%T))"
  case $stage in
  kill_resume)
    # tiny-vl on the demo data: 8 steps straight, and killed with step 6's backward on the device
    # (DELTAMOE_KILL_AT=mid_step@6), then --resume auto from checkpoint-4; checkpoint-8 must match.
    $bin init --config tiny-vl --out "$work/tvl" > "$logs/kill_init.log" 2>&1
    python3 tools/demo/make_tokenizer.py "$work/qwen3_tokenizer.json" $template "$work/tvl" >> "$logs/kill_init.log"
    python3 tools/demo/make_data.py "$work/tdata" --train 96 --val 0 --seed 3 >> "$logs/kill_init.log"
    # Byte identity needs a deterministic attention backward: cuDNN's (the default on sm_90) adds
    # dQ with atomics, so this stage runs our kernel.
    export DELTAMOE_ATTENTION=ours
    args=(train --model "$work/tvl" --dataset "$work/tdata/train.jsonl" --max_steps 8 --save_steps 4
          --micro_batch_tokens 512 --max_length 256 --gradient_accumulation_steps 2 --lr 1e-3 --freeze_vit false
          --freeze_aligner false --device cuda --seed 5)
    $bin "${args[@]}" --output_dir "$work/k_straight" > "$logs/kill_straight.log" 2>&1 || { say "FAIL straight run"; status=1; }
    DELTAMOE_KILL_AT=mid_step@6 $bin "${args[@]}" --output_dir "$work/k_killed" > "$logs/kill_killed.log" 2>&1
    rc=$?
    say "killed run exit $rc (137 = SIGKILL); checkpoints: $(ls "$work/k_killed" | tr '\n' ' ')"
    [ $rc -eq 137 ] || { say "  FAIL: the run was not killed mid-step"; status=1; }
    $bin "${args[@]}" --output_dir "$work/k_killed" --resume auto > "$logs/kill_resumed.log" 2>&1 || { say "FAIL resumed run"; status=1; }
    grep -E "resuming from" "$logs/kill_resumed.log" | tee -a "$summary"
    for f in model.safetensors optimizer.safetensors; do
      if cmp -s "$work/k_straight/checkpoint-8/$f" "$work/k_killed/checkpoint-8/$f"; then
        say "  $f byte-identical ($(stat -c %s "$work/k_straight/checkpoint-8/$f") bytes)"
      else
        say "  FAIL $f differs"; status=1
      fi
    done
    ;;
  refuse)
    unset DELTAMOE_ATTENTION
    # 8 text layers at full widths with fp32 moments: 7.75 B parameters x 18 B = 130 GiB of state alone.
    $bin bench --layers 8 --optimizer_state_dtype f32 --steps 1 --warmup 0 > "$logs/refuse.log" 2>&1
    rc=$?
    if [ $rc -ne 0 ] && grep -q "does not fit on cuda" "$logs/refuse.log"; then
      say "refused before step 1 (exit $rc):"; grep -A 20 "does not fit" "$logs/refuse.log" | tee -a "$summary"
      grep -q "^step " "$logs/refuse.log" && { say "  FAIL: a step ran"; status=1; }
    else
      say "  FAIL: not refused (exit $rc)"; tail -5 "$logs/refuse.log" | tee -a "$summary"; status=1
    fi
    ;;
  vlm4|vlm4_frozen)
    if [ ! -f "$work/m4/config.json" ]; then
      $bin init --config qwen3.5-35b-a3b --layers 4 --out "$work/m4" > "$logs/m4_init.log" 2>&1 || { say "FAIL init"; status=1; }
      python3 tools/demo/make_tokenizer.py "$work/qwen3_tokenizer.json" $template "$work/m4" 248044 >> "$logs/m4_init.log"
      # Samples of about 505 tokens: packed 16 to a micro-batch of 8192 with their images (256-432
      # image tokens each), like the bench's 16 sequences of 512 tokens with images of these sizes.
      python3 tools/gpu/make_vlm_dataset.py "$work/vlmdata" --samples 400 --fill_tokens 505 >> "$logs/m4_init.log"
      du -sh "$work/m4" "$work/vlmdata" | tee -a "$summary"
    fi
    freeze=false; [ $stage = vlm4_frozen ] && freeze=true
    $bin bench --layers 4 --tokens 8192 --seqs 16 --images 16x16,15x20,18x24,20x15 --image_fraction 0.85 \
      --optimizer_state_dtype f32 --freeze_vit $freeze --freeze_aligner $freeze --steps 8 --warmup 3 \
      > "$logs/${stage}_bench.log" 2>&1 || { say "FAIL bench"; tail -20 "$logs/${stage}_bench.log"; status=1; }
    rm -rf "$work/${stage}_run"
    with_rss "$logs/${stage}_train.log" $bin train --model "$work/m4" --dataset "$work/vlmdata/train.jsonl" \
      --output_dir "$work/${stage}_run" --micro_batch_tokens 8192 --max_length 8192 --max_steps 14 --lr 1e-5 \
      --freeze_vit $freeze --freeze_aligner $freeze --max_pixels 442368 --dataloader_num_workers $workers \
      --save_only_model true --device cuda || { say "FAIL train"; tail -30 "$logs/${stage}_train.log"; status=1; }
    grep -A 14 "memory plan" "$logs/${stage}_train.log" | tee -a "$summary"
    grep -E "^step (1|14)/" "$logs/${stage}_train.log" | tee -a "$summary"
    compare "$stage" "$work/${stage}_run" "$logs/${stage}_bench.log" "$logs/${stage}_train.log.rss"
    grep -E "tokens/s|step time|memory|images" "$logs/${stage}_bench.log" | tee -a "$summary"
    ;;
  text8)
    if [ ! -f "$work/t8/config.json" ]; then
      $bin init --config qwen3.5-35b-a3b --layers 8 --text_only true --out "$work/t8" > "$logs/t8_init.log" 2>&1 || { say "FAIL init"; status=1; }
      python3 tools/demo/make_tokenizer.py "$work/qwen3_tokenizer.json" $template "$work/t8" 248044 >> "$logs/t8_init.log"
      python3 tools/gpu/make_vlm_dataset.py "$work/textdata" --samples 600 --text_only --answer_words 700 >> "$logs/t8_init.log"
    fi
    $bin bench --layers 8 --tokens 8192 --seqs 8 --optimizer_state_dtype bf16 --steps 8 --warmup 3 \
      > "$logs/text8_bench.log" 2>&1 || { say "FAIL bench"; tail -20 "$logs/text8_bench.log"; status=1; }
    rm -rf "$work/text8_run"
    with_rss "$logs/text8_train.log" $bin train --model "$work/t8" --dataset "$work/textdata/train.jsonl" \
      --output_dir "$work/text8_run" --micro_batch_tokens 8192 --max_length 8192 --max_steps 14 --lr 1e-5 \
      --optimizer_state_dtype bf16 --dataloader_num_workers $workers --save_only_model true --device cuda \
      || { say "FAIL train"; tail -30 "$logs/text8_train.log"; status=1; }
    grep -A 12 "memory plan" "$logs/text8_train.log" | tee -a "$summary"
    compare text8 "$work/text8_run" "$logs/text8_bench.log" "$logs/text8_train.log.rss"
    grep -E "tokens/s|step time|memory" "$logs/text8_bench.log" | tee -a "$summary"
    ;;
  esac
done
tar czf "$OUT/train_acceptance.tgz" -C "$logs" .
say "train_acceptance: exit $status"
exit $status
