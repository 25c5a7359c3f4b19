// CUDA bias add: a grid-stride element-wise forward and a two-step deterministic column sum for
// the backward (thread per column within a row chunk, then chunks reduced in order).
#include <algorithm>

#include "core/cuda_check.h"
#include "kernels/bias_add/bias_add_cuda.h"
#include "kernels/gemm/bf16_vector.cuh"

namespace deltamoe {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMinRowsPerChunk = 64;
constexpr int64_t kMaxChunks = 256;

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

// partial[chunk, c] = sum of dy[r, c] over the chunk's rows; neighbouring threads read
// neighbouring columns of one row (coalesced).
template <typename TDy>
__global__ void column_sum_partial_kernel(const TDy* dy, float* partial, int64_t rows, int64_t features,
                                          int64_t rows_per_chunk) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= features) return;
  const int64_t chunk = blockIdx.y;
  const int64_t row_end = std::min(rows, (chunk + 1) * rows_per_chunk);
  float acc = 0;
  for (int64_t r = chunk * rows_per_chunk; r < row_end; ++r) acc += to_f32(dy[r * features + c]);
  partial[chunk * features + c] = acc;
}

__global__ void column_partials_reduce_kernel(const float* partial, int64_t num_chunks, int64_t features,
                                              float* d_bias) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= features) return;
  float sum = 0;
  for (int64_t chunk = 0; chunk < num_chunks; ++chunk) sum += partial[chunk * features + c];
  d_bias[c] += sum;
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
  const int64_t chunks = column_sum_num_chunks(rows);
  float* partial = static_cast<float*>(workspace);
  const unsigned column_blocks = static_cast<unsigned>((features + kThreads - 1) / kThreads);
  column_sum_partial_kernel<TDy><<<dim3(column_blocks, static_cast<unsigned>(chunks)), kThreads, 0, stream>>>(
      dy, partial, rows, features, column_sum_rows_per_chunk(rows));
  CUDA_CHECK_LAUNCH();
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

int64_t column_sum_num_chunks(int64_t rows) {
  return std::max<int64_t>(1, std::min(kMaxChunks, (rows + kMinRowsPerChunk - 1) / kMinRowsPerChunk));
}

int64_t column_sum_rows_per_chunk(int64_t rows) {
  const int64_t chunks = column_sum_num_chunks(rows);
  return std::max<int64_t>(1, (rows + chunks - 1) / chunks);
}

size_t bias_add_backward_workspace_bytes(int64_t rows, int64_t features) {
  return static_cast<size_t>(column_sum_num_chunks(rows)) * static_cast<size_t>(std::max<int64_t>(features, 0)) *
         sizeof(float);
}

void column_partials_reduce_cuda(const float* partial, int64_t num_chunks, int64_t features, float* d_bias,
                                 cudaStream_t stream) {
  CHECK(num_chunks > 0 && features > 0, "column_partials_reduce_cuda: bad size chunks ", num_chunks, ", features ",
        features);
  const unsigned blocks = static_cast<unsigned>((features + kThreads - 1) / kThreads);
  column_partials_reduce_kernel<<<blocks, kThreads, 0, stream>>>(partial, num_chunks, features, d_bias);
  CUDA_CHECK_LAUNCH();
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
