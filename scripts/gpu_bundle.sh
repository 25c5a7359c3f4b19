#!/usr/bin/env bash
# Builds the default preset (CUDA) here and gathers what a GPU machine needs into gpu_bundle/:
# the deltamoe program, every gpu-labelled test program, and a runner. Carry gpu_bundle/ to the
# GPU machine (same CUDA major version) and run `bash gpu_bundle/run_gpu_tests.sh` there.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --preset default > /dev/null
cmake --build --preset default -j "${JOBS:-2}"
rm -rf gpu_bundle && mkdir -p gpu_bundle/bin
cp build/default/deltamoe gpu_bundle/bin/
ctest --preset gpu -N | sed -n 's/^ *Test *#[0-9]*: *//p' | while read -r test_name; do
  cp "build/default/$test_name" gpu_bundle/bin/
done
cat > gpu_bundle/run_gpu_tests.sh <<'RUN'
#!/usr/bin/env bash
# Runs every gpu test program in this bundle from the repository root; logs go to $OUT.
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
failed=0 passed=0
for test_program in gpu_bundle/bin/*_gpu_test; do
  [ -e "$test_program" ] || continue
  name=$(basename "$test_program")
  if DELTAMOE_SOURCE_DIR=$PWD DELTAMOE_BINARY=$PWD/gpu_bundle/bin/deltamoe "$test_program" > "$out/$name.log" 2>&1; then
    passed=$((passed + 1)); echo "PASS $name"
  else
    failed=$((failed + 1)); echo "FAIL $name"; tail -30 "$out/$name.log"
  fi
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
RUN
chmod +x gpu_bundle/run_gpu_tests.sh
du -sh gpu_bundle
