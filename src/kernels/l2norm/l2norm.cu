// CUDA kernels of the l2 normalisation over the last dim: one warp per row with the row in
// registers (kernels/common/warp_row.cuh: read once, vector accesses for the 128-wide heads), fp32
// reductions; rows visited by a grid-stride loop over warps.
#include <algorithm>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common/warp_row.cuh"
#include "kernels/l2norm/l2norm.h"
#include "kernels/l2norm/l2norm_cuda.h"

namespace deltamoe {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kMaxBlocks = 2048;
constexpr int kMaxDim = 1024;

__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <int PER>
__device__ inline float inverse_norm(const float (&x)[PER]) {
  float sum_sq = 0.0f;
#pragma unroll
  for (int i = 0; i < PER; ++i) sum_sq += x[i] * x[i];
  return 1.0f / sqrtf(warp_sum(sum_sq) + static_cast<float>(kL2NormEps));
}

template <int PER, bool FULL>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    l2norm_forward_kernel(const __nv_bfloat16* x, int64_t num_rows, int dim, __nv_bfloat16* y) {
  const int lane = threadIdx.x % 32;
  const int64_t row_step = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; row < num_rows;
       row += row_step) {
    float v[PER];
    warp_row_load<PER, FULL>(x + row * dim, dim, lane, v);
    const float rstd = inverse_norm<PER>(v);
#pragma unroll
    for (int i = 0; i < PER; ++i) v[i] *= rstd;
    warp_row_store<PER, FULL>(y + row * dim, dim, lane, v);
  }
}

// dx = r (dy - (dy . y) y) with y = x r.
template <int PER, bool FULL>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    l2norm_backward_kernel(const __nv_bfloat16* x, const __nv_bfloat16* dy, int64_t num_rows, int dim,
                           __nv_bfloat16* dx) {
  const int lane = threadIdx.x % 32;
  const int64_t row_step = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; row < num_rows;
       row += row_step) {
    float xv[PER], g[PER];
    warp_row_load<PER, FULL>(x + row * dim, dim, lane, xv);
    warp_row_load<PER, FULL>(dy + row * dim, dim, lane, g);
    const float rstd = inverse_norm<PER>(xv);
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      xv[i] *= rstd;
      dot += g[i] * xv[i];
    }
    dot = warp_sum(dot);
#pragma unroll
    for (int i = 0; i < PER; ++i) g[i] = rstd * (g[i] - dot * xv[i]);
    warp_row_store<PER, FULL>(dx + row * dim, dim, lane, g);
  }
}

void check_l2norm_launch(int64_t num_rows, int dim) {
  CHECK(num_rows >= 0, "l2norm_cuda: num_rows must not be negative, got ", num_rows);
  CHECK(dim > 0 && dim <= kMaxDim, "l2norm_cuda: dim must be in [1, ", kMaxDim, "] (a row is held by one warp), got ",
        dim);
}

unsigned row_blocks(int64_t num_rows) {
  return static_cast<unsigned>(std::min<int64_t>(kMaxBlocks, (num_rows + kWarpsPerBlock - 1) / kWarpsPerBlock));
}

}  // namespace

void l2norm_forward_cuda(const __nv_bfloat16* x, int64_t num_rows, int dim, __nv_bfloat16* y,
                         cudaStream_t stream) {
  check_l2norm_launch(num_rows, dim);
  if (num_rows == 0) return;
  with_warp_row_width(dim, warp_row_aligned(x) && warp_row_aligned(y), [&]<int PER, bool FULL>() {
    l2norm_forward_kernel<PER, FULL><<<row_blocks(num_rows), kWarpsPerBlock * 32, 0, stream>>>(x, num_rows, dim, y);
  });
  CUDA_CHECK_LAUNCH();
}

void l2norm_backward_cuda(const __nv_bfloat16* x, const __nv_bfloat16* dy, int64_t num_rows,
                          int dim, __nv_bfloat16* dx, cudaStream_t stream) {
  check_l2norm_launch(num_rows, dim);
  if (num_rows == 0) return;
  with_warp_row_width(dim, warp_row_aligned(x) && warp_row_aligned(dy) && warp_row_aligned(dx),
                      [&]<int PER, bool FULL>() {
                        l2norm_backward_kernel<PER, FULL><<<row_blocks(num_rows), kWarpsPerBlock * 32, 0, stream>>>(
                            x, dy, num_rows, dim, dx);
                      });
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
