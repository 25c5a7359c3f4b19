// CUDA zero-centred RMSNorm (y = x * rstd * (1 + w), fp32 math, fp32 weight read from the master
// copy) in two forms, and their backwards (dx written, d_weight fp32 added to):
// - the residual-stream form: the stream is fp32, as in transformers' bf16 autocast (fp32
//   parameters, so the embedding and every residual add stay fp32); the add of a bf16 block output
//   to the stream is fused into the norm that follows it; the output y is bf16 (a GEMM operand);
// - the head form (q_norm / k_norm): bf16 rows in and out, optionally strided.
// Legend: T rows (tokens, or tokens x heads for q_norm/k_norm), C normalised width.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace deltamoe {

// residual [T, C] f32: the stream; delta [T, C] bf16 or null: a block output added to it first.
// s = residual (+ delta) in fp32 is normalised; sum_out [T, C] f32 receives s when delta is given
// (the next stream; may alias residual) and must be null otherwise. weight [C] f32; y [T, C]
// bf16 and rstd [T] f32 written.
void rms_norm_forward_cuda(const __nv_bfloat16* delta, const float* residual, float* sum_out, const float* weight,
                           __nv_bfloat16* y, float* rstd, int64_t rows, int64_t width, double eps,
                           cudaStream_t stream);

// The low half of a stream-form output, for a product that must see the normalised rows unrounded
// (the MoE router: its bf16 input alone moved golden aux-loss gradients by up to 8e-3, docs/vision.md
// "Rounding probe"):
// s, weight, rstd and y as the forward read / wrote them; lo [T, C] bf16 written with
// bf16(s * rstd * (1 + w) - y), so y + lo is the fp32 output to ~2^-17 relative.
void rms_norm_output_low_part_cuda(const float* s, const float* weight, const float* rstd, const __nv_bfloat16* y,
                                   __nv_bfloat16* lo, int64_t rows, int64_t width, cudaStream_t stream);

// Bytes of scratch the backward needs (per-chunk partial sums of d_weight).
size_t rms_norm_backward_workspace_bytes(int64_t rows, int64_t width);

// x: the normalised stream s of the forward [T, C] f32; rstd from the forward; dy [T, C] bf16 or
// f32 (the gradient of y). dx [T, C] f32 written = norm backward (+ d_skip [T, C] f32 when
// non-null: the gradient reaching s along the stream; dx may alias d_skip); dx_bf16 [T, C], when
// non-null, receives bf16(dx) for the GEMMs of the block before. d_weight [C] f32 added to
// (deterministic: no atomics), or null for a frozen weight (its reduction is skipped); its sums
// are formed on the dx pass in shared memory, C x 4 bytes a warp (eight warps a block, fewer for
// wide rows; a row wider than one block's shared memory holds is refused).
void rms_norm_backward_cuda(const float* x, const float* weight, const float* rstd, const __nv_bfloat16* dy,
                            const float* d_skip, float* dx, __nv_bfloat16* dx_bf16, float* d_weight, int64_t rows,
                            int64_t width, void* workspace, size_t workspace_bytes, cudaStream_t stream);
void rms_norm_backward_cuda(const float* x, const float* weight, const float* rstd, const float* dy,
                            const float* d_skip, float* dx, __nv_bfloat16* dx_bf16, float* d_weight, int64_t rows,
                            int64_t width, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// Head form: row r of x at x + r * x_row_stride (x_row_stride = C for contiguous rows; 2D for the
// query half of q_proj's [T, H, 2D] output). weight [C] f32; y [T, C] bf16, rstd [T] f32 written.
void rms_norm_forward_strided_cuda(const __nv_bfloat16* x, int64_t x_row_stride, const float* weight,
                                   __nv_bfloat16* y, float* rstd, int64_t rows, int64_t width, double eps,
                                   cudaStream_t stream);

// Backward of the head form: dy [T, C] bf16 contiguous; dx row r written at dx + r * dx_row_stride
// (the query half of the q_proj output gradient); d_weight added to (null: skipped).
void rms_norm_backward_strided_cuda(const __nv_bfloat16* x, int64_t x_row_stride, const float* weight,
                                    const float* rstd, const __nv_bfloat16* dy, __nv_bfloat16* dx,
                                    int64_t dx_row_stride, float* d_weight, int64_t rows, int64_t width,
                                    void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace deltamoe
