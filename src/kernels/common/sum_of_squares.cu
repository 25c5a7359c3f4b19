// Deterministic fp64 sum of squares of divided fp32 (or widened bf16) values: a fixed number of
// blocks, each a fixed grid-stride walk over every span's 16-byte vectors (four in flight per
// thread) and a tree in shared memory, then one block adds the partials and the extra sums in
// order. The quotient is gradient_divide.h's (fp32 where that is exact: fp64 division made this
// pass compute-bound at a quarter of the memory rate). One template serves both element types.
#include "kernels/common/sum_of_squares_cuda.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common/gradient_divide.h"

namespace deltamoe {

namespace {

constexpr int kThreads = 256;
constexpr int kBlocks = static_cast<int>(kSumOfSquaresWorkspaceBytes / sizeof(double));
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread

// One span passed by value (of float or bf16 values), or a device array of fp32 spans.
template <typename T>
struct ValueSpan {
  const T* data;
  int64_t count;
};
template <typename T>
struct OneSpan {
  using Value = T;
  ValueSpan<T> span;
  __device__ int size() const { return 1; }
  __device__ ValueSpan<T> operator[](int) const { return span; }
};
struct SpanArray {
  using Value = float;
  const DeviceF32Span* spans;
  int count;
  __device__ int size() const { return count; }
  __device__ DeviceF32Span operator[](int i) const { return spans[i]; }
};

__device__ double block_sum(double value, double* shared) {
  shared[threadIdx.x] = value;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
    __syncthreads();
  }
  return shared[0];
}

template <GradientDivide kDivide>
__device__ __forceinline__ double add_square(float g, const GradientDivisor& divisor, double sum) {
  const double d = static_cast<double>(divide_gradient<kDivide>(g, divisor));
  return __fma_rn(d, d, sum);
}

__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }

// The values of one 32-bit word in memory order: one float, or two bf16 (the first in the low
// half; a bf16 widened is its bits in the high half of a float).
template <GradientDivide kDivide, typename T>
__device__ __forceinline__ double add_word_squares(uint32_t word, const GradientDivisor& divisor, double sum) {
  if constexpr (std::is_same_v<T, float>) {
    return add_square<kDivide>(__uint_as_float(word), divisor, sum);
  } else {
    sum = add_square<kDivide>(__uint_as_float(word << 16), divisor, sum);
    return add_square<kDivide>(__uint_as_float(word & 0xFFFF0000u), divisor, sum);
  }
}

// One 16-byte vector's values in memory order.
template <GradientDivide kDivide, typename T>
__device__ __forceinline__ double add_squares(const uint4& v, const GradientDivisor& divisor, double sum) {
  sum = add_word_squares<kDivide, T>(v.x, divisor, sum);
  sum = add_word_squares<kDivide, T>(v.y, divisor, sum);
  sum = add_word_squares<kDivide, T>(v.z, divisor, sum);
  return add_word_squares<kDivide, T>(v.w, divisor, sum);
}

// Per span: values[0, head) and values[head + V nv, count) element by element (head: the values
// before the first 16-byte boundary), values[head, head + V nv) as 16-byte vectors of V values.
template <GradientDivide kDivide, typename Spans>
__global__ void partial_kernel(Spans spans, GradientDivisor divisor, double* partials) {
  using T = typename Spans::Value;
  constexpr int64_t kPerVector = 16 / sizeof(T);
  __shared__ double shared[kThreads];
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(kBlocks) * kThreads;
  double sum = 0.0;
  for (int s = 0; s < spans.size(); ++s) {
    const auto span = spans[s];
    const T* values = span.data;
    const int64_t count = span.count;
    const auto misalignment = static_cast<int64_t>((reinterpret_cast<uintptr_t>(values) % 16) / sizeof(T));
    const int64_t aligned_at = (kPerVector - misalignment) % kPerVector;
    const int64_t head = count < aligned_at ? count : aligned_at;
    const int64_t nv = (count - head) / kPerVector;
    const uint4* vectors = reinterpret_cast<const uint4*>(values + head);
    int64_t i = tid;
    for (; i + (kUnroll - 1) * stride < nv; i += kUnroll * stride) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = vectors[i + u * stride];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) sum = add_squares<kDivide, T>(v[u], divisor, sum);
    }
    for (; i < nv; i += stride) sum = add_squares<kDivide, T>(vectors[i], divisor, sum);
    const int64_t tail_begin = head + kPerVector * nv;
    // head < kPerVector and the tail < kPerVector: one value per thread of the first ones.
    if (tid < head) sum = add_square<kDivide>(widen(values[tid]), divisor, sum);
    if (tid < count - tail_begin) sum = add_square<kDivide>(widen(values[tail_begin + tid]), divisor, sum);
  }
  const double total = block_sum(sum, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// *out = partials[0..kBlocks) (null: none) + extra[0..num_extra), each thread's share in index
// order, then the block's tree.
__global__ void final_kernel(const double* partials, const double* extra, int64_t num_extra, double* out) {
  __shared__ double shared[kThreads];
  double sum = 0.0;
  if (partials != nullptr)
    for (int b = threadIdx.x; b < kBlocks; b += kThreads) sum += partials[b];
  for (int64_t i = threadIdx.x; i < num_extra; i += kThreads) sum += extra[i];
  const double total = block_sum(sum, shared);
  if (threadIdx.x == 0) *out = total;
}

template <typename Spans>
void launch_partials(Spans spans, double divisor, double* partials, cudaStream_t stream) {
  const GradientDivisor d = gradient_divisor(divisor);
  switch (d.kind) {
    case GradientDivide::none:
      partial_kernel<GradientDivide::none><<<kBlocks, kThreads, 0, stream>>>(spans, d, partials);
      break;
    case GradientDivide::f32:
      partial_kernel<GradientDivide::f32><<<kBlocks, kThreads, 0, stream>>>(spans, d, partials);
      break;
    case GradientDivide::f64:
      partial_kernel<GradientDivide::f64><<<kBlocks, kThreads, 0, stream>>>(spans, d, partials);
      break;
  }
  CUDA_CHECK_LAUNCH();
}

// One run of float or bf16 values.
template <typename T>
void sum_of_values(const T* values, int64_t count, double divisor, double* out, void* workspace,
                   cudaStream_t stream) {
  CHECK(count >= 0 && divisor > 0, "sum_of_squares_cuda: count ", count, ", divisor ", divisor);
  CHECK(count == 0 || (values != nullptr && reinterpret_cast<uintptr_t>(values) % sizeof(T) == 0),
        "sum_of_squares_cuda: ", count, " values at a null or misaligned address");
  auto* partials = static_cast<double*>(workspace);
  launch_partials(OneSpan<T>{{values, count}}, divisor, partials, stream);
  final_kernel<<<1, kThreads, 0, stream>>>(partials, nullptr, 0, out);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void sum_of_squares_cuda(const float* values, int64_t count, double divisor, double* out, void* workspace,
                         cudaStream_t stream) {
  sum_of_values(values, count, divisor, out, workspace, stream);
}

void sum_of_squares_cuda(const __nv_bfloat16* values, int64_t count, double divisor, double* out, void* workspace,
                         cudaStream_t stream) {
  sum_of_values(values, count, divisor, out, workspace, stream);
}

void sum_of_squares_cuda(const DeviceF32Span* spans, int num_spans, const double* extra, int64_t num_extra,
                         double divisor, double* out, void* workspace, cudaStream_t stream) {
  CHECK(num_spans >= 0 && num_extra >= 0 && divisor > 0, "sum_of_squares_cuda: ", num_spans, " spans, ", num_extra,
        " extra sums, divisor ", divisor);
  CHECK(num_spans == 0 || spans != nullptr, "sum_of_squares_cuda: no span array for ", num_spans, " spans");
  CHECK(num_extra == 0 || extra != nullptr, "sum_of_squares_cuda: no extra sums for ", num_extra);
  auto* partials = static_cast<double*>(workspace);
  if (num_spans > 0) launch_partials(SpanArray{spans, num_spans}, divisor, partials, stream);
  final_kernel<<<1, kThreads, 0, stream>>>(num_spans > 0 ? partials : nullptr, extra, num_extra, out);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
