// CUDA image-feature scatter into the fp32 embedding stream: one block per feature row, 8 values
// per access where the rows are aligned, single values otherwise.
#include <algorithm>
#include <limits>

#include "core/cuda_check.h"
#include "kernels/gemm/bf16_vector.cuh"
#include "kernels/token_scatter/token_scatter_cuda.h"

namespace deltamoe {
namespace {

constexpr int kThreads = 128;

// Row i of features (bf16) -> row pad_rows[i] of the fp32 embeds (a widening copy, exact).
template <int kVec>
__global__ void token_scatter_forward_kernel(const int32_t* pad_rows, const __nv_bfloat16* features, float* embeds,
                                             int64_t hidden) {
  const int64_t i = blockIdx.x;
  const __nv_bfloat16* src = features + i * hidden;
  float* dst = embeds + static_cast<int64_t>(pad_rows[i]) * hidden;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * kVec; c < hidden; c += static_cast<int64_t>(blockDim.x) * kVec) {
    float v[kVec];
    load_as_f32<kVec>(src + c, v);
    store_from_f32<kVec>(dst + c, v);
  }
}

// Row pad_rows[i] of the fp32 d_embeds -> row i of d_features, rounded to bf16 (the features'
// dtype, as autocast's cast back does), then zeroed.
template <int kVec>
__global__ void token_scatter_backward_kernel(const int32_t* pad_rows, float* d_embeds, __nv_bfloat16* d_features,
                                              int64_t hidden) {
  const int64_t i = blockIdx.x;
  float* src = d_embeds + static_cast<int64_t>(pad_rows[i]) * hidden;
  __nv_bfloat16* dst = d_features + i * hidden;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * kVec; c < hidden; c += static_cast<int64_t>(blockDim.x) * kVec) {
    float v[kVec];
    load_as_f32<kVec>(src + c, v);
    store_from_f32<kVec>(dst + c, v);
    float zeros[kVec] = {};
    store_from_f32<kVec>(src + c, zeros);
  }
}

void check_sizes(const char* where, int64_t num_features, int64_t num_tokens, int64_t hidden) {
  CHECK(num_features >= 0 && num_tokens >= 0 && hidden > 0, where, ": bad size features ", num_features, ", tokens ",
        num_tokens, ", hidden ", hidden);
  CHECK(num_features <= num_tokens, where, ": ", num_features, " feature rows cannot fit in ", num_tokens,
        " tokens");
}

}  // namespace

void token_scatter_pad_rows(const int64_t* ids, int64_t num_tokens, int64_t token_id, int64_t num_features,
                            int32_t* pad_rows) {
  CHECK(num_tokens >= 0 && num_tokens <= std::numeric_limits<int32_t>::max(), "token_scatter_pad_rows: ",
        num_tokens, " tokens do not fit int32 row indices");
  const int64_t count = std::count(ids, ids + num_tokens, token_id);
  CHECK(count == num_features, "image features and image tokens do not match: ", count, " tokens of id ", token_id,
        " but ", num_features, " feature rows; check that the processor expanded each <|image_pad|> to t*h*w/4");
  int64_t row = 0;
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (ids[t] == token_id) pad_rows[row++] = static_cast<int32_t>(t);
  }
}

void token_scatter_forward_cuda(const int32_t* pad_rows, const __nv_bfloat16* features, int64_t num_features,
                                float* embeds, int64_t num_tokens, int64_t hidden, cudaStream_t stream) {
  check_sizes("token_scatter_forward_cuda", num_features, num_tokens, hidden);
  if (num_features == 0) return;
  if (can_use_vec8(hidden, features, embeds)) {
    token_scatter_forward_kernel<8><<<static_cast<unsigned>(num_features), kThreads, 0, stream>>>(pad_rows, features,
                                                                                                  embeds, hidden);
  } else {
    token_scatter_forward_kernel<1><<<static_cast<unsigned>(num_features), kThreads, 0, stream>>>(pad_rows, features,
                                                                                                  embeds, hidden);
  }
  CUDA_CHECK_LAUNCH();
}

void token_scatter_backward_cuda(const int32_t* pad_rows, float* d_embeds, __nv_bfloat16* d_features,
                                 int64_t num_features, int64_t num_tokens, int64_t hidden, cudaStream_t stream) {
  check_sizes("token_scatter_backward_cuda", num_features, num_tokens, hidden);
  if (num_features == 0) return;
  if (can_use_vec8(hidden, d_embeds, d_features)) {
    token_scatter_backward_kernel<8><<<static_cast<unsigned>(num_features), kThreads, 0, stream>>>(
        pad_rows, d_embeds, d_features, hidden);
  } else {
    token_scatter_backward_kernel<1><<<static_cast<unsigned>(num_features), kThreads, 0, stream>>>(
        pad_rows, d_embeds, d_features, hidden);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
