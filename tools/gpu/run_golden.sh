#!/usr/bin/env bash
# Runs on the GPU machine (through the device tool, which sets $OUT): generates the golden
# files with tools/golden/make_golden.py on the CPU and packs them as $OUT/golden.tar.gz.
# Usage: bash tools/gpu/run_golden.sh [all|text|vlm|preprocess] [case,case,...]
#   The optional second argument writes only the named cases (make_golden.py --only), e.g.
#   `bash tools/gpu/run_golden.sh all text_router_margin,vlm_router_margin`; the tarball then holds
#   just those directories, so unpacking it leaves the other cases untouched.
set -euo pipefail
export PYTHONUNBUFFERED=1
export CUDA_VISIBLE_DEVICES=""   # the golden numbers are CPU fp32 by design
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must name the folder whose files come back (the device tool sets it)}"
PYTHON="${PYTHON:-python3}"
CASES="${1:-all}"
ONLY="${2:-}"
kMaxTarBytes=$((16 * 1024 * 1024))

"$PYTHON" - <<'PY'
import platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("torch", "transformers", "safetensors", "numpy", "PIL", "torchvision"):
    try:
        module = __import__(name)
        print(f"{name} {getattr(module, '__version__', '?')}")
    except Exception as error:
        print(f"{name} not importable: {error}")
PY

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
"$PYTHON" tools/golden/make_golden.py --out "$WORK/golden" --cases "$CASES" --only "$ONLY" 2>&1 |
  tee "$OUT/make_golden.log"

echo "--- listing (bytes)"
(cd "$WORK" && find golden -type f -printf '%10s  %p\n' | sort -k2)
echo "--- per case"
(cd "$WORK/golden" && du -sh -- *)
tar -C "$WORK" -czf "$OUT/golden.tar.gz" golden
size=$(stat -c %s "$OUT/golden.tar.gz")
echo "golden.tar.gz: $size bytes ($(du -sh "$OUT/golden.tar.gz" | cut -f1))"
if [ "$size" -ge "$kMaxTarBytes" ]; then
  echo "ERROR: golden.tar.gz is $size bytes, over the 16 MiB limit; shrink the cases in tools/golden/" >&2
  exit 1
fi
echo "unpack with: tar -C tests -xzf golden.tar.gz   (gives tests/golden/...)"
