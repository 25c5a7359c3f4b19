#!/usr/bin/env bash
# `deltamoe train --device cuda` on N GPUs (NPROC, default 2; one rank each, NcclComm, EP = N) against
# one GPU with N times the accumulation, on tiny-vl with the demo data: 10 steps, the first loss bitwise and every loss
# within 1e-4 relative (NCCL reduces in its own order); the checkpoint's per-rank optimizer files;
# saved at N ranks after 5 steps and resumed at N and at 1 rank (within 1e-4 of the straight run).
# Needs a machine of N GPUs (run kind nvidia-h200-x2/x4/x8; carry gpu_bundle). Logs and a summary go to
# $OUT/parallel_train/.
# Usage: bash tools/gpu/parallel_train_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must name the folder whose files come back}"
source gpu_bundle/env.sh
bin=$PWD/gpu_bundle/bin/deltamoe
work=${WORK:-/tmp/parallel_train}
logs=$OUT/parallel_train
mkdir -p "$work" "$logs"
summary=$logs/summary.txt
: > "$summary"
status=0
say() { echo "$*" | tee -a "$summary"; }
gpus=$(nvidia-smi -L | wc -l)
n=${NPROC:-2}
[ "$gpus" -ge "$n" ] && [ "$n" -ge 2 ] || { say "FAIL: $gpus GPU(s); this check needs NPROC=$n >= 2 of them"; exit 1; }
export DELTAMOE_ATTENTION=ours  # deterministic attention backward (resume comparisons)
gunzip -c gpu_bundle/qwen3_tokenizer.json.gz > "$work/qwen3_tokenizer.json"
$bin init --config tiny-vl --out "$work/tvl" > "$logs/init.log" 2>&1
python3 tools/demo/make_tokenizer.py "$work/qwen3_tokenizer.json" tests/tokenizer/qwen3_5_chat_template.jinja \
  "$work/tvl" >> "$logs/init.log"
python3 tools/demo/make_data.py "$work/data" --train 96 --val 0 --seed 3 >> "$logs/init.log"
common=(train --device cuda --model "$work/tvl" --dataset "$work/data/train.jsonl" --max_steps 10 --save_steps 5
        --micro_batch_tokens 512 --max_length 256 --lr 1e-3 --freeze_vit false --freeze_aligner false --seed 5)
two=(--gradient_accumulation_steps 2 --expert_model_parallel_size "$n" --use_distributed_optimizer true)
run() {  # name, then the command
  local name=$1; shift
  "$@" > "$logs/$name.log" 2>&1 || { say "FAIL $name (exit $?; $logs/$name.log)"; status=1; }
}
run one_gpu $bin "${common[@]}" --gradient_accumulation_steps $((2 * n)) --output_dir "$work/one"
run two_gpus $bin launch --nproc_per_node "$n" -- "${common[@]}" "${two[@]}" --output_dir "$work/two"
run two_stop $bin launch --nproc_per_node "$n" -- "${common[@]}" "${two[@]}" --stop_after_steps 5 --output_dir "$work/two_resumed"
run two_resume $bin launch --nproc_per_node "$n" -- "${common[@]}" "${two[@]}" --resume auto --output_dir "$work/two_resumed"
run two_stop_b $bin launch --nproc_per_node "$n" -- "${common[@]}" "${two[@]}" --stop_after_steps 5 --output_dir "$work/one_resumed"
run one_resume $bin "${common[@]}" --gradient_accumulation_steps $((2 * n)) --resume auto --output_dir "$work/one_resumed"
grep -h "GPU engine on\|ranks train on" "$logs/two_gpus.log" | head -3 | tee -a "$summary"
ls "$work/two/checkpoint-10" | tr '\n' ' ' | sed "s/^/checkpoint-10 of $n ranks: /" | tee -a "$summary"; echo | tee -a "$summary"
[ -f "$work/two/checkpoint-10/optim-r1-of-$n.safetensors" ] || { say "FAIL: no per-rank optimizer file"; status=1; }
python3 - "$work" >> "$summary" <<'PY' || status=1
import json, sys
work = sys.argv[1]
def losses(run):
    rows = [json.loads(l) for l in open(f"{work}/{run}/metrics.jsonl") if l.strip()]
    return [r["loss"] for r in rows if r.get("type") == "train"]
one = losses("one")
ok = len(one) == 10
for run in ("two", "two_resumed", "one_resumed"):
    got = losses(run)
    worst = max((abs(a - b) / abs(b) for a, b in zip(got, one)), default=float("inf"))
    good = len(got) == 10 and worst <= 1e-4 and (run != "two" or got[0] == one[0])
    ok = ok and good
    print(f"{run}: {len(got)} losses, first {'bitwise' if got and got[0] == one[0] else 'differs'}, "
          f"worst relative difference to one GPU {worst:.2e} {'PASS' if good else 'FAIL'}")
print(f"one GPU: loss {one[0]:.4f} -> {one[-1]:.4f}")
sys.exit(0 if ok else 1)
PY
tail -n 5 "$summary"
[ $status -eq 0 ] && say "PARALLEL TRAIN CHECK PASS" || say "PARALLEL TRAIN CHECK FAIL"
exit $status
