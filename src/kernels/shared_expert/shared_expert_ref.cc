// Plain CPU reference of the sigmoid-gated shared expert, built from the linear reference.
#include "kernels/shared_expert/shared_expert.h"

#include <cmath>
#include <vector>

#include "kernels/linear/linear.h"

namespace deltamoe {

namespace {

template <typename T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// The intermediate activations of the shared expert for all tokens.
template <typename T>
struct SharedActivations {
  std::vector<T> gate, up, hidden, out, scale_logit;  // [T,I], [T,I], [T,I], [T,C], [T]
};

template <typename T>
SharedActivations<T> shared_forward(const T* x, const T* gate_proj, const T* up_proj, const T* down_proj,
                                    const T* expert_gate, int64_t tokens, int64_t C, int64_t I) {
  SharedActivations<T> a;
  a.gate.resize(tokens * I);
  a.up.resize(tokens * I);
  a.hidden.resize(tokens * I);
  a.out.resize(tokens * C);
  a.scale_logit.resize(tokens);
  linear_forward_ref(x, gate_proj, a.gate.data(), tokens, C, I);
  linear_forward_ref(x, up_proj, a.up.data(), tokens, C, I);
  for (int64_t i = 0; i < tokens * I; ++i) a.hidden[i] = a.gate[i] * sigmoid(a.gate[i]) * a.up[i];
  linear_forward_ref(a.hidden.data(), down_proj, a.out.data(), tokens, I, C);
  linear_forward_ref(x, expert_gate, a.scale_logit.data(), tokens, C, 1);
  return a;
}

}  // namespace

template <typename T>
void shared_expert_forward_ref(const T* x, const T* gate_proj, const T* up_proj, const T* down_proj,
                               const T* expert_gate, T* y, int64_t num_tokens, int64_t hidden, int64_t intermediate) {
  const auto a = shared_forward(x, gate_proj, up_proj, down_proj, expert_gate, num_tokens, hidden, intermediate);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const T scale = sigmoid(a.scale_logit[t]);
    for (int64_t c = 0; c < hidden; ++c) y[t * hidden + c] = scale * a.out[t * hidden + c];
  }
}

template <typename T>
void shared_expert_backward_ref(const T* x, const T* gate_proj, const T* up_proj, const T* down_proj,
                                const T* expert_gate, const T* dy, T* dx, T* d_gate_proj, T* d_up_proj, T* d_down_proj,
                                T* d_expert_gate, int64_t num_tokens, int64_t hidden, int64_t intermediate) {
  const int64_t C = hidden, I = intermediate;
  const auto a = shared_forward(x, gate_proj, up_proj, down_proj, expert_gate, num_tokens, C, I);
  std::vector<T> d_out(num_tokens * C), d_scale_logit(num_tokens);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const T scale = sigmoid(a.scale_logit[t]);
    T d_scale = 0;
    for (int64_t c = 0; c < C; ++c) {
      d_out[t * C + c] = dy[t * C + c] * scale;
      d_scale += dy[t * C + c] * a.out[t * C + c];
    }
    d_scale_logit[t] = d_scale * scale * (T(1) - scale);
  }
  std::vector<T> d_hidden(num_tokens * I), d_gate(num_tokens * I), d_up(num_tokens * I), dx_part(num_tokens * C);
  linear_backward_ref(a.hidden.data(), down_proj, d_out.data(), d_hidden.data(), d_down_proj, num_tokens, I, C);
  for (int64_t i = 0; i < num_tokens * I; ++i) {
    const T g = a.gate[i], s = sigmoid(g);
    d_gate[i] = d_hidden[i] * a.up[i] * s * (T(1) + g * (T(1) - s));
    d_up[i] = d_hidden[i] * g * s;
  }
  // dx collects three paths: gate_proj, up_proj and the scalar gate.
  linear_backward_ref(x, gate_proj, d_gate.data(), dx, d_gate_proj, num_tokens, C, I);
  linear_backward_ref(x, up_proj, d_up.data(), dx_part.data(), d_up_proj, num_tokens, C, I);
  for (int64_t i = 0; i < num_tokens * C; ++i) dx[i] += dx_part[i];
  linear_backward_ref(x, expert_gate, d_scale_logit.data(), dx_part.data(), d_expert_gate, num_tokens, C, 1);
  for (int64_t i = 0; i < num_tokens * C; ++i) dx[i] += dx_part[i];
}

#define INSTANTIATE(T)                                                                                                \
  template void shared_expert_forward_ref<T>(const T*, const T*, const T*, const T*, const T*, T*, int64_t, int64_t,  \
                                             int64_t);                                                                \
  template void shared_expert_backward_ref<T>(const T*, const T*, const T*, const T*, const T*, const T*, T*, T*, T*, \
                                              T*, T*, int64_t, int64_t, int64_t);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace deltamoe
