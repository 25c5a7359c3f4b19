// CUDA GELU (exact erf, or the tanh form) on bf16 rows with fp32 math, optionally fused with the
// bias add of the linear before it (forward) and that bias's gradient (backward, fp32 column sums,
// deterministic). Legend: T rows, N features.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/gelu/gelu.h"

namespace deltamoe {

// x [T, N] bf16 (the linear's output without bias); bias [N] bf16 or null.
// h = bias ? bf16(x + bias) : x is the activation input; y [T, N] bf16 written = gelu(h).
// pre_out [T, N] bf16, when non-null (only with a bias), receives h for the backward; pre_out and
// y may alias x (every element is read and written by the same thread).
void gelu_forward_cuda(GeluKind kind, const __nv_bfloat16* x, const __nv_bfloat16* bias, __nv_bfloat16* pre_out,
                       __nv_bfloat16* y, int64_t rows, int64_t features, cudaStream_t stream);

// Scratch for the backward: 0 without d_bias, else the fp32 per-chunk column partials.
size_t gelu_backward_workspace_bytes(int64_t rows, int64_t features, bool with_bias_grad);

// h [T, N] the activation input; dy [T, N] -> dx [T, N] bf16 written = dy * gelu'(h) (may alias
// dy). d_bias [N] f32, when non-null, added to: column sums of dx taken in fp32 before rounding.
void gelu_backward_cuda(GeluKind kind, const __nv_bfloat16* h, const __nv_bfloat16* dy, __nv_bfloat16* dx,
                        float* d_bias, int64_t rows, int64_t features, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream);

}  // namespace deltamoe
