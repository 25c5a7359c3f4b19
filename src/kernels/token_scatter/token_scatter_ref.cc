// Plain CPU masked scatter of feature rows into pad-token rows, and its backward (gather + zero).
#include <algorithm>

#include "core/error.h"
#include "kernels/token_scatter/token_scatter.h"

namespace deltamoe {
namespace {

void check_pad_count(const int64_t* ids, int64_t num_tokens, int64_t token_id, int64_t num_features) {
  const int64_t count = std::count(ids, ids + num_tokens, token_id);
  CHECK(count == num_features, "image features and image tokens do not match: ", count, " tokens of id ", token_id,
        " but ", num_features, " feature rows; check that the processor expanded each <|image_pad|> to t*h*w/4");
}

}  // namespace

template <typename T>
void token_scatter_forward_ref(const int64_t* ids, int64_t num_tokens, int64_t token_id, const T* features,
                               int64_t num_features, T* embeds, int64_t hidden) {
  check_pad_count(ids, num_tokens, token_id, num_features);
  int64_t row = 0;
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (ids[t] != token_id) continue;
    std::copy(features + row * hidden, features + (row + 1) * hidden, embeds + t * hidden);
    ++row;
  }
}

template <typename T>
void token_scatter_backward_ref(const int64_t* ids, int64_t num_tokens, int64_t token_id, T* d_embeds,
                                T* d_features, int64_t num_features, int64_t hidden) {
  check_pad_count(ids, num_tokens, token_id, num_features);
  int64_t row = 0;
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (ids[t] != token_id) continue;
    std::copy(d_embeds + t * hidden, d_embeds + (t + 1) * hidden, d_features + row * hidden);
    std::fill(d_embeds + t * hidden, d_embeds + (t + 1) * hidden, T(0));
    ++row;
  }
}

#define DELTAMOE_INSTANTIATE(T)                                                                               \
  template void token_scatter_forward_ref<T>(const int64_t*, int64_t, int64_t, const T*, int64_t, T*, int64_t); \
  template void token_scatter_backward_ref<T>(const int64_t*, int64_t, int64_t, T*, T*, int64_t, int64_t);
DELTAMOE_INSTANTIATE(float)
DELTAMOE_INSTANTIATE(double)
#undef DELTAMOE_INSTANTIATE

}  // namespace deltamoe
