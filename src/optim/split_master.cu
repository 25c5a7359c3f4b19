// split_master_cuda, master_weights_cuda: one thread per element (setup and restore work; not on
// the step's path).
#include <algorithm>

#include "core/cuda_check.h"
#include "core/error.h"
#include "optim/split_master.h"
#include "optim/split_master_cuda.h"

namespace deltamoe {

namespace {

__global__ void split_master_kernel(const float* values, __nv_bfloat16* high, uint16_t* low, int64_t count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const uint32_t bits = __float_as_uint(values[i]);
    high[i] = __ushort_as_bfloat16(split_master_high(bits));
    low[i] = split_master_low(bits);
  }
}

__global__ void master_weights_kernel(const float* master, __nv_bfloat16* weights, int64_t count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    weights[i] = __ushort_as_bfloat16(split_master_high(__float_as_uint(master[i])));
}

unsigned blocks_for(int64_t count, int threads) {
  return static_cast<unsigned>(std::min<int64_t>((count + threads - 1) / threads, 65535));
}

}  // namespace

void split_master_cuda(const float* values, __nv_bfloat16* high, uint16_t* low, int64_t count, cudaStream_t stream) {
  CHECK(count >= 0, "split_master_cuda: negative count ", count);
  if (count == 0) return;
  split_master_kernel<<<blocks_for(count, 256), 256, 0, stream>>>(values, high, low, count);
  CUDA_CHECK_LAUNCH();
}

void master_weights_cuda(const float* master, __nv_bfloat16* weights, int64_t count, cudaStream_t stream) {
  CHECK(count >= 0, "master_weights_cuda: negative count ", count);
  if (count == 0) return;
  master_weights_kernel<<<blocks_for(count, 256), 256, 0, stream>>>(master, weights, count);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
