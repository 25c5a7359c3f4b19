// CUDA shared expert with its sigmoid gate (the spec is shared_expert.h): dense products through
// the caller's cuBLASLt GemmContext (bf16 operands, fp32 accumulation), SiLU gate and scaling
// kernels in fp32. LoRA adapters on its four Linears (gate_proj, up_proj, down_proj,
// shared_expert_gate) add their low-rank terms where each base product is issued (kernels/lora/lora_cuda.h), forward and in the backward's
// recompute; their backward forms dA, dB and the input-gradient terms, never a base dW.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/lora/lora_cuda.h"
#include "kernels/moe_experts/moe_experts_sizes.h"

namespace deltamoe {

class GemmContext;

// The shared expert's adapters (one not attached: none) and the scratch their products use (at
// least shared_expert_lora_scratch_bytes for the call's tokens and the largest rank). gemm issues
// the adapter products on the same stream as the base ones. With LoRA dropout each adapter's mask
// (inactive: none) and dropout_scratch of lora_dropout_scratch_bytes(T, max(C, I)) bytes.
struct SharedExpertLora {
  GemmContext* gemm = nullptr;
  LoraDeviceAdapter gate_proj, up_proj, down_proj, expert_gate;
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
  LoraDropoutMask gate_proj_dropout, up_proj_dropout, down_proj_dropout, expert_gate_dropout;
  void* dropout_scratch = nullptr;
  size_t dropout_scratch_bytes = 0;
  bool any() const { return gate_proj.attached() || up_proj.attached() || down_proj.attached() || expert_gate.attached(); }
};
// x A^T and dy B rows [T, r] and the bf16 hi/lo halves of the fp32 gate-logit gradient [T].
size_t shared_expert_lora_scratch_bytes(int64_t num_tokens, int64_t rank);

size_t shared_expert_forward_workspace_bytes(int64_t num_tokens, int64_t hidden, int64_t intermediate);
size_t shared_expert_backward_workspace_bytes(int64_t num_tokens, int64_t hidden, int64_t intermediate);

// x [T, C]; gate_proj, up_proj [I, C]; down_proj [C, I]; expert_gate [1, C]; all bf16.
// y [T, C] bf16 written (accumulate false) or added to (true: y = routed + shared, summed in fp32).
void shared_expert_forward_cuda(GemmContext& gemm, const __nv_bfloat16* x, const __nv_bfloat16* gate_proj,
                                const __nv_bfloat16* up_proj, const __nv_bfloat16* down_proj,
                                const __nv_bfloat16* expert_gate, __nv_bfloat16* y, bool accumulate, int64_t num_tokens,
                                int64_t hidden, int64_t intermediate, void* workspace, size_t workspace_bytes,
                                cudaStream_t stream, const SharedExpertLora* lora = nullptr);

// The forward in two calls, for a caller that runs other work between the shared expert's
// products and their sum with y (the expert-parallel MoE block computes the shared expert while
// the host waits for the exchanged row counts, before the routed experts' y exists).
// shared_expert_forward_products_cuda leaves the ungated fp32 output out [T, C] and the fp32 gate
// logit [T] in `pending`; shared_expert_forward_apply_cuda then adds sigmoid(logit) out to y (or
// writes it) with the kernel shared_expert_forward_cuda ends with, so the result is bitwise that
// of the fused call. The workspace is shared_expert_forward_workspace_bytes' size; `pending` must
// stay untouched between the two calls.
struct SharedExpertPending {
  float* out = nullptr;    // [T, C]
  float* logit = nullptr;  // [T]
};
// Carves the two arrays for `num_tokens` tokens from `memory` (shared_expert_pending_bytes,
// kernels/moe_experts/moe_experts_sizes.h).
SharedExpertPending shared_expert_pending_in(void* memory, size_t bytes, int64_t num_tokens, int64_t hidden);
void shared_expert_forward_products_cuda(GemmContext& gemm, const __nv_bfloat16* x, const __nv_bfloat16* gate_proj,
                                         const __nv_bfloat16* up_proj, const __nv_bfloat16* down_proj,
                                         const __nv_bfloat16* expert_gate, const SharedExpertPending& pending,
                                         int64_t num_tokens, int64_t hidden, int64_t intermediate, void* workspace,
                                         size_t workspace_bytes, cudaStream_t stream,
                                         const SharedExpertLora* lora = nullptr);
void shared_expert_forward_apply_cuda(const SharedExpertPending& pending, __nv_bfloat16* y, bool accumulate,
                                      int64_t num_tokens, int64_t hidden, cudaStream_t stream);

// dy [T, C] bf16 -> dx [T, C] bf16 written (accumulate_dx false) or added to; d_gate_proj,
// d_up_proj [I, C], d_down_proj [C, I], d_expert_gate [1, C] f32 added to (each may be null: a
// frozen weight, its product skipped). Recomputes the gate and up products and the gate logit
// (with the adapters' terms), not the down projection: the logit's gradient is s (1 - s) h . (dy W_down);
// the adapters' gradients are added to their own grad_a / grad_b.
void shared_expert_backward_cuda(GemmContext& gemm, const __nv_bfloat16* x, const __nv_bfloat16* gate_proj,
                                 const __nv_bfloat16* up_proj, const __nv_bfloat16* down_proj,
                                 const __nv_bfloat16* expert_gate, const __nv_bfloat16* dy, __nv_bfloat16* dx,
                                 bool accumulate_dx, float* d_gate_proj, float* d_up_proj, float* d_down_proj,
                                 float* d_expert_gate, int64_t num_tokens, int64_t hidden, int64_t intermediate,
                                 void* workspace, size_t workspace_bytes, cudaStream_t stream,
                                 const SharedExpertLora* lora = nullptr);

}  // namespace deltamoe
