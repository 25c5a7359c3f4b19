// CUDA kernels of the chunked lm_head + cross-entropy: the per-row online log-sum-exp / gradient
// kernel (one block per row), a fixed-order loss reduction, the row copies that gather the
// supervised rows and scatter their gradient back, and the chunk loop over cuBLASLt.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/cuda_check.h"
#include "core/workspace_carver.h"
#include "kernels/cross_entropy/cross_entropy.h"
#include "kernels/cross_entropy/cross_entropy_cuda.h"
#include "kernels/gemm/bf16_vector.cuh"

namespace deltamoe {

namespace {

constexpr int kRowThreads = 512;
constexpr int kReduceThreads = 1024;

// Running (max, sum of exp(x - max)) pairs: the online log-sum-exp state.
struct MaxSum {
  float max;
  float sum;
};

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  if (a.max == -INFINITY) return b;  // an empty side (a thread that saw no element)
  if (b.max == -INFINITY) return a;
  const float m = fmaxf(a.max, b.max);
  return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

template <int kVec>
__global__ void cross_entropy_rows_kernel(__nv_bfloat16* logits, const int64_t* labels, int64_t vocab,
                                          bool write_grad, float grad_scale, float* token_loss, float* lse_out,
                                          int32_t* bad_label_position) {
  const int64_t row = blockIdx.x;
  __nv_bfloat16* row_logits = logits + row * vocab;
  const int64_t label = labels[row];
  const bool label_in_range = label >= 0 && label < vocab;
  const bool supervised = label_in_range;
  if (!label_in_range && label != kIgnoreIndex && threadIdx.x == 0 && bad_label_position != nullptr)
    atomicCAS(bad_label_position, 0, static_cast<int>(row + 1));

  // Read the label's logit now: the gradient pass below overwrites the row.
  __shared__ float label_logit;
  if (threadIdx.x == 0) label_logit = supervised ? __bfloat162float(row_logits[label]) : 0.0f;

  MaxSum state{-INFINITY, 0.0f};
  for (int64_t v = threadIdx.x * kVec; v < vocab; v += kRowThreads * kVec) {
    float x[kVec];
    load_bf16_as_f32<kVec>(row_logits + v, x);
    float chunk_max = x[0];
#pragma unroll
    for (int i = 1; i < kVec; ++i) chunk_max = fmaxf(chunk_max, x[i]);
    const float m = fmaxf(state.max, chunk_max);
    float sum = state.max == -INFINITY ? 0.0f : state.sum * expf(state.max - m);
#pragma unroll
    for (int i = 0; i < kVec; ++i) sum += expf(x[i] - m);
    state = {m, sum};
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, state.max, offset), __shfl_xor_sync(0xffffffffu, state.sum, offset)};
    state = combine(state, other);
  }
  __shared__ MaxSum warp_states[kRowThreads / 32];
  __shared__ float row_lse;
  if (threadIdx.x % 32 == 0) warp_states[threadIdx.x / 32] = state;
  __syncthreads();
  if (threadIdx.x == 0) {
    MaxSum total = warp_states[0];
    for (int w = 1; w < kRowThreads / 32; ++w) total = combine(total, warp_states[w]);
    row_lse = total.max + logf(total.sum);
    lse_out[row] = row_lse;
    token_loss[row] = supervised ? row_lse - label_logit : 0.0f;
  }
  __syncthreads();
  if (!write_grad) return;
  const float lse = row_lse;
  for (int64_t v = threadIdx.x * kVec; v < vocab; v += kRowThreads * kVec) {
    float x[kVec];
    load_bf16_as_f32<kVec>(row_logits + v, x);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      if (supervised) {
        x[i] = grad_scale * expf(x[i] - lse);
        if (v + i == label) x[i] -= grad_scale;
      } else {
        x[i] = 0.0f;
      }
    }
    store_f32_as_bf16<kVec>(row_logits + v, x);
  }
}

// loss = sum(token_loss) / count, one block, fixed order (deterministic).
__global__ void mean_loss_kernel(const float* token_loss, int64_t rows, float inv_count, float* loss) {
  float sum = 0;
  for (int64_t r = threadIdx.x; r < rows; r += kReduceThreads) sum += token_loss[r];
  sum = warp_sum(sum);
  __shared__ float warp_sums[kReduceThreads / 32];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0;
    for (int w = 0; w < kReduceThreads / 32; ++w) total += warp_sums[w];
    loss[0] = total * inv_count;
  }
}

// dst[i] = src[rows[i]] for i < n: whole bf16 rows of `hidden` elements (16-byte words when the
// rows allow, kVector) and, when labels_src is set, the rows' labels. One warp a row. With
// kInverse the other way round (scatter): dst[rows[i]] = src[i].
template <bool kInverse, bool kVector>
__global__ void copy_rows_kernel(const __nv_bfloat16* src, const int32_t* rows, int64_t n, int64_t hidden,
                                 __nv_bfloat16* dst, const int64_t* labels_src, int64_t* labels_dst) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (i >= n) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t row = rows[i];
  const int64_t from = kInverse ? i : row, to = kInverse ? row : i;
  if constexpr (kVector) {
    const uint4* in = reinterpret_cast<const uint4*>(src + from * hidden);
    uint4* out = reinterpret_cast<uint4*>(dst + to * hidden);
    for (int64_t c = lane; c < hidden / 8; c += 32) out[c] = in[c];
  } else {
    for (int64_t c = lane; c < hidden; c += 32) dst[to * hidden + c] = src[from * hidden + c];
  }
  if (labels_src != nullptr && lane == 0) labels_dst[i] = labels_src[row];
}

template <bool kInverse>
void launch_copy_rows(bool vector, unsigned grid, unsigned threads, const __nv_bfloat16* src, const int32_t* rows,
                      int64_t n, int64_t hidden, __nv_bfloat16* dst, const int64_t* labels_src, int64_t* labels_dst,
                      cudaStream_t stream) {
  if (vector) {
    copy_rows_kernel<kInverse, true><<<grid, threads, 0, stream>>>(src, rows, n, hidden, dst, labels_src, labels_dst);
  } else {
    copy_rows_kernel<kInverse, false><<<grid, threads, 0, stream>>>(src, rows, n, hidden, dst, labels_src, labels_dst);
  }
}

void copy_rows(bool inverse, const __nv_bfloat16* src, const int32_t* rows, int64_t n, int64_t hidden,
               __nv_bfloat16* dst, const int64_t* labels_src, int64_t* labels_dst, cudaStream_t stream) {
  if (n == 0) return;
  constexpr int kWarps = 8;
  const unsigned grid = static_cast<unsigned>((n + kWarps - 1) / kWarps);
  const bool vector = hidden % 8 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  if (inverse) {
    launch_copy_rows<true>(vector, grid, 32 * kWarps, src, rows, n, hidden, dst, labels_src, labels_dst, stream);
  } else {
    launch_copy_rows<false>(vector, grid, 32 * kWarps, src, rows, n, hidden, dst, labels_src, labels_dst, stream);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void cross_entropy_rows_cuda(__nv_bfloat16* logits, const int64_t* labels, int64_t rows, int64_t vocab,
                             bool write_grad, float grad_scale, float* token_loss, float* lse,
                             int32_t* bad_label_position, cudaStream_t stream) {
  CHECK(rows >= 0 && vocab > 0, "cross_entropy_rows_cuda: bad sizes rows ", rows, ", V ", vocab);
  CHECK(rows < (int64_t{1} << 31) - 1, "cross_entropy_rows_cuda: ", rows, " rows is too many for one call");
  if (rows == 0) return;
  const unsigned blocks = static_cast<unsigned>(rows);
  if (can_use_vec8(vocab, logits)) {
    cross_entropy_rows_kernel<8><<<blocks, kRowThreads, 0, stream>>>(logits, labels, vocab, write_grad, grad_scale,
                                                                     token_loss, lse, bad_label_position);
  } else {
    cross_entropy_rows_kernel<1><<<blocks, kRowThreads, 0, stream>>>(logits, labels, vocab, write_grad, grad_scale,
                                                                     token_loss, lse, bad_label_position);
  }
  CUDA_CHECK_LAUNCH();
}

void lm_head_cross_entropy_cuda(GemmContext& ctx, const LmHeadLossArgs& args, void* workspace, size_t workspace_bytes,
                                cudaStream_t stream) {
  const int64_t tokens = args.num_tokens, hidden = args.hidden_size, vocab = args.vocab;
  CHECK(tokens >= 0 && hidden > 0 && vocab > 0, "lm_head_cross_entropy_cuda: bad sizes T ", tokens, ", H ", hidden,
        ", V ", vocab);
  CHECK(args.chunk_rows > 0, "lm_head_cross_entropy_cuda: chunk_rows must be positive, got ", args.chunk_rows);
  CHECK(args.num_supervised >= 0, "lm_head_cross_entropy_cuda: negative supervised-token count ",
        args.num_supervised);
  CHECK(args.hidden && args.weight && args.labels && args.token_loss && args.lse && args.loss,
        "lm_head_cross_entropy_cuda: a required pointer (hidden, weight, labels, token_loss, lse, loss) is null");
  const bool gathered = args.rows != nullptr;
  CHECK(!gathered || (args.num_rows >= 0 && args.num_rows <= tokens), "lm_head_cross_entropy_cuda: ", args.num_rows,
        " listed rows of ", tokens, " tokens");
  const int64_t chunk_rows = std::min(args.chunk_rows, std::max<int64_t>(tokens, 1));
  const size_t needed = lm_head_cross_entropy_workspace_bytes(chunk_rows, vocab, hidden);
  CHECK(workspace_bytes >= needed, "lm_head_cross_entropy_cuda: workspace of ", workspace_bytes, " bytes, needs ",
        needed, " for ", chunk_rows, " x ", vocab, " logits and ", chunk_rows, " x ", hidden, " rows");
  const bool backward = args.d_hidden != nullptr || args.d_weight != nullptr;
  // d(mean)/d(token loss) = d_loss / N; N = 0 means nothing is supervised: zero gradient.
  const float grad_scale =
      args.num_supervised > 0 ? static_cast<float>(static_cast<double>(args.d_loss) / args.num_supervised) : 0.0f;
  WorkspaceCarver carve("lm_head_cross_entropy_cuda", workspace, workspace_bytes);
  auto* logits = carve.take<__nv_bfloat16>(chunk_rows * vocab);
  auto* x_rows = carve.take<__nv_bfloat16>(chunk_rows * hidden);
  auto* dx_rows = carve.take<__nv_bfloat16>(chunk_rows * hidden);
  auto* label_rows = carve.take<int64_t>(chunk_rows);
  // Listed rows: the others take no part, so their input gradient is zero.
  if (gathered && args.d_hidden != nullptr) {
    CUDA_CHECK(cudaMemsetAsync(args.d_hidden, 0, static_cast<size_t>(tokens * hidden) * 2, stream));
  }
  const int64_t total = gathered ? args.num_rows : tokens;
  for (int64_t begin = 0; begin < total; begin += chunk_rows) {
    const int64_t rows = std::min(chunk_rows, total - begin);
    const __nv_bfloat16* x_chunk = args.hidden + begin * hidden;
    const int64_t* labels = args.labels + begin;
    if (gathered) {
      copy_rows(false, args.hidden, args.rows + begin, rows, hidden, x_rows, args.labels, label_rows, stream);
      x_chunk = x_rows;
      labels = label_rows;
    }
    linear_forward_cuda(ctx, x_chunk, args.weight, logits, DType::bf16, rows, hidden, vocab, stream);
    cross_entropy_rows_cuda(logits, labels, rows, vocab, backward, grad_scale, args.token_loss + begin,
                            args.lse + begin, args.bad_label_position, stream);
    if (args.d_hidden != nullptr) {
      __nv_bfloat16* dx = gathered ? dx_rows : args.d_hidden + begin * hidden;
      linear_backward_input_cuda(ctx, logits, args.weight, dx, rows, hidden, vocab, stream);
      if (gathered) copy_rows(true, dx_rows, args.rows + begin, rows, hidden, args.d_hidden, nullptr, nullptr, stream);
    }
    if (args.d_weight != nullptr) {
      if (args.d_weight_written && begin == 0) {
        linear_backward_weight_written_cuda(ctx, logits, x_chunk, args.d_weight, rows, hidden, vocab, stream);
      } else {
        linear_backward_weight_cuda(ctx, logits, x_chunk, args.d_weight, rows, hidden, vocab, stream);
      }
    }
  }
  if (args.d_weight != nullptr && args.d_weight_written && total == 0) {
    CUDA_CHECK(cudaMemsetAsync(args.d_weight, 0, static_cast<size_t>(vocab * hidden) * sizeof(float), stream));
  }
  const float inv_count = args.num_supervised > 0 ? 1.0f / static_cast<float>(args.num_supervised) : 0.0f;
  mean_loss_kernel<<<1, kReduceThreads, 0, stream>>>(args.token_loss, total, inv_count, args.loss);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
