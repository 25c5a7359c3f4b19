// Per-stage timing of the gated delta rule CUDA forward and backward (benchmark aid): CUDA events
// recorded between the stages of both directions, medians over repeats.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/cuda_check.h"
#include "kernels/gated_delta_rule/gated_delta_rule_cuda.h"
#include "kernels/gated_delta_rule/gated_delta_rule_internal.cuh"

namespace deltamoe {

std::vector<GatedDeltaRuleStageTime> gated_delta_rule_stage_times_cuda(
    const GatedDeltaRuleShape& shape, float scale, const __nv_bfloat16* q, const __nv_bfloat16* k,
    const __nv_bfloat16* v, const float* g, const float* beta, const float* initial_state,
    __nv_bfloat16* o, float* final_state, const __nv_bfloat16* d_o, const float* d_final_state,
    __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, float* dg, float* dbeta,
    float* d_initial_state, void* workspace, size_t workspace_bytes, cudaStream_t stream,
    int repeats) {
  using namespace gdn_cuda;
  check_shape("gated_delta_rule_stage_times_cuda", shape);
  const size_t needed = std::max(gated_delta_rule_forward_workspace_bytes(shape),
                                 gated_delta_rule_backward_workspace_bytes(shape));
  CHECK(workspace != nullptr && workspace_bytes >= needed,
        "gated_delta_rule_stage_times_cuda: workspace of ", workspace_bytes, " bytes, need ",
        needed);
  CHECK(repeats >= 1, "gated_delta_rule_stage_times_cuda: repeats must be >= 1, got ", repeats);
  CHECK(reinterpret_cast<uintptr_t>(workspace) % 256 == 0, "gated_delta_rule_stage_times_cuda: the workspace "
        "must be 256-byte aligned");
  // The backward layout extends the forward one (same offsets for the shared fields).
  Workspace ws{};
  carve_workspace(shape, true, workspace, &ws);
  StageMarks marks;
  for (cudaEvent_t& event : marks.events) CUDA_CHECK(cudaEventCreate(&event));
  std::vector<std::vector<float>> samples;
  std::vector<const char*> names;
  for (int rep = 0; rep < repeats; ++rep) {
    marks.count = 0;
    run_forward(shape, scale, q, k, v, g, beta, initial_state, o, final_state, ws, stream, &marks);
    run_backward(shape, scale, q, k, v, g, beta, initial_state, d_o, d_final_state, dq, dk, dv, dg,
                 dbeta, d_initial_state, ws, stream, &marks);
    CUDA_CHECK(cudaEventSynchronize(marks.events[marks.count - 1]));
    if (rep == 0) {
      names.assign(marks.names, marks.names + marks.count);
      samples.resize(marks.count);
    }
    for (int i = 1; i < marks.count; ++i) {
      float ms = 0.0f;
      CUDA_CHECK(cudaEventElapsedTime(&ms, marks.events[i - 1], marks.events[i]));
      samples[i].push_back(ms);
    }
  }
  for (cudaEvent_t event : marks.events) CUDA_CHECK(cudaEventDestroy(event));
  std::vector<GatedDeltaRuleStageTime> out;
  for (size_t i = 1; i < samples.size(); ++i) {
    // "backward start" measures the gap after the forward's last stage: skip it.
    if (std::string(names[i]).find(" start") != std::string::npos) continue;
    std::vector<float>& times = samples[i];
    std::sort(times.begin(), times.end());
    out.push_back({names[i], times[times.size() / 2]});
  }
  return out;
}

}  // namespace deltamoe
