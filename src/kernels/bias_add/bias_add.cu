// CUDA bias add: a grid-stride element-wise forward and a two-step deterministic column sum for
// the backward (per row chunk, then the chunks reduced), each summing in a fixed order.
#include <algorithm>

#include "core/cuda_check.h"
#include "kernels/common/block_column_sums.cuh"
#include "kernels/bias_add/bias_add_cuda.h"
#include "kernels/gemm/bf16_vector.cuh"

namespace deltamoe {
namespace {

constexpr int kThreads = 256;

template <int kVec>
__global__ void bias_add_forward_kernel(const __nv_bfloat16* bias, __nv_bfloat16* y, int64_t rows,
                                        int64_t features) {
  const int64_t vectors_per_row = features / kVec;
  const int64_t total = rows * vectors_per_row;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < total;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = (v % vectors_per_row) * kVec;
    const int64_t offset = (v / vectors_per_row) * features + c;
    float out[kVec], b[kVec];
    load_bf16_as_f32<kVec>(y + offset, out);
    load_bf16_as_f32<kVec>(bias + c, b);
#pragma unroll
    for (int i = 0; i < kVec; ++i) out[i] += b[i];
    store_f32_as_bf16<kVec>(y + offset, out);
  }
}

// The column sums run on blocks of kColumnSumThreads x kColumnSumRows threads
// (block_column_sums.cuh): a block covers kColumnSumThreads * kVec columns (kVec consecutive ones per
// thread, 16-byte loads for kVec = 8, so a warp reads whole row segments) and its thread rows take
// every kColumnSumRows-th row.
//
// partial[chunk, c] = sum of dy[r, c] over the chunk's rows.
template <typename TDy, int kVec>
__global__ void column_sum_partial_kernel(const TDy* dy, float* partial, int64_t rows, int64_t features,
                                          int64_t rows_per_chunk) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kColumnSumThreads + threadIdx.x) * kVec;
  const int64_t chunk = blockIdx.y;
  const int64_t row_end = std::min(rows, (chunk + 1) * rows_per_chunk);
  float acc[kVec] = {};
  if (c < features) {
    for (int64_t r = chunk * rows_per_chunk + threadIdx.y; r < row_end; r += kColumnSumRows) {
      float v[kVec];
      load_as_f32<kVec>(dy + r * features + c, v);
#pragma unroll
      for (int k = 0; k < kVec; ++k) acc[k] += v[k];
    }
  }
  store_block_column_sums<kVec>(acc, c < features, partial + chunk * features + c);
}

// outs.out[k][c] += the sum over chunks of partial[k][chunk, c] (blockIdx.y = k; a null output's
// blocks leave at once).
__global__ void column_partials_reduce_kernel(const float* partial, int64_t num_chunks, int64_t features,
                                              ColumnPartialsOutputs outs) {
  float* out = outs.out[blockIdx.y];
  if (out == nullptr) return;
  partial += static_cast<int64_t>(blockIdx.y) * num_chunks * features;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColumnSumThreads + threadIdx.x;
  float acc[1] = {0.0f};
  if (c < features)
    for (int64_t chunk = threadIdx.y; chunk < num_chunks; chunk += kColumnSumRows) acc[0] += partial[chunk * features + c];
  store_block_column_sums<1, true>(acc, c < features, out + c);
}

unsigned grid_stride_blocks(int64_t work) {
  // Enough blocks to fill an H200 several times over; the loop covers the rest.
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, 132 * 16)));
}

template <typename TDy>
void launch_bias_backward(const TDy* dy, float* d_bias, int64_t rows, int64_t features, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream) {
  CHECK(rows >= 0 && features > 0, "bias_add_backward_cuda: bad size rows ", rows, ", features ", features);
  CHECK(d_bias != nullptr, "bias_add_backward_cuda: null d_bias");
  CHECK(workspace_bytes >= bias_add_backward_workspace_bytes(rows, features), "bias_add_backward_cuda: workspace of ",
        workspace_bytes, " bytes, needs ", bias_add_backward_workspace_bytes(rows, features));
  if (rows == 0) return;
  float* partial = static_cast<float*>(workspace);
  const int64_t chunks =
      can_use_vec8(features, dy)
          ? launch_column_sums(column_sum_partial_kernel<TDy, 8>, 8, rows, features, stream, dy, partial)
          : launch_column_sums(column_sum_partial_kernel<TDy, 1>, 1, rows, features, stream, dy, partial);
  column_partials_reduce_cuda(partial, chunks, features, d_bias, stream);
}

}  // namespace

void bias_add_forward_cuda(const __nv_bfloat16* bias, __nv_bfloat16* y, int64_t rows, int64_t features,
                           cudaStream_t stream) {
  CHECK(rows >= 0 && features > 0, "bias_add_forward_cuda: bad size rows ", rows, ", features ", features);
  CHECK(bias != nullptr && (y != nullptr || rows == 0), "bias_add_forward_cuda: null bias or output");
  if (rows == 0) return;
  if (can_use_vec8(features, bias, y)) {
    bias_add_forward_kernel<8><<<grid_stride_blocks(rows * features / 8), kThreads, 0, stream>>>(bias, y, rows,
                                                                                                 features);
  } else {
    bias_add_forward_kernel<1><<<grid_stride_blocks(rows * features), kThreads, 0, stream>>>(bias, y, rows, features);
  }
  CUDA_CHECK_LAUNCH();
}

size_t bias_add_backward_workspace_bytes(int64_t rows, int64_t features) {
  return static_cast<size_t>(column_sum_num_chunks(rows)) * static_cast<size_t>(std::max<int64_t>(features, 0)) *
         sizeof(float);
}

void column_partials_reduce_cuda(const float* partial, int64_t num_chunks, int64_t features,
                                 const ColumnPartialsOutputs& outs, cudaStream_t stream) {
  CHECK(num_chunks > 0 && features > 0, "column_partials_reduce_cuda: bad size chunks ", num_chunks, ", features ",
        features);
  int arrays = 0;
  for (int k = 0; k < ColumnPartialsOutputs::kMaxArrays; ++k)
    if (outs.out[k] != nullptr) arrays = k + 1;
  if (arrays == 0) return;
  const dim3 grid(static_cast<unsigned>((features + kColumnSumThreads - 1) / kColumnSumThreads),
                  static_cast<unsigned>(arrays));
  column_partials_reduce_kernel<<<grid, dim3(kColumnSumThreads, kColumnSumRows), 0, stream>>>(partial, num_chunks,
                                                                                              features, outs);
  CUDA_CHECK_LAUNCH();
}

void column_partials_reduce_cuda(const float* partial, int64_t num_chunks, int64_t features, float* d_bias,
                                 cudaStream_t stream) {
  ColumnPartialsOutputs outs;
  outs.out[0] = d_bias;
  column_partials_reduce_cuda(partial, num_chunks, features, outs, stream);
}

void bias_add_backward_cuda(const __nv_bfloat16* dy, float* d_bias, int64_t rows, int64_t features, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream) {
  launch_bias_backward(dy, d_bias, rows, features, workspace, workspace_bytes, stream);
}

void bias_add_backward_cuda(const float* dy, float* d_bias, int64_t rows, int64_t features, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream) {
  launch_bias_backward(dy, d_bias, rows, features, workspace, workspace_bytes, stream);
}

}  // namespace deltamoe
