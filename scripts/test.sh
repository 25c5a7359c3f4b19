#!/usr/bin/env bash
# Sets up a fresh machine, builds and runs the CPU and golden tests, then the fuzz targets for
# FUZZ_SECONDS each (default 60; scripts/fuzz.sh). This is what CI runs.
# CI builds the cpu preset: nvcc on 2 cores would take most of CI's time. The CUDA code is built
# for the GPU machine by scripts/gpu_bundle.sh (see README.md); DELTAMOE_PRESET=default builds
# both here.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
preset=${DELTAMOE_PRESET:-cpu}
echo "test: preset $preset"
cmake --preset "$preset" > /dev/null
cmake --build --preset "$preset" -j "$(nproc)"
ctest --preset "$preset" --output-on-failure -j "$(nproc)"
bash scripts/fuzz.sh
