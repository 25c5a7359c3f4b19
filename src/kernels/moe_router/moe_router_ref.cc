// Plain CPU reference of the MoE router: softmax, top-k selection, renormalisation and gradients.
#include "kernels/moe_router/moe_router.h"

#include <cmath>
#include <vector>

#include "core/error.h"

namespace deltamoe {

namespace {

template <typename T>
void softmax_row(const T* row, T* p, int64_t num_experts) {
  T max_logit = row[0];
  for (int64_t e = 1; e < num_experts; ++e) max_logit = std::max(max_logit, row[e]);
  T sum = 0;
  for (int64_t e = 0; e < num_experts; ++e) sum += (p[e] = std::exp(row[e] - max_logit));
  for (int64_t e = 0; e < num_experts; ++e) p[e] /= sum;
}

}  // namespace

template <typename T>
void moe_router_forward_given_choice_ref(const T* logits, T* probs, const int32_t* topk_idx, T* topk_weight,
                                         int64_t num_tokens, int64_t num_experts, int64_t top_k) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    T* p = probs + t * num_experts;
    softmax_row(logits + t * num_experts, p, num_experts);
    T selected_sum = 0;
    for (int64_t slot = 0; slot < top_k; ++slot) {
      const int32_t e = topk_idx[t * top_k + slot];
      CHECK(e >= 0 && e < num_experts, "moe_router: given expert ", e, " for token ", t, " is outside [0, ",
            num_experts, ")");
      selected_sum += p[e];
    }
    for (int64_t slot = 0; slot < top_k; ++slot)
      topk_weight[t * top_k + slot] = p[topk_idx[t * top_k + slot]] / selected_sum;
  }
}

template <typename T>
void moe_router_forward_ref(const T* logits, T* probs, int32_t* topk_idx, T* topk_weight, int64_t num_tokens,
                            int64_t num_experts, int64_t top_k) {
  CHECK(top_k >= 1 && top_k <= num_experts, "moe_router: top_k ", top_k, " must be in [1, ", num_experts, "]");
  std::vector<bool> taken(static_cast<size_t>(num_experts));
  for (int64_t t = 0; t < num_tokens; ++t) {
    const T* row = logits + t * num_experts;
    T* p = probs + t * num_experts;
    softmax_row(row, p, num_experts);
    // Selection by repeated arg-max keeps the tie rule explicit (lower index wins).
    std::fill(taken.begin(), taken.end(), false);
    T selected_sum = 0;
    for (int64_t slot = 0; slot < top_k; ++slot) {
      int64_t best = -1;
      for (int64_t e = 0; e < num_experts; ++e)
        if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
      taken[best] = true;
      topk_idx[t * top_k + slot] = static_cast<int32_t>(best);
      topk_weight[t * top_k + slot] = p[best];
      selected_sum += p[best];
    }
    for (int64_t slot = 0; slot < top_k; ++slot) topk_weight[t * top_k + slot] /= selected_sum;
  }
}

template <typename T>
void softmax_backward_rows_ref(const T* probs, const T* d_probs, T* d_logits, int64_t rows, int64_t width) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* p = probs + r * width;
    const T* dp = d_probs + r * width;
    T inner = 0;
    for (int64_t e = 0; e < width; ++e) inner += p[e] * dp[e];
    for (int64_t e = 0; e < width; ++e) d_logits[r * width + e] = p[e] * (dp[e] - inner);
  }
}

template <typename T>
void moe_router_backward_ref(const T* probs, const int32_t* topk_idx, const T* topk_weight, const T* d_topk_weight,
                             T* d_logits, int64_t num_tokens, int64_t num_experts, int64_t top_k) {
  std::vector<T> d_probs(static_cast<size_t>(num_experts));
  for (int64_t t = 0; t < num_tokens; ++t) {
    // w_k = p_k / S with S = sum of the selected p: dp_k = (dw_k - sum_j dw_j w_j) / S.
    T selected_sum = 0, weighted = 0;
    for (int64_t slot = 0; slot < top_k; ++slot) {
      selected_sum += probs[t * num_experts + topk_idx[t * top_k + slot]];
      weighted += d_topk_weight[t * top_k + slot] * topk_weight[t * top_k + slot];
    }
    std::fill(d_probs.begin(), d_probs.end(), T(0));
    for (int64_t slot = 0; slot < top_k; ++slot)
      d_probs[topk_idx[t * top_k + slot]] = (d_topk_weight[t * top_k + slot] - weighted) / selected_sum;
    softmax_backward_rows_ref(probs + t * num_experts, d_probs.data(), d_logits + t * num_experts, 1, num_experts);
  }
}

#define INSTANTIATE(T)                                                                                               \
  template void moe_router_forward_ref<T>(const T*, T*, int32_t*, T*, int64_t, int64_t, int64_t);                    \
  template void moe_router_forward_given_choice_ref<T>(const T*, T*, const int32_t*, T*, int64_t, int64_t, int64_t); \
  template void moe_router_backward_ref<T>(const T*, const int32_t*, const T*, const T*, T*, int64_t, int64_t,       \
                                           int64_t);                                                                 \
  template void softmax_backward_rows_ref<T>(const T*, const T*, T*, int64_t, int64_t);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace deltamoe
