// CUDA non-causal attention within packed segments (the vision tower: one segment per image;
// spec: bidirectional_attention.h / _ref.cc): launchers over the shared kernels in
// kernels/flash_attention. bf16 q/k/v/out and gradients, fp32 lse and arithmetic.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/flash_attention/flash_attention_cuda.h"

namespace deltamoe {

// cu_seqlens is a DEVICE pointer (int32 [num_segments + 1]) validated on the host beforehand.
inline FlashAttentionShape bidirectional_attention_shape(const int32_t* cu_seqlens, int64_t num_segments,
                                                         int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                                                         float scale) {
  FlashAttentionShape shape;
  shape.num_tokens = num_tokens;
  shape.num_q_heads = num_heads;
  shape.num_kv_heads = num_heads;
  shape.head_dim = head_dim;
  shape.cu_seqlens = cu_seqlens;
  shape.num_segments = num_segments;
  shape.causal = false;
  shape.scale = scale;
  return shape;
}

// q, k, v [T, H, D] -> out [T, H, D] and lse [T, H] (fp32), written.
inline void bidirectional_attention_forward_cuda(const __nv_bfloat16* q, const __nv_bfloat16* k,
                                                 const __nv_bfloat16* v, const int32_t* cu_seqlens,
                                                 int64_t num_segments, __nv_bfloat16* out, float* lse,
                                                 int64_t num_tokens, int64_t num_heads, int64_t head_dim, float scale,
                                                 cudaStream_t stream) {
  flash_attention_forward_cuda(
      bidirectional_attention_shape(cu_seqlens, num_segments, num_tokens, num_heads, head_dim, scale), q, k, v, out,
      lse, stream);
}

inline size_t bidirectional_attention_backward_workspace_bytes(int64_t num_tokens, int64_t num_heads) {
  FlashAttentionShape shape;
  shape.num_tokens = num_tokens;
  shape.num_q_heads = num_heads;
  return flash_attention_backward_workspace_bytes(shape);
}

// d_out [T, H, D] -> dq, dk, dv [T, H, D], written; out and lse from the forward.
inline void bidirectional_attention_backward_cuda(const __nv_bfloat16* q, const __nv_bfloat16* k,
                                                  const __nv_bfloat16* v, const __nv_bfloat16* out, const float* lse,
                                                  const __nv_bfloat16* d_out, const int32_t* cu_seqlens,
                                                  int64_t num_segments, __nv_bfloat16* dq, __nv_bfloat16* dk,
                                                  __nv_bfloat16* dv, int64_t num_tokens, int64_t num_heads,
                                                  int64_t head_dim, float scale, void* workspace,
                                                  size_t workspace_bytes, cudaStream_t stream) {
  flash_attention_backward_cuda(
      bidirectional_attention_shape(cu_seqlens, num_segments, num_tokens, num_heads, head_dim, scale), q, k, v, out,
      lse, d_out, dq, dk, dv, workspace, workspace_bytes, stream);
}

}  // namespace deltamoe
