#!/usr/bin/env bash
# Runs on the GPU machine: `deltamoe bench` at 4 and 8 layers and tools/bench_hf.py (transformers,
# grouped_mm experts, torch GDN fallback, SDPA) at the same settings, one after the other, then a
# side-by-side table. Logs and the table go to $OUT (or /tmp).
# Usage: bash tools/gpu/run_bench.sh [layers...]       (default: 4 8)
#   DELTAMOE=path/to/deltamoe (default gpu_bundle/bin/deltamoe, else build/default/deltamoe)
#   BENCH_ARGS="--tokens 8192 --seqs 2 --steps 10 --warmup 3" (passed to both)
#   SKIP_HF=1 skips transformers (e.g. when it is not installed)
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp}"
mkdir -p "$out"
PYTHON="${PYTHON:-python3}"
BENCH_ARGS="${BENCH_ARGS:---tokens 8192 --seqs 2 --steps 10 --warmup 3}"
layer_list=("$@")
[ ${#layer_list[@]} -eq 0 ] && layer_list=(4 8)

[ -f gpu_bundle/env.sh ] && source gpu_bundle/env.sh  # (unpacks the bundle's programs)
if [ -z "${DELTAMOE:-}" ]; then
  if [ -x gpu_bundle/bin/deltamoe ]; then DELTAMOE=gpu_bundle/bin/deltamoe; else DELTAMOE=build/default/deltamoe; fi
fi
if [ ! -x "$DELTAMOE" ]; then
  echo "ERROR: no deltamoe program at '$DELTAMOE' (build with scripts/gpu_bundle.sh or set DELTAMOE=...)" >&2
  exit 1
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true

summary="$out/bench_summary.jsonl"
: > "$summary"
status=0
for layers in "${layer_list[@]}"; do
  log="$out/bench_deltamoe_L${layers}.log"
  echo "=== deltamoe bench --layers $layers $BENCH_ARGS"
  # shellcheck disable=SC2086
  "$DELTAMOE" bench --layers "$layers" $BENCH_ARGS 2>&1 | tee "$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "deltamoe bench --layers $layers FAILED" >&2; status=1; }
  sed -n 's/^BENCH_JSON //p' "$log" >> "$summary"
  if [ -z "${SKIP_HF:-}" ]; then
    log="$out/bench_hf_L${layers}.log"
    echo "=== tools/bench_hf.py --layers $layers $BENCH_ARGS"
    # shellcheck disable=SC2086
    "$PYTHON" tools/bench_hf.py --layers "$layers" $BENCH_ARGS 2>&1 | tee "$log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "bench_hf.py --layers $layers FAILED" >&2; status=1; }
    sed -n 's/^BENCH_JSON //p' "$log" >> "$summary"
  fi
done

"$PYTHON" - "$summary" <<'PY' | tee "$out/bench_table.md"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
if not rows:
    print("no results (every run failed; see the logs)")
    sys.exit(0)
components = ["GDN", "attention", "MoE", "lm_head + loss", "vision tower", "optimizer", "other"]
head = ["engine", "layers", "tokens", "step ms", "tokens/s", "TFLOP/s", "MFU (989)", "MFU (790)", "peak GiB"]
head += [f"{c} ms" for c in components]
print("| " + " | ".join(head) + " |")
print("|" + "---|" * len(head))
for r in sorted(rows, key=lambda r: (r["layers"], r["engine"])):
    comp = r.get("components_ms") or {}
    cells = [r["engine"], r["layers"], r["tokens"], f'{r["step_ms"]:.1f}', f'{r["tokens_per_s"]:.0f}',
             f'{r["tflops"]:.1f}', f'{100 * r["mfu_peak"]:.1f}%', f'{100 * r["mfu_measured"]:.1f}%',
             f'{r["peak_mem_gib"]:.1f}']
    cells += [f"{comp[c]:.1f}" if c in comp else "-" for c in components]
    print("| " + " | ".join(str(c) for c in cells) + " |")
by_layers = {}
for r in rows:
    by_layers.setdefault(r["layers"], {})[r["engine"]] = r
for layers, pair in sorted(by_layers.items()):
    if "deltamoe" in pair and "transformers" in pair:
        print(f"{layers} layers: deltamoe {pair['deltamoe']['tokens_per_s'] / pair['transformers']['tokens_per_s']:.2f}x "
              f"transformers tokens/s")
PY
exit $status
