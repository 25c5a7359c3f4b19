// CUDA LayerNorm over the fp32 stream: forward and backward each read their inputs once (a block's
// rows held a group at a time in registers); the backward writes dx and the per-chunk partials of
// every column sum (parameter and stream-bias gradients) on that pass, reduced in a fixed order
// afterwards (no atomics, same bits every run).
#include <algorithm>

#include "core/cuda_check.h"
#include "kernels/bias_add/bias_add_cuda.h"
#include "kernels/gemm/bf16_vector.cuh"
#include "kernels/layer_norm/layer_norm_cuda.h"

namespace deltamoe {
namespace {

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

// Both kernels: a block owns a run of rows and a thread kVec consecutive columns of every row (one
// sweep covers the row: blockDim.x * kVec >= hidden), rows kGroup at a time held in registers, so
// that every input is read once from memory. A row's sums over its columns are added over the
// block's threads in a fixed order (block_row_sums).
constexpr int kGroup = 4;
// Threads a block may have: with 8-column vectors a backward thread holds ~165 registers (the
// group's x, dy and d_skip, four column sums), so 384 threads fit one SM's register file; the
// forward takes the same widths.
template <int kVec>
constexpr int kMaxRowThreads = kVec == 8 ? 384 : 1024;
constexpr int64_t kForwardRowsPerBlock = 2 * kGroup;

// totals[k] = the sum of parts[k] over the block's threads (warps in order), for every thread.
// Every thread of the block calls it; the shared arrays are the caller's, reused call after call.
template <int kN, int kMaxWarps>
__device__ __forceinline__ void block_row_sums(float (&parts)[kN], float (&warp_parts)[kMaxWarps][kN],
                                               float (&shared_totals)[kN], float (&totals)[kN]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int k = 0; k < kN; ++k) parts[k] = warp_sum(parts[k]);
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < kN; ++k) warp_parts[warp][k] = parts[k];
  }
  __syncthreads();
  if (threadIdx.x < kN) {
    float total = 0;
    for (int v = 0; v < static_cast<int>(blockDim.x / 32); ++v) total += warp_parts[v][threadIdx.x];
    shared_totals[threadIdx.x] = total;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kN; ++k) totals[k] = shared_totals[k];
}

template <int kVec>
__global__ void __launch_bounds__(kMaxRowThreads<kVec>) layer_norm_forward_kernel(
    const Bf16* delta, const float* residual, float* sum_out, const float* weight, const float* bias, Bf16* y,
    float* mean, float* rstd, int64_t rows, int64_t hidden, float eps) {
  __shared__ float warp_parts[kMaxRowThreads<kVec> / 32][kGroup];
  __shared__ float shared_totals[kGroup];
  const int64_t c = static_cast<int64_t>(threadIdx.x) * kVec;
  const bool in_row = c < hidden;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kForwardRowsPerBlock;
  const int64_t last = std::min(rows, first + kForwardRowsPerBlock);
  const float inv_hidden = 1.0f / static_cast<float>(hidden);
  float w[kVec] = {}, b[kVec] = {};
  if (in_row) {
    load_as_f32<kVec>(weight + c, w);
    load_as_f32<kVec>(bias + c, b);
  }
  for (int64_t r0 = first; r0 < last; r0 += kGroup) {
    float s[kGroup][kVec], parts[kGroup], mu[kGroup], inv_std[kGroup];
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) s[j][i] = 0.0f;
      if (in_row && r0 + j < last) load_input<kVec>(delta, residual, (r0 + j) * hidden + c, s[j]);
      parts[j] = 0;
#pragma unroll
      for (int i = 0; i < kVec; ++i) parts[j] += s[j][i];
    }
    block_row_sums(parts, warp_parts, shared_totals, mu);
    // Deviations from the mean in a second sum: no cancellation for rows with a large offset.
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      mu[j] *= inv_hidden;
      parts[j] = 0;
      if (in_row) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) parts[j] += (s[j][i] - mu[j]) * (s[j][i] - mu[j]);
      }
    }
    block_row_sums(parts, warp_parts, shared_totals, inv_std);
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      if (r0 + j >= last) break;
      inv_std[j] = rsqrtf(inv_std[j] * inv_hidden + eps);
      if (threadIdx.x == 0) {
        mean[r0 + j] = mu[j];
        rstd[r0 + j] = inv_std[j];
      }
      if (!in_row) continue;
      float out[kVec];
#pragma unroll
      for (int i = 0; i < kVec; ++i) out[i] = (s[j][i] - mu[j]) * inv_std[j] * w[i] + b[i];
      // sum_out may alias residual: the group's elements were all read above by this thread.
      if (sum_out != nullptr) store_from_f32<kVec>(sum_out + (r0 + j) * hidden + c, s[j]);
      store_from_f32<kVec>(y + (r0 + j) * hidden + c, out);
    }
  }
}

// The backward: a block owns a chunk of rows. For each group, each thread loads its columns of x,
// dy (and d_skip) into registers, the block adds up each row's sum(g) and sum(g xhat) (g = dy w),
// then every thread writes its dx and adds to its column sums: dy xhat (d_weight), dy
// (d_bias), d_skip and dx (the bias gradients of the Linears whose outputs joined the stream here),
// written per chunk to partials[sum][chunk][column] and reduced in chunk order afterwards. Nothing is
// read twice from memory, and the sums need no second walk over the rows.
struct LayerNormBackwardSums {  // which column sums the caller wants (partials written for)
  bool d_weight, d_bias, d_skip, dx;
};

template <int kVec, typename TDy>
__global__ void __launch_bounds__(kMaxRowThreads<kVec>) layer_norm_backward_kernel(
    const float* x, const float* weight, const float* mean, const float* rstd, const TDy* dy, const float* d_skip,
    float* dx, Bf16* dx_bf16, float* partials, LayerNormBackwardSums wanted, int64_t rows, int64_t hidden,
    int64_t rows_per_chunk, int64_t chunks) {
  __shared__ float warp_parts[kMaxRowThreads<kVec> / 32][2 * kGroup];
  __shared__ float shared_totals[2 * kGroup];
  const int64_t c = static_cast<int64_t>(threadIdx.x) * kVec;
  const bool in_row = c < hidden;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * rows_per_chunk;
  const int64_t last = std::min(rows, first + rows_per_chunk);
  const float inv_hidden = 1.0f / static_cast<float>(hidden);
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
      parts[2 * j] = sg;
      parts[2 * j + 1] = sgx;
    }
    float row_means[2 * kGroup];  // mean(g), mean(g xhat) of the group's rows
    block_row_sums(parts, warp_parts, shared_totals, row_means);
#pragma unroll
    for (int k = 0; k < 2 * kGroup; ++k) row_means[k] *= inv_hidden;
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

// Threads of a block of either kernel: one per kVec columns, whole warps; a row wider than one
// block's sweep is refused.
unsigned row_threads(const char* who, int64_t hidden, bool vec8) {
  const int64_t vec = vec8 ? 8 : 1;
  const int64_t threads = ((hidden + vec - 1) / vec + 31) / 32 * 32;
  const int64_t max_threads = vec8 ? kMaxRowThreads<8> : kMaxRowThreads<1>;
  CHECK(threads <= max_threads, who, ": hidden ", hidden, " is wider than one pass takes (", max_threads * vec,
        vec8 ? ")" : " columns without 16-byte vectors: hidden not a multiple of 8 or a tensor not 16-byte aligned)");
  return static_cast<unsigned>(threads);
}

}  // namespace

bool layer_norm_cuda_takes(int64_t hidden) {
  return hidden > 0 && (hidden % 8 == 0 ? hidden <= 8 * kMaxRowThreads<8> : hidden <= kMaxRowThreads<1>);
}

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
  const bool vec8 = can_use_vec8(hidden, delta, residual, sum_out, y) && can_use_vec8(hidden, weight, bias);
  const unsigned threads = row_threads("layer_norm_forward_cuda", hidden, vec8);
  if (rows == 0) return;
  const unsigned blocks = static_cast<unsigned>((rows + kForwardRowsPerBlock - 1) / kForwardRowsPerBlock);
  if (vec8) {
    layer_norm_forward_kernel<8><<<blocks, threads, 0, stream>>>(delta, residual, sum_out, weight, bias, y, mean, rstd,
                                                                 rows, hidden, static_cast<float>(eps));
  } else {
    layer_norm_forward_kernel<1><<<blocks, threads, 0, stream>>>(delta, residual, sum_out, weight, bias, y, mean, rstd,
                                                                 rows, hidden, static_cast<float>(eps));
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
  const unsigned threads = row_threads("layer_norm_backward_cuda", hidden, vec8);
  if (rows == 0) return;
  const int64_t rows_per_chunk = backward_rows_per_chunk(rows), chunks = backward_chunks(rows);
  float* partials = sums ? static_cast<float*>(workspace) : nullptr;
  const dim3 grid(static_cast<unsigned>(chunks)), block(threads);
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
