// Column sums over a block of kColumnThreads x kRowThreads threads (threadIdx.x a column group of
// kVec consecutive columns, threadIdx.y a thread row that took every kRowThreads-th row): the
// thread rows' partial sums meet in shared memory and are added in thread-row order, so the result
// has the same bits on every run (on one kind of GPU: the chunk count follows its SM count). Used by
// the bias gradients (bias_add, gelu).
#pragma once

#include <cuda_runtime.h>

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

}  // namespace deltamoe
