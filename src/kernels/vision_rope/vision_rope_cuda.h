// CUDA 2-D vision RoPE: the cos/sin tables from (row, col) positions, and the rotation of q and k
// (bf16 storage, fp32 math) forward and backward, in place inside the fused qkv output if wanted.
// Legend: N patches, H heads, D head dim (a multiple of 4; 72 in Qwen3.5's tower).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace deltamoe {

// Largest D/4 the table kernel takes (its inverse frequencies travel as a kernel argument).
constexpr int64_t kVisionRopeMaxQuarter = 64;

// positions int64 [N, 2] (device; vision_rope_positions' output); cos, sin f32 [N, D/2] written.
// inv_freq is formed on the host exactly as vision_rope_tables_ref forms it in fp32.
void vision_rope_tables_cuda(const int64_t* positions, int64_t num_patches, int64_t head_dim, double theta,
                             float* cos, float* sin, cudaStream_t stream);

// Rotates `num_heads` heads of D values per patch: head h of patch n at x + n * x_patch_stride +
// h * D, written to y + n * y_patch_stride + h * Dy (y may alias x with the same strides), Dy =
// y_head_stride (0: D); an output head wider than D gets zeros in its columns [D, Dy) (q and k
// zero-padded for cuDNN's attention, cudnn_sdpa.h). For q and k in the vision qkv output [N, 3, H,
// D] pass x = y = qkv, stride 3 * H * D, num_heads = 2 * H: the q heads and then the k heads are
// contiguous. cos, sin f32 [N, D/2].
void vision_rope_forward_cuda(const __nv_bfloat16* x, int64_t x_patch_stride, __nv_bfloat16* y,
                              int64_t y_patch_stride, const float* cos, const float* sin, int64_t num_patches,
                              int64_t num_heads, int64_t head_dim, cudaStream_t stream, int64_t y_head_stride = 0);

// The backward: the rotation by the opposite angle, same layout rules (dx may alias dy); dy's heads
// are dy_head_stride apart (0: D; its columns past D are not read), dx's D apart.
void vision_rope_backward_cuda(const __nv_bfloat16* dy, int64_t dy_patch_stride, __nv_bfloat16* dx,
                               int64_t dx_patch_stride, const float* cos, const float* sin, int64_t num_patches,
                               int64_t num_heads, int64_t head_dim, cudaStream_t stream, int64_t dy_head_stride = 0);

}  // namespace deltamoe
