// Deterministic fp64 sum of squares of a scaled fp32 gradient: a fixed number of blocks, each a
// fixed grid-stride walk and a tree in shared memory, then one block adds the partials in order.
#include "core/cuda_check.h"
#include "core/error.h"
#include "optim/grad_norm_cuda.h"

namespace deltamoe {

namespace {

constexpr int kThreads = 256;
constexpr int kBlocks = 1024;

__device__ double block_sum(double value, double* shared) {
  shared[threadIdx.x] = value;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
    __syncthreads();
  }
  return shared[0];
}

__global__ void partial_kernel(const float* grad, int64_t count, double divisor, double* partials) {
  __shared__ double shared[kThreads];
  const bool divide = divisor != 1.0;
  double sum = 0.0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < count;
       i += static_cast<int64_t>(kBlocks) * kThreads) {
    float g = grad[i];
    if (divide) g = __double2float_rn(__ddiv_rn(static_cast<double>(g), divisor));
    const double d = static_cast<double>(g);
    sum = __fma_rn(d, d, sum);
  }
  const double total = block_sum(sum, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void final_kernel(const double* partials, double* out) {
  __shared__ double shared[kThreads];
  double sum = 0.0;
  for (int b = threadIdx.x; b < kBlocks; b += kThreads) sum += partials[b];
  const double total = block_sum(sum, shared);
  if (threadIdx.x == 0) *out = total;
}

}  // namespace

size_t grad_sum_of_squares_workspace_bytes() { return kBlocks * sizeof(double); }

void grad_sum_of_squares_cuda(const float* grad, int64_t count, double divisor, double* out, void* workspace,
                              cudaStream_t stream) {
  CHECK(count >= 0 && divisor > 0, "grad_sum_of_squares_cuda: count ", count, ", divisor ", divisor);
  auto* partials = static_cast<double*>(workspace);
  partial_kernel<<<kBlocks, kThreads, 0, stream>>>(grad, count, divisor, partials);
  CUDA_CHECK_LAUNCH();
  final_kernel<<<1, kThreads, 0, stream>>>(partials, out);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
