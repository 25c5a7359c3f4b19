// CUDA gate activations, bf16 storage and fp32 math: the attention output gate y = o * sigmoid(g)
// (g read in place from the q_proj output, where each head's gate follows its query) and SwiGLU
// h = silu(g) * u over a fused gate|up row. Forward and backward.
// Legend: T rows (tokens x heads for the attention gate), D width, I intermediate width.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace deltamoe {

// attn [T, D] contiguous; gate row r at gate + r * gate_row_stride (stride >= D); y [T, D]
// written (may alias attn).
void attention_gate_forward_cuda(const __nv_bfloat16* attn, const __nv_bfloat16* gate, int64_t gate_row_stride,
                                 __nv_bfloat16* y, int64_t rows, int64_t width, cudaStream_t stream);

// dy [T, D] -> d_attn [T, D] written (may alias dy) and d_gate written at d_gate + r * d_gate_row_stride
// (the gate half of the q_proj output gradient).
void attention_gate_backward_cuda(const __nv_bfloat16* attn, const __nv_bfloat16* gate, int64_t gate_row_stride,
                                  const __nv_bfloat16* dy, __nv_bfloat16* d_attn, __nv_bfloat16* d_gate,
                                  int64_t d_gate_row_stride, int64_t rows, int64_t width, cudaStream_t stream);

// gate_up [T, 2I] (gate then up) -> h [T, I] written.
void swiglu_forward_cuda(const __nv_bfloat16* gate_up, __nv_bfloat16* h, int64_t rows, int64_t intermediate,
                         cudaStream_t stream);

// dh [T, I] -> d_gate_up [T, 2I] written.
void swiglu_backward_cuda(const __nv_bfloat16* gate_up, const __nv_bfloat16* dh, __nv_bfloat16* d_gate_up,
                          int64_t rows, int64_t intermediate, cudaStream_t stream);

}  // namespace deltamoe
