// CUDA LayerNorm with weight and bias (the vision tower's norms; fp32 statistics, bf16 storage),
// optionally fused with the residual add before it, and its backward (dx written; d_weight and
// d_bias fp32 added to, deterministic). Legend: T rows, C hidden.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace deltamoe {

// x [T, C] bf16; weight, bias [C] bf16; y [T, C] bf16 written; mean, rstd [T] f32 written.
// With residual [T, C] non-null the normalised input is s = bf16(x + residual), written to
// sum_out [T, C] (the residual stream; may alias x or residual); otherwise sum_out must be null.
void layer_norm_forward_cuda(const __nv_bfloat16* x, const __nv_bfloat16* residual, __nv_bfloat16* sum_out,
                             const __nv_bfloat16* weight, const __nv_bfloat16* bias, __nv_bfloat16* y, float* mean,
                             float* rstd, int64_t rows, int64_t hidden, double eps, cudaStream_t stream);

// Scratch for the backward: fp32 per-chunk partials of d_weight and d_bias.
size_t layer_norm_backward_workspace_bytes(int64_t rows, int64_t hidden);

// x: the normalised input s of the forward; mean, rstd from the forward; dy [T, C] bf16.
// dx [T, C] bf16 written = norm backward (+ d_skip [T, C] when non-null: the gradient reaching s
// through the residual stream; dx may alias d_skip). d_weight, d_bias [C] f32 added to (either
// may be null to skip it).
void layer_norm_backward_cuda(const __nv_bfloat16* x, const __nv_bfloat16* weight, const float* mean,
                              const float* rstd, const __nv_bfloat16* dy, const __nv_bfloat16* d_skip,
                              __nv_bfloat16* dx, float* d_weight, float* d_bias, int64_t rows, int64_t hidden,
                              void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace deltamoe
