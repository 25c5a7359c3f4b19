// CUDA router of the Qwen3.5-MoE block (the spec is moe_router.h): projection through the
// caller's cuBLASLt GemmContext, fp32 softmax, top-k (ties to the lower expert) and
// renormalisation, one warp per token.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace deltamoe {

class GemmContext;

// Largest expert count and top-k of the warp-per-token kernels (Qwen3.5: E 256 or 512, K 8 or 10).
constexpr int64_t kRouterMaxExperts = 512;
constexpr int64_t kRouterMaxTopK = 32;

// logits [T, E] f32 = x [T, C] bf16 @ w [E, C]^T (bf16 operands, fp32 accumulate and output:
// the router works on unrounded logits, more exact than HF's bf16 logits).
void moe_router_logits_cuda(GemmContext& gemm, const __nv_bfloat16* x, const __nv_bfloat16* w, float* logits,
                            int64_t num_tokens, int64_t hidden, int64_t num_experts, cudaStream_t stream);

// The same product with both operands carried as bf16 hi/lo pairs (x = x_hi + x_lo, w = w_hi +
// w_lo; kernels/gemm/f32_operand_cuda.h, rms_norm_output_low_part_cuda): three bf16 GEMMs into
// fp32 logits that match an fp32 product to ~2^-16 relative. Why: the aux loss's gradient is a
// difference of routing probabilities that cancels, and the router's bf16 input and weight each
// moved golden aux-loss gradients by up to 8e-3 / 1.2e-2 (docs/vision.md, "Rounding probe").
void moe_router_logits_split_cuda(GemmContext& gemm, const __nv_bfloat16* x_hi, const __nv_bfloat16* x_lo,
                                  const __nv_bfloat16* w_hi, const __nv_bfloat16* w_lo, float* logits,
                                  int64_t num_tokens, int64_t hidden, int64_t num_experts, cudaStream_t stream);

// logits [T, E] f32 -> probs [T, E] f32, topk_idx int32 [T, K], topk_weight [T, K] f32 (kept in
// fp32, as early HF did; the combine multiplies in fp32). All written.
void moe_router_forward_cuda(const float* logits, float* probs, int32_t* topk_idx, float* topk_weight,
                             int64_t num_tokens, int64_t num_experts, int64_t top_k, cudaStream_t stream);

// d_topk_weight [T, K] f32 -> d_logits [T, E] f32, written (accumulate false) or added to (true,
// e.g. after the aux-loss gradient). d_logits_bf16 [T, E] (optional, may be null) receives a bf16
// copy of the final d_logits for the projection's backward.
void moe_router_backward_cuda(const float* probs, const int32_t* topk_idx, const float* topk_weight,
                              const float* d_topk_weight, float* d_logits, __nv_bfloat16* d_logits_bf16,
                              bool accumulate, int64_t num_tokens, int64_t num_experts, int64_t top_k,
                              cudaStream_t stream);

// Projection backward: dx [T, C] bf16 written (accumulate false) or added to; d_w [E, C] f32 added to.
void moe_router_logits_backward_cuda(GemmContext& gemm, const __nv_bfloat16* x, const __nv_bfloat16* w,
                                     const __nv_bfloat16* d_logits_bf16, __nv_bfloat16* dx, bool accumulate_dx,
                                     float* d_w, int64_t num_tokens, int64_t hidden, int64_t num_experts,
                                     cudaStream_t stream);

}  // namespace deltamoe
