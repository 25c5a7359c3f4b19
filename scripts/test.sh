#!/usr/bin/env bash
# Sets up a fresh machine, builds and runs the CPU and golden tests (what CI runs).
# Builds the CUDA kernels too when nvcc is present, so that they keep compiling; GPU tests
# (label gpu) run on a GPU machine: see README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
preset=cpu
if [ -x /usr/local/cuda/bin/nvcc ] && [ "${DELTAMOE_PRESET:-}" != cpu ]; then preset=default; fi
preset=${DELTAMOE_PRESET:-$preset}
echo "test: preset $preset"
cmake --preset "$preset" > /dev/null
cmake --build --preset "$preset"
ctest --preset "$preset" --output-on-failure -j 2
