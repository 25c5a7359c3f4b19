#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang (ASan + UBSan) in build/fuzz and runs each
# for FUZZ_SECONDS (default 60) on a scratch copy of its committed corpus. Fails on any crash,
# sanitizer report, leak, input slower than 10 s or process over 2 GiB; the input is then kept as
# build/fuzz/crash-<target>-* (see tests/fuzz/README.md). FUZZ_TARGETS picks targets.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FUZZ_SECONDS:-60}
targets=${FUZZ_TARGETS:-"sft_record safetensors image_decode"}
launcher=()
command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
CC=clang CXX=clang++ cmake -S . -B build/fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDELTAMOE_CUDA=OFF \
  -DDELTAMOE_TESTS=OFF -DDELTAMOE_FUZZ=ON "${launcher[@]}" > /dev/null
cmake --build build/fuzz -j "$(nproc)" --target fuzz_targets
export DELTAMOE_SOURCE_DIR=$PWD
for target in $targets; do
  scratch=$(mktemp -d)
  echo "fuzz: $target for ${seconds} s ($(ls "tests/fuzz/$target" | wc -l) seed inputs)"
  # New inputs go to the scratch folder (the first one named); the committed corpus is only read.
  if ! "build/fuzz/fuzz_$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      -artifact_prefix="build/fuzz/crash-$target-" "$scratch" "tests/fuzz/$target" > "build/fuzz/$target.log" 2>&1; then
    tail -60 "build/fuzz/$target.log"
    echo "fuzz: $target FAILED (log: build/fuzz/$target.log)"
    rm -rf "$scratch"
    exit 1
  fi
  grep -E "stat::number_of_executed_units|stat::new_units_added|stat::peak_rss_mb" "build/fuzz/$target.log" | tr '\n' ' '
  echo
  rm -rf "$scratch"
done
echo "fuzz: done"
