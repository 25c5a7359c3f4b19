// CUDA 2-D vision RoPE: the cos/sin tables from (row, col) positions, and the rotation of q and k
// (bf16 storage, fp32 math) with v's copy, forward and backward, between the fused qkv rows and
// the separate q, k, v that attention reads.
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

// The attention inputs of one block out of the fused qkv projection, in one pass: qkv rows
// [N, 3, H, D] (qkv_patch_stride apart, >= 3 * H * D) -> q and k rotated into [N, H, Dqk] (Dqk =
// qk_head_stride, 0: D; columns [D, Dqk) of each head written as zeros: q and k zero-padded for
// cuDNN's attention, cudnn_sdpa.h) and v copied into [N, H, D]. cos, sin f32 [N, D/2]. Out of
// place: the outputs must not overlap qkv (nor, backward, d_qkv the inputs).
void vision_qkv_rope_forward_cuda(const __nv_bfloat16* qkv, int64_t qkv_patch_stride, __nv_bfloat16* q,
                                  __nv_bfloat16* k, __nv_bfloat16* v, const float* cos, const float* sin,
                                  int64_t num_patches, int64_t num_heads, int64_t head_dim, int64_t qk_head_stride,
                                  cudaStream_t stream);

// Its backward, in one pass: dq and dk [N, H, Dqk] (columns past D not read) rotated back by the
// opposite angle and dv [N, H, D] copied into the fused gradient rows d_qkv [N, 3, H, D]
// (d_qkv_patch_stride apart).
void vision_qkv_rope_backward_cuda(const __nv_bfloat16* dq, const __nv_bfloat16* dk, const __nv_bfloat16* dv,
                                   __nv_bfloat16* d_qkv, int64_t d_qkv_patch_stride, const float* cos,
                                   const float* sin, int64_t num_patches, int64_t num_heads, int64_t head_dim,
                                   int64_t qk_head_stride, cudaStream_t stream);

}  // namespace deltamoe
