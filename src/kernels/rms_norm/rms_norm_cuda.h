// CUDA zero-centred RMSNorm (y = x * rstd * (1 + w), fp32 math, bf16 storage), optionally fused
// with the residual add before it, and its backward (dx written, d_weight fp32 added to).
// Legend: T rows (tokens, or tokens x heads for q_norm/k_norm), C normalised width.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace deltamoe {

// x [T, C] bf16; weight [C] bf16; y [T, C] bf16 written; rstd [T] f32 written.
// With residual [T, C] non-null the normalised input is s = bf16(x + residual), written to
// sum_out [T, C] (the residual stream for the next layer; may alias x or residual); otherwise
// sum_out must be null and s = x.
void rms_norm_forward_cuda(const __nv_bfloat16* x, const __nv_bfloat16* residual, __nv_bfloat16* sum_out,
                           const __nv_bfloat16* weight, __nv_bfloat16* y, float* rstd, int64_t rows, int64_t width,
                           double eps, cudaStream_t stream);

// Bytes of scratch the backward needs (per-chunk partial sums of d_weight).
size_t rms_norm_backward_workspace_bytes(int64_t rows, int64_t width);

// x: the normalised input s of the forward; rstd from the forward; dy [T, C] bf16.
// dx [T, C] bf16 written = norm backward (+ d_skip [T, C] when non-null: the gradient reaching s
// through the residual stream). d_weight [C] f32 added to (deterministic: no atomics).
void rms_norm_backward_cuda(const __nv_bfloat16* x, const __nv_bfloat16* weight, const float* rstd,
                            const __nv_bfloat16* dy, const __nv_bfloat16* d_skip, __nv_bfloat16* dx, float* d_weight,
                            int64_t rows, int64_t width, void* workspace, size_t workspace_bytes,
                            cudaStream_t stream);

// Per-head q_norm / k_norm straight from the projection output: row r of x at x + r * x_row_stride
// (the query half of q_proj's [T, H, 2D] output: x = q_out, stride 2D); y, rstd as above.
void rms_norm_forward_strided_cuda(const __nv_bfloat16* x, int64_t x_row_stride, const __nv_bfloat16* weight,
                                   __nv_bfloat16* y, float* rstd, int64_t rows, int64_t width, double eps,
                                   cudaStream_t stream);

// Backward of the strided form: dx row r written at dx + r * dx_row_stride (the query half of
// the q_proj output gradient); dy, d_skip contiguous [T, C]; d_weight added to.
void rms_norm_backward_strided_cuda(const __nv_bfloat16* x, int64_t x_row_stride, const __nv_bfloat16* weight,
                                    const float* rstd, const __nv_bfloat16* dy, const __nv_bfloat16* d_skip,
                                    __nv_bfloat16* dx, int64_t dx_row_stride, float* d_weight, int64_t rows,
                                    int64_t width, void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace deltamoe
