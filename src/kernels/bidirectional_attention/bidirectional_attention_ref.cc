// Plain CPU segment attention: probabilities are recomputed from lse in the backward, as the
// fused GPU kernels will do, so the saved state is O(T * H).
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/bidirectional_attention/bidirectional_attention.h"

namespace deltamoe {
namespace {

void check_segments(const int32_t* cu_seqlens, int64_t num_segments, int64_t num_tokens) {
  CHECK(num_segments >= 0 && cu_seqlens[0] == 0 && cu_seqlens[num_segments] == num_tokens,
        "attention: cu_seqlens must start at 0 and end at the token count ", num_tokens);
  for (int64_t s = 0; s < num_segments; ++s) {
    CHECK(cu_seqlens[s] <= cu_seqlens[s + 1], "attention: cu_seqlens must not decrease (segment ", s, ")");
  }
}

template <typename T>
double dot_head(const T* a, const T* b, int64_t head_dim) {
  double sum = 0;
  for (int64_t d = 0; d < head_dim; ++d) sum += static_cast<double>(a[d]) * b[d];
  return sum;
}

}  // namespace

template <typename T>
void bidirectional_attention_forward_ref(const T* q, const T* k, const T* v, const int32_t* cu_seqlens,
                                         int64_t num_segments, T* out, T* lse, int64_t num_tokens, int64_t num_heads,
                                         int64_t head_dim, double scale) {
  check_segments(cu_seqlens, num_segments, num_tokens);
  const int64_t stride = num_heads * head_dim;
  std::vector<double> scores, accum(head_dim);
  for (int64_t s = 0; s < num_segments; ++s) {
    const int64_t begin = cu_seqlens[s], end = cu_seqlens[s + 1];
    scores.resize(end - begin);
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t h = 0; h < num_heads; ++h) {
        const T* qi = q + i * stride + h * head_dim;
        double max_score = -INFINITY;
        for (int64_t j = begin; j < end; ++j) {
          scores[j - begin] = scale * dot_head(qi, k + j * stride + h * head_dim, head_dim);
          max_score = std::max(max_score, scores[j - begin]);
        }
        double total = 0;
        for (double& score : scores) total += (score = std::exp(score - max_score));
        std::fill(accum.begin(), accum.end(), 0.0);
        for (int64_t j = begin; j < end; ++j) {
          const T* vj = v + j * stride + h * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) accum[d] += scores[j - begin] / total * vj[d];
        }
        for (int64_t d = 0; d < head_dim; ++d) out[i * stride + h * head_dim + d] = static_cast<T>(accum[d]);
        lse[i * num_heads + h] = static_cast<T>(max_score + std::log(total));
      }
    }
  }
}

template <typename T>
void bidirectional_attention_backward_ref(const T* q, const T* k, const T* v, const T* out, const T* lse,
                                          const T* d_out, const int32_t* cu_seqlens, int64_t num_segments, T* dq,
                                          T* dk, T* dv, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                                          double scale) {
  check_segments(cu_seqlens, num_segments, num_tokens);
  const int64_t stride = num_heads * head_dim, count = num_tokens * stride;
  // dk and dv gather from many queries: accumulate in double, then store.
  std::vector<double> dq_acc(count, 0.0), dk_acc(count, 0.0), dv_acc(count, 0.0);
  for (int64_t s = 0; s < num_segments; ++s) {
    const int64_t begin = cu_seqlens[s], end = cu_seqlens[s + 1];
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t h = 0; h < num_heads; ++h) {
        const int64_t qi = i * stride + h * head_dim;
        // softmax backward: dS_ij = P_ij (dO_i . v_j - dO_i . O_i)
        const double delta = dot_head(d_out + qi, out + qi, head_dim);
        for (int64_t j = begin; j < end; ++j) {
          const int64_t kj = j * stride + h * head_dim;
          const double prob = std::exp(scale * dot_head(q + qi, k + kj, head_dim) - lse[i * num_heads + h]);
          const double d_score = prob * (dot_head(d_out + qi, v + kj, head_dim) - delta) * scale;
          for (int64_t d = 0; d < head_dim; ++d) {
            dv_acc[kj + d] += prob * d_out[qi + d];
            dq_acc[qi + d] += d_score * k[kj + d];
            dk_acc[kj + d] += d_score * q[qi + d];
          }
        }
      }
    }
  }
  for (int64_t e = 0; e < count; ++e) {
    dq[e] = static_cast<T>(dq_acc[e]);
    dk[e] = static_cast<T>(dk_acc[e]);
    dv[e] = static_cast<T>(dv_acc[e]);
  }
}

#define DELTAMOE_INSTANTIATE(T)                                                                                     \
  template void bidirectional_attention_forward_ref<T>(const T*, const T*, const T*, const int32_t*, int64_t, T*, T*, \
                                                       int64_t, int64_t, int64_t, double);                          \
  template void bidirectional_attention_backward_ref<T>(const T*, const T*, const T*, const T*, const T*, const T*, \
                                                        const int32_t*, int64_t, T*, T*, T*, int64_t, int64_t,     \
                                                        int64_t, double);
DELTAMOE_INSTANTIATE(float)
DELTAMOE_INSTANTIATE(double)
#undef DELTAMOE_INSTANTIATE

}  // namespace deltamoe
