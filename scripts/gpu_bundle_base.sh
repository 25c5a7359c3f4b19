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
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$#" -ge 1 ] || { echo "usage: bash scripts/gpu_bundle_base.sh PROGRAM... (e.g. deltamoe grouped_gemm_gpu_test)"; exit 2; }
arch=${BUNDLE_ARCH:-90a}
bundle=${BUNDLE_DIR:-gpu_bundle}
build=build/bundle-$(echo "$arch" | tr ';,' '__')
[ -f "$bundle/env.sh" ] || { echo "gpu_bundle_base: build the change's bundle first (scripts/gpu_bundle.sh): no $bundle/env.sh"; exit 2; }
[ -d "$build" ] || { echo "gpu_bundle_base: no build folder $build (scripts/gpu_bundle.sh makes it)"; exit 2; }
cmake --build "$build" -j "${JOBS:-2}" --target "$@"
mkdir -p "$bundle/base"
for program in "$@"; do
  stripped=$(mktemp)
  cp "$build/$program" "$stripped" && strip "$stripped"
  xz -9e -T2 -c "$stripped" > "$bundle/base/$program.xz"
  rm -f "$stripped"
done
echo "gpu_bundle_base: $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (with uncommitted changes)') -> $bundle/base/:"
ls -l "$bundle/base"
git rev-parse HEAD > "$bundle/base/REVISION"
