// CUDA LayerNorm over the fp32 stream: one warp per row for the forward (mean, then squared deviations, then output:
// the row stays in L1) and for dx; a column-walking pass for d_weight / d_bias partials per row
// chunk, reduced in a fixed order (no atomics, same bits every run).
#include <algorithm>

#include "core/cuda_check.h"
#include "kernels/bias_add/bias_add_cuda.h"
#include "kernels/gemm/bf16_vector.cuh"
#include "kernels/layer_norm/layer_norm_cuda.h"

namespace deltamoe {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kColumnsPerBlock = 256;

using Bf16 = __nv_bfloat16;

// kVec values of s = residual (+ delta, added in fp32: the stream is not rounded).
template <int kVec>
__device__ __forceinline__ void load_input(const Bf16* delta, const float* residual, int64_t offset,
                                           float (&s)[kVec]) {
  load_as_f32<kVec>(residual + offset, s);
  if (delta != nullptr) {
    float d[kVec];
    load_as_f32<kVec>(delta + offset, d);
#pragma unroll
    for (int i = 0; i < kVec; ++i) s[i] += d[i];
  }
}

template <int kVec>
__global__ void layer_norm_forward_kernel(const Bf16* delta, const float* residual, float* sum_out,
                                          const float* weight, const float* bias, Bf16* y, float* mean, float* rstd,
                                          int64_t rows, int64_t hidden, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const int64_t base = row * hidden;
  float sum = 0;
  for (int64_t c = lane * kVec; c < hidden; c += 32 * kVec) {
    float s[kVec];
    load_input<kVec>(delta, residual, base + c, s);
#pragma unroll
    for (int i = 0; i < kVec; ++i) sum += s[i];
  }
  const float mu = warp_sum(sum) / static_cast<float>(hidden);
  // Deviations from the mean in a second pass: no cancellation for rows with a large offset.
  float squares = 0;
  for (int64_t c = lane * kVec; c < hidden; c += 32 * kVec) {
    float s[kVec];
    load_input<kVec>(delta, residual, base + c, s);
#pragma unroll
    for (int i = 0; i < kVec; ++i) squares += (s[i] - mu) * (s[i] - mu);
  }
  const float inv_std = rsqrtf(warp_sum(squares) / static_cast<float>(hidden) + eps);
  if (lane == 0) {
    mean[row] = mu;
    rstd[row] = inv_std;
  }
  for (int64_t c = lane * kVec; c < hidden; c += 32 * kVec) {
    float s[kVec], w[kVec], b[kVec], out[kVec];
    load_input<kVec>(delta, residual, base + c, s);
    load_as_f32<kVec>(weight + c, w);
    load_as_f32<kVec>(bias + c, b);
#pragma unroll
    for (int i = 0; i < kVec; ++i) out[i] = (s[i] - mu) * inv_std * w[i] + b[i];
    // sum_out may alias residual: each element is read and written by the same lane, and this is
    // the last pass that reads it.
    if (sum_out != nullptr) store_from_f32<kVec>(sum_out + base + c, s);
    store_from_f32<kVec>(y + base + c, out);
  }
}

template <int kVec, typename TDy>
__global__ void layer_norm_backward_dx_kernel(const float* x, const float* weight, const float* mean,
                                              const float* rstd, const TDy* dy, const float* d_skip, float* dx,
                                              Bf16* dx_bf16, int64_t rows, int64_t hidden) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const int64_t base = row * hidden;
  const float mu = mean[row], inv_std = rstd[row];
  // g = dy * w, xhat = (x - mu) * rstd: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
  float sum_g = 0, sum_g_xhat = 0;
  for (int64_t c = lane * kVec; c < hidden; c += 32 * kVec) {
    float xv[kVec], w[kVec], g[kVec];
    load_as_f32<kVec>(x + base + c, xv);
    load_as_f32<kVec>(weight + c, w);
    load_as_f32<kVec>(dy + base + c, g);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float gw = g[i] * w[i];
      sum_g += gw;
      sum_g_xhat += gw * (xv[i] - mu) * inv_std;
    }
  }
  const float mean_g = warp_sum(sum_g) / static_cast<float>(hidden);
  const float mean_g_xhat = warp_sum(sum_g_xhat) / static_cast<float>(hidden);
  for (int64_t c = lane * kVec; c < hidden; c += 32 * kVec) {
    float xv[kVec], w[kVec], g[kVec], out[kVec];
    load_as_f32<kVec>(x + base + c, xv);
    load_as_f32<kVec>(weight + c, w);
    load_as_f32<kVec>(dy + base + c, g);
#pragma unroll
    for (int i = 0; i < kVec; ++i) out[i] = inv_std * (g[i] * w[i] - mean_g - (xv[i] - mu) * inv_std * mean_g_xhat);
    if (d_skip != nullptr) {
      float skip[kVec];
      load_as_f32<kVec>(d_skip + base + c, skip);
#pragma unroll
      for (int i = 0; i < kVec; ++i) out[i] += skip[i];
    }
    store_from_f32<kVec>(dx + base + c, out);
    if (dx_bf16 != nullptr) store_from_f32<kVec>(dx_bf16 + base + c, out);
  }
}

// partial_w[chunk, c] = sum over the chunk's rows of dy * xhat; partial_b[chunk, c] = sum of dy.
template <typename TDy>
__global__ void layer_norm_param_partial_kernel(const float* x, const float* mean, const float* rstd, const TDy* dy, float* partial_w, float* partial_b,
                                                int64_t rows, int64_t hidden, int64_t rows_per_chunk) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColumnsPerBlock + threadIdx.x;
  if (c >= hidden) return;
  const int64_t chunk = blockIdx.y;
  const int64_t row_end = std::min(rows, (chunk + 1) * rows_per_chunk);
  float acc_w = 0, acc_b = 0;
  for (int64_t r = chunk * rows_per_chunk; r < row_end; ++r) {
    const float g = to_f32(dy[r * hidden + c]);
    acc_w += g * ((x[r * hidden + c] - mean[r]) * rstd[r]);
    acc_b += g;
  }
  partial_w[chunk * hidden + c] = acc_w;
  partial_b[chunk * hidden + c] = acc_b;
}

}  // namespace

void layer_norm_forward_cuda(const Bf16* delta, const float* residual, float* sum_out, const float* weight,
                             const float* bias, Bf16* y, float* mean, float* rstd, int64_t rows, int64_t hidden,
                             double eps, cudaStream_t stream) {
  CHECK((delta == nullptr) == (sum_out == nullptr),
        "layer_norm_forward_cuda: delta and sum_out must be given together (the stream is only rewritten when a "
        "block output is added to it)");
  CHECK(rows >= 0 && hidden > 0, "layer_norm_forward_cuda: bad size rows ", rows, ", hidden ", hidden);
  CHECK(eps >= 0, "layer_norm_forward_cuda: eps must be >= 0, got ", eps);
  CHECK(residual != nullptr && weight != nullptr && bias != nullptr,
        "layer_norm_forward_cuda: the stream, weight and bias are required");
  if (rows == 0) return;
  const unsigned blocks = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  if (can_use_vec8(hidden, delta, residual, sum_out, y) && can_use_vec8(hidden, weight, bias)) {
    layer_norm_forward_kernel<8><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
        delta, residual, sum_out, weight, bias, y, mean, rstd, rows, hidden, static_cast<float>(eps));
  } else {
    layer_norm_forward_kernel<1><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
        delta, residual, sum_out, weight, bias, y, mean, rstd, rows, hidden, static_cast<float>(eps));
  }
  CUDA_CHECK_LAUNCH();
}

size_t layer_norm_backward_workspace_bytes(int64_t rows, int64_t hidden) {
  return 2 * bias_add_backward_workspace_bytes(rows, hidden);
}

namespace {

template <typename TDy>
void launch_backward(const float* x, const float* weight, const float* mean, const float* rstd, const TDy* dy,
                     const float* d_skip, float* dx, Bf16* dx_bf16, float* d_weight, float* d_bias, int64_t rows,
                     int64_t hidden, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  CHECK(rows >= 0 && hidden > 0, "layer_norm_backward_cuda: bad size rows ", rows, ", hidden ", hidden);
  const bool params = d_weight != nullptr || d_bias != nullptr;
  const size_t needed = params ? layer_norm_backward_workspace_bytes(rows, hidden) : 0;
  CHECK(workspace_bytes >= needed, "layer_norm_backward_cuda: workspace of ", workspace_bytes, " bytes, needs ",
        needed);
  if (rows == 0) return;
  const unsigned blocks = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  if (can_use_vec8(hidden, x, dy, d_skip, dx) && can_use_vec8(hidden, weight, dx_bf16)) {
    layer_norm_backward_dx_kernel<8, TDy><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
        x, weight, mean, rstd, dy, d_skip, dx, dx_bf16, rows, hidden);
  } else {
    layer_norm_backward_dx_kernel<1, TDy><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
        x, weight, mean, rstd, dy, d_skip, dx, dx_bf16, rows, hidden);
  }
  CUDA_CHECK_LAUNCH();
  if (!params) return;
  const int64_t chunks = column_sum_num_chunks(rows);
  float* partial_w = static_cast<float*>(workspace);
  float* partial_b = partial_w + chunks * hidden;
  const unsigned column_blocks = static_cast<unsigned>((hidden + kColumnsPerBlock - 1) / kColumnsPerBlock);
  layer_norm_param_partial_kernel<TDy><<<dim3(column_blocks, static_cast<unsigned>(chunks)), kColumnsPerBlock, 0,
                                         stream>>>(x, mean, rstd, dy, partial_w, partial_b, rows, hidden,
                                                   column_sum_rows_per_chunk(rows));
  CUDA_CHECK_LAUNCH();
  if (d_weight != nullptr) column_partials_reduce_cuda(partial_w, chunks, hidden, d_weight, stream);
  if (d_bias != nullptr) column_partials_reduce_cuda(partial_b, chunks, hidden, d_bias, stream);
}

}  // namespace

void layer_norm_backward_cuda(const float* x, const float* weight, const float* mean, const float* rstd,
                              const Bf16* dy, const float* d_skip, float* dx, Bf16* dx_bf16, float* d_weight,
                              float* d_bias, int64_t rows, int64_t hidden, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream) {
  launch_backward(x, weight, mean, rstd, dy, d_skip, dx, dx_bf16, d_weight, d_bias, rows, hidden, workspace,
                  workspace_bytes, stream);
}

void layer_norm_backward_cuda(const float* x, const float* weight, const float* mean, const float* rstd,
                              const float* dy, const float* d_skip, float* dx, Bf16* dx_bf16, float* d_weight,
                              float* d_bias, int64_t rows, int64_t hidden, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream) {
  launch_backward(x, weight, mean, rstd, dy, d_skip, dx, dx_bf16, d_weight, d_bias, rows, hidden, workspace,
                  workspace_bytes, stream);
}

}  // namespace deltamoe
