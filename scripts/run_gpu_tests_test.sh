#!/usr/bin/env bash
# Checks scripts/run_gpu_tests.sh on stand-in test programs (shell scripts that answer like
# GoogleTest programs) in a throw-away bundle: the pass/fail tally and exit code, programs missing,
# JOBS > 1 leaving the timing and Exclusive cases out of the first pass and running the Exclusive
# suites alone afterwards, a program failing beside others run again alone, and BUDGET_S listing
# the programs it did not start. Run by ctest (label cpu).
set -uo pipefail
runner=$(cd "$(dirname "$0")" && pwd)/run_gpu_tests.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
repo=$work/repo
bundle=$repo/bundle
mkdir -p "$bundle/bin" "$work/out"
cp "$runner" "$bundle/run_gpu_tests.sh"
: > "$bundle/env.sh"
: > "$bundle/bin/deltamoe"
failures=0
check() {  # check "what" condition...
  local what=$1; shift
  if "$@"; then echo "ok: $what"; else echo "FAILED: $what"; failures=$((failures + 1)); fi
}
# stand_in NAME SECONDS EXIT [exclusive] [fails_beside]: records each run's filter in its log.
stand_in() {
  local name=$1 seconds=$2 code=$3 kind=${4:-}
  cat > "$bundle/bin/$name" <<STANDIN
#!/usr/bin/env bash
if [ "\${1:-}" = --gtest_list_tests ]; then
  [ "$kind" = exclusive ] && case "\${GTEST_FILTER:-}" in *Exclusive*) echo "ThingExclusive."; echo "  ReadsTheDevice";; esac
  exit 0
fi
echo "$name ran with filter [\${GTEST_FILTER:-}]"
sleep $seconds
if [ "$kind" = fails_beside ] && [ "\${GTEST_FILTER:-}" != '-*Timing*' ]; then exit 1; fi
exit $code
STANDIN
  chmod +x "$bundle/bin/$name"
}
run() {  # run VAR=value... : the runner's output in $work/run.txt, its exit code in $status
  rm -f "$work/out/gpu_tests.log"
  (cd "$repo" && env OUT="$work/out" "$@" bash bundle/run_gpu_tests.sh) > "$work/run.txt" 2>&1
  status=$?
}
has() { grep -qF -- "$1" "$work/run.txt"; }
logged() { grep -qF -- "$1" "$work/out/gpu_tests.log"; }

stand_in a_gpu_test 0 0 exclusive
stand_in b_gpu_test 0 0
stand_in c_gpu_test 0 3
stand_in d_gpu_test 0 0 fails_beside

run GPU_TESTS="a_gpu_test b_gpu_test"
check "two passing programs: exit 0, both counted" test "$status" -eq 0
check "two passing programs: the tally" has "2 passed, 0 failed"
check "one at a time: no filter" logged "a_gpu_test ran with filter []"

run GPU_TESTS="b_gpu_test c_gpu_test zz_gpu_test"
check "a failing and a missing program: exit 1" test "$status" -ne 0
check "the failing program named with its exit code" has "FAIL c_gpu_test (exit 3)"
check "the missing program named" has "MISSING zz_gpu_test"
check "a missing program counts as failed" has "1 passed, 2 failed"

run JOBS=3
check "JOBS: the first pass leaves timings and Exclusive suites out" logged "b_gpu_test ran with filter [-*Timing*:*Exclusive.*]"
check "JOBS: the Exclusive suites run alone afterwards" has "PASS a_gpu_test (its Exclusive suites, alone)"
check "JOBS: ... with their own filter" logged "a_gpu_test ran with filter [*Exclusive.*]"
check "JOBS: a program failing beside others runs again alone" has "AGAIN alone: d_gpu_test"
check "JOBS: ... and its earlier failure is kept in the log" logged "(beside other programs it failed:)"
check "JOBS: a program failing alone too still fails the run" test "$status" -ne 0
check "JOBS: the tally counts each program once" has "3 passed, 1 failed"

stand_in b_gpu_test 3 0
run GPU_TESTS="b_gpu_test d_gpu_test a_gpu_test" BUDGET_S=32
check "BUDGET_S: programs not started are listed" has "NOT RUN (time): d_gpu_test a_gpu_test"
check "BUDGET_S: a run with programs not started fails" test "$status" -ne 0

if [ "$failures" -ne 0 ]; then echo "run_gpu_tests_test: $failures check(s) failed"; cat "$work/run.txt"; exit 1; fi
echo "run_gpu_tests_test: all checks pass"
