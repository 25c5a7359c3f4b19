// Elementwise fp32 accumulate (grad_accumulate_cuda.h).
#include <algorithm>

#include "core/cuda_check.h"
#include "optim/grad_accumulate_cuda.h"

namespace deltamoe {

namespace {

__global__ void add_kernel(const float* in, float* acc, int64_t count) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    acc[i] += in[i];
  }
}

}  // namespace

void add_f32_cuda(const float* in, float* acc, int64_t count, cudaStream_t stream) {
  if (count <= 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((count + kThreads - 1) / kThreads, 4096);
  add_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(in, acc, count);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace deltamoe
