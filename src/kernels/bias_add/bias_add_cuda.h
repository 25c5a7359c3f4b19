// CUDA bias add (bf16 rows += bf16 bias) and its backward (fp32 column sums of dy, deterministic:
// per-chunk partials then a fixed-order reduction). The column-partial machinery is shared with
// gelu's fused bias backward. Legend: T rows, N features.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace deltamoe {

// y [T, N] bf16 updated: y = bf16(y + bias), fp32 add.
void bias_add_forward_cuda(const __nv_bfloat16* bias, __nv_bfloat16* y, int64_t rows, int64_t features,
                           cudaStream_t stream);

// Bytes of scratch the backward needs: column_sum_num_chunks(rows) (block_column_sums.cuh) *
// features fp32 partials.
size_t bias_add_backward_workspace_bytes(int64_t rows, int64_t features);

// dy [T, N] bf16 or f32 (an fp32 residual-stream gradient) -> d_bias [N] f32 added to (column
// sums, fp32, same result every run).
void bias_add_backward_cuda(const __nv_bfloat16* dy, float* d_bias, int64_t rows, int64_t features, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream);
void bias_add_backward_cuda(const float* dy, float* d_bias, int64_t rows, int64_t features, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream);

// d_bias[c] += sum over chunks of partial[chunk, c], chunks in order (the second step above).
void column_partials_reduce_cuda(const float* partial, int64_t num_chunks, int64_t features, float* d_bias,
                                 cudaStream_t stream);

// Several sums at once (LayerNorm's parameter and stream-bias gradients): partial holds
// kMaxArrays stacked [num_chunks, features] arrays; out[k] (null: not wanted) += array k's column
// sums, chunks in order. One launch.
struct ColumnPartialsOutputs {
  static constexpr int kMaxArrays = 4;
  float* out[kMaxArrays] = {};
};
void column_partials_reduce_cuda(const float* partial, int64_t num_chunks, int64_t features,
                                 const ColumnPartialsOutputs& outs, cudaStream_t stream);

}  // namespace deltamoe
