// Column sums over a block of kColumnSumThreads x kColumnSumRows threads (threadIdx.x a column
// group of kVec consecutive columns, threadIdx.y a thread row that took every kColumnSumRows-th
// row): the thread rows' partial sums meet in shared memory and are added in thread-row order, so
// the result has the same bits on every run (on one kind of GPU: the chunk count follows its SM
// count). Also the row chunks such a kernel's grid takes and its launch. Used by the bias gradients
// (bias_add, gelu).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda_check.h"

namespace deltamoe {

constexpr int kColumnSumThreads = 32;  // threadIdx.x: column groups of a block
constexpr int kColumnSumRows = 8;      // threadIdx.y: thread rows of a block

// out[k] = (kAdd: out[k] +) the sum over the block's thread rows of acc[k], for k < kVec, written by
// thread row 0 where `in_range` (the column group lies inside the matrix). Every thread of the block
// calls it.
template <int kVec, bool kAdd = false>
__device__ __forceinline__ void store_block_column_sums(const float (&acc)[kVec], bool in_range, float* out) {
  __shared__ float sums[kColumnSumRows][kColumnSumThreads * kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) sums[threadIdx.y][threadIdx.x * kVec + k] = acc[k];
  __syncthreads();
  if (threadIdx.y != 0 || !in_range) return;
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    float total = 0;
    for (int y = 0; y < kColumnSumRows; ++y) total += sums[y][threadIdx.x * kVec + k];
    out[k] = kAdd ? out[k] + total : total;
  }
}

// Row chunks of a column reduction over `rows` rows (each chunk writes one fp32 partial row): at
// most column_sum_num_chunks(rows) (what a workspace is sized for), and no more than one wave of
// `column_blocks` x chunks blocks where `resident_blocks` are resident at once (SMs x the kernel's
// blocks per SM; 0: no limit). A wave and a part leaves the GPU part idle in the last: the 6,272 x
// 4,304 GELU backward's 17 x 98 blocks were 1.58 waves of 1,056 on an H100.
constexpr int64_t kColumnSumMinRowsPerChunk = 64;
constexpr int64_t kColumnSumMaxChunks = 256;

inline int64_t column_sum_num_chunks(int64_t rows) {
  return std::max<int64_t>(1, std::min(kColumnSumMaxChunks,
                                       (rows + kColumnSumMinRowsPerChunk - 1) / kColumnSumMinRowsPerChunk));
}

inline int64_t column_sum_chunks(int64_t rows, int64_t column_blocks, int64_t resident_blocks) {
  const int64_t most = column_sum_num_chunks(rows);
  if (resident_blocks <= 0 || column_blocks <= 0) return most;
  return std::max<int64_t>(1, std::min(most, resident_blocks / column_blocks));
}

inline int64_t column_sum_rows_per_chunk(int64_t rows, int64_t chunks) {
  return std::max<int64_t>(1, (rows + chunks - 1) / std::max<int64_t>(1, chunks));
}

// The blocks of kColumnSumThreads x kColumnSumRows threads of `kernel` resident at once on the
// current device (its SMs x its blocks per SM; host-side queries, no sync; the per-SM count is
// taken once per kernel), for column_sum_chunks.
template <typename Kernel>
int64_t resident_column_sum_blocks(Kernel kernel) {
  static const int blocks_per_sm = [&] {
    int blocks = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kColumnSumThreads * kColumnSumRows, 0));
    return blocks;
  }();
  int device = 0, sms = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return static_cast<int64_t>(sms) * blocks_per_sm;
}

// Launches a column-sum kernel of `vec` columns a thread whose parameters are `args` followed by
// (rows, features, rows per chunk) on column blocks x row chunks (column_sum_chunks, one wave) and
// returns the chunk count: the partial rows it writes. rows > 0.
template <typename... Params, typename... Args>
int64_t launch_column_sums(void (*kernel)(Params...), int vec, int64_t rows, int64_t features, cudaStream_t stream,
                           Args... args) {
  const int64_t column_blocks = (features + vec * kColumnSumThreads - 1) / (vec * kColumnSumThreads);
  const int64_t chunks = column_sum_chunks(rows, column_blocks, resident_column_sum_blocks(kernel));
  const dim3 grid(static_cast<unsigned>(column_blocks), static_cast<unsigned>(chunks));
  kernel<<<grid, dim3(kColumnSumThreads, kColumnSumRows), 0, stream>>>(args..., rows, features,
                                                                         column_sum_rows_per_chunk(rows, chunks));
  CUDA_CHECK_LAUNCH();
  return chunks;
}

}  // namespace deltamoe
