#!/usr/bin/env bash
# The main job on a fresh machine: set up, build, create the tiny-vl model with the demo tokenizer,
# generate a small image + text dataset, train it (validation loss must halve), save, and print
# where the result is. Builds with CUDA only where a GPU answers (nvcc alone is not enough: the
# CUDA build takes most of an hour on 2 cores); the loop picks its engine (src/train/engine_factory.cc):
# the GPU engine where the CUDA build finds a GPU, else the CPU reference (DEMO_DEVICE=cpu|cuda forces one).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/setup.sh
preset=cpu
if [ -x /usr/local/cuda/bin/nvcc ] && nvidia-smi -L > /dev/null 2>&1; then preset=default; fi
cmake --preset "$preset" > /dev/null
cmake --build --preset "$preset" --target deltamoe
built=$(date +%s)
bash tools/demo/run_demo.sh "build/$preset/deltamoe" out/demo
end=$(date +%s)
echo "demo: done in $((end - start)) s (setup and build $((built - start)) s, demo $((end - built)) s)"
echo "demo: metrics in out/demo/run/metrics.jsonl; the trained model loads with transformers from out/demo/run/checkpoint-*"
