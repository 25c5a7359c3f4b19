#!/usr/bin/env bash
# Runs on the GPU machine, in one call: the per-layer cost of deltamoe against transformers +
# grouped_mm experts + FLA's Gated DeltaNet kernels (issue 20's bar), then the steady-state check.
#   1. `deltamoe bench --layers 4` and `--layers 8` (2 x 4,096 tokens, bf16 moments as the anchor's);
#   2. the anchor: ../shared/tools/hf_anchor.py (carried as .anchors_src/hf_anchor.py, with FLA's
#      source as .anchors_src/fla) at 4 and 8 layers, variant grouped_mm+fla;
#   3. `deltamoe bench --layers 4 --vary_lengths true --seqs 8`: a new packing and token count every
#      step; steps 2..n must allocate nothing and build nothing (exit 4 otherwise);
#   4. a table: step ms, tokens/s, per-layer cost (L8 - L4) / 4 for both, the ratio.
# Carry: gpu_bundle, .anchors_src. Writes $OUT/layer_anchor/{*.log,summary.md}.
#   STAGES="bench anchor steady" (default all); STEPS (bench's measured steps, default 8);
#   LAYERS (default "4 8"; "4" alone on a GPU under 120 GiB: the 8-layer step needs ~112 GiB, and
#   neither engine fits it on an 80 GB H100, so only the 4-layer rows are measured there).
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp}/layer_anchor"
mkdir -p "$out"
stages="${STAGES:-bench anchor steady}"
steps="${STEPS:-8}"
[ -f gpu_bundle/env.sh ] || { echo "ERROR: carry gpu_bundle (bash scripts/gpu_bundle.sh)"; exit 2; }
source gpu_bundle/env.sh
deltamoe=gpu_bundle/bin/deltamoe
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' || true
status=0
memory_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -dc 0-9)
if [ -z "${LAYERS:-}" ] && [ -n "$memory_mib" ] && [ "$memory_mib" -lt 122880 ]; then
  echo "NOTE: ${memory_mib} MiB of GPU memory: the 8-layer steps (~112 GiB) do not fit; 4 layers only, no per-layer cost"
fi
layer_counts=${LAYERS:-$([ -n "$memory_mib" ] && [ "$memory_mib" -lt 122880 ] && echo 4 || echo "4 8")}
for layers in $layer_counts; do
  case " $stages " in *" bench "*)
    echo "=== deltamoe bench --layers $layers"
    "$deltamoe" bench --layers "$layers" --tokens 8192 --seqs 2 --steps "$steps" --warmup 2 \
      > "$out/bench_L$layers.log" 2>&1 || { echo "bench L$layers FAILED"; status=1; }
    grep -E "step time|tokens/s|MFU|peak in use|after step 1" "$out/bench_L$layers.log" ;;
  esac
  case " $stages " in *" anchor "*)
    if [ -f .anchors_src/hf_anchor.py ] && [ -d .anchors_src/fla ]; then
      echo "=== hf_anchor.py --layers $layers grouped_mm+fla"
      python3 .anchors_src/hf_anchor.py --layers "$layers" --seq 4096 --batch 2 --steps 4 \
        --variants grouped_mm+fla --out "$out" > "$out/anchor_L$layers.log" 2>&1 || { echo "anchor L$layers FAILED"; status=1; }
      grep -E "^grouped_mm\+fla|fla import" "$out/anchor_L$layers.log"
    else
      echo "anchor skipped: carry .anchors_src with hf_anchor.py and fla/"; status=1
    fi ;;
  esac
done
case " $stages " in *" steady "*)
  echo "=== deltamoe bench --layers 4 --vary_lengths true --seqs 8"
  "$deltamoe" bench --layers 4 --tokens 8192 --seqs 8 --vary_lengths true --steps "$steps" --warmup 1 \
    > "$out/bench_varied.log" 2>&1 || { echo "varied-length bench FAILED (exit $?)"; status=1; }
  grep -E "lengths:|after step 1|tokens/s" "$out/bench_varied.log" ;;
esac

python3 - "$out" <<'PY' | tee "$out/summary.md"
import json, os, re, sys
out = sys.argv[1]
def bench(layers):
    try:
        for line in open(os.path.join(out, f"bench_L{layers}.log")):
            if line.startswith("BENCH_JSON "):
                return json.loads(line[len("BENCH_JSON "):])
    except OSError:
        pass
    return None
def anchor(layers):
    try:
        for line in open(os.path.join(out, f"anchor_L{layers}.log")):
            if line.startswith("grouped_mm+fla "):
                r = json.loads(line[len("grouped_mm+fla "):])
                return None if "error" in r else r
    except OSError:
        pass
    return None
rows = []
ours = {l: bench(l) for l in (4, 8)}
ref = {l: anchor(l) for l in (4, 8)}
print("| engine | L4 step ms | L8 step ms | L8 tokens/s | per layer (L8 - L4) / 4 ms |")
print("|---|---|---|---|---|")
per = {}
for name, row in (("deltamoe", ours[4]), ("transformers + grouped_mm + FLA", ref[4])):
    if row and not (ours[8] and ref[8]):  # the 4-layer rows alone (no 8-layer step on this GPU)
        ms = row["step_ms"] if "step_ms" in row else 1e3 * row["step_s"]
        print(f"| {name} | {ms:.1f} | - | - | - (4-layer tokens/s {row['tokens_per_s']:.0f}) |")
if ours[4] and ref[4] and not (ours[8] and ref[8]):
    print(f"\n4-layer tokens/s ours / anchor = {ours[4]['tokens_per_s'] / ref[4]['tokens_per_s']:.2f}x (no per-layer cost)")
if all(ours.values()):
    a, b = ours[4]["step_ms"], ours[8]["step_ms"]
    per["ours"] = (b - a) / 4
    print(f"| deltamoe | {a:.1f} | {b:.1f} | {ours[8]['tokens_per_s']:.0f} | {per['ours']:.2f} |")
    if all("back_to_back_step_ms" in r for r in ours.values()):
        # The same steps back to back: timed as the anchor is (one synchronisation around them all).
        a, b = ours[4]["back_to_back_step_ms"], ours[8]["back_to_back_step_ms"]
        per["ours, back to back"] = (b - a) / 4
        print(f"| deltamoe, back to back | {a:.1f} | {b:.1f} | {ours[8]['back_to_back_tokens_per_s']:.0f} | "
              f"{per['ours, back to back']:.2f} |")
if all(ref.values()):
    a, b = 1e3 * ref[4]["step_s"], 1e3 * ref[8]["step_s"]
    per["anchor"] = (b - a) / 4
    print(f"| transformers + grouped_mm + FLA | {a:.1f} | {b:.1f} | {ref[8]['tokens_per_s']:.0f} | {per['anchor']:.2f} |")
if "ours" in per and "anchor" in per:
    print(f"\nper-layer: anchor / ours = {per['anchor'] / per['ours']:.2f}x (goal >= 2x: <= {per['anchor'] / 2:.2f} ms); "
          f"8-layer tokens/s ours / anchor = {ours[8]['tokens_per_s'] / ref[8]['tokens_per_s']:.2f}x")
    if "back_to_back_tokens_per_s" in ours[8]:
        print(f"8-layer tokens/s back to back, ours / anchor = "
              f"{ours[8]['back_to_back_tokens_per_s'] / ref[8]['tokens_per_s']:.2f}x (both timed the same way)")
if ours[8]:
    comps = ", ".join(f"{k} {v:.1f}" for k, v in ours[8]["components_ms"].items())
    print(f"\ndeltamoe L8 components (ms per step): {comps}")
    if ours[4]:
        diff = ", ".join(f"{k} {(ours[8]['components_ms'][k] - ours[4]['components_ms'][k]) / 4:.2f}"
                         for k in ours[8]["components_ms"])
        print(f"per added layer by component (ms): {diff}")
PY
exit $status
