// CUDA routed experts (the spec is moe_experts.h): a routing plan built on the device (expert
// counts, offsets, expert-major order), permute, grouped GEMMs, SiLU gate, deterministic combine.
// bf16 activations and weights, fp32 routing weights and accumulation, fp32 or bf16 weight
// gradients.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/grouped_gemm/grouped_gemm_cuda.h"
#include "kernels/lora/lora_cuda.h"
#include "kernels/moe_experts/moe_experts.h"
#include "kernels/moe_experts/moe_experts_sizes.h"

namespace deltamoe {

// Where each (token, slot) goes, all on the device. Rows of the expert-major order are sorted by
// expert, then by flat slot t*K+k (so the order, and everything built on it, is deterministic).
struct MoeRoutingPlan {
  int32_t* expert_offsets = nullptr;  // [E+1] rows of expert e: [offsets[e], offsets[e+1])
  int32_t* sorted_slot = nullptr;     // [T*K] flat slot t*K+k of expert-major row r
  int32_t* row_of_slot = nullptr;     // [T*K] expert-major row of flat slot t*K+k
  int32_t* chunk_counts = nullptr;    // scratch while building: per-chunk expert counts
  int32_t* chunk_rows = nullptr;      // scratch while building: first row of each chunk's experts
};

// The plan laid out in memory of moe_routing_plan_bytes (moe_experts_sizes.h).
MoeRoutingPlan moe_routing_plan_in(void* memory, int64_t num_tokens, int64_t num_experts, int64_t top_k);

// topk_idx int32 [T, K] (each in [0, E); not checked on the device) -> the plan. No host sync.
void moe_routing_plan_cuda(const int32_t* topk_idx, const MoeRoutingPlan& plan, int64_t num_tokens, int64_t num_experts,
                           int64_t top_k, cudaStream_t stream);

// LoRA adapters on the routed experts (kernels/lora/lora_cuda.h; an adapter not attached: none),
// applied over the same expert-major rows as the base products, with their own workspace (at least
// moe_experts_lora_workspace_bytes). Frozen base experts pass null weight gradients as before.
struct MoeExpertsLora {
  LoraDeviceAdapter gate_up, down;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
size_t moe_experts_lora_workspace_bytes(const MoeExpertsDims& dims, int64_t rank);

// Workspace (bytes) of the forward and the backward: moe_experts_sizes.h.

// Expert-major rows a forward keeps for its backward, which then need not form them again (null:
// not kept): the permuted inputs [T K, C] bf16 and the gate/up rows [T K, 2I] bf16 (adapters
// included). Each may be kept without the other.
struct MoeExpertRows {
  __nv_bfloat16* inputs = nullptr;
  __nv_bfloat16* gate_up = nullptr;
};

// x [T, C] bf16; topk_weight [T, K] f32; gate_up [E, 2I, C] bf16; down [E, C, I] bf16;
// y [T, C] bf16 written (each token sums its K weighted expert outputs in slot order, in fp32).
// keep (null: nothing kept): the rows written into its buffers, for the backward's `kept`.
void moe_experts_forward_cuda(const MoeExpertsDims& dims, const MoeRoutingPlan& plan, const __nv_bfloat16* x,
                              const float* topk_weight, const __nv_bfloat16* gate_up, const __nv_bfloat16* down,
                              __nv_bfloat16* y, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                              const MoeExpertsLora* lora = nullptr, const MoeExpertRows* keep = nullptr);

// The sums of squares of written expert gradients as the optimizer's norm counts them (the grouped
// GEMM's WeightGradSquares): *gate_up and *down (device doubles) set; scratch of
// kWeightGradSquaresScratchBytes.
struct ExpertGradSquares {
  double* gate_up = nullptr;
  double* down = nullptr;
  double divisor = 1.0;
  void* scratch = nullptr;
};

// dy [T, C] bf16 -> dx [T, C] bf16 and d_topk_weight [T, K] f32 written; d_gate_up [E, 2I, C]
// and d_down [E, C, I] added to, or with expert_grads = written overwritten (zeros for experts
// without rows, and everywhere when T = 0), so that a step's first product needs no zeroed
// gradient (null: frozen, the weight products are skipped). Both gradients are grad_dtype, f32 or
// bf16 (grouped_gemm_weight_grad_cuda's rounding: each product accumulated in fp32, added to the
// widened value and rounded once). The permuted inputs and the gate/up rows come from `kept` (the
// same forward's `keep`, read only here) where it holds them, else they are formed again (the same
// bits: the same permute, the same product of the same operands).
// squares (written only; null: none): each written gradient's sum of squares (of the stored values),
// 0 for one not formed.
void moe_experts_backward_cuda(const MoeExpertsDims& dims, const MoeRoutingPlan& plan, const __nv_bfloat16* x,
                               const float* topk_weight, const __nv_bfloat16* gate_up, const __nv_bfloat16* down,
                               const __nv_bfloat16* dy, __nv_bfloat16* dx, float* d_topk_weight, void* d_gate_up,
                               void* d_down, DType grad_dtype, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream,
                               const MoeExpertsLora* lora = nullptr,
                               WeightGradOutput expert_grads = WeightGradOutput::added_to,
                               const ExpertGradSquares* squares = nullptr, const MoeExpertRows* kept = nullptr);

// Pieces, exposed for the tests and for fusing later. R = T*K expert-major rows.
// xp[r] = x[sorted_slot[r] / K]: [R, C] bf16.
void moe_permute_cuda(const __nv_bfloat16* x, const int32_t* sorted_slot, __nv_bfloat16* xp, int64_t rows,
                      int64_t hidden, int64_t top_k, cudaStream_t stream);
// y[t] = sum over k (in order) of w[t, k] * yp[row_of_slot[t*K+k]] (w null: weight 1), fp32 sum: [T, C] bf16.
void moe_combine_cuda(const __nv_bfloat16* yp, const int32_t* row_of_slot, const float* topk_weight, __nv_bfloat16* y,
                      int64_t num_tokens, int64_t hidden, int64_t top_k, cudaStream_t stream);

}  // namespace deltamoe
