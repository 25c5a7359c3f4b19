// CUDA kernels of the GDN gates. Element-wise; the backward's parameter gradients are reduced per
// head by one block in a fixed order (deterministic: a rerun gives the same bits).
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

// Element-wise: da = dg * d g / d a, db = dbeta * sigmoid'(b).
__global__ void gates_backward_kernel(const float* a, const float* b, const float* A_log, const float* dt_bias,
                                      const float* dg, const float* dbeta, int64_t count, int num_heads, float* da,
                                      float* db) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int h = static_cast<int>(i % num_heads);
    da[i] = -dg[i] * expf(A_log[h]) * softplus_derivative_f(a[i] + dt_bias[h]);
    const float s = sigmoid_f(b[i]);
    db[i] = dbeta[i] * s * (1.0f - s);
  }
}

// One block per head: dA_log[h] and ddt_bias[h] summed over the tokens in a fixed order (each
// thread a fixed stride of tokens, then a tree over the threads), so every run rounds alike.
__global__ void gates_param_grad_kernel(const float* a, const float* A_log, const float* dt_bias, const float* dg,
                                        int64_t num_tokens, int num_heads, float* dA_log, float* ddt_bias) {
  __shared__ float s_a_log[kThreads], s_dt[kThreads];
  const int h = blockIdx.x;
  const float decay_rate = expf(A_log[h]);
  float sum_a_log = 0.0f, sum_dt = 0.0f;
  for (int64_t t = threadIdx.x; t < num_tokens; t += kThreads) {
    const int64_t i = t * num_heads + h;
    const float pre = a[i] + dt_bias[h];
    sum_dt += -dg[i] * decay_rate * softplus_derivative_f(pre);
    sum_a_log += dg[i] * (-decay_rate * softplus_f(pre));
  }
  s_a_log[threadIdx.x] = sum_a_log;
  s_dt[threadIdx.x] = sum_dt;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      s_a_log[threadIdx.x] += s_a_log[threadIdx.x + stride];
      s_dt[threadIdx.x] += s_dt[threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    if (dA_log != nullptr) dA_log[h] += s_a_log[0];
    if (ddt_bias != nullptr) ddt_bias[h] += s_dt[0];
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
  gates_backward_kernel<<<gate_blocks(count), kThreads, 0, stream>>>(a, b, A_log, dt_bias, dg, dbeta, count,
                                                                     num_heads, da, db);
  CUDA_CHECK_LAUNCH();
  if (dA_log == nullptr && ddt_bias == nullptr) return;  // frozen: no parameter gradients
  gates_param_grad_kernel<<<num_heads, kThreads, 0, stream>>>(a, A_log, dt_bias, dg, num_tokens, num_heads, dA_log,
                                                               ddt_bias);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
