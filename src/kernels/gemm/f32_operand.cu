// The hi/lo bf16 split of fp32 tensors (plain and as column blocks of a stacked GEMM operand) and
// the pair add that sums two bf16 input gradients into an fp32 one.
#include <algorithm>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/gemm/f32_operand_cuda.h"

namespace deltamoe {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;

__device__ __forceinline__ void split_value(float value, __nv_bfloat16* hi, __nv_bfloat16* lo) {
  const __nv_bfloat16 high = __float2bfloat16(value);
  *hi = high;
  *lo = __float2bfloat16(value - __bfloat162float(high));  // exact: hi is x rounded at bit 8
}

__global__ void split_hi_lo_kernel(const float* x, __nv_bfloat16* hi, __nv_bfloat16* lo, int64_t count) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    split_value(x[i], hi + i, lo + i);
}

__global__ void pack_hi_lo_kernel(const float* x, int64_t rows, int64_t cols, __nv_bfloat16* packed, int64_t ld,
                                  int64_t hi_col, int64_t lo_col, int64_t hi2_col) {
  const int64_t count = rows * cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t r = i / cols, c = i - r * cols;
    __nv_bfloat16* row = packed + r * ld;
    split_value(x[i], row + hi_col + c, row + lo_col + c);
    if (hi2_col >= 0) row[hi2_col + c] = row[hi_col + c];
  }
}

__global__ void add_bf16_pair_kernel(const __nv_bfloat16* a, const __nv_bfloat16* b, float* dst, int64_t count) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    dst[i] = (dst[i] + __bfloat162float(a[i])) + __bfloat162float(b[i]);
}

unsigned elementwise_blocks(int64_t count) {
  return static_cast<unsigned>(std::min(kMaxBlocks, (count + kThreads - 1) / kThreads));
}

}  // namespace

void split_f32_to_bf16_hi_lo_cuda(const float* x, __nv_bfloat16* hi, __nv_bfloat16* lo, int64_t count,
                                  cudaStream_t stream) {
  CHECK(count >= 0, "split_f32_to_bf16_hi_lo_cuda: count must not be negative, got ", count);
  if (count == 0) return;
  split_hi_lo_kernel<<<elementwise_blocks(count), kThreads, 0, stream>>>(x, hi, lo, count);
  CUDA_CHECK_LAUNCH();
}

void pack_f32_hi_lo_cuda(const float* x, int64_t rows, int64_t cols, __nv_bfloat16* packed, int64_t ld,
                         int64_t hi_col, int64_t lo_col, int64_t hi2_col, cudaStream_t stream) {
  const char* where = "pack_f32_hi_lo_cuda";
  CHECK(rows >= 0 && cols >= 1, where, ": bad sizes rows=", rows, " cols=", cols);
  const auto fits = [&](int64_t col) { return col >= 0 && col + cols <= ld; };
  const auto apart = [&](int64_t p, int64_t q) { return p + cols <= q || q + cols <= p; };
  CHECK(fits(hi_col) && fits(lo_col) && (hi2_col < 0 || fits(hi2_col)), where, ": the blocks at columns ", hi_col,
        ", ", lo_col, ", ", hi2_col, " of width ", cols, " do not fit rows of ", ld);
  CHECK(apart(hi_col, lo_col) && (hi2_col < 0 || (apart(hi_col, hi2_col) && apart(lo_col, hi2_col))), where,
        ": the blocks at columns ", hi_col, ", ", lo_col, ", ", hi2_col, " of width ", cols, " overlap");
  if (rows == 0) return;
  pack_hi_lo_kernel<<<elementwise_blocks(rows * cols), kThreads, 0, stream>>>(x, rows, cols, packed, ld, hi_col,
                                                                              lo_col, hi2_col);
  CUDA_CHECK_LAUNCH();
}

void add_bf16_pair_to_f32_cuda(const __nv_bfloat16* a, const __nv_bfloat16* b, float* dst, int64_t count,
                               cudaStream_t stream) {
  CHECK(count >= 0, "add_bf16_pair_to_f32_cuda: count must not be negative, got ", count);
  if (count == 0) return;
  add_bf16_pair_kernel<<<elementwise_blocks(count), kThreads, 0, stream>>>(a, b, dst, count);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
