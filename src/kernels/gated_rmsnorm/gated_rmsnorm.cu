// CUDA kernels of the gated RMSNorm: one warp per row, fp32 reductions. The backward sums the
// weight gradient per warp in shared memory, per block in warp order into a workspace, and over
// the blocks in block order: the same bits on every run.
#include <algorithm>

#include "core/cuda_check.h"
#include "kernels/gated_rmsnorm/gated_rmsnorm_cuda.h"

namespace deltamoe {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kMaxBackwardBlocks = 1024;

__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
__device__ inline float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ inline float row_inverse_rms(const __nv_bfloat16* row, int dim, float eps, int lane) {
  float sum_sq = 0.0f;
  for (int d = lane; d < dim; d += 32) {
    const float v = __bfloat162float(row[d]);
    sum_sq += v * v;
  }
  return 1.0f / sqrtf(warp_sum(sum_sq) / static_cast<float>(dim) + eps);
}

__global__ void gated_rmsnorm_forward_kernel(const __nv_bfloat16* o, const __nv_bfloat16* z,
                                             const float* weight, int64_t num_rows,
                                             int dim, float eps, __nv_bfloat16* y) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= num_rows) return;
  const int lane = threadIdx.x % 32;
  const __nv_bfloat16* o_row = o + row * dim;
  const float rstd = row_inverse_rms(o_row, dim, eps, lane);
  for (int d = lane; d < dim; d += 32) {
    const float zv = __bfloat162float(z[row * dim + d]);
    const float value = __bfloat162float(o_row[d]) * rstd * weight[d] *
                        (zv * sigmoid_f(zv));
    y[row * dim + d] = __float2bfloat16(value);
  }
}

// Rows are visited by a grid-stride loop over warps; each warp sums its rows' dweight terms in its
// own shared slice (dynamic shared memory, kWarpsPerBlock x dim floats; each lane owns columns
// lane, lane + 32, ...), then the block writes the sum of its warps, in warp order, to block_dweight.
__global__ void gated_rmsnorm_backward_kernel(const __nv_bfloat16* o, const __nv_bfloat16* z,
                                              const float* weight,
                                              const __nv_bfloat16* dy, int64_t num_rows, int dim,
                                              float eps, __nv_bfloat16* d_o, __nv_bfloat16* dz,
                                              float* block_dweight) {
  extern __shared__ float s_dweight[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float* mine = s_dweight + warp * dim;
  for (int d = lane; d < dim; d += 32) mine[d] = 0.0f;
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  const int64_t row_step = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = first_row; row < num_rows; row += row_step) {
    const int64_t base = row * dim;
    const float rstd = row_inverse_rms(o + base, dim, eps, lane);
    // u = dL/dn with n = o * rstd; d_o = rstd (u - mean(u . n) n).
    float u_dot_n = 0.0f;
    for (int d = lane; d < dim; d += 32) {
      const float n = __bfloat162float(o[base + d]) * rstd;
      const float zv = __bfloat162float(z[base + d]);
      const float s = sigmoid_f(zv);
      const float gate = zv * s;
      const float dyv = __bfloat162float(dy[base + d]);
      const float w = weight[d];
      u_dot_n += dyv * gate * w * n;
      mine[d] += dyv * gate * n;
      dz[base + d] = __float2bfloat16(dyv * n * w * s * (1.0f + zv * (1.0f - s)));
    }
    const float mean_u_dot_n = warp_sum(u_dot_n) / static_cast<float>(dim);
    for (int d = lane; d < dim; d += 32) {
      const float n = __bfloat162float(o[base + d]) * rstd;
      const float zv = __bfloat162float(z[base + d]);
      const float u = __bfloat162float(dy[base + d]) * zv * sigmoid_f(zv) *
                      weight[d];
      d_o[base + d] = __float2bfloat16(rstd * (u - mean_u_dot_n * n));
    }
  }
  __syncthreads();
  for (int d = threadIdx.x; d < dim; d += blockDim.x) {
    float sum = 0.0f;
    for (int w = 0; w < kWarpsPerBlock; ++w) sum += s_dweight[w * dim + d];
    block_dweight[static_cast<int64_t>(blockIdx.x) * dim + d] = sum;
  }
}

// dweight[d] += the blocks' partial sums, in block order.
__global__ void gated_rmsnorm_dweight_reduce_kernel(const float* block_dweight, int num_blocks, int dim,
                                                    float* dweight) {
  const int d = blockIdx.x * blockDim.x + threadIdx.x;
  if (d >= dim) return;
  float sum = 0.0f;
  for (int b = 0; b < num_blocks; ++b) sum += block_dweight[static_cast<int64_t>(b) * dim + d];
  dweight[d] += sum;
}

unsigned backward_blocks(int64_t num_rows) {
  return static_cast<unsigned>(std::min<int64_t>(kMaxBackwardBlocks, (num_rows + kWarpsPerBlock - 1) / kWarpsPerBlock));
}

void check_gated_rmsnorm_launch(int64_t num_rows, int dim, float eps) {
  CHECK(num_rows >= 0, "gated_rmsnorm_cuda: num_rows must not be negative, got ", num_rows);
  CHECK(dim > 0 && dim <= 1024, "gated_rmsnorm_cuda: dim must be in [1, 1024], got ", dim);
  CHECK(eps >= 0, "gated_rmsnorm_cuda: eps must not be negative, got ", eps);
  CHECK((num_rows + kWarpsPerBlock - 1) / kWarpsPerBlock < (int64_t{1} << 31),
        "gated_rmsnorm_cuda: too many rows for one launch: ", num_rows);
}

}  // namespace

void gated_rmsnorm_forward_cuda(const __nv_bfloat16* o, const __nv_bfloat16* z,
                                const float* weight, int64_t num_rows, int dim, float eps,
                                __nv_bfloat16* y, cudaStream_t stream) {
  check_gated_rmsnorm_launch(num_rows, dim, eps);
  if (num_rows == 0) return;
  const auto blocks = static_cast<unsigned>((num_rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  gated_rmsnorm_forward_kernel<<<blocks, kWarpsPerBlock * 32, 0, stream>>>(o, z, weight, num_rows,
                                                                           dim, eps, y);
  CUDA_CHECK_LAUNCH();
}

size_t gated_rmsnorm_backward_workspace_bytes(int64_t num_rows, int dim) {
  return static_cast<size_t>(std::max<unsigned>(backward_blocks(num_rows), 1)) * static_cast<size_t>(dim) * sizeof(float);
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
  const unsigned blocks = backward_blocks(num_rows);
  const size_t smem = static_cast<size_t>(kWarpsPerBlock) * static_cast<size_t>(dim) * sizeof(float);
  float* block_dweight = static_cast<float*>(workspace);
  gated_rmsnorm_backward_kernel<<<blocks, kWarpsPerBlock * 32, smem, stream>>>(o, z, weight, dy, num_rows, dim, eps,
                                                                               d_o, dz, block_dweight);
  CUDA_CHECK_LAUNCH();
  if (dweight == nullptr) return;  // frozen: the partial sums are not needed
  gated_rmsnorm_dweight_reduce_kernel<<<static_cast<unsigned>((dim + 127) / 128), 128, 0, stream>>>(
      block_dweight, static_cast<int>(blocks), dim, dweight);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
