// CUDA kernels of the zero-centred RMSNorm: one warp per row for the forward and the backward, the
// backward forming d_weight's per-chunk partials on the same pass, then a fixed-order reduction.
// Templated on the element types so that the fp32 residual stream and the bf16 head rows share
// one implementation; the math is fp32 throughout. Where the width is a small multiple of 256
// (the decoder's hidden widths), a lane keeps its part of the row in registers between the sum
// and the output pass: a 2,048-wide fp32 row is 8 KB, and the rows in flight on the GPU (~200 MB
// at 8,192 tokens) do not stay in L2 for a second read, which cost the re-reading form a third of
// its traffic (the 256-wide head rows, re-read from L1, do not need it).
#include <algorithm>
#include <type_traits>

#include "core/cuda_check.h"
#include "kernels/common/kernel_path_cuda.h"
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

// The rows whose lanes keep their part in registers: widths of 32 lanes x 8 values x kIters, kIters
// a power of two from 4 up to the cap (the backward holds x and dy: 128 floats a lane at 8; the
// forward one row: 128 at 16). Narrower rows are re-read from L1 cheaply. 0: the re-reading form.
constexpr int kMaxForwardIters = 16;
constexpr int kMaxBackwardIters = 8;
int registered_iters(int64_t width, int cap) {
  for (int iters = 4; iters <= cap; iters *= 2)
    if (width == int64_t{256} * iters) return iters;
  return 0;
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

// How many of a row's kVec-wide vectors lane `lane` handles (vectors lane, lane + 32, ...).
__device__ __forceinline__ int vectors_of_lane(int64_t vectors, int lane) {
  return static_cast<int>((vectors - lane + 31) / 32);
}

// kIters > 0: the width is 32 kVec kIters, and a lane's kIters vectors stay in registers between
// the two passes; 0: any width, the second pass re-reads the inputs (L1-resident for narrow rows).
// Vector `it` of a lane is at column (32 it + lane) kVec in both forms.
template <int kVec, int kIters, typename TX>
__global__ void rms_norm_forward_kernel(const TX* x, int64_t x_stride, const Bf16* delta, float* sum_out,
                                        const float* weight, Bf16* y, float* rstd, int64_t rows, int64_t width,
                                        float eps) {
  constexpr bool kKept = kIters > 0;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const int64_t base = row * width, x_base = row * x_stride;
  const int vectors = kKept ? kIters : vectors_of_lane(width / kVec, lane);
  float kept[kKept ? kIters : 1][kVec];  // the row's vectors, or the one in hand
  float sum_squares = 0;
#pragma unroll
  for (int it = 0; it < vectors; ++it) {
    const int64_t c = (static_cast<int64_t>(it) * 32 + lane) * kVec;
    float(&s)[kVec] = kept[kKept ? it : 0];
    load_input<kVec>(x, x_base + c, delta, base + c, s);
#pragma unroll
    for (int i = 0; i < kVec; ++i) sum_squares += s[i] * s[i];
  }
  sum_squares = warp_sum(sum_squares);
  const float inv_rms = 1.0f / sqrtf(sum_squares / static_cast<float>(width) + eps);
  if (lane == 0) rstd[row] = inv_rms;
#pragma unroll
  for (int it = 0; it < vectors; ++it) {
    const int64_t c = (static_cast<int64_t>(it) * 32 + lane) * kVec;
    float(&s)[kVec] = kept[kKept ? it : 0];
    if constexpr (!kKept) load_input<kVec>(x, x_base + c, delta, base + c, s);
    float w[kVec], out[kVec];
    load_as_f32<kVec>(weight + c, w);
#pragma unroll
    for (int i = 0; i < kVec; ++i) out[i] = s[i] * inv_rms * (1.0f + w[i]);
    // sum_out may alias x: every element was read by this lane before it is written here.
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

// Block b owns the rows of chunk b, its warps taking them in turn (warp w: rows w, w + warps, ...
// of the chunk), one row at a time as the forward does. kIters as in the forward: a lane's x and dy
// vectors stay in registers between the passes. With partial set, the block also forms the chunk's
// share of d_weight on the same pass: each warp sums dy * x * rstd over its rows into its own row of
// shared memory (a lane only touches its own columns), and the warps' rows are added in warp order
// into partial[b, :] at the end, so the inputs are read once, not again by a d_weight pass.
template <int kVec, int kIters, typename TX, typename TDy, typename TDx>
__global__ void rms_norm_backward_kernel(const TX* x, int64_t x_stride, const float* weight, const float* rstd,
                                         const TDy* dy, const TDx* d_skip, TDx* dx, int64_t dx_stride,
                                         Bf16* dx_bf16, float* partial, int64_t rows, int64_t width,
                                         int64_t rows_per_chunk) {
  constexpr bool kKept = kIters > 0;
  extern __shared__ float warp_dweight[];  // [warps, width] when partial is set
  const int warps = static_cast<int>(blockDim.x / 32), warp = static_cast<int>(threadIdx.x / 32);
  const int lane = threadIdx.x % 32;
  const int64_t chunk_begin = static_cast<int64_t>(blockIdx.x) * rows_per_chunk;
  const int64_t chunk_end = std::min(rows, chunk_begin + rows_per_chunk);
  const int vectors = kKept ? kIters : vectors_of_lane(width / kVec, lane);
  const auto column = [&](int it) { return (static_cast<int64_t>(it) * 32 + lane) * kVec; };
  float* own_dweight = warp_dweight + static_cast<int64_t>(warp) * width;
  if (partial != nullptr) {
    for (int it = 0; it < vectors; ++it)
#pragma unroll
      for (int i = 0; i < kVec; ++i) own_dweight[column(it) + i] = 0.0f;
  }
  for (int64_t row = chunk_begin + warp; row < chunk_end; row += warps) {
    const int64_t base = row * width, x_base = row * x_stride, dx_base = row * dx_stride;
    const float inv_rms = rstd[row];
    float x_kept[kKept ? kIters : 1][kVec], dy_kept[kKept ? kIters : 1][kVec];
    // dn = dy * (1 + w); dx = inv_rms * (dn - n * mean(dn * n)), n = x * inv_rms.
    float sum_dn_n = 0;
#pragma unroll
    for (int it = 0; it < vectors; ++it) {
      const int64_t c = column(it);
      float(&xv)[kVec] = x_kept[kKept ? it : 0];
      float(&g)[kVec] = dy_kept[kKept ? it : 0];
      float w[kVec];
      load_as_f32<kVec>(x + x_base + c, xv);
      load_as_f32<kVec>(weight + c, w);
      load_as_f32<kVec>(dy + base + c, g);
#pragma unroll
      for (int i = 0; i < kVec; ++i) sum_dn_n += g[i] * (1.0f + w[i]) * (xv[i] * inv_rms);
    }
    const float mean_dn_n = warp_sum(sum_dn_n) / static_cast<float>(width);
    // The skip gradient (which dx may overwrite in place) is read kBatch vectors at a time before
    // their outputs are stored: with the row kept, a few round trips instead of one per vector,
    // within the registers x and dy already take.
    constexpr int kBatch = !kKept ? 1 : kIters < 4 ? kIters : 4;
    static_assert(!kKept || kIters % kBatch == 0, "whole batches of skip vectors");
#pragma unroll
    for (int it0 = 0; it0 < vectors; it0 += kBatch) {
      float skip[kBatch][kVec];
      if (d_skip != nullptr) {
#pragma unroll
        for (int b = 0; b < kBatch; ++b) load_as_f32<kVec>(d_skip + base + column(it0 + b), skip[b]);
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int it = it0 + b;
        const int64_t c = column(it);
        float(&xv)[kVec] = x_kept[kKept ? it : 0];
        float(&g)[kVec] = dy_kept[kKept ? it : 0];
        if constexpr (!kKept) {
          load_as_f32<kVec>(x + x_base + c, xv);
          load_as_f32<kVec>(dy + base + c, g);
        }
        float w[kVec], out[kVec];
        load_as_f32<kVec>(weight + c, w);
        // The skip is added by its own rounded add, so that no multiply-add contraction takes it in.
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          out[i] = inv_rms * (g[i] * (1.0f + w[i]) - xv[i] * inv_rms * mean_dn_n);
          if (d_skip != nullptr) out[i] = __fadd_rn(out[i], skip[b][i]);
        }
        if (partial != nullptr) {
#pragma unroll
          for (int i = 0; i < kVec; ++i) own_dweight[c + i] += g[i] * (xv[i] * inv_rms);
        }
        store_from_f32<kVec>(dx + dx_base + c, out);
        if (dx_bf16 != nullptr) store_from_f32<kVec>(dx_bf16 + base + c, out);
      }
    }
  }
  if (partial == nullptr) return;
  __syncthreads();
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
    float sum = 0;
    for (int w = 0; w < warps; ++w) sum += warp_dweight[static_cast<int64_t>(w) * width + c];
    partial[static_cast<int64_t>(blockIdx.x) * width + c] = sum;
  }
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
  const float e = static_cast<float>(eps);
  const dim3 grid(blocks), block(kWarpsPerBlock * 32);
  if (can_use_vec8(width, x, delta, sum_out, y) && can_use_vec8(width, weight) && x_stride % 8 == 0) {
    // The kept-row forms serve the fp32 stream only (the bf16 head rows are narrow).
    const int iters = std::is_same_v<TX, float> ? registered_iters(width, kMaxForwardIters) : 0;
    if constexpr (std::is_same_v<TX, float>) {
      if (iters == 4) rms_norm_forward_kernel<8, 4, TX><<<grid, block, 0, stream>>>(x, x_stride, delta, sum_out, weight,
                                                                                     y, rstd, rows, width, e);
      if (iters == 8) rms_norm_forward_kernel<8, 8, TX><<<grid, block, 0, stream>>>(x, x_stride, delta, sum_out, weight,
                                                                                     y, rstd, rows, width, e);
      if (iters == 16) rms_norm_forward_kernel<8, 16, TX><<<grid, block, 0, stream>>>(x, x_stride, delta, sum_out,
                                                                                       weight, y, rstd, rows, width, e);
    }
    if (iters == 0) rms_norm_forward_kernel<8, 0, TX><<<grid, block, 0, stream>>>(x, x_stride, delta, sum_out, weight, y,
                                                                                   rstd, rows, width, e);
  } else {
    rms_norm_forward_kernel<1, 0, TX><<<grid, block, 0, stream>>>(x, x_stride, delta, sum_out, weight, y, rstd, rows,
                                                                   width, e);
  }
  CUDA_CHECK_LAUNCH();
}

template <int kVec, int kIters, typename TX, typename TDy, typename TDx>
void launch_backward_kernel(const TX* x, int64_t x_stride, const float* weight, const float* rstd, const TDy* dy,
                            const TDx* d_skip, TDx* dx, int64_t dx_stride, Bf16* dx_bf16, float* partial,
                            int64_t rows, int64_t width, int64_t chunks, int warps, cudaStream_t stream) {
  const auto kernel = rms_norm_backward_kernel<kVec, kIters, TX, TDy, TDx>;
  const size_t shared = partial != nullptr ? static_cast<size_t>(warps) * static_cast<size_t>(width) * sizeof(float) : 0;
  if (shared > 48 * 1024) allow_dynamic_shared_memory(kernel, shared, "rms_norm_backward_cuda");
  const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
  kernel<<<static_cast<unsigned>(chunks), static_cast<unsigned>(warps * 32), shared, stream>>>(
      x, x_stride, weight, rstd, dy, d_skip, dx, dx_stride, dx_bf16, partial, rows, width, rows_per_chunk);
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
  const int64_t chunks = num_row_chunks(rows);
  float* partial = d_weight != nullptr ? static_cast<float*>(workspace) : nullptr;
  // Eight warps a block, fewer where their d_weight rows would not fit the block's shared memory.
  int warps = kWarpsPerBlock;
  if (partial != nullptr) {
    const auto shared_bytes = static_cast<int64_t>(kernel_path().max_shared_bytes);
    const int64_t fit = shared_bytes / (width * static_cast<int64_t>(sizeof(float)));
    CHECK(fit >= 1, "rms_norm_backward_cuda: rows of ", width, " columns are too wide for the d_weight sums in ",
          "shared memory (", shared_bytes, " bytes a block on the ", kernel_path().describe(), " path)");
    warps = static_cast<int>(std::min<int64_t>(kWarpsPerBlock, fit));
  }
  if (can_use_vec8(width, x, dy, d_skip, dx) && can_use_vec8(width, weight, dx_bf16) && x_stride % 8 == 0 &&
      dx_stride % 8 == 0) {
    const int iters = std::is_same_v<TX, float> ? registered_iters(width, kMaxBackwardIters) : 0;
    if constexpr (std::is_same_v<TX, float>) {
      if (iters == 4)
        launch_backward_kernel<8, 4, TX, TDy, TDx>(x, x_stride, weight, rstd, dy, d_skip, dx, dx_stride, dx_bf16,
                                                   partial, rows, width, chunks, warps, stream);
      if (iters == 8)
        launch_backward_kernel<8, 8, TX, TDy, TDx>(x, x_stride, weight, rstd, dy, d_skip, dx, dx_stride, dx_bf16,
                                                   partial, rows, width, chunks, warps, stream);
    }
    if (iters == 0)
      launch_backward_kernel<8, 0, TX, TDy, TDx>(x, x_stride, weight, rstd, dy, d_skip, dx, dx_stride, dx_bf16,
                                                 partial, rows, width, chunks, warps, stream);
  } else {
    launch_backward_kernel<1, 0, TX, TDy, TDx>(x, x_stride, weight, rstd, dy, d_skip, dx, dx_stride, dx_bf16, partial,
                                               rows, width, chunks, warps, stream);
  }
  if (d_weight == nullptr) return;  // frozen weight: no weight gradient
  const unsigned column_blocks = static_cast<unsigned>((width + kColumnsPerBlock - 1) / kColumnsPerBlock);
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
