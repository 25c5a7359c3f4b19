// Plain CPU reference of the shifted, ignore-index cross-entropy of causal LM training.
#include "kernels/cross_entropy/cross_entropy.h"

#include <cmath>

#include "core/error.h"

namespace deltamoe {

void shift_labels_ref(const int64_t* labels, int64_t* shifted, int64_t rows, int64_t seq_len) {
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t s = 0; s < seq_len; ++s)
      shifted[b * seq_len + s] = s + 1 < seq_len ? labels[b * seq_len + s + 1] : kIgnoreIndex;
}

namespace {

bool is_supervised(const int64_t* labels, int64_t t, int64_t vocab) {
  const int64_t label = labels[t];
  if (label == kIgnoreIndex) return false;
  CHECK(label >= 0 && label < vocab, "cross_entropy: label ", label, " at (shifted) token ", t,
        " is neither -100 nor a vocabulary id in [0, ", vocab, ")");
  return true;
}

}  // namespace

template <typename T>
double cross_entropy_forward_ref(const T* logits, const int64_t* labels, T* lse, int64_t num_tokens, int64_t vocab,
                                 int64_t* num_supervised) {
  double total = 0;
  int64_t count = 0;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const T* row = logits + t * vocab;
    T max_logit = row[0];
    for (int64_t v = 1; v < vocab; ++v) max_logit = std::max(max_logit, row[v]);
    T sum = 0;
    for (int64_t v = 0; v < vocab; ++v) sum += std::exp(row[v] - max_logit);
    lse[t] = max_logit + std::log(sum);
    if (!is_supervised(labels, t, vocab)) continue;
    total += static_cast<double>(lse[t]) - static_cast<double>(row[labels[t]]);
    ++count;
  }
  *num_supervised = count;
  return count > 0 ? total / static_cast<double>(count) : 0.0;
}

template <typename T>
void cross_entropy_backward_ref(const T* logits, const int64_t* labels, const T* lse, T d_loss, T* d_logits,
                                int64_t num_tokens, int64_t vocab) {
  int64_t count = 0;
  for (int64_t t = 0; t < num_tokens; ++t) count += is_supervised(labels, t, vocab) ? 1 : 0;
  for (int64_t t = 0; t < num_tokens; ++t) {
    T* d_row = d_logits + t * vocab;
    if (!is_supervised(labels, t, vocab)) {
      for (int64_t v = 0; v < vocab; ++v) d_row[v] = 0;
      continue;
    }
    const T scale = d_loss / T(count);
    for (int64_t v = 0; v < vocab; ++v) d_row[v] = scale * std::exp(logits[t * vocab + v] - lse[t]);
    d_row[labels[t]] -= scale;
  }
}

#define INSTANTIATE(T)                                                                                    \
  template double cross_entropy_forward_ref<T>(const T*, const int64_t*, T*, int64_t, int64_t, int64_t*); \
  template void cross_entropy_backward_ref<T>(const T*, const int64_t*, const T*, T, T*, int64_t, int64_t);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace deltamoe
