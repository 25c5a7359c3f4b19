// CPU reference of the GDN gates: beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias).
#include <cmath>

#include "core/error.h"
#include "kernels/gdn_gates/gdn_gates.h"

namespace deltamoe {
namespace {

// torch.nn.functional.softplus with beta 1, threshold 20 (linear above the threshold).
constexpr double kSoftplusThreshold = 20.0;

template <typename S>
S softplus(S x) {
  return x > S(kSoftplusThreshold) ? x : std::log1p(std::exp(x));
}

// Derivative of the thresholded softplus: sigmoid(x), and exactly 1 on the linear branch.
template <typename S>
S softplus_derivative(S x) {
  return x > S(kSoftplusThreshold) ? S(1) : S(1) / (S(1) + std::exp(-x));
}

template <typename S>
S sigmoid(S x) {
  return S(1) / (S(1) + std::exp(-x));
}

void check_gate_args(int64_t num_tokens, int num_heads) {
  CHECK(num_tokens >= 0, "gdn_gates: num_tokens must not be negative, got ", num_tokens);
  CHECK(num_heads > 0, "gdn_gates: num_heads must be positive, got ", num_heads);
}

}  // namespace

template <typename S>
void gdn_gates_forward_ref(const S* a, const S* b, const S* A_log, const S* dt_bias,
                           int64_t num_tokens, int num_heads, S* g, S* beta) {
  check_gate_args(num_tokens, num_heads);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int h = 0; h < num_heads; ++h) {
      const int64_t i = t * num_heads + h;
      g[i] = -std::exp(A_log[h]) * softplus(a[i] + dt_bias[h]);
      beta[i] = sigmoid(b[i]);
    }
  }
}

template <typename S>
void gdn_gates_backward_ref(const S* a, const S* b, const S* A_log, const S* dt_bias, const S* dg,
                            const S* dbeta, int64_t num_tokens, int num_heads, S* da, S* db,
                            S* dA_log, S* ddt_bias) {
  check_gate_args(num_tokens, num_heads);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int h = 0; h < num_heads; ++h) {
      const int64_t i = t * num_heads + h;
      const S decay_rate = std::exp(A_log[h]);
      const S pre = a[i] + dt_bias[h];
      // g = -exp(A_log) sp(pre): dg/dA_log = g, dg/dpre = -exp(A_log) sp'(pre).
      const S d_pre = -dg[i] * decay_rate * softplus_derivative(pre);
      da[i] = d_pre;
      if (ddt_bias != nullptr) ddt_bias[h] += d_pre;
      if (dA_log != nullptr) dA_log[h] += dg[i] * (-decay_rate * softplus(pre));
      const S s = sigmoid(b[i]);
      db[i] = dbeta[i] * s * (S(1) - s);
    }
  }
}

template void gdn_gates_forward_ref<float>(const float*, const float*, const float*, const float*,
                                           int64_t, int, float*, float*);
template void gdn_gates_forward_ref<double>(const double*, const double*, const double*,
                                            const double*, int64_t, int, double*, double*);
template void gdn_gates_backward_ref<float>(const float*, const float*, const float*, const float*,
                                            const float*, const float*, int64_t, int, float*,
                                            float*, float*, float*);
template void gdn_gates_backward_ref<double>(const double*, const double*, const double*,
                                             const double*, const double*, const double*, int64_t,
                                             int, double*, double*, double*, double*);

}  // namespace deltamoe
