// CUDA kernels of the causal depthwise conv1d + SiLU over packed sequences, forward and backward.
// One thread per channel walks a strip of tokens, so the taps of one channel stay in registers.
#include <algorithm>

#include "core/cuda_check.h"
#include "kernels/causal_conv1d/causal_conv1d_cuda.h"

namespace deltamoe {
namespace {

constexpr int kThreads = 128;           // channels per block
constexpr int kTokensPerStrip = 32;     // tokens one thread walks (amortises the weight loads)

__device__ inline float sigmoid_f(float z) { return 1.0f / (1.0f + __expf(-z)); }

// Start of the sequence that holds token t: the largest n < N with cu_seqlens[n] <= t.
__device__ inline int64_t sequence_begin(const int32_t* cu_seqlens, int num_seqs, int64_t t) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu_seqlens[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return cu_seqlens[lo];
}

// End (exclusive) of the sequence that holds token t.
__device__ inline int64_t sequence_end(const int32_t* cu_seqlens, int num_seqs, int64_t t) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu_seqlens[mid] <= t) lo = mid; else hi = mid - 1;
  }
  // Skip empty sequences that share the start: the end is the first boundary after t.
  int n = lo + 1;
  while (cu_seqlens[n] <= t) ++n;
  return cu_seqlens[n];
}

// z[t,c] = sum_j tap[j] x[t-j,c] over taps inside [seq_begin, t], where tap[j] = w[c,K-1-j].
// Loops run to the compile-time maximum so that the tap arrays stay in registers.
__device__ inline float preactivation(const __nv_bfloat16* x, const float* tap, int64_t seq_begin,
                                      int64_t t, int c, int num_channels, int kernel_size) {
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kCausalConv1dMaxKernel; ++j) {
    if (j < kernel_size && t - j >= seq_begin) {
      sum += tap[j] * __bfloat162float(x[(t - j) * num_channels + c]);
    }
  }
  return sum;
}

// tap[j] = weight[c, K-1-j] (the weight that multiplies the token j steps back); zero past K.
__device__ inline void load_taps(const __nv_bfloat16* weight, int c, int kernel_size, float* tap) {
#pragma unroll
  for (int j = 0; j < kCausalConv1dMaxKernel; ++j) {
    tap[j] = j < kernel_size ? __bfloat162float(weight[c * kernel_size + kernel_size - 1 - j])
                             : 0.0f;
  }
}

__global__ void conv_forward_kernel(const __nv_bfloat16* x, const __nv_bfloat16* weight,
                                    const int32_t* cu_seqlens, int num_seqs, int64_t num_tokens,
                                    int num_channels, int kernel_size, __nv_bfloat16* y) {
  const int c = blockIdx.x * kThreads + threadIdx.x;
  if (c >= num_channels) return;
  float tap[kCausalConv1dMaxKernel];
  load_taps(weight, c, kernel_size, tap);
  const int64_t t_begin = static_cast<int64_t>(blockIdx.y) * kTokensPerStrip;
  const int64_t t_end = min(num_tokens, t_begin + kTokensPerStrip);
  for (int64_t t = t_begin; t < t_end; ++t) {
    const int64_t seq_begin = sequence_begin(cu_seqlens, num_seqs, t);
    const float z = preactivation(x, tap, seq_begin, t, c, num_channels, kernel_size);
    y[t * num_channels + c] = __float2bfloat16(z * sigmoid_f(z));
  }
}

// dz[t,c] = dy * silu'(z): the gradient at the pre-activation.
__device__ inline float preactivation_grad(const __nv_bfloat16* x, const __nv_bfloat16* dy,
                                           const float* tap, int64_t seq_begin, int64_t t, int c,
                                           int num_channels, int kernel_size) {
  const float z = preactivation(x, tap, seq_begin, t, c, num_channels, kernel_size);
  const float s = sigmoid_f(z);
  return __bfloat162float(dy[t * num_channels + c]) * s * (1.0f + z * (1.0f - s));
}

// dx[t,c] = sum_j tap[j] dz[t+j,c] over t+j inside t's sequence; d tap[j] (= dweight[c,K-1-j])
// gets x[t-j,c] dz[t,c], summed over the strip in registers and written to the strip's row of
// strip_dweight [strips, C, K] (null: frozen weight, not formed).
__global__ void conv_backward_kernel(const __nv_bfloat16* x, const __nv_bfloat16* weight,
                                     const __nv_bfloat16* dy, const int32_t* cu_seqlens,
                                     int num_seqs, int64_t num_tokens, int num_channels,
                                     int kernel_size, __nv_bfloat16* dx, float* strip_dweight) {
  const int c = blockIdx.x * kThreads + threadIdx.x;
  if (c >= num_channels) return;
  float tap[kCausalConv1dMaxKernel];
  float d_tap[kCausalConv1dMaxKernel];
  load_taps(weight, c, kernel_size, tap);
#pragma unroll
  for (int j = 0; j < kCausalConv1dMaxKernel; ++j) d_tap[j] = 0.0f;
  const int64_t t_begin = static_cast<int64_t>(blockIdx.y) * kTokensPerStrip;
  const int64_t t_end = min(num_tokens, t_begin + kTokensPerStrip);
  for (int64_t t = t_begin; t < t_end; ++t) {
    const int64_t seq_begin = sequence_begin(cu_seqlens, num_seqs, t);
    const int64_t seq_end = sequence_end(cu_seqlens, num_seqs, t);
    // Weight gradient from this token's own pre-activation.
    const float dz_t = preactivation_grad(x, dy, tap, seq_begin, t, c, num_channels, kernel_size);
#pragma unroll
    for (int j = 0; j < kCausalConv1dMaxKernel; ++j) {
      if (j < kernel_size && t - j >= seq_begin) {
        d_tap[j] += __bfloat162float(x[(t - j) * num_channels + c]) * dz_t;
      }
    }
    // Input gradient gathers the later tokens of the same sequence that read x[t].
    float dx_t = 0.0f;
#pragma unroll
    for (int j = 0; j < kCausalConv1dMaxKernel; ++j) {
      if (j < kernel_size && t + j < seq_end) {
        const float dz = j == 0 ? dz_t
                                : preactivation_grad(x, dy, tap, seq_begin, t + j, c,
                                                     num_channels, kernel_size);
        dx_t += tap[j] * dz;
      }
    }
    dx[t * num_channels + c] = __float2bfloat16(dx_t);
  }
  if (strip_dweight == nullptr) return;
  float* mine = strip_dweight + static_cast<int64_t>(blockIdx.y) * num_channels * kernel_size;
#pragma unroll
  for (int j = 0; j < kCausalConv1dMaxKernel; ++j) {
    if (j < kernel_size) mine[c * kernel_size + kernel_size - 1 - j] = d_tap[j];
  }
}

// dweight[i] += the strips' partial sums, in strip order (the same bits on every run).
__global__ void conv_dweight_reduce_kernel(const float* strip_dweight, int64_t num_strips, int64_t count,
                                           float* dweight) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= count) return;
  float sum = 0.0f;
  for (int64_t s = 0; s < num_strips; ++s) sum += strip_dweight[s * count + i];
  dweight[i] += sum;
}

void check_conv_launch(int num_seqs, int64_t num_tokens, int num_channels, int kernel_size) {
  CHECK(num_seqs >= 1, "causal_conv1d_cuda: need at least one sequence, got ", num_seqs);
  CHECK(num_tokens >= 0, "causal_conv1d_cuda: num_tokens must not be negative, got ", num_tokens);
  CHECK(num_channels > 0, "causal_conv1d_cuda: num_channels must be positive, got ",
        num_channels);
  CHECK(kernel_size > 0 && kernel_size <= kCausalConv1dMaxKernel,
        "causal_conv1d_cuda: kernel_size must be in [1, ", kCausalConv1dMaxKernel, "], got ",
        kernel_size);
  CHECK((num_tokens + kTokensPerStrip - 1) / kTokensPerStrip <= 65535,
        "causal_conv1d_cuda: too many tokens for one launch: ", num_tokens);
}

dim3 conv_grid(int64_t num_tokens, int num_channels) {
  return dim3((num_channels + kThreads - 1) / kThreads,
              static_cast<unsigned>((num_tokens + kTokensPerStrip - 1) / kTokensPerStrip));
}

}  // namespace

void causal_conv1d_forward_cuda(const __nv_bfloat16* x, const __nv_bfloat16* weight,
                                const int32_t* cu_seqlens, int num_seqs, int64_t num_tokens,
                                int num_channels, int kernel_size, __nv_bfloat16* y,
                                cudaStream_t stream) {
  check_conv_launch(num_seqs, num_tokens, num_channels, kernel_size);
  if (num_tokens == 0) return;
  conv_forward_kernel<<<conv_grid(num_tokens, num_channels), kThreads, 0, stream>>>(
      x, weight, cu_seqlens, num_seqs, num_tokens, num_channels, kernel_size, y);
  CUDA_CHECK_LAUNCH();
}

size_t causal_conv1d_backward_workspace_bytes(int64_t num_tokens, int num_channels, int kernel_size) {
  const int64_t strips = std::max<int64_t>((num_tokens + kTokensPerStrip - 1) / kTokensPerStrip, 1);
  return static_cast<size_t>(strips) * static_cast<size_t>(num_channels) * static_cast<size_t>(kernel_size) *
         sizeof(float);
}

void causal_conv1d_backward_cuda(const __nv_bfloat16* x, const __nv_bfloat16* weight,
                                 const __nv_bfloat16* dy, const int32_t* cu_seqlens, int num_seqs,
                                 int64_t num_tokens, int num_channels, int kernel_size,
                                 __nv_bfloat16* dx, float* dweight, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream) {
  check_conv_launch(num_seqs, num_tokens, num_channels, kernel_size);
  const size_t needed = dweight != nullptr ? causal_conv1d_backward_workspace_bytes(num_tokens, num_channels,
                                                                                    kernel_size)
                                           : 0;
  CHECK(workspace_bytes >= needed, "causal_conv1d_backward_cuda: workspace of ", workspace_bytes, " bytes, needs ",
        needed);
  if (num_tokens == 0) return;
  float* strip_dweight = dweight != nullptr ? static_cast<float*>(workspace) : nullptr;
  conv_backward_kernel<<<conv_grid(num_tokens, num_channels), kThreads, 0, stream>>>(
      x, weight, dy, cu_seqlens, num_seqs, num_tokens, num_channels, kernel_size, dx, strip_dweight);
  CUDA_CHECK_LAUNCH();
  if (dweight == nullptr) return;
  const int64_t strips = (num_tokens + kTokensPerStrip - 1) / kTokensPerStrip;
  const int64_t count = static_cast<int64_t>(num_channels) * kernel_size;
  conv_dweight_reduce_kernel<<<static_cast<unsigned>((count + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      strip_dweight, strips, count, dweight);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
