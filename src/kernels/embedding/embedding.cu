// CUDA kernels of the embedding lookup (fp32 rows of the master table) and its scatter-add
// backward: one block per token, threads across the hidden width (16-byte accesses when aligned).
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

template <int kVec>
__global__ void embedding_backward_kernel(const int64_t* ids, const float* d_out, float* d_table,
                                          int64_t vocab, int64_t hidden) {
  const int64_t t = blockIdx.x;
  const int64_t id = ids[t];
  if (id < 0 || id >= vocab) return;
  for (int64_t c = threadIdx.x * kVec; c < hidden; c += kThreads * kVec) {
    float values[kVec];
    load_as_f32<kVec>(d_out + t * hidden + c, values);
#pragma unroll
    for (int i = 0; i < kVec; ++i) atomicAdd(d_table + id * hidden + c + i, values[i]);
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

void embedding_backward_cuda(const int64_t* ids, const float* d_out, float* d_table, int64_t num_tokens,
                             int64_t vocab, int64_t hidden, cudaStream_t stream) {
  CHECK(num_tokens >= 0 && vocab > 0 && hidden > 0, "embedding_backward_cuda: bad sizes T ", num_tokens, ", V ",
        vocab, ", C ", hidden);
  CHECK(num_tokens < (int64_t{1} << 31) - 1, "embedding_backward_cuda: ", num_tokens, " tokens is too many for one call");
  if (num_tokens == 0) return;
  const unsigned blocks = static_cast<unsigned>(num_tokens);
  if (can_use_vec8(hidden, d_out)) {
    embedding_backward_kernel<8><<<blocks, kThreads, 0, stream>>>(ids, d_out, d_table, vocab, hidden);
  } else {
    embedding_backward_kernel<1><<<blocks, kThreads, 0, stream>>>(ids, d_out, d_table, vocab, hidden);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
