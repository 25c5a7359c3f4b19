#!/usr/bin/env bash
# The sm_80 kernel path on the H200 (issue 20, item 5) in one device call: every gpu-labelled test
# program of gpu_bundle_sm80/ (`BUNDLE_ARCH=80-virtual bash scripts/gpu_bundle.sh`: compute_80 PTX
# only, which the driver compiles for the H200 at load time, so every kernel runs its sm_80 code,
# the kernel path is the A800's — mma.sync grouped GEMM, our flash attention, 163 KB of shared
# memory per block — and no sm_90a kernel can be chosen), then a short `deltamoe bench --layers 4`
# on that path. The CPU-bound tests run in the background beside the rest (16 cores; their CPU
# references dominate), the bench once they are done. Logs: $OUT/sm80_path.tgz; summary:
# $OUT/sm80_summary.txt and stdout.
# Usage (carry gpu_bundle_sm80):
#   bash tools/gpu/sm80_path.sh
# Knobs: GPU_TESTS="a_gpu_test b_gpu_test" runs only those; SM80_FULL=1 keeps the 35B-width
# reference cases and the timings of the CPU-bound tests (~300 s each; without it they run with
# --gtest_filter=$REDUCED_FILTER); BACKGROUND_TESTS (default: those two); BENCH=0 skips the bench;
# TEST_TIMEOUT (s, default 420) per program; BUDGET_S (default 540): past it the remaining
# foreground programs and the bench are reported NOT RUN, so that the logs still come back
# within a 10-minute device call (a second call with GPU_TESTS=<the rest> finishes the pass).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
: "${OUT:?OUT must name the folder whose files come back}"
bundle=${SM80_BUNDLE:-gpu_bundle_sm80}
if [ ! -f "$bundle/env.sh" ]; then
  echo "sm80_path: $bundle/ is missing: build it with BUNDLE_ARCH=80-virtual bash scripts/gpu_bundle.sh and carry it"
  exit 2
fi
source "$bundle/env.sh"
# The driver compiles each program's compute_80 PTX at first use; its cache (4 GiB, the most it
# takes) lets the programs that share kernels (the same library objects) compile them once.
export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-/tmp/deltamoe_jit_cache}
export CUDA_CACHE_MAXSIZE=4294967296
results=/tmp/sm80_path
rm -rf "$results" && mkdir -p "$results"
summary=$OUT/sm80_summary.txt
: > "$summary"
say() { echo "$*" | tee -a "$summary"; }
start_all=$(date +%s)
status=0

# The bundle must be the compute_80 one: its `version` names the architectures it was built for.
version=$("$bundle/bin/deltamoe" version 2>&1)
say "$version"
[ -f "$bundle/ARCHITECTURES" ] && sed 's/^/  /' "$bundle/ARCHITECTURES" | tee -a "$summary"
if [[ "$version" != *"(80-virtual)"* ]]; then
  say "FAIL sm80_path: $bundle was not built for 80-virtual alone (BUNDLE_ARCH=80-virtual bash scripts/gpu_bundle.sh)"
  exit 1
fi
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /' | tee -a "$summary"

# The two CPU-bound programs: their 35B-width reference checks and timings hold 2 GB weight tensors
# and take ~300 s each; the reduced set keeps every other case (all kernels, every smaller shape).
REDUCED_FILTER=${REDUCED_FILTER:--*Widths35B*:*Timing35B*}
slow_tests="grouped_gemm_gpu_test moe_experts_gpu_test"
filter_for() {
  if [ "${SM80_FULL:-0}" != 1 ] && [[ " $slow_tests " == *" $1 "* ]]; then echo "$REDUCED_FILTER"; fi
}

run_test() {  # name: one program from the repository root, its log in $results
  local name=$1 start filter rc
  start=$(date +%s)
  filter=$(filter_for "$name")
  if [ ! -x "$bundle/bin/$name" ]; then
    echo "FAIL $name (not in $bundle)"
    return 1
  fi
  DELTAMOE_SOURCE_DIR=$PWD DELTAMOE_BINARY=$PWD/$bundle/bin/deltamoe timeout "${TEST_TIMEOUT:-420}" \
    "$bundle/bin/$name" ${filter:+"--gtest_filter=$filter"} > "$results/$name.log" 2>&1
  rc=$?
  local passed skipped
  passed=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$results/$name.log" | tail -1)
  skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$results/$name.log" | tail -1)
  local detail="$(( $(date +%s) - start )) s, ${passed:-0} passed, ${skipped:-0} skipped${filter:+, filter $filter}"
  if [ "$rc" -eq 0 ]; then
    echo "PASS $name ($detail)"
  else
    [ "$rc" -eq 124 ] && detail="$detail, TIMED OUT"
    echo "FAIL $name (exit $rc, $detail)"
    grep -E "Failure|Expected|actual|Which is|error|FAILED|what\(\)" "$results/$name.log" | head -20
    return 1
  fi
}

all_tests=$(find "$bundle/bin" -maxdepth 1 -name '*_gpu_test' -printf '%f\n' | sort)
# shellcheck disable=SC2086,SC2116  # word splitting wanted: one line, names separated by single spaces
programs=$(echo ${GPU_TESTS:-$all_tests})
background=${BACKGROUND_TESTS-$slow_tests}
say "kernel path tests: $(echo "$programs" | wc -w) programs from $bundle$([ "${SM80_FULL:-0}" = 1 ] && echo ", full case sets")"
pids=()
bg_names=()
for name in $background; do
  [[ " $programs " == *" $name "* ]] || continue
  run_test "$name" > "$results/$name.status" 2>&1 &
  pids+=($!)
  bg_names+=("$name")
done
budget=${BUDGET_S:-540}
elapsed() { echo $(( $(date +%s) - start_all )); }
not_run=()
for name in $programs; do
  [[ " ${bg_names[*]:-} " == *" $name "* ]] && continue
  if [ "$(elapsed)" -ge "$budget" ]; then not_run+=("$name"); continue; fi
  run_test "$name" 2>&1 | tee -a "$summary"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || status=1
  tee -a "$summary" < "$results/${bg_names[$i]}.status"
done
if [ "${#not_run[@]}" -gt 0 ]; then
  say "NOT RUN (past BUDGET_S=$budget s): ${not_run[*]}"
  status=1
fi
# What the path looked like from inside the tests (kernel_path_gpu_test prints it).
grep -h "^GPU .*path" "$results"/kernel_path_gpu_test.log 2>/dev/null | tee -a "$summary"

if [ "${BENCH:-1}" != 0 ] && [ "$(elapsed)" -ge "$budget" ]; then
  say "NOT RUN bench (past BUDGET_S=$budget s)"
  status=1
elif [ "${BENCH:-1}" != 0 ]; then
  say "################ bench --layers 4 on the sm_80 path"
  "$bundle/bin/deltamoe" bench --layers 4 --steps 5 --warmup 2 > "$results/bench_layers4.log" 2>&1
  bench_rc=$?
  grep -E "^== deltamoe bench|^kernels:|^step time|^tokens/s|^loss:|model attention" "$results/bench_layers4.log" |
    tee -a "$summary"
  json=$(sed -n 's/^BENCH_JSON //p' "$results/bench_layers4.log" | tail -1)
  if [ "$bench_rc" -ne 0 ] || [ -z "$json" ]; then
    say "FAIL bench (exit $bench_rc)"; tail -20 "$results/bench_layers4.log" | tee -a "$summary"; status=1
  elif ! python3 - "$json" <<'PY' | tee -a "$summary"; then
import json, sys
r = json.loads(sys.argv[1])
ok = r.get("kernels") == "sm_80" and r.get("attention") == "ours" and "compute_80 PTX" in r.get("kernels_detail", "")
print(f"{'PASS' if ok else 'FAIL'} bench: kernels {r.get('kernels_detail')}, attention {r.get('attention')}, "
      f"{r.get('tokens_per_s', 0):.0f} tokens/s, step {r.get('step_ms', 0):.1f} ms, built for {r.get('cuda_architectures')}")
sys.exit(0 if ok else 1)
PY
    status=1
  fi
fi

say "sm80_path: $(grep -c '^PASS' "$summary") PASS, $(grep -c '^FAIL' "$summary") FAIL, $(( $(date +%s) - start_all )) s; exit $status"
tar czf "$OUT/sm80_path.tgz" -C "$results" .
exit $status
