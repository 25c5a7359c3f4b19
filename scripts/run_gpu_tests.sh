#!/usr/bin/env bash
# Runs the gpu test programs of the bundle it sits in (scripts/gpu_bundle.sh copies it there) from
# the repository root on the GPU machine; logs go to $OUT/gpu_tests.log (one file: the device
# returns at most 8). Exit 0 only when every program asked for ran and passed.
#   GPU_TESTS="a_gpu_test b_gpu_test": only those, in that order (default: every one, by name).
#   JOBS=N: N programs at once (default 1); their CPU references take most of the suite's time and
#     the GPU machine has the cores. With JOBS > 1 the timing cases are left out (they would time
#     beside other programs), the suites named *Exclusive (they read the whole device's memory in
#     use) run afterwards one program at a time, and a program that failed beside others runs again
#     alone, its result the one that counts (both printed). GTEST_FILTER set by hand replaces the
#     first filter.
#   BUDGET_S: seconds for the whole run (default: none); programs not started with under 30 s left
#     are listed as NOT RUN, to pass as GPU_TESTS to the next call. TIME_LIMIT: per program (300).
bundle_dir=$(cd "$(dirname "$0")" && pwd)
cd "$bundle_dir/.."
source "$bundle_dir/env.sh"
[ -f "$bundle_dir/REVISION" ] && echo "bundle built at $(cat "$bundle_dir/REVISION")"
out=${OUT:-/tmp}
jobs_at_once=${JOBS:-1}
if [ "$jobs_at_once" -gt 1 ] && [ -z "${GTEST_FILTER:-}" ]; then export GTEST_FILTER='-*Timing*:*Exclusive.*'; fi
logs=$(mktemp -d)
start=$(date +%s)
programs=${GPU_TESTS:-$(cd "$bundle_dir/bin" && ls *_gpu_test 2>/dev/null)}
run_one() {
  local name=$1 limit=$2 code=0
  DELTAMOE_SOURCE_DIR=$PWD DELTAMOE_BINARY=$bundle_dir/bin/deltamoe timeout "$limit" "$bundle_dir/bin/$name" \
    > "$logs/$name.log" 2>&1 || code=$?
  echo "$code" > "$logs/$name.status"
  if [ "$code" -eq 0 ]; then echo "PASS $name"; else echo "FAIL $name (exit $code)"; tail -30 "$logs/$name.log"; fi
}
not_run=""
for name in $programs; do
  [ -e "$bundle_dir/bin/$name" ] || { echo "MISSING $name"; echo 127 > "$logs/$name.status"; continue; }
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_at_once" ]; do wait -n; done
  limit=${TIME_LIMIT:-300}
  if [ -n "${BUDGET_S:-}" ]; then
    left=$(( BUDGET_S - ($(date +%s) - start) ))
    if [ "$left" -lt 30 ]; then not_run="$not_run $name"; continue; fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  run_one "$name" "$limit" &
done
wait
if [ "$jobs_at_once" -gt 1 ]; then
  for name in $programs; do
    [ -f "$logs/$name.status" ] && [ "$(cat "$logs/$name.status")" != 127 ] || continue
    if [ -n "${BUDGET_S:-}" ] && [ $(( BUDGET_S - ($(date +%s) - start) )) -lt 30 ]; then
      not_run="$not_run $name(alone)"; continue
    fi
    if [ "$(cat "$logs/$name.status")" != 0 ]; then  # failed beside others: once more, alone
      echo "AGAIN alone: $name"
      mv "$logs/$name.log" "$logs/$name.beside.log"
      GTEST_FILTER='-*Timing*' run_one "$name" "${TIME_LIMIT:-300}"
      { echo "(beside other programs it failed:)"; cat "$logs/$name.beside.log"; } >> "$logs/$name.log"
    elif GTEST_FILTER='*Exclusive.*' "$bundle_dir/bin/$name" --gtest_list_tests 2>/dev/null | grep -q 'Exclusive\.'; then
      code=0
      GTEST_FILTER='*Exclusive.*' DELTAMOE_SOURCE_DIR=$PWD DELTAMOE_BINARY=$bundle_dir/bin/deltamoe \
        timeout "${TIME_LIMIT:-300}" "$bundle_dir/bin/$name" >> "$logs/$name.log" 2>&1 || code=$?
      echo "$code" > "$logs/$name.status"
      if [ "$code" -eq 0 ]; then echo "PASS $name (its Exclusive suites, alone)"; else echo "FAIL $name (its Exclusive suites, alone; exit $code)"; fi
    fi
  done
fi
passed=0 failed=0
for name in $programs; do
  [ -f "$logs/$name.status" ] || continue
  if [ "$(cat "$logs/$name.status")" = 0 ]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
  [ -f "$logs/$name.log" ] && { echo "===== $name"; cat "$logs/$name.log"; } >> "$out/gpu_tests.log"
done
rm -rf "$logs"
echo "$passed passed, $failed failed${GTEST_FILTER:+ (GTEST_FILTER=$GTEST_FILTER)}"
[ -n "$not_run" ] && echo "NOT RUN (time):$not_run"
[ "$failed" -eq 0 ] && [ -z "$not_run" ]
