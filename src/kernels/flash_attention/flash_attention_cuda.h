// CUDA softmax attention over packed segments, causal or not, with grouped-query heads: the one
// engine behind attention_cuda.h (text, causal GQA, D = 256) and bidirectional_attention_cuda.h
// (vision, per-image, D = 72). Specs: attention_ref.cc and bidirectional_attention_ref.cc.
//
// Why our own kernel and not cuDNN's fused SDPA: cuDNN 9.19 offers causal training only through
// the composite backend graph (~40 hand-built descriptors per direction, plan caching, and
// "no engine" until the graph matches exactly), and its
// d = 256 backward exists only on Hopper while we also build sm_80. A self-contained kernel
// gives any packing, any head dim <= 256, sm_80 and sm_90a, and a deterministic backward; the
// cuDNN graph can be added later behind the same launchers and checked against this path.
//
// FlashAttention-2 shaped: query tiles, online softmax in fp32, the log-sum-exp saved and the
// probabilities recomputed in the backward; the backward runs two passes without atomics: dQ (and
// delta = dO . O) per query tile, then dK/dV per key tile summed over the query heads of its KV
// head inside the block, so results are bitwise reproducible.
//
// Three kernel families, each owning a range of shapes (the dispatchers pick by shape and
// alignment; no switches):
//   wide  (flash_attention_*_wide.cu)  head dims in (128, 256], multiples of 8: the text model's
//         D = 256. ldmatrix(.trans) fragment loads, cp.async overlap of the next K/V (or Q/dO)
//         tile with the products, a dK/dV pass of 8 warps covering D = 256 in one pass.
//   mma   (flash_attention_*_mma.cu)   head dims up to 128, multiples of 8: the vision tower's
//         D = 72 (padded to 80). mma.sync bf16 with fp32 accumulation.
//   simt  (flash_attention_forward.cu, _backward.cu)  any head dim up to 256 and unaligned
//         tensors: fp32, eight lanes share a row and split the head dim.
// Not yet: wgmma on sm_90a.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace deltamoe {

constexpr int64_t kFlashAttentionMaxHeadDim = 256;
constexpr int64_t kFlashAttentionMmaMaxHeadDim = 128;  // wider heads take the wide kernels

// Sizes of one call. cu_seqlens is a DEVICE pointer, int32 [num_segments + 1], 0 = c[0] <= ...
// <= c[N] = num_tokens (the host validates it, e.g. with check_cu_seqlens; it is never read on
// the host). Query head h uses KV head h / (num_q_heads / num_kv_heads).
struct FlashAttentionShape {
  int64_t num_tokens = 0;    // T
  int64_t num_q_heads = 0;   // Hq
  int64_t num_kv_heads = 0;  // Hkv, divides Hq
  int64_t head_dim = 0;      // D, 1..256
  const int32_t* cu_seqlens = nullptr;
  int64_t num_segments = 0;  // N >= 1
  bool causal = true;        // causal within each segment, else every token sees its whole segment
  float scale = 0;           // usually D^-0.5
};

// q [T, Hq, D], k and v [T, Hkv, D] bf16 -> out [T, Hq, D] bf16 and lse [T, Hq] fp32, written.
void flash_attention_forward_cuda(const FlashAttentionShape& shape, const __nv_bfloat16* q, const __nv_bfloat16* k,
                                  const __nv_bfloat16* v, __nv_bfloat16* out, float* lse, cudaStream_t stream);

// The two forward paths behind flash_attention_forward_cuda, callable directly so that tests can
// check each: tensor cores (mma.sync) for head dims that are multiples of 8, 16-byte aligned q/k/v,
// and the fp32 SIMT kernel for any head dim. The dispatcher takes the first when it applies.
bool flash_attention_forward_mma_supported(const FlashAttentionShape& shape);
void flash_attention_forward_mma_cuda(const FlashAttentionShape& shape, const __nv_bfloat16* q,
                                      const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out, float* lse,
                                      cudaStream_t stream);
void flash_attention_forward_simt_cuda(const FlashAttentionShape& shape, const __nv_bfloat16* q,
                                       const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out,
                                       float* lse, cudaStream_t stream);

// Scratch of the backward: delta = rowsum(dO * O) in fp32, [T, Hq].
size_t flash_attention_backward_workspace_bytes(const FlashAttentionShape& shape);

// d_out [T, Hq, D] -> dq [T, Hq, D], dk and dv [T, Hkv, D], bf16, written (dK/dV summed over the
// query heads of each KV head). out and lse are the forward's.
void flash_attention_backward_cuda(const FlashAttentionShape& shape, const __nv_bfloat16* q, const __nv_bfloat16* k,
                                   const __nv_bfloat16* v, const __nv_bfloat16* out, const float* lse,
                                   const __nv_bfloat16* d_out, __nv_bfloat16* dq, __nv_bfloat16* dk,
                                   __nv_bfloat16* dv, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// The two backward paths behind flash_attention_backward_cuda (same arguments), callable
// directly for tests: tensor cores for D a multiple of 8 with 16-byte aligned q/k/v/d_out and
// 4-byte aligned gradients, and the fp32 SIMT kernels for any head dim.
bool flash_attention_backward_mma_supported(const FlashAttentionShape& shape);
void flash_attention_backward_mma_cuda(const FlashAttentionShape& shape, const __nv_bfloat16* q,
                                       const __nv_bfloat16* k, const __nv_bfloat16* v, const __nv_bfloat16* out,
                                       const float* lse, const __nv_bfloat16* d_out, __nv_bfloat16* dq,
                                       __nv_bfloat16* dk, __nv_bfloat16* dv, void* workspace, size_t workspace_bytes,
                                       cudaStream_t stream);
void flash_attention_backward_simt_cuda(const FlashAttentionShape& shape, const __nv_bfloat16* q,
                                        const __nv_bfloat16* k, const __nv_bfloat16* v, const __nv_bfloat16* out,
                                        const float* lse, const __nv_bfloat16* d_out, __nv_bfloat16* dq,
                                        __nv_bfloat16* dk, __nv_bfloat16* dv, void* workspace, size_t workspace_bytes,
                                        cudaStream_t stream);

// The wide paths (flash_attention_forward_wide.cu, flash_attention_backward_wide.cu) for head
// dims that are multiples of 8 in (128, 256], same arguments and alignment needs as the mma ones
// (out also 16-byte aligned for the backward).
bool flash_attention_wide_supported(const FlashAttentionShape& shape);
void flash_attention_forward_wide_cuda(const FlashAttentionShape& shape, const __nv_bfloat16* q,
                                       const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out,
                                       float* lse, cudaStream_t stream);
void flash_attention_backward_wide_cuda(const FlashAttentionShape& shape, const __nv_bfloat16* q,
                                        const __nv_bfloat16* k, const __nv_bfloat16* v, const __nv_bfloat16* out,
                                        const float* lse, const __nv_bfloat16* d_out, __nv_bfloat16* dq,
                                        __nv_bfloat16* dk, __nv_bfloat16* dv, void* workspace, size_t workspace_bytes,
                                        cudaStream_t stream);

// Throws with a message naming `where` unless the sizes are usable (used by both launchers).
void check_flash_attention_shape(const FlashAttentionShape& shape, const char* where);

}  // namespace deltamoe
