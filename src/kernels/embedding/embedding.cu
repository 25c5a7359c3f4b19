// CUDA kernels of the embedding lookup (fp32 rows of the master table), one block per token, and
// its backward, one block per distinct id; threads across the hidden width (16-byte accesses when
// aligned).
#include "core/cuda_check.h"
#include "kernels/embedding/embedding_cuda.h"
#include "kernels/gemm/bf16_vector.cuh"

namespace deltamoe {

namespace {

constexpr int kThreads = 256;

template <int kVec>
__global__ void embedding_forward_kernel(const int64_t* ids, const float* table, float* out,
                                         int64_t vocab, int64_t hidden, int32_t* bad_id_position) {
  const int64_t t = blockIdx.x;
  const int64_t id = ids[t];
  const bool valid = id >= 0 && id < vocab;
  if (!valid && threadIdx.x == 0 && bad_id_position != nullptr) atomicCAS(bad_id_position, 0, static_cast<int>(t + 1));
  for (int64_t c = threadIdx.x * kVec; c < hidden; c += kThreads * kVec) {
    float values[kVec];
    if (valid) {
      load_as_f32<kVec>(table + id * hidden + c, values);
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) values[i] = 0.0f;
    }
    store_from_f32<kVec>(out + t * hidden + c, values);
  }
}

// One block per distinct id: the row's gradient is the sum of its tokens' rows, in token order.
template <int kVec>
__global__ void embedding_backward_kernel(const int32_t* sorted_tokens, const int32_t* segment_offsets,
                                          const int64_t* segment_ids, const float* d_out, float* d_table,
                                          int64_t hidden) {
  const int64_t segment = blockIdx.x;
  const int32_t first = segment_offsets[segment], last = segment_offsets[segment + 1];
  float* row = d_table + segment_ids[segment] * hidden;
  for (int64_t c = threadIdx.x * kVec; c < hidden; c += kThreads * kVec) {
    float sum[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) sum[i] = 0.0f;
    for (int32_t k = first; k < last; ++k) {
      float values[kVec];
      load_as_f32<kVec>(d_out + static_cast<int64_t>(sorted_tokens[k]) * hidden + c, values);
#pragma unroll
      for (int i = 0; i < kVec; ++i) sum[i] += values[i];
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) row[c + i] += sum[i];
  }
}

}  // namespace

void embedding_forward_cuda(const int64_t* ids, const float* table, float* out, int64_t num_tokens,
                            int64_t vocab, int64_t hidden, int32_t* bad_id_position, cudaStream_t stream) {
  CHECK(num_tokens >= 0 && vocab > 0 && hidden > 0, "embedding_forward_cuda: bad sizes T ", num_tokens, ", V ", vocab,
        ", C ", hidden);
  CHECK(num_tokens < (int64_t{1} << 31) - 1, "embedding_forward_cuda: ", num_tokens, " tokens is too many for one call");
  if (num_tokens == 0) return;
  const unsigned blocks = static_cast<unsigned>(num_tokens);
  if (can_use_vec8(hidden, table, out)) {
    embedding_forward_kernel<8><<<blocks, kThreads, 0, stream>>>(ids, table, out, vocab, hidden, bad_id_position);
  } else {
    embedding_forward_kernel<1><<<blocks, kThreads, 0, stream>>>(ids, table, out, vocab, hidden, bad_id_position);
  }
  CUDA_CHECK_LAUNCH();
}

void embedding_backward_cuda(const int32_t* sorted_tokens, const int32_t* segment_offsets,
                             const int64_t* segment_ids, int64_t num_segments, const float* d_out, float* d_table,
                             int64_t hidden, cudaStream_t stream) {
  CHECK(num_segments >= 0 && hidden > 0, "embedding_backward_cuda: bad sizes U ", num_segments, ", C ", hidden);
  CHECK(num_segments < (int64_t{1} << 31) - 1, "embedding_backward_cuda: ", num_segments, " ids is too many for one call");
  if (num_segments == 0) return;
  const unsigned blocks = static_cast<unsigned>(num_segments);
  if (can_use_vec8(hidden, d_out, d_table)) {
    embedding_backward_kernel<8><<<blocks, kThreads, 0, stream>>>(sorted_tokens, segment_offsets, segment_ids, d_out,
                                                                  d_table, hidden);
  } else {
    embedding_backward_kernel<1><<<blocks, kThreads, 0, stream>>>(sorted_tokens, segment_offsets, segment_ids, d_out,
                                                                  d_table, hidden);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
