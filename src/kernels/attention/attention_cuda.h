// CUDA causal GQA attention over packed sequences (spec: attention.h / attention_ref.cc): thin
// launchers over the shared packed-segment kernels in kernels/flash_attention (which explain the
// choice of our own kernel over cuDNN). bf16 q/k/v/out and gradients, fp32 lse and arithmetic.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/attention/attention.h"
#include "kernels/flash_attention/flash_attention_cuda.h"

namespace deltamoe {

// cu_seqlens is a DEVICE pointer (int32 [num_seqs + 1]) validated on the host beforehand.
inline FlashAttentionShape causal_attention_shape(const AttentionDims& dims, const int32_t* cu_seqlens,
                                                  int64_t num_seqs, float scale) {
  FlashAttentionShape shape;
  shape.num_tokens = dims.num_tokens;
  shape.num_q_heads = dims.num_q_heads;
  shape.num_kv_heads = dims.num_kv_heads;
  shape.head_dim = dims.head_dim;
  shape.cu_seqlens = cu_seqlens;
  shape.num_segments = num_seqs;
  shape.causal = true;
  shape.scale = scale;
  return shape;
}

// q [T, Hq, D], k and v [T, Hkv, D] -> out [T, Hq, D] and lse [T, Hq] (fp32), written.
inline void attention_forward_cuda(const AttentionDims& dims, const __nv_bfloat16* q, const __nv_bfloat16* k,
                                   const __nv_bfloat16* v, const int32_t* cu_seqlens, int64_t num_seqs, float scale,
                                   __nv_bfloat16* out, float* lse, cudaStream_t stream) {
  flash_attention_forward_cuda(causal_attention_shape(dims, cu_seqlens, num_seqs, scale), q, k, v, out, lse, stream);
}

inline size_t attention_backward_workspace_bytes(const AttentionDims& dims) {
  FlashAttentionShape shape;
  shape.num_tokens = dims.num_tokens;
  shape.num_q_heads = dims.num_q_heads;
  return flash_attention_backward_workspace_bytes(shape);
}

// d_out [T, Hq, D] -> dq [T, Hq, D], dk and dv [T, Hkv, D], written; out and lse from the forward.
inline void attention_backward_cuda(const AttentionDims& dims, const __nv_bfloat16* q, const __nv_bfloat16* k,
                                    const __nv_bfloat16* v, const __nv_bfloat16* out, const float* lse,
                                    const __nv_bfloat16* d_out, const int32_t* cu_seqlens, int64_t num_seqs,
                                    float scale, __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv,
                                    void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  flash_attention_backward_cuda(causal_attention_shape(dims, cu_seqlens, num_seqs, scale), q, k, v, out, lse, d_out,
                                dq, dk, dv, workspace, workspace_bytes, stream);
}

}  // namespace deltamoe
