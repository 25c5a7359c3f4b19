// CUDA kernels of partial interleaved M-RoPE: a table kernel (thread per token x frequency) and
// one rotation kernel for both directions (thread per rotated pair or copied channel).
#include <cmath>

#include "core/cuda_check.h"
#include "kernels/mrope/mrope_cuda.h"

namespace deltamoe {

namespace {

// Per-frequency constants, passed by value (kernel parameters) so the launcher allocates nothing.
struct MropeFrequencies {
  float inv_freq[kMropeMaxFrequencies];
  int8_t axis[kMropeMaxFrequencies];
};

void check_spec(const MropeSpec& spec, int64_t head_dim, const char* where) {
  CHECK(spec.rotary_dim > 0 && spec.rotary_dim % 2 == 0 && spec.rotary_dim <= head_dim, where, ": rotary dim ",
        spec.rotary_dim, " must be even and within the head dim ", head_dim);
  CHECK(spec.rotary_dim / 2 <= kMropeMaxFrequencies, where, ": rotary dim ", spec.rotary_dim, " exceeds ",
        2 * kMropeMaxFrequencies);
  CHECK(spec.section[0] + spec.section[1] + spec.section[2] == spec.rotary_dim / 2, where, ": mrope_section [",
        spec.section[0], ", ", spec.section[1], ", ", spec.section[2], "] must sum to rotary_dim / 2 = ",
        spec.rotary_dim / 2);
}

__global__ void mrope_tables_kernel(MropeFrequencies freqs, const int64_t* positions, int64_t num_tokens,
                                    int64_t half, float* cos, float* sin) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= num_tokens * half) return;
  const int64_t t = index / half, j = index % half;
  const float angle = static_cast<float>(positions[freqs.axis[j] * num_tokens + t]) * freqs.inv_freq[j];
  cos[index] = cosf(angle);
  sin[index] = sinf(angle);
}

// sin_sign +1 rotates (forward), -1 applies the transpose (backward). Work item c of a head:
// c < half rotates the pair (c, c + half); otherwise channel c + half (>= R) is copied.
__global__ void mrope_rotate_kernel(const __nv_bfloat16* x, const float* cos, const float* sin, __nv_bfloat16* y,
                                    int64_t num_rows, int64_t head_dim, int64_t half, int64_t num_heads,
                                    float sin_sign) {
  const int64_t items_per_head = head_dim - half;
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= num_rows * items_per_head) return;
  const int64_t row = index / items_per_head, c = index % items_per_head;  // row = t * H + h
  const int64_t base = row * head_dim;
  if (c >= half) {
    y[base + c + half] = x[base + c + half];
    return;
  }
  const int64_t t = row / num_heads;
  const float cos_c = cos[t * half + c], sin_c = sin_sign * sin[t * half + c];
  const float first = __bfloat162float(x[base + c]), second = __bfloat162float(x[base + c + half]);
  y[base + c] = __float2bfloat16_rn(first * cos_c - second * sin_c);
  y[base + c + half] = __float2bfloat16_rn(second * cos_c + first * sin_c);
}

void launch_rotation(const MropeSpec& spec, const __nv_bfloat16* x, const float* cos, const float* sin,
                     __nv_bfloat16* y, int64_t num_tokens, int64_t num_heads, int64_t head_dim, float sin_sign,
                     cudaStream_t stream, const char* where) {
  check_spec(spec, head_dim, where);
  CHECK(num_tokens >= 0 && num_heads > 0, where, ": bad sizes T ", num_tokens, ", H ", num_heads);
  const int64_t half = spec.rotary_dim / 2;
  const int64_t items = num_tokens * num_heads * (head_dim - half);
  if (items == 0) return;
  constexpr int kThreads = 256;
  mrope_rotate_kernel<<<static_cast<unsigned>((items + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      x, cos, sin, y, num_tokens * num_heads, head_dim, half, num_heads, sin_sign);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void mrope_tables_cuda(const MropeSpec& spec, const int64_t* positions, int64_t num_tokens, float* cos, float* sin,
                       cudaStream_t stream) {
  check_spec(spec, spec.rotary_dim, "mrope_tables_cuda");
  CHECK(num_tokens >= 0, "mrope_tables_cuda: negative token count ", num_tokens);
  const int64_t half = spec.rotary_dim / 2;
  MropeFrequencies freqs{};
  for (int64_t j = 0; j < half; ++j) {
    // The reference's fp32 expression, term for term, so inv_freq is bit-identical.
    const float exponent = static_cast<float>(2 * j) / static_cast<float>(spec.rotary_dim);
    freqs.inv_freq[j] = 1.0f / std::pow(static_cast<float>(spec.theta), exponent);
    freqs.axis[j] = static_cast<int8_t>(mrope_axis_of_frequency(spec, j));
  }
  const int64_t items = num_tokens * half;
  if (items == 0) return;
  constexpr int kThreads = 256;
  mrope_tables_kernel<<<static_cast<unsigned>((items + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      freqs, positions, num_tokens, half, cos, sin);
  CUDA_CHECK_LAUNCH();
}

void mrope_forward_cuda(const MropeSpec& spec, const __nv_bfloat16* x, const float* cos, const float* sin,
                        __nv_bfloat16* y, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                        cudaStream_t stream) {
  launch_rotation(spec, x, cos, sin, y, num_tokens, num_heads, head_dim, 1.0f, stream, "mrope_forward_cuda");
}

void mrope_backward_cuda(const MropeSpec& spec, const __nv_bfloat16* dy, const float* cos, const float* sin,
                         __nv_bfloat16* dx, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                         cudaStream_t stream) {
  launch_rotation(spec, dy, cos, sin, dx, num_tokens, num_heads, head_dim, -1.0f, stream, "mrope_backward_cuda");
}

}  // namespace deltamoe
