#!/usr/bin/env bash
# Two or more builds of the same test programs on one GPU in one call: whether they give the same
# bits (the BITS fingerprint lines the GDN and RMSNorm GPU tests print, src/testing/bit_fingerprint.h)
# and their timings side by side. For changes meant to move data only (staging, vector stores,
# register-resident state): every fingerprint must match the first build's.
#   BUILDS="base=dirA next=dirB ..."  folders holding the test programs of each build (e.g. the
#       gated_delta_rule_gpu_test taken out of each build's bundle with
#       tar xJf gpu_bundle/programs.tar.xz bin/gated_delta_rule_gpu_test); the first is the reference
#   TESTS (default "gated_delta_rule_gpu_test"): programs to run from each folder
#   FILTER (default -*Timing*): the cases whose fingerprints are compared
#   TIMED (default *Qwen35BShapeTimed*), REPS (default 2): the timed cases, run REPS times per build,
#       interleaved, their TIMING and STAGE lines printed
# Needs gpu_bundle/ (its env.sh finds the CUDA libraries). Output: stdout and $OUT/compare_builds.txt.
# Exits non-zero when a program is missing or fails; differing fingerprints are listed, not judged
# (some may be expected: say which in the change that explains them).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
: "${BUILDS:?BUILDS must name at least two builds: name=folder ...}"
source gpu_bundle/env.sh
export DELTAMOE_SOURCE_DIR=$PWD
tests=${TESTS:-gated_delta_rule_gpu_test}
filter=${FILTER:--*Timing*}
timed=${TIMED:-*Qwen35BShapeTimed*}
reps=${REPS:-2}
work=/tmp/compare_builds
rm -rf "$work" && mkdir -p "$work"
report=${OUT:-/tmp}/compare_builds.txt
: > "$report"
say() { echo "$*" | tee -a "$report"; }
read -r -a builds <<< "$BUILDS"
[ "${#builds[@]}" -ge 2 ] || { echo "compare_builds: BUILDS needs two or more name=folder entries"; exit 2; }
reference=${builds[0]%%=*}
status=0
for test_name in $tests; do
  for build in "${builds[@]}"; do
    name=${build%%=*} dir=${build#*=}
    if [ ! -x "$dir/$test_name" ]; then say "MISSING $dir/$test_name"; status=1; continue; fi
    timeout 300 "$dir/$test_name" --gtest_filter="$filter" > "$work/$name.$test_name.log" 2>&1
    grep ' BITS ' "$work/$name.$test_name.log" > "$work/$name.$test_name.bits"
    result=$(grep -E '^\[  (PASSED|FAILED) ' "$work/$name.$test_name.log" | tr '\n' ' ')
    say "== $test_name [$name]: $(wc -l < "$work/$name.$test_name.bits") fingerprints; ${result:-no gtest summary (crashed or timed out)}"
    grep -q '^\[  PASSED ' "$work/$name.$test_name.log" && ! grep -q '^\[  FAILED ' "$work/$name.$test_name.log" || status=1
  done
  for build in "${builds[@]:1}"; do
    name=${build%%=*}
    differing=$(diff "$work/$reference.$test_name.bits" "$work/$name.$test_name.bits" | grep -c '^[<>]')
    say "== $test_name: $name against $reference: $differing differing fingerprint lines"
    diff "$work/$reference.$test_name.bits" "$work/$name.$test_name.bits" | grep '^[<>]' | head -20 | tee -a "$report"
  done
  for rep in $(seq 1 "$reps"); do
    for build in "${builds[@]}"; do
      name=${build%%=*} dir=${build#*=}
      [ -x "$dir/$test_name" ] || continue
      say "== $test_name [$name] timed, run $rep"
      timeout 300 "$dir/$test_name" --gtest_filter="$timed" 2>&1 | grep -E '^ *(TIMING|STAGE)' | tee -a "$report"
    done
  done
done
exit $status
