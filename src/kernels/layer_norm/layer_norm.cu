// CUDA LayerNorm over the fp32 stream: one warp per row for the forward (mean, then squared
// deviations, then output: the row stays in L1); the backward in one pass that writes dx and the
// per-chunk partials of every column sum (parameter and stream-bias gradients), reduced in a fixed
// order afterwards (no atomics, same bits every run).
#include <algorithm>

#include "core/cuda_check.h"
#include "kernels/bias_add/bias_add_cuda.h"
#include "kernels/gemm/bf16_vector.cuh"
#include "kernels/layer_norm/layer_norm_cuda.h"

namespace deltamoe {
namespace {

constexpr int kWarpsPerBlock = 8;

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

// The backward in one pass over the rows. A block owns a chunk of rows and a thread kVec
// consecutive columns of every row (one sweep covers the row: blockDim.x * kVec >= hidden). Rows go
// kGroup at a time: each thread loads its columns of x, dy (and d_skip) for the group into
// registers, the block adds up each row's sum(g) and sum(g xhat) (g = dy w) over its threads in a
// fixed order, then every thread writes its dx and adds to its column sums: dy xhat (d_weight), dy
// (d_bias), d_skip and dx (the bias gradients of the Linears whose outputs joined the stream here),
// written per chunk to partials[sum][chunk][column] and reduced in chunk order afterwards. Nothing is
// read twice from memory, and the sums need no second walk over the rows.
constexpr int kGroup = 4;
// Threads a backward block may have: with 8-column vectors a thread holds ~165 registers (the
// group's x, dy and d_skip, four column sums), so 384 threads fit one SM's register file.
template <int kVec>
constexpr int kMaxBackwardThreads = kVec == 8 ? 384 : 1024;

struct LayerNormBackwardSums {  // which column sums the caller wants (partials written for)
  bool d_weight, d_bias, d_skip, dx;
};

template <int kVec, typename TDy>
__global__ void __launch_bounds__(kMaxBackwardThreads<kVec>) layer_norm_backward_kernel(
    const float* x, const float* weight, const float* mean, const float* rstd, const TDy* dy, const float* d_skip,
    float* dx, Bf16* dx_bf16, float* partials, LayerNormBackwardSums wanted, int64_t rows, int64_t hidden,
    int64_t rows_per_chunk, int64_t chunks) {
  __shared__ float warp_parts[kMaxBackwardThreads<kVec> / 32][2 * kGroup];
  __shared__ float row_means[2 * kGroup];  // mean(g), mean(g xhat) of the group's rows
  const int64_t c = static_cast<int64_t>(threadIdx.x) * kVec;
  const bool in_row = c < hidden;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * rows_per_chunk;
  const int64_t last = std::min(rows, first + rows_per_chunk);
  float w[kVec] = {};
  if (in_row) load_as_f32<kVec>(weight + c, w);
  float sum_w[kVec] = {}, sum_b[kVec] = {}, sum_skip[kVec] = {}, sum_dx[kVec] = {};
  for (int64_t r0 = first; r0 < last; r0 += kGroup) {
    float xv[kGroup][kVec], g[kGroup][kVec], skip[kGroup][kVec], mu[kGroup], inv_std[kGroup];
    float parts[2 * kGroup];
    // Every load of the group first: dx may alias d_skip, so none could move above a store.
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      const bool live = in_row && r0 + j < last;
      mu[j] = live ? mean[r0 + j] : 0.0f;
      inv_std[j] = live ? rstd[r0 + j] : 0.0f;
#pragma unroll
      for (int i = 0; i < kVec; ++i) xv[j][i] = g[j][i] = skip[j][i] = 0.0f;
      if (live) {
        load_as_f32<kVec>(x + (r0 + j) * hidden + c, xv[j]);
        load_as_f32<kVec>(dy + (r0 + j) * hidden + c, g[j]);
        if (d_skip != nullptr) load_as_f32<kVec>(d_skip + (r0 + j) * hidden + c, skip[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      float sg = 0, sgx = 0;
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float gw = g[j][i] * w[i];
        sg += gw;
        sgx += gw * (xv[j][i] - mu[j]) * inv_std[j];
      }
      parts[2 * j] = warp_sum(sg);
      parts[2 * j + 1] = warp_sum(sgx);
    }
    if (lane == 0) {
#pragma unroll
      for (int k = 0; k < 2 * kGroup; ++k) warp_parts[warp][k] = parts[k];
    }
    __syncthreads();
    if (threadIdx.x < 2 * kGroup) {
      float total = 0;
      for (int v = 0; v < warps; ++v) total += warp_parts[v][threadIdx.x];
      row_means[threadIdx.x] = total / static_cast<float>(hidden);
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      if (!in_row || r0 + j >= last) continue;
      const float mean_g = row_means[2 * j], mean_g_xhat = row_means[2 * j + 1];
      float out[kVec];
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float xhat = (xv[j][i] - mu[j]) * inv_std[j];
        out[i] = inv_std[j] * (g[j][i] * w[i] - mean_g - xhat * mean_g_xhat) + skip[j][i];
        sum_w[i] += g[j][i] * xhat;
        sum_b[i] += g[j][i];
        sum_skip[i] += skip[j][i];
        sum_dx[i] += out[i];
      }
      store_from_f32<kVec>(dx + (r0 + j) * hidden + c, out);
      if (dx_bf16 != nullptr) store_from_f32<kVec>(dx_bf16 + (r0 + j) * hidden + c, out);
    }
  }
  if (partials == nullptr || !in_row) return;
  const int64_t chunk_offset = static_cast<int64_t>(blockIdx.x) * hidden + c;
  const int64_t sum_stride = chunks * hidden;
  if (wanted.d_weight) store_from_f32<kVec>(partials + 0 * sum_stride + chunk_offset, sum_w);
  if (wanted.d_bias) store_from_f32<kVec>(partials + 1 * sum_stride + chunk_offset, sum_b);
  if (wanted.d_skip) store_from_f32<kVec>(partials + 2 * sum_stride + chunk_offset, sum_skip);
  if (wanted.dx) store_from_f32<kVec>(partials + 3 * sum_stride + chunk_offset, sum_dx);
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

namespace {

// Rows of a backward chunk: about kBackwardChunks chunks whatever the row count, so that one wave of
// blocks fills the GPU and the partials stay small; a multiple of kGroup.
constexpr int64_t kBackwardChunks = 256;

int64_t backward_rows_per_chunk(int64_t rows) {
  const int64_t per_chunk = std::max<int64_t>(1, (rows + kBackwardChunks - 1) / kBackwardChunks);
  return (per_chunk + kGroup - 1) / kGroup * kGroup;
}

int64_t backward_chunks(int64_t rows) {
  return std::max<int64_t>(1, (rows + backward_rows_per_chunk(rows) - 1) / backward_rows_per_chunk(rows));
}

constexpr int kSums = ColumnPartialsOutputs::kMaxArrays;  // d_weight, d_bias, d_skip's and dx's column sums

}  // namespace

size_t layer_norm_backward_workspace_bytes(int64_t rows, int64_t hidden) {
  return static_cast<size_t>(kSums) * static_cast<size_t>(backward_chunks(rows)) *
         static_cast<size_t>(std::max<int64_t>(hidden, 0)) * sizeof(float);
}

namespace {

template <typename TDy>
void launch_backward(const float* x, const float* weight, const float* mean, const float* rstd, const TDy* dy,
                     const float* d_skip, float* dx, Bf16* dx_bf16, float* d_weight, float* d_bias,
                     const LayerNormStreamBiasGrads& stream_bias, int64_t rows, int64_t hidden, void* workspace,
                     size_t workspace_bytes, cudaStream_t stream) {
  CHECK(rows >= 0 && hidden > 0, "layer_norm_backward_cuda: bad size rows ", rows, ", hidden ", hidden);
  CHECK(stream_bias.of_d_skip == nullptr || d_skip != nullptr,
        "layer_norm_backward_cuda: the column sums of d_skip asked for without d_skip");
  ColumnPartialsOutputs outs;
  outs.out[0] = d_weight;
  outs.out[1] = d_bias;
  outs.out[2] = stream_bias.of_d_skip;
  outs.out[3] = stream_bias.of_dx;
  const LayerNormBackwardSums wanted{d_weight != nullptr, d_bias != nullptr, stream_bias.of_d_skip != nullptr,
                                     stream_bias.of_dx != nullptr};
  const bool sums = wanted.d_weight || wanted.d_bias || wanted.d_skip || wanted.dx;
  const size_t needed = sums ? layer_norm_backward_workspace_bytes(rows, hidden) : 0;
  CHECK(workspace_bytes >= needed, "layer_norm_backward_cuda: workspace of ", workspace_bytes, " bytes, needs ",
        needed);
  const bool vec8 = can_use_vec8(hidden, x, dy, d_skip, dx) && can_use_vec8(hidden, weight, dx_bf16);
  const int64_t vec = vec8 ? 8 : 1;
  const int64_t threads = ((hidden + vec - 1) / vec + 31) / 32 * 32;
  const int64_t max_threads = vec8 ? kMaxBackwardThreads<8> : kMaxBackwardThreads<1>;
  CHECK(threads <= max_threads, "layer_norm_backward_cuda: hidden ", hidden, " is wider than one pass takes (",
        max_threads * vec, vec8 ? ")" : " columns without 16-byte vectors: hidden not a multiple of 8 or a tensor "
        "not 16-byte aligned)");
  if (rows == 0) return;
  const int64_t rows_per_chunk = backward_rows_per_chunk(rows), chunks = backward_chunks(rows);
  float* partials = sums ? static_cast<float*>(workspace) : nullptr;
  const dim3 grid(static_cast<unsigned>(chunks)), block(static_cast<unsigned>(threads));
  if (vec8) {
    layer_norm_backward_kernel<8, TDy><<<grid, block, 0, stream>>>(x, weight, mean, rstd, dy, d_skip, dx, dx_bf16,
                                                                   partials, wanted, rows, hidden, rows_per_chunk,
                                                                   chunks);
  } else {
    layer_norm_backward_kernel<1, TDy><<<grid, block, 0, stream>>>(x, weight, mean, rstd, dy, d_skip, dx, dx_bf16,
                                                                   partials, wanted, rows, hidden, rows_per_chunk,
                                                                   chunks);
  }
  CUDA_CHECK_LAUNCH();
  if (sums) column_partials_reduce_cuda(partials, chunks, hidden, outs, stream);
}

}  // namespace

void layer_norm_backward_cuda(const float* x, const float* weight, const float* mean, const float* rstd,
                              const Bf16* dy, const float* d_skip, float* dx, Bf16* dx_bf16, float* d_weight,
                              float* d_bias, const LayerNormStreamBiasGrads& stream_bias, int64_t rows,
                              int64_t hidden, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  launch_backward(x, weight, mean, rstd, dy, d_skip, dx, dx_bf16, d_weight, d_bias, stream_bias, rows, hidden,
                  workspace, workspace_bytes, stream);
}

void layer_norm_backward_cuda(const float* x, const float* weight, const float* mean, const float* rstd,
                              const float* dy, const float* d_skip, float* dx, Bf16* dx_bf16, float* d_weight,
                              float* d_bias, const LayerNormStreamBiasGrads& stream_bias, int64_t rows,
                              int64_t hidden, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  launch_backward(x, weight, mean, rstd, dy, d_skip, dx, dx_bf16, d_weight, d_bias, stream_bias, rows, hidden,
                  workspace, workspace_bytes, stream);
}

}  // namespace deltamoe
