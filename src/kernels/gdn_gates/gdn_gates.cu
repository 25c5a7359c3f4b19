// CUDA kernels of the GDN gates. Element-wise; the backward reduces the parameter gradients per
// head in shared memory first, so each block adds to global memory once per head.
#include <algorithm>

#include "core/cuda_check.h"
#include "kernels/gdn_gates/gdn_gates_cuda.h"

namespace deltamoe {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;
constexpr float kSoftplusThreshold = 20.0f;  // torch's default: linear above it

__device__ inline float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ inline float softplus_f(float x) {
  return x > kSoftplusThreshold ? x : log1pf(expf(x));
}
__device__ inline float softplus_derivative_f(float x) {
  return x > kSoftplusThreshold ? 1.0f : sigmoid_f(x);
}

__global__ void gates_forward_kernel(const float* a, const float* b,
                                     const float* A_log, const float* dt_bias, int64_t count,
                                     int num_heads, float* g, float* beta) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int h = static_cast<int>(i % num_heads);
    g[i] = -expf(A_log[h]) * softplus_f(a[i] + dt_bias[h]);
    beta[i] = sigmoid_f(b[i]);
  }
}

// Dynamic shared memory: 2 * num_heads floats (dA_log and ddt_bias partial sums).
__global__ void gates_backward_kernel(const float* a, const float* b,
                                      const float* A_log, const float* dt_bias, const float* dg,
                                      const float* dbeta, int64_t count, int num_heads,
                                      float* da, float* db, float* dA_log,
                                      float* ddt_bias) {
  extern __shared__ float partial[];
  float* s_dA_log = partial;
  float* s_ddt_bias = partial + num_heads;
  for (int h = threadIdx.x; h < 2 * num_heads; h += kThreads) partial[h] = 0.0f;
  __syncthreads();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int h = static_cast<int>(i % num_heads);
    const float decay_rate = expf(A_log[h]);
    const float pre = a[i] + dt_bias[h];
    const float d_pre = -dg[i] * decay_rate * softplus_derivative_f(pre);
    da[i] = d_pre;
    atomicAdd(&s_ddt_bias[h], d_pre);
    atomicAdd(&s_dA_log[h], dg[i] * (-decay_rate * softplus_f(pre)));
    const float s = sigmoid_f(b[i]);
    db[i] = dbeta[i] * s * (1.0f - s);
  }
  __syncthreads();
  for (int h = threadIdx.x; h < num_heads; h += kThreads) {
    atomicAdd(&dA_log[h], s_dA_log[h]);
    atomicAdd(&ddt_bias[h], s_ddt_bias[h]);
  }
}

void check_gates_launch(int64_t num_tokens, int num_heads) {
  CHECK(num_tokens >= 0, "gdn_gates_cuda: num_tokens must not be negative, got ", num_tokens);
  CHECK(num_heads > 0 && num_heads <= 4096, "gdn_gates_cuda: num_heads must be in [1, 4096], got ",
        num_heads);
}

unsigned gate_blocks(int64_t count) {
  return static_cast<unsigned>(std::min<int64_t>(kMaxBlocks, (count + kThreads - 1) / kThreads));
}

}  // namespace

void gdn_gates_forward_cuda(const float* a, const float* b, const float* A_log,
                            const float* dt_bias, int64_t num_tokens, int num_heads, float* g,
                            float* beta, cudaStream_t stream) {
  check_gates_launch(num_tokens, num_heads);
  const int64_t count = num_tokens * num_heads;
  if (count == 0) return;
  gates_forward_kernel<<<gate_blocks(count), kThreads, 0, stream>>>(a, b, A_log, dt_bias, count,
                                                                    num_heads, g, beta);
  CUDA_CHECK_LAUNCH();
}

void gdn_gates_backward_cuda(const float* a, const float* b, const float* A_log,
                             const float* dt_bias, const float* dg, const float* dbeta,
                             int64_t num_tokens, int num_heads, float* da,
                             float* db, float* dA_log, float* ddt_bias,
                             cudaStream_t stream) {
  check_gates_launch(num_tokens, num_heads);
  const int64_t count = num_tokens * num_heads;
  if (count == 0) return;
  const size_t smem = 2 * static_cast<size_t>(num_heads) * sizeof(float);
  gates_backward_kernel<<<gate_blocks(count), kThreads, smem, stream>>>(
      a, b, A_log, dt_bias, dg, dbeta, count, num_heads, da, db, dA_log, ddt_bias);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
