// The hi/lo bf16 split of an fp32 tensor and the two-GEMM linear backward products built on it.
#include <algorithm>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/gemm/f32_operand_cuda.h"

namespace deltamoe {

namespace {

constexpr int kSplitThreads = 256;
constexpr int64_t kSplitMaxBlocks = 4096;

__global__ void split_hi_lo_kernel(const float* x, __nv_bfloat16* hi, __nv_bfloat16* lo, int64_t count) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kSplitThreads + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * kSplitThreads) {
    const float value = x[i];
    const __nv_bfloat16 high = __float2bfloat16(value);
    hi[i] = high;
    lo[i] = __float2bfloat16(value - __bfloat162float(high));  // exact: hi is x rounded at bit 8
  }
}

__global__ void add_bf16_to_f32_kernel(const __nv_bfloat16* src, float* dst, int64_t count) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kSplitThreads + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * kSplitThreads)
    dst[i] += __bfloat162float(src[i]);
}

unsigned elementwise_blocks(int64_t count) {
  return static_cast<unsigned>(std::min(kSplitMaxBlocks, (count + kSplitThreads - 1) / kSplitThreads));
}

}  // namespace

void split_f32_to_bf16_hi_lo_cuda(const float* x, __nv_bfloat16* hi, __nv_bfloat16* lo, int64_t count,
                                  cudaStream_t stream) {
  CHECK(count >= 0, "split_f32_to_bf16_hi_lo_cuda: count must not be negative, got ", count);
  if (count == 0) return;
  split_hi_lo_kernel<<<elementwise_blocks(count), kSplitThreads, 0, stream>>>(x, hi, lo, count);
  CUDA_CHECK_LAUNCH();
}

void add_bf16_to_f32_cuda(const __nv_bfloat16* src, float* dst, int64_t count, cudaStream_t stream) {
  CHECK(count >= 0, "add_bf16_to_f32_cuda: count must not be negative, got ", count);
  if (count == 0) return;
  add_bf16_to_f32_kernel<<<elementwise_blocks(count), kSplitThreads, 0, stream>>>(src, dst, count);
  CUDA_CHECK_LAUNCH();
}

void linear_backward_input_split_cuda(GemmContext& ctx, const __nv_bfloat16* dy_hi, const __nv_bfloat16* dy_lo,
                                      const __nv_bfloat16* weight, float* dx, bool accumulate, int64_t rows,
                                      int64_t in_features, int64_t out_features, cudaStream_t stream) {
  // dx [T, K] (+)= dy_hi [T, N] @ W [N, K], then += dy_lo @ W: both accumulate in fp32 into dx.
  linear_backward_input_f32_cuda(ctx, dy_hi, weight, dx, accumulate, rows, in_features, out_features, stream);
  linear_backward_input_f32_cuda(ctx, dy_lo, weight, dx, true, rows, in_features, out_features, stream);
}

void linear_backward_weight_split_cuda(GemmContext& ctx, const __nv_bfloat16* dy_hi, const __nv_bfloat16* dy_lo,
                                       const __nv_bfloat16* x, float* d_weight, int64_t rows, int64_t in_features,
                                       int64_t out_features, cudaStream_t stream) {
  linear_backward_weight_cuda(ctx, dy_hi, x, d_weight, rows, in_features, out_features, stream);
  linear_backward_weight_cuda(ctx, dy_lo, x, d_weight, rows, in_features, out_features, stream);
}

}  // namespace deltamoe
