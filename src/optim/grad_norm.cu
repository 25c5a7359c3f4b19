// Deterministic fp64 sum of squares of a scaled fp32 gradient: a fixed number of blocks, each a
// fixed grid-stride walk over 16-byte vectors (four of them in flight per thread) and a tree in
// shared memory, then one block adds the partials in order. The quotient fl32(fl64(g) / divisor)
// is formed in fp32 when the divisor is an integer below 2^24 (a supervised-token count): the
// correctly rounded fp32 quotient of two such numbers equals the fp64 one rounded to fp32 (the
// exact quotient is never within an fp64 half-ulp of an fp32 rounding midpoint unless it is one),
// and fp64 division is what made this pass compute-bound at a quarter of the memory rate.
#include <algorithm>
#include <cmath>

#include "core/cuda_check.h"
#include "core/error.h"
#include "optim/grad_norm_cuda.h"

namespace deltamoe {

namespace {

constexpr int kThreads = 256;
constexpr int kBlocks = 1024;
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread

enum class Divide { none, f32, f64 };

__device__ double block_sum(double value, double* shared) {
  shared[threadIdx.x] = value;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
    __syncthreads();
  }
  return shared[0];
}

template <Divide kDivide>
__device__ __forceinline__ double add_square(float g, double divisor, float divisor_f32, double sum) {
  if constexpr (kDivide == Divide::f32) g = __fdiv_rn(g, divisor_f32);
  if constexpr (kDivide == Divide::f64) g = __double2float_rn(__ddiv_rn(static_cast<double>(g), divisor));
  const double d = static_cast<double>(g);
  return __fma_rn(d, d, sum);
}

template <Divide kDivide>
__device__ __forceinline__ double add_squares(const float4& v, double divisor, float divisor_f32, double sum) {
  sum = add_square<kDivide>(v.x, divisor, divisor_f32, sum);
  sum = add_square<kDivide>(v.y, divisor, divisor_f32, sum);
  sum = add_square<kDivide>(v.z, divisor, divisor_f32, sum);
  return add_square<kDivide>(v.w, divisor, divisor_f32, sum);
}

// grad[0, head) and grad[head + 4 n4, count) element by element (head: elements before the first
// 16-byte boundary), grad[head, head + 4 n4) as float4.
template <Divide kDivide>
__global__ void partial_kernel(const float* grad, int64_t count, int64_t head, int64_t n4, double divisor,
                               float divisor_f32, double* partials) {
  __shared__ double shared[kThreads];
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(kBlocks) * kThreads;
  double sum = 0.0;
  const float4* vectors = reinterpret_cast<const float4*>(grad + head);
  int64_t i = tid;
  for (; i + (kUnroll - 1) * stride < n4; i += kUnroll * stride) {
    float4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = vectors[i + u * stride];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) sum = add_squares<kDivide>(v[u], divisor, divisor_f32, sum);
  }
  for (; i < n4; i += stride) sum = add_squares<kDivide>(vectors[i], divisor, divisor_f32, sum);
  const int64_t tail_begin = head + 4 * n4;
  if (tid < head) sum = add_square<kDivide>(grad[tid], divisor, divisor_f32, sum);
  if (tid < count - tail_begin) sum = add_square<kDivide>(grad[tail_begin + tid], divisor, divisor_f32, sum);
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
  const auto misalignment = static_cast<int64_t>((reinterpret_cast<uintptr_t>(grad) % 16) / sizeof(float));
  const int64_t head = std::min<int64_t>(count, (4 - misalignment) % 4);
  const int64_t n4 = (count - head) / 4;
  const bool integer_divisor = divisor == std::floor(divisor) && divisor < 16777216.0;
  const auto divisor_f32 = static_cast<float>(divisor);
  if (divisor == 1.0) {
    partial_kernel<Divide::none><<<kBlocks, kThreads, 0, stream>>>(grad, count, head, n4, divisor, divisor_f32,
                                                                   partials);
  } else if (integer_divisor) {
    partial_kernel<Divide::f32><<<kBlocks, kThreads, 0, stream>>>(grad, count, head, n4, divisor, divisor_f32,
                                                                  partials);
  } else {
    partial_kernel<Divide::f64><<<kBlocks, kThreads, 0, stream>>>(grad, count, head, n4, divisor, divisor_f32,
                                                                  partials);
  }
  CUDA_CHECK_LAUNCH();
  final_kernel<<<1, kThreads, 0, stream>>>(partials, out);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
