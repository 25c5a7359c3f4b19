#!/usr/bin/env bash
# Issue 20's timing rows in one device call, most important first, each bounded by what is left of
# the call: the per-layer table beside transformers + grouped_mm + FLA (layer_anchor.sh), then the
# GDN core beside FLA's chunk_gated_delta_rule, AdamW over a flat buffer (beside a copy of its
# bytes), the grouped GEMM at 35B widths, attention beside PyTorch's cuDNN SDPA, the vision tower
# beside transformers', and last the per-kernel profile of one 4-layer step (layer_profile.sh).
# Carry gpu_bundle (PROGRAMS="gated_delta_rule_gpu_test adamw_gpu_test grouped_gemm_gpu_test
# cudnn_sdpa_gpu_test gpu_vision_model_gpu_test") and .anchors_src. Logs: $OUT/timings.tgz;
# summary on stdout.
#   BUDGET_S (default 570): the whole call's seconds; a stage that cannot start with 30 s left is
#   reported NOT RUN.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
: "${OUT:?OUT must name the folder whose files come back}"
out=$OUT/timings
mkdir -p "$out"
source gpu_bundle/env.sh
# FLA's Triton autotuning costs ~2 min a process; its results kept on disk let the anchor's second
# process and gdn_anchor.py reuse them.
export TRITON_CACHE_AUTOTUNING=1
budget=${BUDGET_S:-570}
# shellcheck source=tools/gpu/budget_stages.sh
source tools/gpu/budget_stages.sh
export DELTAMOE_SOURCE_DIR=$PWD
OUT=$out stage layer_anchor bash tools/gpu/layer_anchor.sh
cat "$out/layer_anchor/summary.md" 2>/dev/null; grep -E "FAILED|skipped|after step 1" "$out/layer_anchor.log"
stage gdn_core gpu_bundle/bin/gated_delta_rule_gpu_test --gtest_filter='*Qwen35BShapeTimed*'
grep -iE "ms|FAILED|PASSED" "$out/gdn_core.log" | tail -12
stage gdn_fla python3 tools/gpu/gdn_anchor.py
grep -E "ANCHOR|Error" "$out/gdn_fla.log" | tail -4
stage adamw gpu_bundle/bin/adamw_gpu_test --gtest_filter='*Timing*'
grep -iE "ms|GB/s|FAILED|PASSED" "$out/adamw.log" | tail -8
stage grouped_gemm gpu_bundle/bin/grouped_gemm_gpu_test --gtest_filter='*Timing35B*'
grep -iE "TFLOP|ms|FAILED|PASSED" "$out/grouped_gemm.log" | tail -12
# The attention and vision rows beside their anchors (PyTorch's cuDNN SDPA, transformers' tower),
# each pair in one stage so that both sides share the machine's state.
stage attention bash -c "gpu_bundle/bin/cudnn_sdpa_gpu_test --gtest_filter='*Timing*' && python3 tools/gpu/attention_anchor.py"
grep -E "TIMING (forward|backward)|ANCHOR" "$out/attention.log" | cut -c1-160
# Twice, alternating: transformers' tower times its host-side launches too and has varied 96-129 ms
# across calls on H100s (docs/performance.md, 2026-12-07, fbfc515).
stage vision bash -c "for round in 1 2; do gpu_bundle/bin/gpu_vision_model_gpu_test --gtest_filter='*TimingFullTower*' && (cd tools/gpu && python3 vision_anchor.py) || exit 1; done"
grep -E "VISION_OURS|VISION_ANCHOR" "$out/vision.log" | cut -c1-200
OUT=$out stage profile bash tools/gpu/layer_profile.sh step
head -45 "$out/step_profile.txt" 2>/dev/null
tar czf "$OUT/timings.tgz" -C "$out" . && rm -rf "$out"
echo "issue20_timings: exit $status"
exit $status
