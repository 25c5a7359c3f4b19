#!/usr/bin/env bash
# Packs the checked-out tree's builds of the named programs into gpu_bundle/base/ (xz, ~6x smaller),
# the reference builds tools/gpu/change_check.sh times a change against. Run it after
# scripts/gpu_bundle.sh has built the change's bundle (which empties gpu_bundle/), with the base
# checked out:
#   git checkout dw-change && PROGRAMS="grouped_gemm_gpu_test" bash scripts/gpu_bundle.sh
#   git checkout main && bash scripts/gpu_bundle_base.sh deltamoe grouped_gemm_gpu_test
#   git checkout dw-change
# Builds the programs in the bundle's build folder (BUNDLE_ARCH as gpu_bundle.sh, default 90a), so
# the next gpu_bundle.sh of the change rebuilds only what differs.
#   AS=NAME: pack into gpu_bundle/extra/NAME/ instead, a further build whose deltamoe change_check.sh
#   benches beside the base and the change (e.g. one of the change's parts alone):
#   git checkout part-a && AS=part_a bash scripts/gpu_bundle_base.sh deltamoe
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$#" -ge 1 ] || { echo "usage: bash scripts/gpu_bundle_base.sh PROGRAM... (e.g. deltamoe grouped_gemm_gpu_test)"; exit 2; }
arch=${BUNDLE_ARCH:-90a}
bundle=${BUNDLE_DIR:-gpu_bundle}
name=${AS:-base}
case "$name" in base) into=base ;; *[!A-Za-z0-9_]* | "") echo "gpu_bundle_base: AS must be letters, digits and _ (got '$name')"; exit 2 ;; *) into=extra/$name ;; esac
build=build/bundle-$(echo "$arch" | tr ';,' '__')
[ -f "$bundle/env.sh" ] || { echo "gpu_bundle_base: build the change's bundle first (scripts/gpu_bundle.sh): no $bundle/env.sh"; exit 2; }
[ -d "$build" ] || { echo "gpu_bundle_base: no build folder $build (scripts/gpu_bundle.sh makes it)"; exit 2; }
cmake --build "$build" -j "${JOBS:-2}" --target "$@"
mkdir -p "$bundle/$into"
for program in "$@"; do
  stripped=$(mktemp)
  cp "$build/$program" "$stripped" && strip "$stripped"
  xz -9e -T2 -c "$stripped" > "$bundle/$into/$program.xz"
  rm -f "$stripped"
done
echo "gpu_bundle_base: $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (with uncommitted changes)') -> $bundle/$into/:"
ls -l "$bundle/$into"
git rev-parse HEAD > "$bundle/$into/REVISION"
