// CUDA launchers of the chunked gated delta rule (spec: gated_delta_rule.h and its chunked CPU
// reference), forward and backward over packed sequences with GQA. bf16 q/k/v/o, fp32 gates and
// initial / final states; the workspace holds the products' operands in bf16 and the accumulators
// in fp32 (gated_delta_rule_workspace.h); chunks of kGatedDeltaRuleChunkSize tokens restart at
// every sequence.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/gated_delta_rule/gated_delta_rule.h"

namespace deltamoe {

// Head dims up to this are supported by the CUDA path (Qwen3.5 uses Dk = Dv = 128).
constexpr int kGatedDeltaRuleCudaMaxHeadDim = 128;

// `shape` is the same struct as the reference's, but shape.cu_seqlens is a DEVICE pointer
// (int32 [N+1], validated on the host by the data loader) and is never read on the host.
// Tensors (device pointers, contiguous):
//   q, k [T, Hk, Dk] bf16 (already l2-normalised), v [T, Hv, Dv] bf16, g, beta [T, Hv] fp32,
//   initial_state / final_state [N, Hv, Dk, Dv] fp32 or null, o [T, Hv, Dv] bf16.
// The workspace is caller-provided device memory of at least the bytes the *_workspace_bytes
// functions return (256-byte aligned); the launchers neither allocate nor synchronise.

size_t gated_delta_rule_forward_workspace_bytes(const GatedDeltaRuleShape& shape);
size_t gated_delta_rule_backward_workspace_bytes(const GatedDeltaRuleShape& shape);

void gated_delta_rule_forward_cuda(const GatedDeltaRuleShape& shape, float scale,
                                   const __nv_bfloat16* q, const __nv_bfloat16* k,
                                   const __nv_bfloat16* v, const float* g, const float* beta,
                                   const float* initial_state, __nv_bfloat16* o,
                                   float* final_state, void* workspace, size_t workspace_bytes,
                                   cudaStream_t stream);

// Given d_o [T, Hv, Dv] bf16 and d_final_state (fp32 or null = zeros): WRITES dq, dk [T, Hk, Dk]
// bf16 (summed over the value heads of a key head), dv [T, Hv, Dv] bf16, dg, dbeta [T, Hv] fp32,
// and d_initial_state [N, Hv, Dk, Dv] fp32 when not null. The forward is recomputed inside.
void gated_delta_rule_backward_cuda(const GatedDeltaRuleShape& shape, float scale,
                                    const __nv_bfloat16* q, const __nv_bfloat16* k,
                                    const __nv_bfloat16* v, const float* g, const float* beta,
                                    const float* initial_state, const __nv_bfloat16* d_o,
                                    const float* d_final_state, __nv_bfloat16* dq,
                                    __nv_bfloat16* dk, __nv_bfloat16* dv, float* dg, float* dbeta,
                                    float* d_initial_state, void* workspace,
                                    size_t workspace_bytes, cudaStream_t stream);

// The same backward after a forward whose workspace the caller kept unchanged (its chunk table,
// W, V_new, P, A and chunk-entry states for these same inputs and shape): they are read from
// forward_workspace instead of being recomputed (the same values), and the backward's own arrays
// come from workspace (at least gated_delta_rule_backward_after_forward_workspace_bytes). The
// kept workspace is only read, so several backwards may follow one forward.
size_t gated_delta_rule_backward_after_forward_workspace_bytes(const GatedDeltaRuleShape& shape);
void gated_delta_rule_backward_after_forward_cuda(const GatedDeltaRuleShape& shape, float scale,
                                                  const __nv_bfloat16* q, const __nv_bfloat16* k,
                                                  const __nv_bfloat16* v, const float* g, const float* beta,
                                                  const float* initial_state, const __nv_bfloat16* d_o,
                                                  const float* d_final_state, __nv_bfloat16* dq, __nv_bfloat16* dk,
                                                  __nv_bfloat16* dv, float* dg, float* dbeta,
                                                  float* d_initial_state, const void* forward_workspace,
                                                  size_t forward_workspace_bytes, void* workspace,
                                                  size_t workspace_bytes, cudaStream_t stream);

// Benchmark aid: runs the forward and then the backward `repeats` times with CUDA events between
// their stages and returns each stage's median milliseconds, in launch order. Same arguments as
// the two launchers (the workspace must fit both); synchronises, so never inside a training step.
struct GatedDeltaRuleStageTime {
  std::string name;
  double ms;
};
std::vector<GatedDeltaRuleStageTime> gated_delta_rule_stage_times_cuda(
    const GatedDeltaRuleShape& shape, float scale, const __nv_bfloat16* q, const __nv_bfloat16* k,
    const __nv_bfloat16* v, const float* g, const float* beta, const float* initial_state,
    __nv_bfloat16* o, float* final_state, const __nv_bfloat16* d_o, const float* d_final_state,
    __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, float* dg, float* dbeta,
    float* d_initial_state, void* workspace, size_t workspace_bytes, cudaStream_t stream,
    int repeats);

}  // namespace deltamoe
