// CUDA LayerNorm with weight and bias (the vision tower's norms) over the fp32 residual stream, as
// in transformers' bf16 autocast (fp32 parameters keep the embedding and the residual adds fp32):
// fp32 statistics, weight and bias read from the fp32 master, the add of a bf16 block output to
// the stream fused in, bf16 output (a GEMM operand). The backward writes the fp32 stream gradient
// and its bf16 copy; d_weight and d_bias fp32 added to, deterministic. Legend: T rows, C hidden.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace deltamoe {

// residual [T, C] f32: the stream; delta [T, C] bf16 or null: a block output added to it first.
// s = residual (+ delta) in fp32 is normalised; sum_out [T, C] f32 receives s when delta is given
// (may alias residual) and must be null otherwise. weight, bias [C] f32; y [T, C] bf16, mean and
// rstd [T] f32 written. C as the backward takes it (below).
void layer_norm_forward_cuda(const __nv_bfloat16* delta, const float* residual, float* sum_out, const float* weight,
                             const float* bias, __nv_bfloat16* y, float* mean, float* rstd, int64_t rows,
                             int64_t hidden, double eps, cudaStream_t stream);

// Column sums the backward adds to beside d_weight and d_bias, on the same pass: the stream
// gradient it reads (d_skip) and the one it writes (dx) are the bias gradients of the Linears whose
// outputs joined the stream at this norm (a vision block's fc2 and proj at norm2). Null: not wanted.
struct LayerNormStreamBiasGrads {
  float* of_d_skip = nullptr;  // [C] f32 += column sums of d_skip (needs d_skip)
  float* of_dx = nullptr;      // [C] f32 += column sums of dx
};

// Whether both kernels take rows of `hidden` columns (see the backward's widths below; 16-byte
// aligned tensors assumed), so that a model can refuse a config when it is built.
bool layer_norm_cuda_takes(int64_t hidden);

// Scratch for the backward: fp32 per-chunk partials of the column sums.
size_t layer_norm_backward_workspace_bytes(int64_t rows, int64_t hidden);

// x: the normalised stream s of the forward [T, C] f32; mean, rstd from the forward; dy [T, C]
// bf16 or f32 (a product's fp32 output). dx [T, C] f32 written = norm backward (+ d_skip [T, C] f32
// when non-null: the gradient reaching s along the stream; dx may alias d_skip); dx_bf16 [T, C],
// when non-null, receives bf16(dx). d_weight, d_bias [C] f32 added to (either may be null to skip
// it); stream_bias as above. One pass over the rows, for C up to 3,072 when C is a multiple of 8
// and the tensors 16-byte aligned, else up to 1,024 (wider: an error).
void layer_norm_backward_cuda(const float* x, const float* weight, const float* mean, const float* rstd,
                              const __nv_bfloat16* dy, const float* d_skip, float* dx, __nv_bfloat16* dx_bf16,
                              float* d_weight, float* d_bias, const LayerNormStreamBiasGrads& stream_bias,
                              int64_t rows, int64_t hidden, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream);
void layer_norm_backward_cuda(const float* x, const float* weight, const float* mean, const float* rstd,
                              const float* dy, const float* d_skip, float* dx, __nv_bfloat16* dx_bf16,
                              float* d_weight, float* d_bias, const LayerNormStreamBiasGrads& stream_bias,
                              int64_t rows, int64_t hidden, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream);

}  // namespace deltamoe
