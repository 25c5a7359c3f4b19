// CPU reference of the gated delta rule as a token-by-token recurrence (the spec and the oracle
// for the chunked form), with its reverse-time backward.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/gated_delta_rule/gated_delta_rule.h"
#include "kernels/gated_delta_rule/gated_delta_rule_ref_util.h"

namespace deltamoe {
namespace {

// One token of the recurrence on the state S [Dk, Dv] (row-major, S[i*Dv + j]):
//   S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T.
// Leaves delta (= beta (v - m)) and the prediction error (v - m) in the given buffers.
template <typename S>
void recurrent_step(S* state, const S* k, const S* v, S g, S beta, int key_dim, int value_dim,
                    S* delta, S* error) {
  const S decay = std::exp(g);
  for (int64_t i = 0; i < static_cast<int64_t>(key_dim) * value_dim; ++i) state[i] *= decay;
  for (int j = 0; j < value_dim; ++j) {
    S predicted = 0;  // (S^T k)_j
    for (int i = 0; i < key_dim; ++i) predicted += state[i * value_dim + j] * k[i];
    error[j] = v[j] - predicted;
    delta[j] = beta * error[j];
  }
  for (int i = 0; i < key_dim; ++i) {
    for (int j = 0; j < value_dim; ++j) state[i * value_dim + j] += k[i] * delta[j];
  }
}

// o = S^T (scale q).
template <typename S>
void read_out(const S* state, const S* q, S scale, int key_dim, int value_dim, S* o) {
  for (int j = 0; j < value_dim; ++j) {
    S sum = 0;
    for (int i = 0; i < key_dim; ++i) sum += state[i * value_dim + j] * q[i];
    o[j] = scale * sum;
  }
}

}  // namespace

template <typename S>
void gated_delta_rule_recurrent_forward_ref(const GatedDeltaRuleShape& shape, S scale, const S* q,
                                            const S* k, const S* v, const S* g, const S* beta,
                                            const S* initial_state, S* o, S* final_state) {
  gdn_ref::check_gated_delta_rule_args("gated_delta_rule_recurrent_forward_ref", shape);
  const gdn_ref::GdnLayout at(shape);
  const int dk = shape.key_dim, dv = shape.value_dim;
  std::vector<S> state(at.state_size()), delta(dv), error(dv);
  for (int n = 0; n < shape.num_seqs; ++n) {
    for (int h = 0; h < shape.num_value_heads; ++h) {
      if (initial_state != nullptr) {
        std::copy_n(initial_state + at.state(n, h), at.state_size(), state.begin());
      } else {
        std::fill(state.begin(), state.end(), S(0));
      }
      for (int64_t t = at.seq_begin(n); t < at.seq_end(n); ++t) {
        recurrent_step(state.data(), k + at.qk_row(t, h), v + at.v_row(t, h), g[at.gate(t, h)],
                       beta[at.gate(t, h)], dk, dv, delta.data(), error.data());
        read_out(state.data(), q + at.qk_row(t, h), scale, dk, dv, o + at.v_row(t, h));
      }
      if (final_state != nullptr)
        std::copy(state.begin(), state.end(), final_state + at.state(n, h));
    }
  }
}

template <typename S>
void gated_delta_rule_recurrent_backward_ref(const GatedDeltaRuleShape& shape, S scale, const S* q,
                                             const S* k, const S* v, const S* g, const S* beta,
                                             const S* initial_state, const S* d_o,
                                             const S* d_final_state, S* dq, S* dk, S* dv, S* dg,
                                             S* dbeta, S* d_initial_state) {
  gdn_ref::check_gated_delta_rule_args("gated_delta_rule_recurrent_backward_ref", shape);
  const gdn_ref::GdnLayout at(shape);
  const int key_dim = shape.key_dim, value_dim = shape.value_dim;
  const int64_t state_size = at.state_size();
  // dq and dk collect the contributions of every value head sharing a key head.
  std::fill_n(dq, shape.num_tokens * shape.num_key_heads * key_dim, S(0));
  std::fill_n(dk, shape.num_tokens * shape.num_key_heads * key_dim, S(0));

  int64_t max_len = 0;
  for (int n = 0; n < shape.num_seqs; ++n)
    max_len = std::max(max_len, at.seq_end(n) - at.seq_begin(n));
  // states_before[t] = the state entering token t of the current (sequence, head).
  std::vector<S> states_before(max_len * state_size);
  std::vector<S> state(state_size), d_state(state_size);
  std::vector<S> delta(value_dim), error(value_dim), d_delta(value_dim);

  for (int n = 0; n < shape.num_seqs; ++n) {
    const int64_t begin = at.seq_begin(n), end = at.seq_end(n);
    for (int h = 0; h < shape.num_value_heads; ++h) {
      // Forward pass, keeping the state entering every token.
      if (initial_state != nullptr) {
        std::copy_n(initial_state + at.state(n, h), state_size, state.begin());
      } else {
        std::fill(state.begin(), state.end(), S(0));
      }
      for (int64_t t = begin; t < end; ++t) {
        std::copy(state.begin(), state.end(), states_before.begin() + (t - begin) * state_size);
        recurrent_step(state.data(), k + at.qk_row(t, h), v + at.v_row(t, h), g[at.gate(t, h)],
                       beta[at.gate(t, h)], key_dim, value_dim, delta.data(), error.data());
      }
      if (d_final_state != nullptr) {
        std::copy_n(d_final_state + at.state(n, h), state_size, d_state.begin());
      } else {
        std::fill(d_state.begin(), d_state.end(), S(0));
      }
      // Reverse time. `state` is rebuilt as S_t from the saved S_{t-1}; d_state holds dL/dS_t.
      for (int64_t t = end - 1; t >= begin; --t) {
        const S* k_t = k + at.qk_row(t, h);
        const S* q_t = q + at.qk_row(t, h);
        const S* v_t = v + at.v_row(t, h);
        const S* do_t = d_o + at.v_row(t, h);
        const S g_t = g[at.gate(t, h)], beta_t = beta[at.gate(t, h)];
        const S decay = std::exp(g_t);
        const S* state_prev = states_before.data() + (t - begin) * state_size;
        std::copy_n(state_prev, state_size, state.begin());
        recurrent_step(state.data(), k_t, v_t, g_t, beta_t, key_dim, value_dim, delta.data(),
                       error.data());
        S* dq_t = dq + at.qk_row(t, h);
        S* dk_t = dk + at.qk_row(t, h);
        // o_t = S_t^T (scale q_t): dq += scale S_t do_t; dS_t += scale q_t do_t^T.
        for (int i = 0; i < key_dim; ++i) {
          S sum = 0;
          for (int j = 0; j < value_dim; ++j) {
            sum += state[i * value_dim + j] * do_t[j];
            d_state[i * value_dim + j] += scale * q_t[i] * do_t[j];
          }
          dq_t[i] += scale * sum;
        }
        // S_t = S' + k delta^T: d delta = dS^T k; dk += dS delta.
        for (int j = 0; j < value_dim; ++j) {
          S sum = 0;
          for (int i = 0; i < key_dim; ++i) sum += d_state[i * value_dim + j] * k_t[i];
          d_delta[j] = sum;
        }
        for (int i = 0; i < key_dim; ++i) {
          S sum = 0;
          for (int j = 0; j < value_dim; ++j) sum += d_state[i * value_dim + j] * delta[j];
          dk_t[i] += sum;
        }
        // delta = beta (v - m): dbeta = d_delta . (v - m); dv = beta d_delta; dm = -beta d_delta.
        S d_beta = 0;
        for (int j = 0; j < value_dim; ++j) d_beta += d_delta[j] * error[j];
        dbeta[at.gate(t, h)] = d_beta;
        S* dv_t = dv + at.v_row(t, h);
        for (int j = 0; j < value_dim; ++j) dv_t[j] = beta_t * d_delta[j];
        // m = S'^T k with S' = exp(g) S_{t-1}: dS' = dS + k dm^T; dk += S' dm.
        for (int i = 0; i < key_dim; ++i) {
          S sum = 0;
          for (int j = 0; j < value_dim; ++j) {
            const S d_m = -beta_t * d_delta[j];
            sum += decay * state_prev[i * value_dim + j] * d_m;
            d_state[i * value_dim + j] += k_t[i] * d_m;
          }
          dk_t[i] += sum;
        }
        // S' = exp(g) S_{t-1}: dg = <dS', S'>; dS_{t-1} = exp(g) dS'.
        S d_g = 0;
        for (int64_t i = 0; i < state_size; ++i) d_g += d_state[i] * decay * state_prev[i];
        dg[at.gate(t, h)] = d_g;
        for (int64_t i = 0; i < state_size; ++i) d_state[i] *= decay;
      }
      if (d_initial_state != nullptr) {
        std::copy(d_state.begin(), d_state.end(), d_initial_state + at.state(n, h));
      }
    }
  }
}

#define DELTAMOE_INSTANTIATE_RECURRENT(S)                                                          \
  template void gated_delta_rule_recurrent_forward_ref<S>(const GatedDeltaRuleShape&, S, const S*, \
                                                          const S*, const S*, const S*, const S*,  \
                                                          const S*, S*, S*);                       \
  template void gated_delta_rule_recurrent_backward_ref<S>(                                        \
      const GatedDeltaRuleShape&, S, const S*, const S*, const S*, const S*, const S*, const S*,   \
      const S*, const S*, S*, S*, S*, S*, S*, S*);
DELTAMOE_INSTANTIATE_RECURRENT(float)
DELTAMOE_INSTANTIATE_RECURRENT(double)
#undef DELTAMOE_INSTANTIATE_RECURRENT

}  // namespace deltamoe
