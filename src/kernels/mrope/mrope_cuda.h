// CUDA partial interleaved M-RoPE: per-token cos/sin tables from 3-D positions, the rotation of
// the first R channels of each head (bf16 in/out, fp32 math) and its transpose for the backward.
// Legend: T tokens, H heads, D head dim, R rotary dim (even, <= D, R / 2 <= kMropeMaxFrequencies).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/mrope/mrope.h"

namespace deltamoe {

constexpr int64_t kMropeMaxFrequencies = 128;

// positions int64 [3, T] (rows t, h, w); cos, sin f32 [T, R/2] written. inv_freq is formed on the
// host exactly as the reference does; the angles pos * inv_freq are the same fp32 products.
void mrope_tables_cuda(const MropeSpec& spec, const int64_t* positions, int64_t num_tokens, float* cos, float* sin,
                       cudaStream_t stream);

// x [T, H, D] bf16 -> y [T, H, D] bf16 written (channels >= R copied); y may alias x.
void mrope_forward_cuda(const MropeSpec& spec, const __nv_bfloat16* x, const float* cos, const float* sin,
                        __nv_bfloat16* y, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                        cudaStream_t stream);

// dy [T, H, D] -> dx [T, H, D] written (the inverse rotation); dx may alias dy.
void mrope_backward_cuda(const MropeSpec& spec, const __nv_bfloat16* dy, const float* cos, const float* sin,
                         __nv_bfloat16* dx, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                         cudaStream_t stream);

}  // namespace deltamoe
