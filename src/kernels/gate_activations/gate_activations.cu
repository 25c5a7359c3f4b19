// CUDA kernels of the attention output gate and SwiGLU: element-wise, one thread per kVec
// consecutive values of a row (16-byte accesses when widths, strides and pointers allow).
#include "core/cuda_check.h"
#include "kernels/gate_activations/gate_activations_cuda.h"
#include "kernels/gemm/bf16_vector.cuh"

namespace deltamoe {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

unsigned blocks_for(int64_t items) { return static_cast<unsigned>((items + kThreads - 1) / kThreads); }

template <int kVec>
__global__ void attention_gate_forward_kernel(const __nv_bfloat16* attn, const __nv_bfloat16* gate,
                                              int64_t gate_stride, __nv_bfloat16* y, int64_t rows, int64_t width) {
  const int64_t per_row = width / kVec;
  const int64_t index = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (index >= rows * per_row) return;
  const int64_t r = index / per_row, c = (index % per_row) * kVec;
  float o[kVec], g[kVec];
  load_bf16_as_f32<kVec>(attn + r * width + c, o);
  load_bf16_as_f32<kVec>(gate + r * gate_stride + c, g);
#pragma unroll
  for (int i = 0; i < kVec; ++i) o[i] *= sigmoid(g[i]);
  store_f32_as_bf16<kVec>(y + r * width + c, o);
}

template <int kVec>
__global__ void attention_gate_backward_kernel(const __nv_bfloat16* attn, const __nv_bfloat16* gate,
                                               int64_t gate_stride, const __nv_bfloat16* dy, __nv_bfloat16* d_attn,
                                               __nv_bfloat16* d_gate, int64_t d_gate_stride, int64_t rows,
                                               int64_t width) {
  const int64_t per_row = width / kVec;
  const int64_t index = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (index >= rows * per_row) return;
  const int64_t r = index / per_row, c = (index % per_row) * kVec;
  float o[kVec], g[kVec], grad[kVec], d_o[kVec], d_g[kVec];
  load_bf16_as_f32<kVec>(attn + r * width + c, o);
  load_bf16_as_f32<kVec>(gate + r * gate_stride + c, g);
  load_bf16_as_f32<kVec>(dy + r * width + c, grad);
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const float s = sigmoid(g[i]);
    d_o[i] = grad[i] * s;
    d_g[i] = grad[i] * o[i] * s * (1.0f - s);
  }
  store_f32_as_bf16<kVec>(d_attn + r * width + c, d_o);
  store_f32_as_bf16<kVec>(d_gate + r * d_gate_stride + c, d_g);
}

template <int kVec>
__global__ void swiglu_forward_kernel(const __nv_bfloat16* gate_up, __nv_bfloat16* h, int64_t rows,
                                      int64_t intermediate) {
  const int64_t per_row = intermediate / kVec;
  const int64_t index = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (index >= rows * per_row) return;
  const int64_t r = index / per_row, c = (index % per_row) * kVec;
  float g[kVec], u[kVec];
  load_bf16_as_f32<kVec>(gate_up + r * 2 * intermediate + c, g);
  load_bf16_as_f32<kVec>(gate_up + r * 2 * intermediate + intermediate + c, u);
#pragma unroll
  for (int i = 0; i < kVec; ++i) g[i] = g[i] * sigmoid(g[i]) * u[i];
  store_f32_as_bf16<kVec>(h + r * intermediate + c, g);
}

template <int kVec>
__global__ void swiglu_backward_kernel(const __nv_bfloat16* gate_up, const __nv_bfloat16* dh,
                                       __nv_bfloat16* d_gate_up, int64_t rows, int64_t intermediate) {
  const int64_t per_row = intermediate / kVec;
  const int64_t index = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (index >= rows * per_row) return;
  const int64_t r = index / per_row, c = (index % per_row) * kVec;
  float g[kVec], u[kVec], grad[kVec], d_g[kVec], d_u[kVec];
  load_bf16_as_f32<kVec>(gate_up + r * 2 * intermediate + c, g);
  load_bf16_as_f32<kVec>(gate_up + r * 2 * intermediate + intermediate + c, u);
  load_bf16_as_f32<kVec>(dh + r * intermediate + c, grad);
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const float s = sigmoid(g[i]);
    d_g[i] = grad[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
    d_u[i] = grad[i] * g[i] * s;
  }
  store_f32_as_bf16<kVec>(d_gate_up + r * 2 * intermediate + c, d_g);
  store_f32_as_bf16<kVec>(d_gate_up + r * 2 * intermediate + intermediate + c, d_u);
}

void check_sizes(int64_t rows, int64_t width, const char* where) {
  CHECK(rows >= 0 && width > 0, where, ": bad sizes rows ", rows, ", width ", width);
}

}  // namespace

void attention_gate_forward_cuda(const __nv_bfloat16* attn, const __nv_bfloat16* gate, int64_t gate_row_stride,
                                 __nv_bfloat16* y, int64_t rows, int64_t width, cudaStream_t stream) {
  check_sizes(rows, width, "attention_gate_forward_cuda");
  CHECK(gate_row_stride >= width, "attention_gate_forward_cuda: gate row stride ", gate_row_stride,
        " is shorter than the width ", width);
  if (rows == 0) return;
  if (can_use_vec8(width, attn, gate, y) && gate_row_stride % 8 == 0) {
    attention_gate_forward_kernel<8>
        <<<blocks_for(rows * width / 8), kThreads, 0, stream>>>(attn, gate, gate_row_stride, y, rows, width);
  } else {
    attention_gate_forward_kernel<1>
        <<<blocks_for(rows * width), kThreads, 0, stream>>>(attn, gate, gate_row_stride, y, rows, width);
  }
  CUDA_CHECK_LAUNCH();
}

void attention_gate_backward_cuda(const __nv_bfloat16* attn, const __nv_bfloat16* gate, int64_t gate_row_stride,
                                  const __nv_bfloat16* dy, __nv_bfloat16* d_attn, __nv_bfloat16* d_gate,
                                  int64_t d_gate_row_stride, int64_t rows, int64_t width, cudaStream_t stream) {
  check_sizes(rows, width, "attention_gate_backward_cuda");
  CHECK(gate_row_stride >= width && d_gate_row_stride >= width, "attention_gate_backward_cuda: gate row strides ",
        gate_row_stride, " and ", d_gate_row_stride, " must cover the width ", width);
  if (rows == 0) return;
  if (can_use_vec8(width, attn, gate, dy, d_attn) && can_use_vec8(width, d_gate) && gate_row_stride % 8 == 0 &&
      d_gate_row_stride % 8 == 0) {
    attention_gate_backward_kernel<8><<<blocks_for(rows * width / 8), kThreads, 0, stream>>>(
        attn, gate, gate_row_stride, dy, d_attn, d_gate, d_gate_row_stride, rows, width);
  } else {
    attention_gate_backward_kernel<1><<<blocks_for(rows * width), kThreads, 0, stream>>>(
        attn, gate, gate_row_stride, dy, d_attn, d_gate, d_gate_row_stride, rows, width);
  }
  CUDA_CHECK_LAUNCH();
}

void swiglu_forward_cuda(const __nv_bfloat16* gate_up, __nv_bfloat16* h, int64_t rows, int64_t intermediate,
                         cudaStream_t stream) {
  check_sizes(rows, intermediate, "swiglu_forward_cuda");
  if (rows == 0) return;
  if (can_use_vec8(intermediate, gate_up, h)) {
    swiglu_forward_kernel<8><<<blocks_for(rows * intermediate / 8), kThreads, 0, stream>>>(gate_up, h, rows,
                                                                                          intermediate);
  } else {
    swiglu_forward_kernel<1><<<blocks_for(rows * intermediate), kThreads, 0, stream>>>(gate_up, h, rows,
                                                                                      intermediate);
  }
  CUDA_CHECK_LAUNCH();
}

void swiglu_backward_cuda(const __nv_bfloat16* gate_up, const __nv_bfloat16* dh, __nv_bfloat16* d_gate_up,
                          int64_t rows, int64_t intermediate, cudaStream_t stream) {
  check_sizes(rows, intermediate, "swiglu_backward_cuda");
  if (rows == 0) return;
  if (can_use_vec8(intermediate, gate_up, dh, d_gate_up)) {
    swiglu_backward_kernel<8><<<blocks_for(rows * intermediate / 8), kThreads, 0, stream>>>(gate_up, dh, d_gate_up,
                                                                                           rows, intermediate);
  } else {
    swiglu_backward_kernel<1><<<blocks_for(rows * intermediate), kThreads, 0, stream>>>(gate_up, dh, d_gate_up,
                                                                                       rows, intermediate);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
