// CUDA GELU kernels: element-wise forward (with the bias add fused), element-wise backward, and a
// column-walking backward that also writes per-chunk bias-gradient partials (reduced in order).
#include <algorithm>

#include "core/cuda_check.h"
#include "kernels/common/block_column_sums.cuh"
#include "kernels/bias_add/bias_add_cuda.h"
#include "kernels/gelu/gelu_cuda.h"
#include "kernels/gemm/bf16_vector.cuh"

namespace deltamoe {
namespace {

constexpr int kThreads = 256;
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;
constexpr float kCubic = 0.044715f;

template <GeluKind kKind>
__device__ __forceinline__ float gelu_value(float x) {
  if constexpr (kKind == GeluKind::exact) {
    return 0.5f * x * (1.0f + erff(x * kInvSqrt2));
  } else {
    return 0.5f * x * (1.0f + tanhf(kSqrt2OverPi * (x + kCubic * x * x * x)));
  }
}

template <GeluKind kKind>
__device__ __forceinline__ float gelu_derivative(float x) {
  if constexpr (kKind == GeluKind::exact) {
    return 0.5f * (1.0f + erff(x * kInvSqrt2)) + x * kInvSqrt2Pi * __expf(-0.5f * x * x);
  } else {
    const float t = tanhf(kSqrt2OverPi * (x + kCubic * x * x * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kCubic * x * x);
  }
}

unsigned grid_stride_blocks(int64_t work) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, 132 * 16)));
}

template <GeluKind kKind, int kVec>
__global__ void gelu_forward_kernel(const __nv_bfloat16* x, const __nv_bfloat16* bias, __nv_bfloat16* pre_out,
                                    __nv_bfloat16* y, int64_t rows, int64_t features) {
  const int64_t vectors_per_row = features / kVec;
  const int64_t total = rows * vectors_per_row;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < total;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = (v % vectors_per_row) * kVec;
    const int64_t offset = (v / vectors_per_row) * features + c;
    float h[kVec], out[kVec];
    load_bf16_as_f32<kVec>(x + offset, h);
    if (bias != nullptr) {
      float b[kVec];
      load_bf16_as_f32<kVec>(bias + c, b);
      // The activation sees the bias-added value as stored in bf16, as the backward will.
#pragma unroll
      for (int i = 0; i < kVec; ++i) h[i] = __bfloat162float(__float2bfloat16_rn(h[i] + b[i]));
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) out[i] = gelu_value<kKind>(h[i]);
    if (pre_out != nullptr) store_f32_as_bf16<kVec>(pre_out + offset, h);
    store_f32_as_bf16<kVec>(y + offset, out);
  }
}

template <GeluKind kKind, int kVec>
__global__ void gelu_backward_kernel(const __nv_bfloat16* h, const __nv_bfloat16* dy, __nv_bfloat16* dx,
                                     int64_t count) {
  const int64_t total = count / kVec;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < total;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float hv[kVec], g[kVec];
    load_bf16_as_f32<kVec>(h + v * kVec, hv);
    load_bf16_as_f32<kVec>(dy + v * kVec, g);
#pragma unroll
    for (int i = 0; i < kVec; ++i) g[i] *= gelu_derivative<kKind>(hv[i]);
    store_f32_as_bf16<kVec>(dx + v * kVec, g);
  }
}

// dx written and the chunk's column sums to partial. A block covers kColumnSumThreads * kVec
// columns (kVec consecutive ones per thread, 16-byte accesses for kVec = 8) and the chunk's rows,
// its kColumnSumRows thread rows taking every kColumnSumRows-th row (block_column_sums.cuh).
template <GeluKind kKind, int kVec>
__global__ void gelu_backward_bias_kernel(const __nv_bfloat16* h, const __nv_bfloat16* dy, __nv_bfloat16* dx,
                                          float* partial, int64_t rows, int64_t features, int64_t rows_per_chunk) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kColumnSumThreads + threadIdx.x) * kVec;
  const int64_t chunk = blockIdx.y;
  const int64_t row_end = std::min(rows, (chunk + 1) * rows_per_chunk);
  float acc[kVec] = {};
  if (c < features) {
    for (int64_t r = chunk * rows_per_chunk + threadIdx.y; r < row_end; r += kColumnSumRows) {
      const int64_t i = r * features + c;
      float hv[kVec], g[kVec];
      load_bf16_as_f32<kVec>(h + i, hv);
      load_bf16_as_f32<kVec>(dy + i, g);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        g[k] *= gelu_derivative<kKind>(hv[k]);
        acc[k] += g[k];
      }
      store_f32_as_bf16<kVec>(dx + i, g);
    }
  }
  store_block_column_sums<kVec>(acc, c < features, partial + chunk * features + c);
}

template <GeluKind kKind>
void launch_forward(const __nv_bfloat16* x, const __nv_bfloat16* bias, __nv_bfloat16* pre_out, __nv_bfloat16* y,
                    int64_t rows, int64_t features, cudaStream_t stream) {
  if (can_use_vec8(features, x, bias, pre_out, y)) {
    gelu_forward_kernel<kKind, 8><<<grid_stride_blocks(rows * features / 8), kThreads, 0, stream>>>(
        x, bias, pre_out, y, rows, features);
  } else {
    gelu_forward_kernel<kKind, 1><<<grid_stride_blocks(rows * features), kThreads, 0, stream>>>(x, bias, pre_out, y,
                                                                                               rows, features);
  }
  CUDA_CHECK_LAUNCH();
}

template <GeluKind kKind>
void launch_backward(const __nv_bfloat16* h, const __nv_bfloat16* dy, __nv_bfloat16* dx, float* d_bias, int64_t rows,
                     int64_t features, void* workspace, cudaStream_t stream) {
  if (d_bias == nullptr) {
    const int64_t count = rows * features;
    if (can_use_vec8(count, h, dy, dx)) {
      gelu_backward_kernel<kKind, 8><<<grid_stride_blocks(count / 8), kThreads, 0, stream>>>(h, dy, dx, count);
    } else {
      gelu_backward_kernel<kKind, 1><<<grid_stride_blocks(count), kThreads, 0, stream>>>(h, dy, dx, count);
    }
    CUDA_CHECK_LAUNCH();
    return;
  }
  float* partial = static_cast<float*>(workspace);
  const int64_t chunks =
      can_use_vec8(features, h, dy, dx)
          ? launch_column_sums(gelu_backward_bias_kernel<kKind, 8>, 8, rows, features, stream, h, dy, dx, partial)
          : launch_column_sums(gelu_backward_bias_kernel<kKind, 1>, 1, rows, features, stream, h, dy, dx, partial);
  column_partials_reduce_cuda(partial, chunks, features, d_bias, stream);
}

}  // namespace

void gelu_forward_cuda(GeluKind kind, const __nv_bfloat16* x, const __nv_bfloat16* bias, __nv_bfloat16* pre_out,
                       __nv_bfloat16* y, int64_t rows, int64_t features, cudaStream_t stream) {
  CHECK(rows >= 0 && features > 0, "gelu_forward_cuda: bad size rows ", rows, ", features ", features);
  CHECK(pre_out == nullptr || bias != nullptr,
        "gelu_forward_cuda: pre_out is only written with a bias (without one the input is the activation input)");
  if (rows == 0) return;
  if (kind == GeluKind::exact) {
    launch_forward<GeluKind::exact>(x, bias, pre_out, y, rows, features, stream);
  } else {
    launch_forward<GeluKind::tanh>(x, bias, pre_out, y, rows, features, stream);
  }
}

size_t gelu_backward_workspace_bytes(int64_t rows, int64_t features, bool with_bias_grad) {
  return with_bias_grad ? bias_add_backward_workspace_bytes(rows, features) : 0;
}

void gelu_backward_cuda(GeluKind kind, const __nv_bfloat16* h, const __nv_bfloat16* dy, __nv_bfloat16* dx,
                        float* d_bias, int64_t rows, int64_t features, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream) {
  CHECK(rows >= 0 && features > 0, "gelu_backward_cuda: bad size rows ", rows, ", features ", features);
  const size_t needed = gelu_backward_workspace_bytes(rows, features, d_bias != nullptr);
  CHECK(workspace_bytes >= needed, "gelu_backward_cuda: workspace of ", workspace_bytes, " bytes, needs ", needed);
  if (rows == 0) return;
  if (kind == GeluKind::exact) {
    launch_backward<GeluKind::exact>(h, dy, dx, d_bias, rows, features, workspace, stream);
  } else {
    launch_backward<GeluKind::tanh>(h, dy, dx, d_bias, rows, features, workspace, stream);
  }
}

}  // namespace deltamoe
