#!/usr/bin/env bash
# On the GPU machine: shows that the GPU tests catch the planted GPU engine bugs of
# tools/mutation/mutations.py. Runs the test programs packed in gpu_mutants/ (built here by
# `python3 tools/mutation/run_mutations.py --gpu`): the unmutated ones must pass, and for each
# mutation at least one of its tests must fail (CAUGHT). Needs gpu_bundle/ (its env.sh: the
# carried libraries, CUDA's) and tests/golden. Writes $OUT/mutation_summary.txt and
# $OUT/mutation_logs.txt (every program's output, one file). Exit 0 only if the base passes and
# every mutation is caught. Run from the repository root (gpu_mutants/ carries a copy of this
# script, so a checkout without it can run `bash gpu_mutants/mutation_check.sh`).
set -uo pipefail
[ -f gpu_bundle/env.sh ] && [ -d tests/golden ] && [ -f gpu_mutants/programs.tar.xz ] ||
  { echo "run from the repository root with gpu_bundle/ and gpu_mutants/ there"; exit 2; }
source gpu_bundle/env.sh
out=${OUT:-/tmp/mutation_check}
mkdir -p "$out"
mutants=gpu_mutants
work=$(mktemp -d)
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$mutants/programs.tar.xz" "$work"
summary=$out/mutation_summary.txt
logs=$out/mutation_logs.txt
: > "$summary"; : > "$logs"
echo "built from $(cat "$mutants/built_from.txt"); $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" | tee -a "$summary"

# run VARIANT TEST: runs one program, appends its output to the log; prints PASS/FAIL and the
# failed gtest cases.
run_one() {
  local variant=$1 name=$2 log=$work/$1.$2.log start status
  start=$(date +%s)
  DELTAMOE_SOURCE_DIR=$PWD DELTAMOE_BINARY=$PWD/gpu_bundle/bin/deltamoe timeout 300 "$work/bin/$variant/$name" > "$log" 2>&1
  status=$?
  { echo "===== $variant $name (exit $status)"; cat "$log"; } >> "$logs"
  if [ "$status" -eq 0 ]; then
    echo "  $variant $name: PASS ($(( $(date +%s) - start )) s)"
  else
    echo "  $variant $name: FAIL exit $status ($(( $(date +%s) - start )) s); failed: $(grep -o '^\[  FAILED  \] [A-Za-z0-9_./]*' "$log" | sort -u | sed 's/^\[  FAILED  \] //' | tr '\n' ' ')"
    # The first assertion messages, to show what caught it.
    grep -m 3 -A 2 'Failure$' "$log" | grep -v '^--$' | head -9 | sed 's/^/      /' | cut -c1-220
  fi
  return "$status"
}

# A test that fails unmutated shows nothing: only tests that passed here can catch a mutation.
base_ok=1
declare -A base_passed
echo "base (unmutated, must PASS):" | tee -a "$summary"
for name in $(cat "$mutants/tests.txt"); do
  run_one base "$name" | tee -a "$summary"
  if [ "${PIPESTATUS[0]}" -eq 0 ]; then base_passed[$name]=1; else base_ok=0; fi
done

all_caught=1
while IFS=$'\t' read -r mutation tests why; do
  [ -n "$mutation" ] || continue
  echo "$mutation ($why), must FAIL:" | tee -a "$summary"
  failed=""
  for name in $tests; do
    run_one "$mutation" "$name" | tee -a "$summary"
    [ "${PIPESTATUS[0]}" -eq 0 ] || [ -z "${base_passed[$name]:-}" ] || failed="$failed $name"
  done
  if [ -n "$failed" ]; then
    echo "RESULT $mutation: CAUGHT by$failed" | tee -a "$summary"
  else
    echo "RESULT $mutation: MISSED (or its tests failed unmutated)" | tee -a "$summary"; all_caught=0
  fi
done < "$mutants/mutations.tsv"

echo "RESULT base: $([ $base_ok -eq 1 ] && echo PASS || echo FAIL)" | tee -a "$summary"
rm -rf "$work"
[ $base_ok -eq 1 ] && [ $all_caught -eq 1 ]
