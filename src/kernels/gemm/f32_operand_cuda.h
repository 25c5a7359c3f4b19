// Products whose one operand is fp32 (small per-token gate gradients, [T, 32] or [T, E]) and the
// other bf16, through a hi/lo bf16 split of the fp32 operand: two bf16 GEMMs into an fp32 result.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/gemm/gemm_cuda.h"

namespace deltamoe {

// hi = bf16(x), lo = bf16(x - hi) for `count` values: hi + lo equals x to ~2^-17 relative (each
// rounding keeps 8 significant bits), so a product of hi and lo with a bf16 operand, accumulated in
// fp32, is as exact as the bf16 operand itself allows. Why a split and not an fp32 kernel: the two
// products reuse the cuBLASLt path tested in gemm_gpu_test, and at [T, 32] they cost microseconds.
void split_f32_to_bf16_hi_lo_cuda(const float* x, __nv_bfloat16* hi, __nv_bfloat16* lo, int64_t count,
                                  cudaStream_t stream);

// dx [T, K] f32 written (accumulate false) or added to: dx (+)= (dy_hi + dy_lo) [T, N] @ W [N, K].
void linear_backward_input_split_cuda(GemmContext& ctx, const __nv_bfloat16* dy_hi, const __nv_bfloat16* dy_lo,
                                      const __nv_bfloat16* weight, float* dx, bool accumulate, int64_t rows,
                                      int64_t in_features, int64_t out_features, cudaStream_t stream);

// d_weight [N, K] f32 added to: d_weight += (dy_hi + dy_lo)^T [N, T] @ x [T, K].
void linear_backward_weight_split_cuda(GemmContext& ctx, const __nv_bfloat16* dy_hi, const __nv_bfloat16* dy_lo,
                                       const __nv_bfloat16* x, float* d_weight, int64_t rows, int64_t in_features,
                                       int64_t out_features, cudaStream_t stream);

// dst[i] += src[i] (fp32) for i < count: bf16 gradients (e.g. of the experts and the shared expert)
// summed into an fp32 one (the router's input gradient from the split products above).
void add_bf16_to_f32_cuda(const __nv_bfloat16* src, float* dst, int64_t count, cudaStream_t stream);

}  // namespace deltamoe
