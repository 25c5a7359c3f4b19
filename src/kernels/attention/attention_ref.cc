// Plain CPU reference of causal GQA attention over packed sequences (scores recomputed in the
// backward from the saved log-sum-exp) and of the sigmoid output gate.
#include "kernels/attention/attention.h"

#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"

namespace deltamoe {

void check_cu_seqlens(const int32_t* cu_seqlens, int64_t num_seqs, int64_t num_tokens, const char* where) {
  CHECK(num_seqs >= 1, where, ": cu_seqlens needs at least two entries");
  CHECK(cu_seqlens[0] == 0, where, ": cu_seqlens must start at 0, got ", cu_seqlens[0]);
  for (int64_t s = 0; s < num_seqs; ++s)
    CHECK(cu_seqlens[s + 1] >= cu_seqlens[s], where, ": cu_seqlens must not decrease, entry ", s + 1, " is ",
          cu_seqlens[s + 1], " after ", cu_seqlens[s]);
  CHECK(cu_seqlens[num_seqs] == num_tokens, where, ": cu_seqlens must end at the token count ", num_tokens, ", got ",
        cu_seqlens[num_seqs]);
}

namespace {

void check_dims(const AttentionDims& dims) {
  CHECK(dims.num_kv_heads > 0 && dims.num_q_heads % dims.num_kv_heads == 0, "attention: ", dims.num_q_heads,
        " query heads are not a multiple of ", dims.num_kv_heads, " key/value heads");
}

template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  T sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace

template <typename T>
void attention_forward_ref(const AttentionDims& dims, const T* q, const T* k, const T* v, const int32_t* cu_seqlens,
                           int64_t num_seqs, double scale, T* out, T* lse) {
  check_dims(dims);
  check_cu_seqlens(cu_seqlens, num_seqs, dims.num_tokens, "attention");
  const int64_t Hq = dims.num_q_heads, Hkv = dims.num_kv_heads, D = dims.head_dim;
  const int64_t group = Hq / Hkv;
  std::vector<T> scores;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t begin = cu_seqlens[s], end = cu_seqlens[s + 1];
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t h = 0; h < Hq; ++h) {
        const int64_t kv_head = h / group;
        const T* q_row = q + (i * Hq + h) * D;
        // Causal: query i sees keys begin..i of its own sequence.
        scores.assign(static_cast<size_t>(i - begin + 1), T(0));
        T max_score = -std::numeric_limits<T>::infinity();
        for (int64_t j = begin; j <= i; ++j) {
          scores[j - begin] = dot(q_row, k + (j * Hkv + kv_head) * D, D) * T(scale);
          max_score = std::max(max_score, scores[j - begin]);
        }
        T denominator = 0;
        for (T& score : scores) {
          score = std::exp(score - max_score);
          denominator += score;
        }
        T* out_row = out + (i * Hq + h) * D;
        for (int64_t d = 0; d < D; ++d) out_row[d] = 0;
        for (int64_t j = begin; j <= i; ++j) {
          const T p = scores[j - begin] / denominator;
          const T* v_row = v + (j * Hkv + kv_head) * D;
          for (int64_t d = 0; d < D; ++d) out_row[d] += p * v_row[d];
        }
        lse[i * Hq + h] = max_score + std::log(denominator);
      }
    }
  }
}

template <typename T>
void attention_backward_ref(const AttentionDims& dims, const T* q, const T* k, const T* v, const T* out, const T* lse,
                            const T* d_out, const int32_t* cu_seqlens, int64_t num_seqs, double scale, T* dq, T* dk,
                            T* dv) {
  check_dims(dims);
  check_cu_seqlens(cu_seqlens, num_seqs, dims.num_tokens, "attention");
  const int64_t Hq = dims.num_q_heads, Hkv = dims.num_kv_heads, D = dims.head_dim, Tn = dims.num_tokens;
  const int64_t group = Hq / Hkv;
  for (int64_t i = 0; i < Tn * Hq * D; ++i) dq[i] = 0;
  for (int64_t i = 0; i < Tn * Hkv * D; ++i) dk[i] = dv[i] = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t begin = cu_seqlens[s], end = cu_seqlens[s + 1];
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t h = 0; h < Hq; ++h) {
        const int64_t kv_head = h / group;
        const T* q_row = q + (i * Hq + h) * D;
        const T* d_out_row = d_out + (i * Hq + h) * D;
        // dS_ij = P_ij (dO_i . v_j - dO_i . O_i): softmax backward with the row term precomputed.
        const T row_term = dot(d_out_row, out + (i * Hq + h) * D, D);
        T* dq_row = dq + (i * Hq + h) * D;
        for (int64_t j = begin; j <= i; ++j) {
          const T* k_row = k + (j * Hkv + kv_head) * D;
          const T* v_row = v + (j * Hkv + kv_head) * D;
          const T p = std::exp(dot(q_row, k_row, D) * T(scale) - lse[i * Hq + h]);
          const T d_score = p * (dot(d_out_row, v_row, D) - row_term) * T(scale);
          T* dk_row = dk + (j * Hkv + kv_head) * D;
          T* dv_row = dv + (j * Hkv + kv_head) * D;
          for (int64_t d = 0; d < D; ++d) {
            dq_row[d] += d_score * k_row[d];
            dk_row[d] += d_score * q_row[d];
            dv_row[d] += p * d_out_row[d];
          }
        }
      }
    }
  }
}

template <typename T>
void attention_gate_forward_ref(const T* attn, const T* gate, T* y, int64_t count) {
  for (int64_t i = 0; i < count; ++i) y[i] = attn[i] / (T(1) + std::exp(-gate[i]));
}

template <typename T>
void attention_gate_backward_ref(const T* attn, const T* gate, const T* dy, T* d_attn, T* d_gate, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const T sig = T(1) / (T(1) + std::exp(-gate[i]));
    d_attn[i] = dy[i] * sig;
    d_gate[i] = dy[i] * attn[i] * sig * (T(1) - sig);
  }
}

#define INSTANTIATE(T)                                                                                                \
  template void attention_forward_ref<T>(const AttentionDims&, const T*, const T*, const T*, const int32_t*, int64_t, \
                                         double, T*, T*);                                                             \
  template void attention_backward_ref<T>(const AttentionDims&, const T*, const T*, const T*, const T*, const T*,     \
                                          const T*, const int32_t*, int64_t, double, T*, T*, T*);                     \
  template void attention_gate_forward_ref<T>(const T*, const T*, T*, int64_t);                                       \
  template void attention_gate_backward_ref<T>(const T*, const T*, const T*, T*, T*, int64_t);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace deltamoe
