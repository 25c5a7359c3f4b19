// CUDA vision RoPE: a thread per (patch, angle) for the tables, and a grid-stride rotation with a
// thread per (patch, head, two channel pairs) reading bf16x2 at c and c + D/2.
#include <algorithm>
#include <cmath>

#include "core/cuda_check.h"
#include "kernels/vision_rope/vision_rope_cuda.h"

namespace deltamoe {
namespace {

constexpr int kThreads = 256;

struct InverseFrequencies {
  float value[kVisionRopeMaxQuarter];
};

__global__ void vision_rope_tables_kernel(const int64_t* positions, int64_t num_patches, int64_t half,
                                          InverseFrequencies inv_freq, float* cos_out, float* sin_out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= num_patches * half) return;
  const int64_t n = i / half, c = i % half, quarter = half / 2;
  // First quarter of the angles from the row, second from the column (rotate_half layout).
  const float position = static_cast<float>(positions[n * 2 + (c < quarter ? 0 : 1)]);
  const float angle = position * inv_freq.value[c % quarter];
  cos_out[i] = cosf(angle);
  sin_out[i] = sinf(angle);
}

// kPairs consecutive channel pairs (c, c + half) per thread; sign = -1 rotates backwards. Heads
// are x_head / y_head apart; an output head wider than head_dim gets zeros past it (written by the
// thread of its first pairs).
template <int kPairs>
__global__ void vision_rope_rotate_kernel(const __nv_bfloat16* x, int64_t x_stride, int64_t x_head, __nv_bfloat16* y,
                                          int64_t y_stride, int64_t y_head, const float* cos_table,
                                          const float* sin_table, int64_t num_patches, int64_t num_heads,
                                          int64_t head_dim, float sign) {
  const int64_t half = head_dim / 2;
  const int64_t groups = half / kPairs;
  const int64_t total = num_patches * num_heads * groups;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = (i % groups) * kPairs;
    const int64_t head = (i / groups) % num_heads;
    const int64_t n = i / (groups * num_heads);
    const __nv_bfloat16* in = x + n * x_stride + head * x_head;
    __nv_bfloat16* out = y + n * y_stride + head * y_head;
    if (c == 0)
      for (int64_t pad = head_dim; pad < y_head; ++pad) out[pad] = __float2bfloat16_rn(0.0f);
    float a[kPairs], b[kPairs];
    if constexpr (kPairs == 2) {
      const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(in + c));
      const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(in + c + half));
      a[0] = lo.x, a[1] = lo.y, b[0] = hi.x, b[1] = hi.y;
    } else {
      a[0] = __bfloat162float(in[c]);
      b[0] = __bfloat162float(in[c + half]);
    }
    float out_a[kPairs], out_b[kPairs];
#pragma unroll
    for (int p = 0; p < kPairs; ++p) {
      const float cs = cos_table[n * half + c + p], sn = sign * sin_table[n * half + c + p];
      out_a[p] = a[p] * cs - b[p] * sn;
      out_b[p] = b[p] * cs + a[p] * sn;
    }
    if constexpr (kPairs == 2) {
      *reinterpret_cast<__nv_bfloat162*>(out + c) = __floats2bfloat162_rn(out_a[0], out_a[1]);
      *reinterpret_cast<__nv_bfloat162*>(out + c + half) = __floats2bfloat162_rn(out_b[0], out_b[1]);
    } else {
      out[c] = __float2bfloat16_rn(out_a[0]);
      out[c + half] = __float2bfloat16_rn(out_b[0]);
    }
  }
}

void check_head_dim(const char* where, int64_t head_dim) {
  CHECK(head_dim > 0 && head_dim % 4 == 0, where, ": head_dim ", head_dim, " must be a positive multiple of 4");
}

void launch_rotation(const char* where, const __nv_bfloat16* x, int64_t x_stride, int64_t x_head, __nv_bfloat16* y,
                     int64_t y_stride, int64_t y_head, const float* cos, const float* sin, int64_t num_patches,
                     int64_t num_heads, int64_t head_dim, float sign, cudaStream_t stream) {
  check_head_dim(where, head_dim);
  CHECK(num_patches >= 0 && num_heads > 0, where, ": bad size patches ", num_patches, ", heads ", num_heads);
  if (x_head == 0) x_head = head_dim;
  if (y_head == 0) y_head = head_dim;
  CHECK(x_head >= head_dim && y_head >= head_dim, where, ": head strides ", x_head, " (in) and ", y_head,
        " (out) must be 0 or at least head_dim ", head_dim);
  CHECK(x_stride >= num_heads * x_head && y_stride >= num_heads * y_head, where, ": patch strides ", x_stride,
        " (in) and ", y_stride, " (out) must cover ", num_heads, " heads ", x_head, " and ", y_head, " apart");
  CHECK(x != y || (x_stride == y_stride && x_head == y_head), where, ": in-place rotation needs equal strides, got ",
        x_stride, " and ", y_stride);
  if (num_patches == 0) return;
  auto aligned4 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 3u) == 0; };
  // D % 4 == 0 keeps c and c + D/2 even: pairs of channels are 4-byte aligned when rows are.
  const bool paired =
      aligned4(x) && aligned4(y) && x_stride % 2 == 0 && y_stride % 2 == 0 && x_head % 2 == 0 && y_head % 2 == 0;
  const int64_t work = num_patches * num_heads * (head_dim / 2) / (paired ? 2 : 1);
  const unsigned blocks =
      static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, 132 * 16)));
  if (paired) {
    vision_rope_rotate_kernel<2><<<blocks, kThreads, 0, stream>>>(x, x_stride, x_head, y, y_stride, y_head, cos, sin,
                                                                  num_patches, num_heads, head_dim, sign);
  } else {
    vision_rope_rotate_kernel<1><<<blocks, kThreads, 0, stream>>>(x, x_stride, x_head, y, y_stride, y_head, cos, sin,
                                                                  num_patches, num_heads, head_dim, sign);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void vision_rope_tables_cuda(const int64_t* positions, int64_t num_patches, int64_t head_dim, double theta,
                             float* cos, float* sin, cudaStream_t stream) {
  check_head_dim("vision_rope_tables_cuda", head_dim);
  CHECK(head_dim / 4 <= kVisionRopeMaxQuarter, "vision_rope_tables_cuda: head_dim ", head_dim, " above the ",
        4 * kVisionRopeMaxQuarter, " the table kernel takes");
  CHECK(theta > 0, "vision_rope_tables_cuda: theta must be > 0, got ", theta);
  CHECK(num_patches >= 0, "vision_rope_tables_cuda: bad patch count ", num_patches);
  if (num_patches == 0) return;
  const int64_t half = head_dim / 2, quarter = head_dim / 4;
  InverseFrequencies inv_freq{};
  for (int64_t j = 0; j < quarter; ++j) {
    // The reference's fp32 expression, term by term, so that both sides hold the same floats.
    const float exponent = static_cast<float>(2 * j) / static_cast<float>(half);
    inv_freq.value[j] = 1.0f / std::pow(static_cast<float>(theta), exponent);
  }
  const int64_t total = num_patches * half;
  vision_rope_tables_kernel<<<static_cast<unsigned>((total + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      positions, num_patches, half, inv_freq, cos, sin);
  CUDA_CHECK_LAUNCH();
}

void vision_rope_forward_cuda(const __nv_bfloat16* x, int64_t x_patch_stride, __nv_bfloat16* y,
                              int64_t y_patch_stride, const float* cos, const float* sin, int64_t num_patches,
                              int64_t num_heads, int64_t head_dim, cudaStream_t stream, int64_t y_head_stride) {
  launch_rotation("vision_rope_forward_cuda", x, x_patch_stride, head_dim, y, y_patch_stride, y_head_stride, cos, sin,
                  num_patches, num_heads, head_dim, 1.0f, stream);
}

void vision_rope_backward_cuda(const __nv_bfloat16* dy, int64_t dy_patch_stride, __nv_bfloat16* dx,
                               int64_t dx_patch_stride, const float* cos, const float* sin, int64_t num_patches,
                               int64_t num_heads, int64_t head_dim, cudaStream_t stream, int64_t dy_head_stride) {
  launch_rotation("vision_rope_backward_cuda", dy, dy_patch_stride, dy_head_stride, dx, dx_patch_stride, head_dim, cos,
                  sin, num_patches, num_heads, head_dim, -1.0f, stream);
}

}  // namespace deltamoe
