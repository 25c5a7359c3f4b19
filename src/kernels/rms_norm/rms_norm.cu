// CUDA kernels of the zero-centred RMSNorm: one warp per row for the forward and the dx backward,
// a column-parallel pass for d_weight that writes per-chunk partials and a fixed-order reduction.
// Templated on the element types so that the fp32 residual stream and the bf16 head rows share
// one implementation; the math is fp32 throughout.
#include <algorithm>

#include "core/cuda_check.h"
#include "kernels/gemm/bf16_vector.cuh"
#include "kernels/rms_norm/rms_norm_cuda.h"

namespace deltamoe {

namespace {

using Bf16 = __nv_bfloat16;

constexpr int kWarpsPerBlock = 8;
constexpr int kColumnsPerBlock = 256;
constexpr int64_t kMinRowsPerChunk = 64;
constexpr int64_t kMaxChunks = 256;

int64_t num_row_chunks(int64_t rows) {
  return std::max<int64_t>(1, std::min(kMaxChunks, (rows + kMinRowsPerChunk - 1) / kMinRowsPerChunk));
}

// kVec values of s = x (+ delta, added in fp32: the stream is not rounded).
template <int kVec, typename TX>
__device__ __forceinline__ void load_input(const TX* x, int64_t x_offset, const Bf16* delta, int64_t offset,
                                           float (&s)[kVec]) {
  load_as_f32<kVec>(x + x_offset, s);
  if (delta != nullptr) {
    float d[kVec];
    load_as_f32<kVec>(delta + offset, d);
#pragma unroll
    for (int i = 0; i < kVec; ++i) s[i] += d[i];
  }
}

template <int kVec, typename TX>
__global__ void rms_norm_forward_kernel(const TX* x, int64_t x_stride, const Bf16* delta, float* sum_out,
                                        const float* weight, Bf16* y, float* rstd, int64_t rows, int64_t width,
                                        float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const int64_t base = row * width, x_base = row * x_stride;
  float sum_squares = 0;
  for (int64_t c = lane * kVec; c < width; c += 32 * kVec) {
    float s[kVec];
    load_input<kVec>(x, x_base + c, delta, base + c, s);
#pragma unroll
    for (int i = 0; i < kVec; ++i) sum_squares += s[i] * s[i];
  }
  sum_squares = warp_sum(sum_squares);
  const float inv_rms = 1.0f / sqrtf(sum_squares / static_cast<float>(width) + eps);
  if (lane == 0) rstd[row] = inv_rms;
  // Second pass re-reads the inputs (L1/L2-resident) so that any width fits.
  for (int64_t c = lane * kVec; c < width; c += 32 * kVec) {
    float s[kVec], w[kVec], out[kVec];
    load_input<kVec>(x, x_base + c, delta, base + c, s);
    load_as_f32<kVec>(weight + c, w);
#pragma unroll
    for (int i = 0; i < kVec; ++i) out[i] = s[i] * inv_rms * (1.0f + w[i]);
    // sum_out may alias x: every element is read and written by the same lane, in this last pass.
    if (sum_out != nullptr) store_from_f32<kVec>(sum_out + base + c, s);
    store_from_f32<kVec>(y + base + c, out);
  }
}

// lo = bf16(s * rstd * (1 + w) - y): the same fp32 expression as the forward's output, so y + lo
// is that output to ~2^-17 relative.
template <int kVec>
__global__ void rms_norm_low_part_kernel(const float* s, const float* weight, const float* rstd, const Bf16* y,
                                         Bf16* lo, int64_t rows, int64_t width) {
  const int64_t start = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * kVec;
  for (int64_t i = start; i < rows * width; i += stride) {
    const int64_t row = i / width, c = i % width;  // kVec divides width: a vector never spans rows
    float x[kVec], w[kVec], hi[kVec], out[kVec];
    load_as_f32<kVec>(s + i, x);
    load_as_f32<kVec>(weight + c, w);
    load_as_f32<kVec>(y + i, hi);
    const float inv_rms = rstd[row];
#pragma unroll
    for (int k = 0; k < kVec; ++k) out[k] = x[k] * inv_rms * (1.0f + w[k]) - hi[k];
    store_from_f32<kVec>(lo + i, out);
  }
}

template <int kVec, typename TX, typename TDy, typename TDx>
__global__ void rms_norm_backward_dx_kernel(const TX* x, int64_t x_stride, const float* weight, const float* rstd,
                                            const TDy* dy, const TDx* d_skip, TDx* dx, int64_t dx_stride,
                                            Bf16* dx_bf16, int64_t rows, int64_t width) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const int64_t base = row * width, x_base = row * x_stride, dx_base = row * dx_stride;
  const float inv_rms = rstd[row];
  // dn = dy * (1 + w); dx = inv_rms * (dn - n * mean(dn * n)), n = x * inv_rms.
  float sum_dn_n = 0;
  for (int64_t c = lane * kVec; c < width; c += 32 * kVec) {
    float xv[kVec], w[kVec], g[kVec];
    load_as_f32<kVec>(x + x_base + c, xv);
    load_as_f32<kVec>(weight + c, w);
    load_as_f32<kVec>(dy + base + c, g);
#pragma unroll
    for (int i = 0; i < kVec; ++i) sum_dn_n += g[i] * (1.0f + w[i]) * (xv[i] * inv_rms);
  }
  const float mean_dn_n = warp_sum(sum_dn_n) / static_cast<float>(width);
  for (int64_t c = lane * kVec; c < width; c += 32 * kVec) {
    float xv[kVec], w[kVec], g[kVec], out[kVec];
    load_as_f32<kVec>(x + x_base + c, xv);
    load_as_f32<kVec>(weight + c, w);
    load_as_f32<kVec>(dy + base + c, g);
#pragma unroll
    for (int i = 0; i < kVec; ++i) out[i] = inv_rms * (g[i] * (1.0f + w[i]) - xv[i] * inv_rms * mean_dn_n);
    if (d_skip != nullptr) {
      float skip[kVec];
      load_as_f32<kVec>(d_skip + base + c, skip);
#pragma unroll
      for (int i = 0; i < kVec; ++i) out[i] += skip[i];
    }
    store_from_f32<kVec>(dx + dx_base + c, out);
    if (dx_bf16 != nullptr) store_from_f32<kVec>(dx_bf16 + base + c, out);
  }
}

// partial[chunk, c] = sum over the chunk's rows of dy * x * rstd (thread per column, coalesced), in
// row order; kDweightRows rows' loads are issued before they are added, so that a thread keeps
// several in flight (a thread walks up to 512 rows: the q norm's 131,072 rows in 256 chunks).
constexpr int kDweightRows = 8;

template <typename TX, typename TDy>
__global__ void rms_norm_dweight_partial_kernel(const TX* x, int64_t x_stride, const float* rstd, const TDy* dy,
                                                float* partial, int64_t rows, int64_t width, int64_t rows_per_chunk) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColumnsPerBlock + threadIdx.x;
  if (c >= width) return;
  const int64_t chunk = blockIdx.y;
  const int64_t row_end = std::min(rows, (chunk + 1) * rows_per_chunk);
  float acc = 0;
  int64_t r = chunk * rows_per_chunk;
  for (; r + kDweightRows <= row_end; r += kDweightRows) {
    float g[kDweightRows], xv[kDweightRows], rs[kDweightRows];
#pragma unroll
    for (int u = 0; u < kDweightRows; ++u) {
      g[u] = to_f32(dy[(r + u) * width + c]);
      xv[u] = to_f32(x[(r + u) * x_stride + c]);
      rs[u] = rstd[r + u];
    }
#pragma unroll
    for (int u = 0; u < kDweightRows; ++u) acc += g[u] * (xv[u] * rs[u]);
  }
  for (; r < row_end; ++r) acc += to_f32(dy[r * width + c]) * (to_f32(x[r * x_stride + c]) * rstd[r]);
  partial[chunk * width + c] = acc;
}

__global__ void rms_norm_dweight_reduce_kernel(const float* partial, float* d_weight, int64_t num_chunks,
                                               int64_t width) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColumnsPerBlock + threadIdx.x;
  if (c >= width) return;
  float sum = 0;
  for (int64_t chunk = 0; chunk < num_chunks; ++chunk) sum += partial[chunk * width + c];
  d_weight[c] += sum;
}

template <typename TX>
void launch_forward(const TX* x, int64_t x_stride, const Bf16* delta, float* sum_out, const float* weight, Bf16* y,
                    float* rstd, int64_t rows, int64_t width, double eps, cudaStream_t stream) {
  CHECK(rows >= 0 && width > 0, "rms_norm_forward_cuda: bad size rows ", rows, ", width ", width);
  CHECK(x_stride >= width, "rms_norm_forward_cuda: x row stride ", x_stride, " is shorter than the width ", width);
  CHECK(eps >= 0, "rms_norm_forward_cuda: eps must be >= 0, got ", eps);
  CHECK(x != nullptr && weight != nullptr && y != nullptr && rstd != nullptr,
        "rms_norm_forward_cuda: input, weight, output and rstd are required");
  if (rows == 0) return;
  const unsigned blocks = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  if (can_use_vec8(width, x, delta, sum_out, y) && can_use_vec8(width, weight) && x_stride % 8 == 0) {
    rms_norm_forward_kernel<8, TX><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
        x, x_stride, delta, sum_out, weight, y, rstd, rows, width, static_cast<float>(eps));
  } else {
    rms_norm_forward_kernel<1, TX><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
        x, x_stride, delta, sum_out, weight, y, rstd, rows, width, static_cast<float>(eps));
  }
  CUDA_CHECK_LAUNCH();
}

template <typename TX, typename TDy, typename TDx>
void launch_backward(const TX* x, int64_t x_stride, const float* weight, const float* rstd, const TDy* dy,
                     const TDx* d_skip, TDx* dx, int64_t dx_stride, Bf16* dx_bf16, float* d_weight, int64_t rows,
                     int64_t width, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  CHECK(rows >= 0 && width > 0, "rms_norm_backward_cuda: bad size rows ", rows, ", width ", width);
  CHECK(x_stride >= width && dx_stride >= width, "rms_norm_backward_cuda: row strides ", x_stride, " (x) and ",
        dx_stride, " (dx) must cover the width ", width);
  const size_t needed = d_weight != nullptr ? rms_norm_backward_workspace_bytes(rows, width) : 0;
  CHECK(workspace_bytes >= needed, "rms_norm_backward_cuda: workspace of ", workspace_bytes, " bytes, needs ", needed);
  if (rows == 0) return;
  const unsigned blocks = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  if (can_use_vec8(width, x, dy, d_skip, dx) && can_use_vec8(width, weight, dx_bf16) && x_stride % 8 == 0 &&
      dx_stride % 8 == 0) {
    rms_norm_backward_dx_kernel<8, TX, TDy, TDx><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
        x, x_stride, weight, rstd, dy, d_skip, dx, dx_stride, dx_bf16, rows, width);
  } else {
    rms_norm_backward_dx_kernel<1, TX, TDy, TDx><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
        x, x_stride, weight, rstd, dy, d_skip, dx, dx_stride, dx_bf16, rows, width);
  }
  CUDA_CHECK_LAUNCH();
  if (d_weight == nullptr) return;  // frozen weight: no weight gradient
  const int64_t chunks = num_row_chunks(rows);
  const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
  float* partial = static_cast<float*>(workspace);
  const unsigned column_blocks = static_cast<unsigned>((width + kColumnsPerBlock - 1) / kColumnsPerBlock);
  rms_norm_dweight_partial_kernel<TX, TDy><<<dim3(column_blocks, static_cast<unsigned>(chunks)), kColumnsPerBlock, 0,
                                             stream>>>(x, x_stride, rstd, dy, partial, rows, width, rows_per_chunk);
  CUDA_CHECK_LAUNCH();
  rms_norm_dweight_reduce_kernel<<<column_blocks, kColumnsPerBlock, 0, stream>>>(partial, d_weight, chunks, width);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void rms_norm_forward_cuda(const Bf16* delta, const float* residual, float* sum_out, const float* weight, Bf16* y,
                           float* rstd, int64_t rows, int64_t width, double eps, cudaStream_t stream) {
  CHECK((delta == nullptr) == (sum_out == nullptr),
        "rms_norm_forward_cuda: delta and sum_out must be given together (the stream is only rewritten when a "
        "block output is added to it)");
  launch_forward<float>(residual, width, delta, sum_out, weight, y, rstd, rows, width, eps, stream);
}

void rms_norm_forward_strided_cuda(const Bf16* x, int64_t x_row_stride, const float* weight, Bf16* y, float* rstd,
                                   int64_t rows, int64_t width, double eps, cudaStream_t stream) {
  launch_forward<Bf16>(x, x_row_stride, nullptr, nullptr, weight, y, rstd, rows, width, eps, stream);
}

void rms_norm_output_low_part_cuda(const float* s, const float* weight, const float* rstd, const Bf16* y, Bf16* lo,
                                   int64_t rows, int64_t width, cudaStream_t stream) {
  CHECK(rows >= 0 && width > 0, "rms_norm_output_low_part_cuda: bad size rows ", rows, ", width ", width);
  CHECK(s != nullptr && weight != nullptr && rstd != nullptr && y != nullptr && lo != nullptr,
        "rms_norm_output_low_part_cuda: every pointer is required");
  if (rows == 0) return;
  const int64_t count = rows * width;
  constexpr int kThreads = 256;
  if (can_use_vec8(width, s, y, lo) && can_use_vec8(width, weight)) {
    const int64_t blocks = std::min<int64_t>((count / 8 + kThreads - 1) / kThreads, 65535);
    rms_norm_low_part_kernel<8><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(s, weight, rstd, y, lo, rows,
                                                                                       width);
  } else {
    const int64_t blocks = std::min<int64_t>((count + kThreads - 1) / kThreads, 65535);
    rms_norm_low_part_kernel<1><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(s, weight, rstd, y, lo, rows,
                                                                                       width);
  }
  CUDA_CHECK_LAUNCH();
}

size_t rms_norm_backward_workspace_bytes(int64_t rows, int64_t width) {
  return static_cast<size_t>(num_row_chunks(rows)) * static_cast<size_t>(width) * sizeof(float);
}

void rms_norm_backward_cuda(const float* x, const float* weight, const float* rstd, const Bf16* dy,
                            const float* d_skip, float* dx, Bf16* dx_bf16, float* d_weight, int64_t rows,
                            int64_t width, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  launch_backward<float, Bf16, float>(x, width, weight, rstd, dy, d_skip, dx, width, dx_bf16, d_weight, rows, width,
                                      workspace, workspace_bytes, stream);
}

void rms_norm_backward_cuda(const float* x, const float* weight, const float* rstd, const float* dy,
                            const float* d_skip, float* dx, Bf16* dx_bf16, float* d_weight, int64_t rows,
                            int64_t width, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  launch_backward<float, float, float>(x, width, weight, rstd, dy, d_skip, dx, width, dx_bf16, d_weight, rows, width,
                                       workspace, workspace_bytes, stream);
}

void rms_norm_backward_strided_cuda(const Bf16* x, int64_t x_row_stride, const float* weight, const float* rstd,
                                    const Bf16* dy, Bf16* dx, int64_t dx_row_stride, float* d_weight, int64_t rows,
                                    int64_t width, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  launch_backward<Bf16, Bf16, Bf16>(x, x_row_stride, weight, rstd, dy, static_cast<const Bf16*>(nullptr), dx,
                                    dx_row_stride, nullptr, d_weight, rows, width, workspace, workspace_bytes, stream);
}

}  // namespace deltamoe
