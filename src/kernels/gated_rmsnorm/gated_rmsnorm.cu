// CUDA kernels of the gated RMSNorm: one warp per row, each lane holding PER = ceil(D / 32)
// adjacent elements of the row in registers (read once, as 4- to 16-byte accesses when D = 32 PER),
// fp32 reductions. The backward sums each lane's weight-gradient terms in registers over its warp's
// rows, then per block in warp order into a workspace, and over the blocks in a fixed tree: the
// same bits on every run.
#include <algorithm>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common/warp_row.cuh"
#include "kernels/gated_rmsnorm/gated_rmsnorm_cuda.h"

namespace deltamoe {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kMaxBlocks = 1024;

__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
__device__ inline float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

template <int PER>
__device__ inline void load_weight(const float* weight, int dim, int lane, float (&w)[PER]) {
#pragma unroll
  for (int i = 0; i < PER; ++i) w[i] = lane * PER + i < dim ? weight[lane * PER + i] : 0.0f;
}

template <int PER>
__device__ inline float inverse_rms(const float (&o)[PER], int dim, float eps) {
  float sum_sq = 0.0f;
#pragma unroll
  for (int i = 0; i < PER; ++i) sum_sq += o[i] * o[i];
  return 1.0f / sqrtf(warp_sum(sum_sq) / static_cast<float>(dim) + eps);
}

// Rows visited by a grid-stride loop over warps.
template <int PER, bool FULL>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    gated_rmsnorm_forward_kernel(const __nv_bfloat16* o, const __nv_bfloat16* z, const float* weight,
                                 int64_t num_rows, int dim, float eps, __nv_bfloat16* y) {
  const int lane = threadIdx.x % 32;
  float w[PER];
  load_weight<PER>(weight, dim, lane, w);
  const int64_t row_step = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; row < num_rows;
       row += row_step) {
    const int64_t base = row * dim;
    float ov[PER], zv[PER];
    warp_row_load<PER, FULL>(o + base, dim, lane, ov);
    warp_row_load<PER, FULL>(z + base, dim, lane, zv);
    const float rstd = inverse_rms<PER>(ov, dim, eps);
#pragma unroll
    for (int i = 0; i < PER; ++i) ov[i] = ov[i] * rstd * w[i] * (zv[i] * sigmoid_f(zv[i]));
    warp_row_store<PER, FULL>(y + base, dim, lane, ov);
  }
}

// u = dL/dn with n = o rstd: d_o = rstd (u - mean(u . n) n), dz = dy n w silu'(z), dweight += dy silu(z) n.
template <int PER, bool FULL>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    gated_rmsnorm_backward_kernel(const __nv_bfloat16* o, const __nv_bfloat16* z, const float* weight,
                                  const __nv_bfloat16* dy, int64_t num_rows, int dim, float eps,
                                  __nv_bfloat16* d_o, __nv_bfloat16* dz, float* block_dweight) {
  __shared__ float s_dweight[kWarpsPerBlock][32 * PER];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float w[PER], dw[PER];
  load_weight<PER>(weight, dim, lane, w);
#pragma unroll
  for (int i = 0; i < PER; ++i) dw[i] = 0.0f;
  const int64_t row_step = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp; row < num_rows; row += row_step) {
    const int64_t base = row * dim;
    float ov[PER], zv[PER], g[PER];
    warp_row_load<PER, FULL>(o + base, dim, lane, ov);
    warp_row_load<PER, FULL>(z + base, dim, lane, zv);
    warp_row_load<PER, FULL>(dy + base, dim, lane, g);
    const float rstd = inverse_rms<PER>(ov, dim, eps);
    float u_dot_n = 0.0f;
    float u[PER], dzv[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const float n = ov[i] * rstd;
      const float s = sigmoid_f(zv[i]);
      const float gate = zv[i] * s;
      u[i] = g[i] * gate * w[i];
      u_dot_n += u[i] * n;
      dw[i] += g[i] * gate * n;
      dzv[i] = g[i] * n * w[i] * s * (1.0f + zv[i] * (1.0f - s));
      ov[i] = n;
    }
    const float mean_u_dot_n = warp_sum(u_dot_n) / static_cast<float>(dim);
#pragma unroll
    for (int i = 0; i < PER; ++i) u[i] = rstd * (u[i] - mean_u_dot_n * ov[i]);
    warp_row_store<PER, FULL>(dz + base, dim, lane, dzv);
    warp_row_store<PER, FULL>(d_o + base, dim, lane, u);
  }
#pragma unroll
  for (int i = 0; i < PER; ++i) s_dweight[warp][lane * PER + i] = dw[i];
  __syncthreads();
  for (int d = threadIdx.x; d < dim; d += blockDim.x) {
    float sum = 0.0f;
    for (int k = 0; k < kWarpsPerBlock; ++k) sum += s_dweight[k][d];
    block_dweight[static_cast<int64_t>(blockIdx.x) * dim + d] = sum;
  }
}

// dweight[d] += the blocks' partial sums: one block per column d, each thread a fixed stride of the
// partials, then a tree in shared memory (a fixed order: the same bits on every run).
constexpr int kReduceThreads = 256;
__global__ void gated_rmsnorm_dweight_reduce_kernel(const float* block_dweight, int num_blocks, int dim,
                                                    float* dweight) {
  __shared__ float sums[kReduceThreads];
  const int d = blockIdx.x;
  float sum = 0.0f;
  for (int b = threadIdx.x; b < num_blocks; b += kReduceThreads) sum += block_dweight[static_cast<int64_t>(b) * dim + d];
  sums[threadIdx.x] = sum;
  __syncthreads();
  for (int stride = kReduceThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) sums[threadIdx.x] += sums[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) dweight[d] += sums[0];
}

unsigned row_blocks(int64_t num_rows) {
  return static_cast<unsigned>(std::min<int64_t>(kMaxBlocks, (num_rows + kWarpsPerBlock - 1) / kWarpsPerBlock));
}

void check_gated_rmsnorm_launch(int64_t num_rows, int dim, float eps) {
  CHECK(num_rows >= 0, "gated_rmsnorm_cuda: num_rows must not be negative, got ", num_rows);
  CHECK(dim > 0 && dim <= 1024, "gated_rmsnorm_cuda: dim must be in [1, 1024], got ", dim);
  CHECK(eps >= 0, "gated_rmsnorm_cuda: eps must not be negative, got ", eps);
}

}  // namespace

void gated_rmsnorm_forward_cuda(const __nv_bfloat16* o, const __nv_bfloat16* z,
                                const float* weight, int64_t num_rows, int dim, float eps,
                                __nv_bfloat16* y, cudaStream_t stream) {
  check_gated_rmsnorm_launch(num_rows, dim, eps);
  if (num_rows == 0) return;
  const unsigned blocks = row_blocks(num_rows);
  with_warp_row_width(dim, warp_row_aligned(o) && warp_row_aligned(z) && warp_row_aligned(y), [&]<int PER, bool FULL>() {
    gated_rmsnorm_forward_kernel<PER, FULL><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(o, z, weight, num_rows,
                                                                                         dim, eps, y);
  });
  CUDA_CHECK_LAUNCH();
}

size_t gated_rmsnorm_backward_workspace_bytes(int64_t num_rows, int dim) {
  return static_cast<size_t>(std::max<unsigned>(row_blocks(num_rows), 1)) * static_cast<size_t>(dim) * sizeof(float);
}

void gated_rmsnorm_backward_cuda(const __nv_bfloat16* o, const __nv_bfloat16* z,
                                 const float* weight, const __nv_bfloat16* dy,
                                 int64_t num_rows, int dim, float eps, __nv_bfloat16* d_o,
                                 __nv_bfloat16* dz, float* dweight, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream) {
  check_gated_rmsnorm_launch(num_rows, dim, eps);
  CHECK(workspace_bytes >= gated_rmsnorm_backward_workspace_bytes(num_rows, dim), "gated_rmsnorm_backward_cuda: ",
        "workspace of ", workspace_bytes, " bytes, needs ", gated_rmsnorm_backward_workspace_bytes(num_rows, dim));
  if (num_rows == 0) return;
  const unsigned blocks = row_blocks(num_rows);
  float* block_dweight = static_cast<float*>(workspace);
  const bool pointers_aligned =
      warp_row_aligned(o) && warp_row_aligned(z) && warp_row_aligned(dy) && warp_row_aligned(d_o) && warp_row_aligned(dz);
  with_warp_row_width(dim, pointers_aligned, [&]<int PER, bool FULL>() {
    gated_rmsnorm_backward_kernel<PER, FULL><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
        o, z, weight, dy, num_rows, dim, eps, d_o, dz, block_dweight);
  });
  CUDA_CHECK_LAUNCH();
  if (dweight == nullptr) return;  // frozen: the partial sums are not needed
  gated_rmsnorm_dweight_reduce_kernel<<<static_cast<unsigned>(dim), kReduceThreads, 0, stream>>>(
      block_dweight, static_cast<int>(blocks), dim, dweight);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
