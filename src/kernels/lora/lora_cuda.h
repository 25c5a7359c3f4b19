// LoRA adapter products on the GPU (PEFT's LoRA, model/lora/lora.h is the spec): the low-rank
// term a projection adds to its base product, issued where the base GEMM is issued (compare
// llama.cpp's build_lora_mm), and its backward. The frozen base weight forms no gradient here: the
// caller skips its dW GEMM, which is where LoRA saves a third of a projection's work.
//
// Dense projection, W [out, in], A [r, in], B [out, r], s the scaling:
//   forward   y  (+)= x W^T (caller)  +  s (x A^T) B^T
//   backward  dxa = s dy B  [T, r] (bf16), dB += s dy^T (x A^T), dA += dxa^T x, dx += dxa A
// With LoRA dropout (PEFT's B(A(dropout(x))), a LoraDropoutPass given) x above is x' = dropout(x)
// (bf16, formed in the pass's scratch) and dx += dropout'(dxa A) through the same mask.
// Routed experts (fused [E, out, in], PEFT 0.21's ParamWrapper layout): A [r E, in] (expert e's
// rows e r .. e r + r - 1, contiguous), B [out, r E] (expert e's column j at j E + e, strided).
// The grouped products read B through a per-expert copy [E, out, r] (B_e contiguous), refreshed
// once per forward from the working weight; its gradient is formed in that layout and added back
// into PEFT's layout, so no merged [E, out, in] delta or delta gradient is ever formed.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "kernels/lora/lora_dropout_mask.h"

namespace deltamoe {

class GemmContext;

// One adapter's device views (the owner is DeviceParams: A and B are trained tensors there).
struct LoraDeviceAdapter {
  const __nv_bfloat16* a = nullptr;  // bf16 working weight, [r, in] (experts: [r E, in])
  const __nv_bfloat16* b = nullptr;  // bf16 working weight, [out, r] (experts: [out, r E])
  float* grad_a = nullptr;           // fp32 gradients, added to; null with grad_b: a frozen adapter
  float* grad_b = nullptr;
  int64_t rank = 0;
  float scaling = 0;
  bool attached() const { return a != nullptr; }
};

// LoRA dropout of one dense adapter in one training pass: the mask (lora_dropout_mask.h; inactive:
// nothing is dropped and the scratch is not used) and lora_dropout_scratch_bytes(rows, in) of scratch.
struct LoraDropoutPass {
  LoraDropoutMask mask;
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
};

// out [rows, cols] bf16 = x * the mask's factor (rows 0 .. rows - 1 of the mask); out may be x.
void lora_dropout_apply_cuda(const LoraDropoutMask& mask, const __nv_bfloat16* x, __nv_bfloat16* out, int64_t rows,
                             int64_t cols, cudaStream_t stream);

// dst [rows, cols] (f32 or bf16) added to with src [rows, cols] f32 times the mask's factor.
void lora_dropout_add_cuda(const LoraDropoutMask& mask, const float* src, void* dst, DType dst_dtype, int64_t rows,
                           int64_t cols, cudaStream_t stream);

// ---- dense projections (cuBLASLt through GemmContext) ----

// xa [T, r] bf16 written with x A^T (kept by the caller for the backward, or recomputed there), then
// y [T, out] (bf16 or f32, y_dtype) added to with s xa B^T (beta = 1: y holds the base product).
// dropout: null or inactive for none; the backward must get the same one.
void lora_linear_forward_cuda(GemmContext& gemm, const __nv_bfloat16* x, const LoraDeviceAdapter& adapter,
                              __nv_bfloat16* xa, void* y, DType y_dtype, int64_t rows, int64_t in_features,
                              int64_t out_features, cudaStream_t stream, const LoraDropoutPass* dropout = nullptr);

// x [T, in], dy [T, out] bf16. xa [T, r] holds x A^T from the forward (recompute_xa false) or is
// scratch that is refilled here (recompute_xa true). dxa [T, r] bf16 scratch. dx [T, in] (bf16 or
// f32, dx_dtype) added to with the adapter's input gradient (null: skipped); grad_a / grad_b added
// to when the adapter is trained. A projection whose dy is fp32 (split into bf16 hi + lo halves) calls
// this once per half: every product is linear in dy.
void lora_linear_backward_cuda(GemmContext& gemm, const __nv_bfloat16* x, const __nv_bfloat16* dy,
                               const LoraDeviceAdapter& adapter, __nv_bfloat16* xa, bool recompute_xa,
                               __nv_bfloat16* dxa, void* dx, DType dx_dtype, int64_t rows, int64_t in_features,
                               int64_t out_features, cudaStream_t stream, const LoraDropoutPass* dropout = nullptr);

// ---- routed experts (grouped products over the expert-major rows of a routing plan) ----

struct LoraExpertDims {
  int64_t num_experts = 0;   // E
  int64_t in_features = 0;   // K of the base product
  int64_t out_features = 0;  // N of the base product
  int64_t rank = 0;          // r
  int64_t max_rows = 0;      // most expert-major rows (T K) of a micro-batch
};

// Scratch one call needs (bytes): the per-expert B copy, xa / dxa rows [R, r], the [R, out] low-rank
// product, dB in the per-expert layout, and the grouped GEMM's tile prefix.
size_t lora_experts_workspace_bytes(const LoraExpertDims& dims);

// B [out, r E] (PEFT) -> b_experts [E, out, r] (bf16), the layout the grouped products read.
void lora_experts_gather_b_cuda(const __nv_bfloat16* b, __nv_bfloat16* b_experts, const LoraExpertDims& dims,
                                cudaStream_t stream);

// Expert-major rows xp [R, in] bf16 with rows [offsets[e], offsets[e+1]) of expert e (device
// offsets, R = offsets[E] <= max_rows): y [R, out] (bf16 or f32, y_dtype) added to with
// s (xp A_e^T) B_e^T. No host sync.
void lora_experts_forward_cuda(const __nv_bfloat16* xp, const LoraDeviceAdapter& adapter, const int32_t* offsets,
                               void* y, DType y_dtype, const LoraExpertDims& dims, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream);

// dy [R, out] bf16 over the same rows: dx [R, in] (bf16 or f32) added to (null: skipped), grad_a
// [r E, in] and grad_b [out, r E] (PEFT layouts) added to when the adapter is trained.
void lora_experts_backward_cuda(const __nv_bfloat16* xp, const __nv_bfloat16* dy, const LoraDeviceAdapter& adapter,
                                const int32_t* offsets, void* dx, DType dx_dtype, const LoraExpertDims& dims,
                                void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace deltamoe
