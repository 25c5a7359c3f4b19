// CUDA kernels of partial interleaved M-RoPE: a table kernel (thread per token x frequency) and
// one rotation kernel for both directions (warp per head row, 8 channels per access).
#include <cmath>
#include <cstdint>

#include "core/cuda_check.h"
#include "kernels/gemm/bf16_vector.cuh"
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

// sin_sign +1 rotates (forward), -1 applies the transpose (backward). One warp per row (t, h),
// each lane taking N-channel vectors: a vector in the first half of the rotated channels is loaded
// with its partner half channels further, both rotated and stored; vectors past the rotated
// channels are copied, unless y aliases x (every caller rotates in place), so an in-place call
// moves only the R rotated channels of each row. N = 8: 16-byte accesses (D and R / 2 multiples of
// 8, rows 16-byte aligned: checked by the launcher); N = 1 takes any shape.
template <int N>
__global__ void mrope_rotate_kernel(const __nv_bfloat16* x, const float* cos, const float* sin, __nv_bfloat16* y,
                                    int num_rows, int head_dim, int half, int num_heads, float sin_sign) {
  const int row = static_cast<int>((static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32);
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (row >= num_rows) return;
  const int t = row / num_heads;  // row = t * H + h
  const int64_t base = static_cast<int64_t>(row) * head_dim;
  const bool copy_rest = x != y;
  for (int c = lane * N; c < head_dim; c += 32 * N) {
    if (c < half) {
      float first[N], second[N], cos_c[N], sin_c[N];
      load_bf16_as_f32<N>(x + base + c, first);
      load_bf16_as_f32<N>(x + base + c + half, second);
      load_as_f32<N>(cos + static_cast<int64_t>(t) * half + c, cos_c);
      load_as_f32<N>(sin + static_cast<int64_t>(t) * half + c, sin_c);
      float out_first[N], out_second[N];
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const float s = sin_sign * sin_c[i];
        out_first[i] = first[i] * cos_c[i] - second[i] * s;
        out_second[i] = second[i] * cos_c[i] + first[i] * s;
      }
      store_f32_as_bf16<N>(y + base + c, out_first);
      store_f32_as_bf16<N>(y + base + c + half, out_second);
    } else if (c >= 2 * half && copy_rest) {
      float rest[N];
      load_bf16_as_f32<N>(x + base + c, rest);
      store_f32_as_bf16<N>(y + base + c, rest);
    }
  }
}

void launch_rotation(const MropeSpec& spec, const __nv_bfloat16* x, const float* cos, const float* sin,
                     __nv_bfloat16* y, int64_t num_tokens, int64_t num_heads, int64_t head_dim, float sin_sign,
                     cudaStream_t stream, const char* where) {
  check_spec(spec, head_dim, where);
  CHECK(num_tokens >= 0 && num_heads > 0, where, ": bad sizes T ", num_tokens, ", H ", num_heads);
  const int64_t half = spec.rotary_dim / 2, rows = num_tokens * num_heads;
  if (rows == 0) return;
  CHECK(rows < (int64_t{1} << 31) && head_dim < (int64_t{1} << 31), where, ": ", rows, " rows of ", head_dim,
        " channels exceed 32-bit row indices");
  constexpr int kThreads = 256, kRowsPerBlock = kThreads / 32;
  const auto blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  const bool vec8 = head_dim % 8 == 0 && half % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(y) % 16 == 0 && reinterpret_cast<uintptr_t>(cos) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(sin) % 16 == 0;
  const int n_rows = static_cast<int>(rows), d = static_cast<int>(head_dim), h = static_cast<int>(half);
  const int heads = static_cast<int>(num_heads);
  if (vec8)
    mrope_rotate_kernel<8><<<blocks, kThreads, 0, stream>>>(x, cos, sin, y, n_rows, d, h, heads, sin_sign);
  else
    mrope_rotate_kernel<1><<<blocks, kThreads, 0, stream>>>(x, cos, sin, y, n_rows, d, h, heads, sin_sign);
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
