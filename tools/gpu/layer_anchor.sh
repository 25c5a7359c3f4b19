#!/usr/bin/env bash
# Runs on the GPU machine, in one call: the per-layer cost of deltamoe against transformers +
# grouped_mm experts + FLA's Gated DeltaNet kernels (issue 20's bar), then the steady-state check.
#   1. `deltamoe bench --layers LO` and `--layers HI` (2 x 4,096 tokens, bf16 moments as the
#      anchor's);
#   2. the anchor: ../shared/tools/hf_anchor.py (carried as .anchors_src/hf_anchor.py, with FLA's
#      source as .anchors_src/fla) at the same depths, variant grouped_mm+fla, run with the model's
#      cache off (hf_anchor_no_cache.py: transformers cannot build a 1-layer model with it on);
#   3. `deltamoe bench --layers 4 --vary_lengths true --seqs 8`: a new packing and token count every
#      step; steps 2..n must allocate nothing and build nothing (exit 4 otherwise);
#   4. a table: step ms, tokens/s, per-layer cost (L_HI - L_LO) / (HI - LO) for both, the ratio.
# The depths: 4 and 8 (the issue's), or on a GPU under 120 GiB, where neither engine fits 8 layers
# (~112 GiB), 1 and 5: the four layers between them are the same mix as layers 4-7 (three Gated
# DeltaNet layers and one attention layer; every fourth layer is attention), so the per-layer cost
# compares with the 4-and-8 one; the HI-layer tokens/s ratio is then not the issue's 8-layer one.
# Carry: gpu_bundle, .anchors_src. Writes $OUT/layer_anchor/{*.log,summary.md}.
#   STAGES="bench anchor steady" (default all); STEPS (bench's measured steps, default 8);
#   LAYERS="LO HI" to choose the depths; BENCH_EXTRA: more flags for deltamoe's bench (e.g.
#   "--overlap_optimizer true").
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
  echo "NOTE: ${memory_mib} MiB of GPU memory: the 8-layer steps (~112 GiB) do not fit; per-layer cost from 1 and 5 layers"
fi
layer_counts=${LAYERS:-$([ -n "$memory_mib" ] && [ "$memory_mib" -lt 122880 ] && echo "1 5" || echo "4 8")}
read -r lo hi extra <<< "$layer_counts"
if [ -z "${hi:-}" ] || [ -n "${extra:-}" ] || ! [ "$hi" -gt "$lo" ] 2>/dev/null; then
  echo "ERROR: LAYERS must be two depths, the smaller first (got '$layer_counts')"; exit 2
fi
for layers in $layer_counts; do
  case " $stages " in *" bench "*)
    echo "=== deltamoe bench --layers $layers"
    # shellcheck disable=SC2086  # BENCH_EXTRA is a list of flags
    "$deltamoe" bench --layers "$layers" --tokens 8192 --seqs 2 --steps "$steps" --warmup 2 ${BENCH_EXTRA:-} \
      > "$out/bench_L$layers.log" 2>&1 || { echo "bench L$layers FAILED"; status=1; }
    grep -E "step time|tokens/s|MFU|peak in use|after step 1" "$out/bench_L$layers.log" ;;
  esac
  case " $stages " in *" anchor "*)
    if [ -f .anchors_src/hf_anchor.py ] && [ -d .anchors_src/fla ]; then
      echo "=== hf_anchor.py --layers $layers grouped_mm+fla"
      python3 tools/gpu/hf_anchor_no_cache.py --layers "$layers" --seq 4096 --batch 2 --steps 4 \
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

python3 - "$out" "$lo" "$hi" <<'PY' | tee "$out/summary.md"
import json, os, re, sys
sys.path.insert(0, "tools/gpu")
from bench_json import read_bench_json
out, lo, hi = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
span = hi - lo
def bench(layers):
    return read_bench_json(os.path.join(out, f"bench_L{layers}.log"))
def anchor(layers):
    try:
        for line in open(os.path.join(out, f"anchor_L{layers}.log")):
            if line.startswith("grouped_mm+fla "):
                r = json.loads(line[len("grouped_mm+fla "):])
                return None if "error" in r else r
    except OSError:
        pass
    return None
ours = {l: bench(l) for l in (lo, hi)}
ref = {l: anchor(l) for l in (lo, hi)}
per_col = f"per layer (L{hi} - L{lo}) / {span} ms"
print(f"| engine | L{lo} step ms | L{hi} step ms | L{hi} tokens/s | {per_col} |")
print("|---|---|---|---|---|")
per = {}
for name, rows in (("deltamoe", ours), ("transformers + grouped_mm + FLA", ref)):
    for l, row in rows.items():  # a depth whose partner is missing: its row alone
        if row and not all(rows.values()):
            ms = row["step_ms"] if "step_ms" in row else 1e3 * row["step_s"]
            print(f"| {name} | L{l}: {ms:.1f} | - | - | - (L{l} tokens/s {row['tokens_per_s']:.0f}) |")
if all(ours.values()):
    a, b = ours[lo]["step_ms"], ours[hi]["step_ms"]
    per["ours"] = (b - a) / span
    print(f"| deltamoe | {a:.1f} | {b:.1f} | {ours[hi]['tokens_per_s']:.0f} | {per['ours']:.2f} |")
    if all("back_to_back_step_ms" in r for r in ours.values()):
        # The same steps back to back: timed as the anchor is (one synchronisation around them all).
        a, b = ours[lo]["back_to_back_step_ms"], ours[hi]["back_to_back_step_ms"]
        per["ours, back to back"] = (b - a) / span
        print(f"| deltamoe, back to back | {a:.1f} | {b:.1f} | {ours[hi]['back_to_back_tokens_per_s']:.0f} | "
              f"{per['ours, back to back']:.2f} |")
if all(ref.values()):
    a, b = 1e3 * ref[lo]["step_s"], 1e3 * ref[hi]["step_s"]
    per["anchor"] = (b - a) / span
    print(f"| transformers + grouped_mm + FLA | {a:.1f} | {b:.1f} | {ref[hi]['tokens_per_s']:.0f} | {per['anchor']:.2f} |")
if "ours" in per and "anchor" in per:
    print(f"\nper-layer: anchor / ours = {per['anchor'] / per['ours']:.2f}x (goal >= 2x: <= {per['anchor'] / 2:.2f} ms); "
          f"{hi}-layer tokens/s ours / anchor = {ours[hi]['tokens_per_s'] / ref[hi]['tokens_per_s']:.2f}x")
    if "back_to_back_tokens_per_s" in ours[hi]:
        print(f"{hi}-layer tokens/s back to back, ours / anchor = "
              f"{ours[hi]['back_to_back_tokens_per_s'] / ref[hi]['tokens_per_s']:.2f}x (both timed the same way)")
if ours[hi]:
    comps = ", ".join(f"{k} {v:.1f}" for k, v in ours[hi]["components_ms"].items())
    print(f"\ndeltamoe L{hi} components (ms per step): {comps}")
    if ours[lo]:
        diff = ", ".join(f"{k} {(ours[hi]['components_ms'][k] - ours[lo]['components_ms'][k]) / span:.2f}"
                         for k in ours[hi]["components_ms"])
        print(f"per added layer by component (ms): {diff}")
PY
exit $status
