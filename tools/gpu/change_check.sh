#!/usr/bin/env bash
# A kernel or step change against its base in one device call, most telling first, each stage
# bounded by what is left of the call: the change's tests (correctness before speed), the named
# timed cases of the base's and the change's test programs alternating, `deltamoe bench` of both at
# two depths (bench_ab.sh), the change's per-kernel trace (kernel_trace.sh) and last its per-layer
# row beside transformers + grouped_mm + FLA (layer_anchor.sh, when .anchors_src is carried).
# Carry gpu_bundle: the change's bundle (scripts/gpu_bundle.sh) with the base's programs packed
# into gpu_bundle/base/ (scripts/gpu_bundle_base.sh).
#   TESTS="prog[:gtest filter] ..."  the change's test programs to run first (default: none)
#   TIMED="prog:filter ..."          timed cases run on both builds, alternating (default: none)
#   ROUNDS (default 2): rounds of TIMED and of the bench; LAYERS, STEPS: bench_ab.sh's
#   EXTRA_BUILDS="name=path ..."     more deltamoe programs for the bench beside base and change; those
#                                    packed into gpu_bundle/extra/NAME/ (gpu_bundle_base.sh with AS=NAME) join it
#   ANCHOR_BENCH_EXTRA: more flags for the change's bench in the anchor stage (e.g. "--overlap_optimizer true")
#   STAGES (default "tests timed bench trace anchor"); BUDGET_S (default 560): the call's seconds;
#   a stage that cannot start with 30 s left is reported NOT RUN.
# Logs: $OUT/change_check.tgz; the bench summary and the trace per layer also on stdout.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
: "${OUT:?OUT must name the folder whose files come back}"
[ -f gpu_bundle/env.sh ] || { echo "change_check: carry gpu_bundle (scripts/gpu_bundle.sh)"; exit 2; }
source gpu_bundle/env.sh
export DELTAMOE_SOURCE_DIR=$PWD PYTHONUNBUFFERED=1
out=$OUT/change_check
mkdir -p "$out"
budget=${BUDGET_S:-560}
# shellcheck source=tools/gpu/budget_stages.sh
source tools/gpu/budget_stages.sh
# Unpacks an xz-packed program once (python3's lzma, present wherever torch is).
unpack_program() {
  mkdir -p "$(dirname "$2")"
  [ -x "$2" ] || { python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
    "$1" "$2" && chmod +x "$2"; }
}
# The base's programs travel xz-packed (one ~4.5 MB deltamoe beside the change's bundle).
base=gpu_bundle/base_bin
mkdir -p "$base"
for packed in gpu_bundle/base/*.xz; do
  [ -e "$packed" ] && unpack_program "$packed" "$base/$(basename "$packed" .xz)"
done
# Further builds packed as gpu_bundle/extra/NAME/deltamoe.xz join the bench as NAME.
for packed in gpu_bundle/extra/*/deltamoe.xz; do
  [ -e "$packed" ] || continue
  name=$(basename "$(dirname "$packed")")
  unpack_program "$packed" "gpu_bundle/extra_bin/$name/deltamoe" && EXTRA_BUILDS="${EXTRA_BUILDS:-} $name=gpu_bundle/extra_bin/$name/deltamoe"
done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
# One pair of depths for the bench, the trace and the anchor: 4 and 8 layers, or 1 and 5 on a GPU
# under 120 GiB, where 8 do not fit (the four layers between are the same mix).
memory_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -dc 0-9)
[ -n "${LAYERS:-}" ] || LAYERS=$([ -n "$memory_mib" ] && [ "$memory_mib" -lt 122880 ] && echo "1 5" || echo "4 8")
export LAYERS
stages=${STAGES:-tests timed bench trace anchor}
rounds=${ROUNDS:-2}
for what in $stages; do
  case $what in
    tests)
      for entry in ${TESTS:-}; do
        program=${entry%%:*} filter='*'
        [ "$entry" != "$program" ] && filter=${entry#*:}
        stage "test_$program" env DELTAMOE_BINARY=gpu_bundle/bin/deltamoe gpu_bundle/bin/"$program" \
          --gtest_filter="$filter" && echo "PASS $program"
        grep -E "^\[  (PASSED|FAILED) " "$out/test_$program.log" 2>/dev/null | head -8
      done ;;
    timed)
      for entry in ${TIMED:-}; do
        program=${entry%%:*} filter=${entry#*:}
        [ -x "$base/$program" ] || { echo "change_check: no base build of $program in gpu_bundle/base"; status=1; continue; }
        for round in $(seq 1 "$rounds"); do
          for build in base change; do
            binary=gpu_bundle/bin/$program
            [ "$build" = base ] && binary=$base/$program
            stage "timed_${program}_${build}_r$round" "$binary" --gtest_filter="$filter"
            grep -E "TIMING" "$out/timed_${program}_${build}_r$round.log" 2>/dev/null | sed "s/^/$build r$round: /" | cut -c1-180
          done
        done
      done ;;
    bench)
      [ -x "$base/deltamoe" ] || { echo "change_check: no base deltamoe in gpu_bundle/base"; status=1; continue; }
      OUT=$out ROUNDS=$rounds stage bench env BUILDS="base=$base/deltamoe change=gpu_bundle/bin/deltamoe ${EXTRA_BUILDS:-}" \
        bash tools/gpu/bench_ab.sh
      cat "$out/bench_ab/summary.md" 2>/dev/null ;;
    trace)
      OUT=$out stage trace bash tools/gpu/kernel_trace.sh
      head -40 "$out/trace_per_layer.txt" 2>/dev/null ;;
    anchor)
      [ -f .anchors_src/hf_anchor.py ] || { echo "NOT RUN anchor (carry .anchors_src)"; continue; }
      OUT=$out BENCH_EXTRA="${ANCHOR_BENCH_EXTRA:-}" stage anchor bash tools/gpu/layer_anchor.sh
      cat "$out/layer_anchor/summary.md" 2>/dev/null ;;
    *) echo "change_check: unknown stage '$what' (tests timed bench trace anchor)"; status=1 ;;
  esac
done
tar czf "$OUT/change_check.tgz" -C "$out" . && rm -rf "$out"
echo "change_check: exit $status after $(( $(date +%s) - start )) s"
exit $status
