// CUDA kernels of the l2 normalisation over the last dim: one warp per row, fp32 reductions.
#include "core/cuda_check.h"
#include "kernels/l2norm/l2norm.h"
#include "kernels/l2norm/l2norm_cuda.h"

namespace deltamoe {
namespace {

constexpr int kWarpsPerBlock = 8;

__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ inline float row_inverse_norm(const __nv_bfloat16* row, int dim, int lane) {
  float sum_sq = 0.0f;
  for (int d = lane; d < dim; d += 32) {
    const float v = __bfloat162float(row[d]);
    sum_sq += v * v;
  }
  return 1.0f / sqrtf(warp_sum(sum_sq) + static_cast<float>(kL2NormEps));
}

__global__ void l2norm_forward_kernel(const __nv_bfloat16* x, int64_t num_rows, int dim,
                                      __nv_bfloat16* y) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= num_rows) return;
  const int lane = threadIdx.x % 32;
  const __nv_bfloat16* x_row = x + row * dim;
  const float rstd = row_inverse_norm(x_row, dim, lane);
  for (int d = lane; d < dim; d += 32) {
    y[row * dim + d] = __float2bfloat16(__bfloat162float(x_row[d]) * rstd);
  }
}

// dx = r (dy - (dy . y) y) with y = x r.
__global__ void l2norm_backward_kernel(const __nv_bfloat16* x, const __nv_bfloat16* dy,
                                       int64_t num_rows, int dim, __nv_bfloat16* dx) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= num_rows) return;
  const int lane = threadIdx.x % 32;
  const __nv_bfloat16* x_row = x + row * dim;
  const __nv_bfloat16* dy_row = dy + row * dim;
  const float rstd = row_inverse_norm(x_row, dim, lane);
  float dot = 0.0f;
  for (int d = lane; d < dim; d += 32) {
    dot += __bfloat162float(dy_row[d]) * __bfloat162float(x_row[d]) * rstd;
  }
  dot = warp_sum(dot);
  for (int d = lane; d < dim; d += 32) {
    const float yv = __bfloat162float(x_row[d]) * rstd;
    dx[row * dim + d] = __float2bfloat16(rstd * (__bfloat162float(dy_row[d]) - dot * yv));
  }
}

void check_l2norm_launch(int64_t num_rows, int dim) {
  CHECK(num_rows >= 0, "l2norm_cuda: num_rows must not be negative, got ", num_rows);
  CHECK(dim > 0, "l2norm_cuda: dim must be positive, got ", dim);
  CHECK((num_rows + kWarpsPerBlock - 1) / kWarpsPerBlock < (int64_t{1} << 31),
        "l2norm_cuda: too many rows for one launch: ", num_rows);
}

unsigned row_blocks(int64_t num_rows) {
  return static_cast<unsigned>((num_rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

}  // namespace

void l2norm_forward_cuda(const __nv_bfloat16* x, int64_t num_rows, int dim, __nv_bfloat16* y,
                         cudaStream_t stream) {
  check_l2norm_launch(num_rows, dim);
  if (num_rows == 0) return;
  l2norm_forward_kernel<<<row_blocks(num_rows), kWarpsPerBlock * 32, 0, stream>>>(x, num_rows, dim,
                                                                                  y);
  CUDA_CHECK_LAUNCH();
}

void l2norm_backward_cuda(const __nv_bfloat16* x, const __nv_bfloat16* dy, int64_t num_rows,
                          int dim, __nv_bfloat16* dx, cudaStream_t stream) {
  check_l2norm_launch(num_rows, dim);
  if (num_rows == 0) return;
  l2norm_backward_kernel<<<row_blocks(num_rows), kWarpsPerBlock * 32, 0, stream>>>(
      x, dy, num_rows, dim, dx);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
