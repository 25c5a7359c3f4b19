#!/usr/bin/env bash
# The main job on a fresh machine: set up, build, create the tiny model and inspect it.
# (Becomes the training demo once `deltamoe train` lands.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
preset=cpu
if [ -x /usr/local/cuda/bin/nvcc ]; then preset=default; fi
cmake --preset "$preset" > /dev/null
cmake --build --preset "$preset" --target deltamoe
bin=build/$preset/deltamoe
out=out/demo
mkdir -p "$out"
"$bin" version
"$bin" init --config tiny-vl --out "$out/tiny-vl" --seed 0
"$bin" inspect "$out/tiny-vl"
echo "demo: model written to $out/tiny-vl"
