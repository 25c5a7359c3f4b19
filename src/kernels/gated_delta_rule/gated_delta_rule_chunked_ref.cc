// CPU reference of the chunked (WY/UT) gated delta rule, forward and a true chunked backward:
// per chunk the UT transform A = (I + L)^-1, W = A diag(beta e^gamma) K, U = A diag(beta) V,
// V_new = U - W H; then a forward scan of chunk states H and a reverse scan of dH. Optionally
// rounds chosen intermediates to bf16 where a kernel would hold them as bf16 operands
// (GdnBf16Intermediates); with none chosen every operation is the plain fp32/fp64 one.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "kernels/gated_delta_rule/gated_delta_rule.h"
#include "kernels/gated_delta_rule/gated_delta_rule_ref_util.h"

namespace deltamoe {
namespace {

// The inputs of one (sequence, value head) of the op.
template <typename S>
struct HeadInputs {
  const gdn_ref::GdnLayout& at;
  int h;
  S scale;
  const S *q, *k, *v, *g, *beta;
};

// Everything one chunk needs, gathered into small dense row-major arrays sized for chunk_size
// tokens once and reused (no allocation per chunk). Row i is the chunk's i-th token.
template <typename S>
struct ChunkWork {
  ChunkWork(int chunk_size, int key_dim, int value_dim, const GdnBf16Intermediates& rounding)
      : bf16(rounding),
        dk(key_dim),
        dv(value_dim),
        cap(chunk_size),
        q(cap * dk),
        k(cap * dk),
        v(cap * dv),
        gamma(cap),
        exp_gamma(cap),
        beta(cap),
        decay_matrix(cap * cap),
        kk(cap * cap),
        qk(cap * cap),
        p(cap * cap),
        a_inv(cap * cap),
        w(cap * dk),
        u(cap * dv),
        v_new(cap * dv) {}

  // exp(gamma_i - gamma_j): the decay from token j to token i inside the chunk (i >= j).
  S decay(int i, int j) const { return decay_matrix[i * cap + j]; }

  GdnBf16Intermediates bf16;  // which intermediates are rounded to bf16
  int dk, dv, cap;
  int len = 0;               // tokens in this chunk (the last chunk of a sequence may be short)
  std::vector<S> q;          // [C, Dk] scale * q
  std::vector<S> k;          // [C, Dk]
  std::vector<S> v;          // [C, Dv]
  std::vector<S> gamma;      // [C] cumulative log decay inside the chunk, gamma_i = sum_{j<=i} g_j
  std::vector<S> exp_gamma;  // [C] exp(gamma_i): decay from the chunk start to token i
  std::vector<S> beta;       // [C]
  std::vector<S> decay_matrix;  // [C, C] exp(gamma_i - gamma_j) for i >= j (exp computed once)
  std::vector<S> kk;            // [C, C] k_i . k_j (lower triangle)
  std::vector<S> qk;            // [C, C] (scale q_i) . k_j (lower triangle)
  std::vector<S> p;             // [C, C] P_ij = qk_ij exp(gamma_i - gamma_j) (lower triangle)
  std::vector<S> a_inv;         // [C, C] A = (I + L)^-1, unit lower triangular
  std::vector<S> w;             // [C, Dk] W = A diag(beta e^gamma) K
  std::vector<S> u;             // [C, Dv] U = A diag(beta) V
  std::vector<S> v_new;         // [C, Dv] V_new = U - W H (the delta-rule corrections, delta_t)
};

// x as a bf16 operand when `round` is set (round to nearest even), else unchanged.
template <typename S>
S operand(S x, bool round) {
  return round ? static_cast<S>(round_to_bf16(static_cast<float>(x))) : x;
}

template <typename S>
void round_operands(S* x, int64_t n, bool round) {
  if (round) {
    for (int64_t i = 0; i < n; ++i) x[i] = operand(x[i], true);
  }
}

template <typename S>
S dot(const S* a, const S* b, int n) {
  S sum = 0;
  for (int i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Gathers tokens [t0, t0 + len) of one head and builds the UT/WY representation.
template <typename S>
void prepare_chunk(const HeadInputs<S>& in, int64_t t0, int len, ChunkWork<S>& c) {
  const int dk = c.dk, dv = c.dv, cap = c.cap;
  c.len = len;
  S running = 0;
  for (int i = 0; i < len; ++i) {
    const int64_t t = t0 + i;
    const S* q_t = in.q + in.at.qk_row(t, in.h);
    const S* k_t = in.k + in.at.qk_row(t, in.h);
    for (int d = 0; d < dk; ++d) {
      c.q[i * dk + d] = in.scale * q_t[d];
      c.k[i * dk + d] = k_t[d];
    }
    std::copy_n(in.v + in.at.v_row(t, in.h), dv, c.v.begin() + i * dv);
    running += in.g[in.at.gate(t, in.h)];
    c.gamma[i] = running;
    c.beta[i] = in.beta[in.at.gate(t, in.h)];
  }
  for (int i = 0; i < len; ++i) {
    c.exp_gamma[i] = std::exp(c.gamma[i]);
    for (int j = 0; j <= i; ++j) c.decay_matrix[i * cap + j] = std::exp(c.gamma[i] - c.gamma[j]);
  }
  // Only the lower triangle (j <= i) of kk and qk is ever read.
  for (int i = 0; i < len; ++i) {
    for (int j = 0; j <= i; ++j) {
      c.kk[i * cap + j] = dot(&c.k[i * dk], &c.k[j * dk], dk);
      c.qk[i * cap + j] = dot(&c.q[i * dk], &c.k[j * dk], dk);
      c.p[i * cap + j] = operand(c.qk[i * cap + j] * c.decay(i, j), c.bf16.p);
    }
  }
  // A = (I + L)^-1 with L_ij = beta_i (k_i . k_j) exp(gamma_i - gamma_j) for i > j, by forward
  // substitution row by row: A_ii = 1, A_ij = -sum_{j <= m < i} L_im A_mj.
  for (int i = 0; i < len; ++i) {
    for (int j = 0; j < len; ++j) c.a_inv[i * cap + j] = i == j ? S(1) : S(0);
    for (int j = 0; j < i; ++j) {
      S sum = 0;
      for (int m = j; m < i; ++m) sum += c.kk[i * cap + m] * c.decay(i, m) * c.a_inv[m * cap + j];
      c.a_inv[i * cap + j] = -c.beta[i] * sum;
    }
  }
  // W = A diag(beta e^gamma) K, U = A diag(beta) V (A is lower triangular: sum over j <= i).
  for (int i = 0; i < len; ++i) {
    std::fill_n(c.w.begin() + i * dk, dk, S(0));
    std::fill_n(c.u.begin() + i * dv, dv, S(0));
    for (int j = 0; j <= i; ++j) {
      const S a = c.a_inv[i * cap + j];
      const S wk = operand(a * c.beta[j] * c.exp_gamma[j], c.bf16.a);
      const S uv = operand(a * c.beta[j], c.bf16.a);
      for (int d = 0; d < dk; ++d) c.w[i * dk + d] += wk * c.k[j * dk + d];
      for (int d = 0; d < dv; ++d) c.u[i * dv + d] += uv * c.v[j * dv + d];
    }
  }
  // A as the backward's products read it (after W and U, which took it unrounded).
  for (int i = 0; i < len; ++i) round_operands(&c.a_inv[i * cap], i, c.bf16.a);
  round_operands(c.w.data(), static_cast<int64_t>(len) * dk, c.bf16.w);
  round_operands(c.u.data(), static_cast<int64_t>(len) * dv, c.bf16.u);
}

// V_new = U - W H for the state H [Dk, Dv] entering the chunk.
template <typename S>
void compute_v_new(const S* state, ChunkWork<S>& c) {
  const int dk = c.dk, dv = c.dv;
  for (int i = 0; i < c.len; ++i) {
    for (int e = 0; e < dv; ++e) {
      S sum = 0;
      for (int d = 0; d < dk; ++d) sum += c.w[i * dk + d] * state[d * dv + e];
      c.v_new[i * dv + e] = c.u[i * dv + e] - sum;
    }
  }
  round_operands(c.v_new.data(), static_cast<int64_t>(c.len) * dv, c.bf16.v_new);
}

// o_i = e^gamma_i (scale q_i)^T H + sum_{j <= i} (scale q_i . k_j) e^(gamma_i - gamma_j) v_new_j.
template <typename S>
void write_chunk_output(const HeadInputs<S>& in, int64_t t0, const S* state, const ChunkWork<S>& c,
                        S* o) {
  const int dk = c.dk, dv = c.dv, cap = c.cap;
  for (int i = 0; i < c.len; ++i) {
    S* o_t = o + in.at.v_row(t0 + i, in.h);
    const S inter_scale = c.exp_gamma[i];
    for (int e = 0; e < dv; ++e) {
      S inter = 0;
      for (int d = 0; d < dk; ++d) inter += c.q[i * dk + d] * state[d * dv + e];
      S intra = 0;
      for (int j = 0; j <= i; ++j) intra += c.p[i * cap + j] * c.v_new[j * dv + e];
      o_t[e] = inter_scale * inter + intra;
    }
  }
}

// H <- e^gamma_last H + sum_j e^(gamma_last - gamma_j) k_j v_new_j^T (the state leaving the chunk).
template <typename S>
void advance_state(const ChunkWork<S>& c, S* state) {
  const int dk = c.dk, dv = c.dv, last = c.len - 1;
  const S chunk_decay = c.exp_gamma[last];
  for (int64_t i = 0; i < static_cast<int64_t>(dk) * dv; ++i) state[i] *= chunk_decay;
  for (int j = 0; j < c.len; ++j) {
    const S to_end = c.decay(last, j);
    for (int d = 0; d < dk; ++d) {
      const S kd = to_end * c.k[j * dk + d];
      for (int e = 0; e < dv; ++e) state[d * dv + e] += kd * c.v_new[j * dv + e];
    }
  }
}

// Gradient buffers of one chunk (chunk-local rows), allocated once.
template <typename S>
struct ChunkGrads {
  ChunkGrads(int cap, int dk, int dv)
      : dq(cap * dk),
        dk(cap * dk),
        dv(cap * dv),
        d_gamma(cap),
        d_beta(cap),
        d_v_new(cap * dv),
        d_w(cap * dk),
        d_a(cap * cap),
        d_a_at(cap * cap),
        d_l(cap * cap),
        q_gated(cap * dk),
        d_state_op(dk * dv),
        d_state_in(dk * dv) {}
  std::vector<S> dq, dk, dv;        // [C, Dk] (w.r.t. scale*q), [C, Dk], [C, Dv]
  std::vector<S> d_gamma, d_beta;   // [C]
  std::vector<S> d_v_new, d_w;      // [C, Dv], [C, Dk]; dU = d_v_new
  std::vector<S> d_a, d_a_at, d_l;  // [C, C]
  std::vector<S> q_gated;           // [C, Dk] e^gamma_i (scale q_i), the dH update's operand
  std::vector<S> d_state_op;        // [Dk, Dv] dH as an operand when it is rounded to bf16
  std::vector<S> d_state_in;        // [Dk, Dv]
};

// Backward of one chunk. `state` is H entering the chunk (as an operand), d_state is dL/dH
// leaving it on entry and dL/dH entering it on return. Requires prepare_chunk and compute_v_new
// for this chunk.
template <typename S>
void chunk_backward(const ChunkWork<S>& c, const S* state, const S* d_o_chunk, S* d_state,
                    ChunkGrads<S>& gr) {
  const int dk = c.dk, dv = c.dv, cap = c.cap, len = c.len, last = len - 1;
  std::fill(gr.dq.begin(), gr.dq.end(), S(0));
  std::fill(gr.dk.begin(), gr.dk.end(), S(0));
  std::fill(gr.d_gamma.begin(), gr.d_gamma.end(), S(0));
  std::fill(gr.d_beta.begin(), gr.d_beta.end(), S(0));
  const S chunk_decay = c.exp_gamma[last];
  auto d_o = [&](int i) { return d_o_chunk + static_cast<int64_t>(i) * dv; };
  const bool round_local = c.bf16.local_grads;
  // dH as the products read it; the carried d_state itself stays unrounded.
  const S* dh = d_state;
  if (c.bf16.dh) {
    for (int64_t i = 0; i < static_cast<int64_t>(dk) * dv; ++i) {
      gr.d_state_op[i] = operand(d_state[i], true);
    }
    dh = gr.d_state_op.data();
  }

  // Output: o_i = e^gamma_i q_i^T H + sum_{j<=i} (q_i.k_j) e^(gamma_i-gamma_j) v_new_j.
  // G_ij = do_i . v_new_j gives the gradient of the intra term's coefficients.
  for (int i = 0; i < len; ++i) {
    const S e_i = c.exp_gamma[i];
    // Inter-chunk term: dq_i += e^gamma_i H do_i; d_gamma_i += e^gamma_i q_i^T H do_i.
    for (int d = 0; d < dk; ++d) {
      S h_do = 0;
      for (int e = 0; e < dv; ++e) h_do += state[d * dv + e] * d_o(i)[e];
      gr.dq[i * dk + d] += e_i * h_do;
      gr.d_gamma[i] += e_i * h_do * c.q[i * dk + d];
    }
    for (int j = 0; j <= i; ++j) {
      const S decay_ij = c.decay(i, j);
      const S g_ij = dot(d_o(i), &c.v_new[j * dv], dv);
      // d(q_i . k_j) = G_ij e_ij.
      const S g_decay = operand(g_ij * decay_ij, round_local);
      for (int d = 0; d < dk; ++d) {
        gr.dq[i * dk + d] += g_decay * c.k[j * dk + d];
        gr.dk[j * dk + d] += g_decay * c.q[i * dk + d];
      }
      // d gamma_i += M_ij, d gamma_j -= M_ij (zero net on the diagonal). A kernel holding P as a
      // bf16 operand (flag p) forms M_ij = G_ij P_ij from it.
      const S m_ij = c.bf16.p ? g_ij * c.p[i * cap + j] : g_ij * c.qk[i * cap + j] * decay_ij;
      gr.d_gamma[i] += m_ij;
      gr.d_gamma[j] -= m_ij;
    }
  }
  // dV_new_j = sum_{i>=j} (q_i.k_j) e_ij do_i + e^(gamma_last-gamma_j) dH^T k_j.
  for (int j = 0; j < len; ++j) {
    const S to_end = c.decay(last, j);
    for (int e = 0; e < dv; ++e) {
      S sum = 0;
      for (int i = j; i < len; ++i) sum += c.p[i * cap + j] * d_o(i)[e];
      S carried = 0;
      for (int d = 0; d < dk; ++d) carried += dh[d * dv + e] * c.k[j * dk + d];
      gr.d_v_new[j * dv + e] = sum + to_end * carried;
    }
  }
  round_operands(gr.d_v_new.data(), static_cast<int64_t>(len) * dv, c.bf16.dv_new);
  // State leaving: H_out = e^gamma_last H + sum_j e^(gamma_last-gamma_j) k_j v_new_j^T.
  S h_dot_dh = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(dk) * dv; ++i) h_dot_dh += state[i] * dh[i];
  gr.d_gamma[last] += chunk_decay * h_dot_dh;
  for (int j = 0; j < len; ++j) {
    const S to_end = c.decay(last, j);
    S k_dh_vnew = 0;  // k_j^T dH v_new_j
    for (int d = 0; d < dk; ++d) {
      S dh_vnew = 0;
      for (int e = 0; e < dv; ++e) dh_vnew += dh[d * dv + e] * c.v_new[j * dv + e];
      gr.dk[j * dk + d] += to_end * dh_vnew;
      k_dh_vnew += c.k[j * dk + d] * dh_vnew;
    }
    gr.d_gamma[last] += to_end * k_dh_vnew;
    gr.d_gamma[j] -= to_end * k_dh_vnew;
  }
  // dH entering = e^gamma_last dH + sum_i e^gamma_i q_i do_i^T - W^T dV_new.
  for (int i = 0; i < len; ++i) {
    for (int d = 0; d < dk; ++d) {
      gr.q_gated[i * dk + d] = operand(c.exp_gamma[i] * c.q[i * dk + d], c.bf16.q_gated);
    }
  }
  for (int d = 0; d < dk; ++d) {
    for (int e = 0; e < dv; ++e) {
      S sum = chunk_decay * d_state[d * dv + e];
      for (int i = 0; i < len; ++i) {
        sum += gr.q_gated[i * dk + d] * d_o(i)[e];
        sum -= c.w[i * dk + d] * gr.d_v_new[i * dv + e];
      }
      gr.d_state_in[d * dv + e] = sum;
    }
  }
  // V_new = U - W H: dU = dV_new, dW_i = -H dV_new_i.
  for (int i = 0; i < len; ++i) {
    for (int d = 0; d < dk; ++d) {
      S sum = 0;
      for (int e = 0; e < dv; ++e) sum += state[d * dv + e] * gr.d_v_new[i * dv + e];
      gr.d_w[i * dk + d] = -sum;
    }
  }
  round_operands(gr.d_w.data(), static_cast<int64_t>(len) * dk, round_local);
  // W = A X with X_j = beta_j e^gamma_j k_j, U = A Y with Y_j = beta_j v_j.
  // dA_ij = dW_i . X_j + dU_i . Y_j, kept on the strict lower triangle (A's only free entries).
  for (int i = 0; i < len; ++i) {
    for (int j = 0; j < len; ++j) {
      S value = 0;
      if (j < i) {
        value = c.beta[j] * c.exp_gamma[j] * dot(&gr.d_w[i * dk], &c.k[j * dk], dk) +
                c.beta[j] * dot(&gr.d_v_new[i * dv], &c.v[j * dv], dv);
      }
      gr.d_a[i * cap + j] = value;
    }
  }
  for (int i = 0; i < len; ++i) round_operands(&gr.d_a[i * cap], i, round_local);
  // dX = A^T dW and dY = A^T dU give the direct gradients of k, v, beta, gamma.
  for (int j = 0; j < len; ++j) {
    const S e_j = c.exp_gamma[j];
    S dx_dot_k = 0;
    for (int d = 0; d < dk; ++d) {
      S dx = 0;
      for (int i = j; i < len; ++i) dx += c.a_inv[i * cap + j] * gr.d_w[i * dk + d];
      gr.dk[j * dk + d] += c.beta[j] * e_j * dx;
      dx_dot_k += dx * c.k[j * dk + d];
    }
    gr.d_beta[j] += e_j * dx_dot_k;
    gr.d_gamma[j] += c.beta[j] * e_j * dx_dot_k;
    S dy_dot_v = 0;
    for (int e = 0; e < dv; ++e) {
      S dy = 0;
      for (int i = j; i < len; ++i) dy += c.a_inv[i * cap + j] * gr.d_v_new[i * dv + e];
      gr.dv[j * dv + e] = c.beta[j] * dy;
      dy_dot_v += dy * c.v[j * dv + e];
    }
    gr.d_beta[j] += dy_dot_v;
  }
  // A = (I + L)^-1 => dL = -A^T dA A^T (strict lower part). First d_a_at = dA A^T.
  for (int a = 0; a < len; ++a) {
    for (int j = 0; j < len; ++j) {
      S sum = 0;
      for (int b = 0; b <= j; ++b) sum += gr.d_a[a * cap + b] * c.a_inv[j * cap + b];
      gr.d_a_at[a * cap + j] = sum;
    }
    round_operands(&gr.d_a_at[a * cap], len, round_local);
  }
  for (int i = 0; i < len; ++i) {
    for (int j = 0; j < i; ++j) {
      S sum = 0;
      for (int a = i; a < len; ++a) sum += c.a_inv[a * cap + i] * gr.d_a_at[a * cap + j];
      gr.d_l[i * cap + j] = -sum;
    }
  }
  // L_ij = beta_i (k_i . k_j) e^(gamma_i - gamma_j), i > j.
  for (int i = 0; i < len; ++i) {
    for (int j = 0; j < i; ++j) {
      const S decay_ij = c.decay(i, j);
      const S dl = gr.d_l[i * cap + j];
      const S f_ij = dl * c.kk[i * cap + j] * decay_ij;
      gr.d_beta[i] += f_ij;
      gr.d_gamma[i] += c.beta[i] * f_ij;
      gr.d_gamma[j] -= c.beta[i] * f_ij;
      const S coeff = operand(dl * c.beta[i] * decay_ij, round_local);
      for (int d = 0; d < dk; ++d) {
        gr.dk[i * dk + d] += coeff * c.k[j * dk + d];
        gr.dk[j * dk + d] += coeff * c.k[i * dk + d];
      }
    }
  }
  std::copy(gr.d_state_in.begin(), gr.d_state_in.end(), d_state);
}

template <typename S>
void load_state(const S* initial_state, int64_t offset, int64_t size, std::vector<S>& state) {
  if (initial_state != nullptr) {
    std::copy_n(initial_state + offset, size, state.begin());
  } else {
    std::fill(state.begin(), state.end(), S(0));
  }
}

// The state entering a chunk as its products read it: `state` itself, or its bf16 rounding in
// `snapshot` when the chunk states are bf16 operands.
template <typename S>
const S* state_operand(const std::vector<S>& state, bool round, std::vector<S>& snapshot) {
  if (!round) return state.data();
  for (size_t i = 0; i < state.size(); ++i) snapshot[i] = operand(state[i], true);
  return snapshot.data();
}

}  // namespace

template <typename S>
void gated_delta_rule_chunked_forward_ref(const GatedDeltaRuleShape& shape, S scale, const S* q,
                                          const S* k, const S* v, const S* g, const S* beta,
                                          const S* initial_state, S* o, S* final_state,
                                          int chunk_size) {
  gated_delta_rule_chunked_forward_ref(shape, scale, q, k, v, g, beta, initial_state, o,
                                       final_state, GdnBf16Intermediates{}, chunk_size);
}

template <typename S>
void gated_delta_rule_chunked_forward_ref(const GatedDeltaRuleShape& shape, S scale, const S* q,
                                          const S* k, const S* v, const S* g, const S* beta,
                                          const S* initial_state, S* o, S* final_state,
                                          const GdnBf16Intermediates& bf16, int chunk_size) {
  gdn_ref::check_gated_delta_rule_args("gated_delta_rule_chunked_forward_ref", shape);
  CHECK(chunk_size > 0, "gated_delta_rule_chunked_forward_ref: chunk_size must be positive, got ",
        chunk_size);
  const gdn_ref::GdnLayout at(shape);
  ChunkWork<S> work(chunk_size, shape.key_dim, shape.value_dim, bf16);
  std::vector<S> state(at.state_size()), snapshot(bf16.h ? at.state_size() : 0);
  for (int n = 0; n < shape.num_seqs; ++n) {
    for (int h = 0; h < shape.num_value_heads; ++h) {
      const HeadInputs<S> in{at, h, scale, q, k, v, g, beta};
      load_state(initial_state, at.state(n, h), at.state_size(), state);
      // Chunks restart at every sequence boundary; the last one may be shorter.
      for (int64_t t0 = at.seq_begin(n); t0 < at.seq_end(n); t0 += chunk_size) {
        const int len = static_cast<int>(std::min<int64_t>(chunk_size, at.seq_end(n) - t0));
        prepare_chunk(in, t0, len, work);
        const S* entering = state_operand(state, bf16.h, snapshot);
        compute_v_new(entering, work);
        write_chunk_output(in, t0, entering, work, o);
        advance_state(work, state.data());
      }
      if (final_state != nullptr)
        std::copy(state.begin(), state.end(), final_state + at.state(n, h));
    }
  }
}

template <typename S>
void gated_delta_rule_chunked_backward_ref(const GatedDeltaRuleShape& shape, S scale, const S* q,
                                           const S* k, const S* v, const S* g, const S* beta,
                                           const S* initial_state, const S* d_o,
                                           const S* d_final_state, S* dq, S* dk, S* dv, S* dg,
                                           S* dbeta, S* d_initial_state, int chunk_size) {
  gated_delta_rule_chunked_backward_ref(shape, scale, q, k, v, g, beta, initial_state, d_o,
                                        d_final_state, dq, dk, dv, dg, dbeta, d_initial_state,
                                        GdnBf16Intermediates{}, chunk_size);
}

template <typename S>
void gated_delta_rule_chunked_backward_ref(const GatedDeltaRuleShape& shape, S scale, const S* q,
                                           const S* k, const S* v, const S* g, const S* beta,
                                           const S* initial_state, const S* d_o,
                                           const S* d_final_state, S* dq, S* dk, S* dv, S* dg,
                                           S* dbeta, S* d_initial_state,
                                           const GdnBf16Intermediates& bf16, int chunk_size) {
  gdn_ref::check_gated_delta_rule_args("gated_delta_rule_chunked_backward_ref", shape);
  CHECK(chunk_size > 0, "gated_delta_rule_chunked_backward_ref: chunk_size must be positive, got ",
        chunk_size);
  const gdn_ref::GdnLayout at(shape);
  const int key_dim = shape.key_dim, value_dim = shape.value_dim;
  const int64_t state_size = at.state_size();
  std::fill_n(dq, shape.num_tokens * shape.num_key_heads * key_dim, S(0));
  std::fill_n(dk, shape.num_tokens * shape.num_key_heads * key_dim, S(0));

  int64_t max_chunks = 0;
  for (int n = 0; n < shape.num_seqs; ++n) {
    max_chunks =
        std::max(max_chunks, (at.seq_end(n) - at.seq_begin(n) + chunk_size - 1) / chunk_size);
  }
  ChunkWork<S> work(chunk_size, key_dim, value_dim, bf16);
  ChunkGrads<S> grads(chunk_size, key_dim, value_dim);
  // H entering each chunk of one head, as the products read it (bf16-rounded with bf16.h).
  std::vector<S> chunk_states(max_chunks * state_size);
  std::vector<S> state(state_size), d_state(state_size);
  std::vector<S> d_o_chunk(static_cast<int64_t>(chunk_size) * value_dim);

  for (int n = 0; n < shape.num_seqs; ++n) {
    const int64_t begin = at.seq_begin(n), end = at.seq_end(n);
    const int64_t num_chunks = (end - begin + chunk_size - 1) / chunk_size;
    for (int h = 0; h < shape.num_value_heads; ++h) {
      const HeadInputs<S> in{at, h, scale, q, k, v, g, beta};
      // Pass 1: forward scan recomputing the state entering every chunk.
      load_state(initial_state, at.state(n, h), state_size, state);
      for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t t0 = begin + c * chunk_size;
        const int len = static_cast<int>(std::min<int64_t>(chunk_size, end - t0));
        S* entering = chunk_states.data() + c * state_size;
        for (int64_t i = 0; i < state_size; ++i) entering[i] = operand(state[i], bf16.h);
        prepare_chunk(in, t0, len, work);
        compute_v_new(entering, work);
        advance_state(work, state.data());
      }
      // Pass 2: reverse scan over chunks carrying dL/dH.
      load_state(d_final_state, at.state(n, h), state_size, d_state);
      for (int64_t c = num_chunks - 1; c >= 0; --c) {
        const int64_t t0 = begin + c * chunk_size;
        const int len = static_cast<int>(std::min<int64_t>(chunk_size, end - t0));
        const S* chunk_state = chunk_states.data() + c * state_size;
        prepare_chunk(in, t0, len, work);
        compute_v_new(chunk_state, work);
        for (int i = 0; i < len; ++i) {
          std::copy_n(d_o + at.v_row(t0 + i, h), value_dim, d_o_chunk.begin() + i * value_dim);
        }
        chunk_backward(work, chunk_state, d_o_chunk.data(), d_state.data(), grads);
        // Scatter: q was scaled inside, so dq = scale * d(scale q); dg is the gradient of the
        // chunk-local prefix sum gamma, i.e. a reverse cumulative sum of d_gamma.
        S d_gamma_suffix = 0;
        for (int i = len - 1; i >= 0; --i) {
          const int64_t t = t0 + i;
          S* dq_t = dq + at.qk_row(t, h);
          S* dk_t = dk + at.qk_row(t, h);
          for (int d = 0; d < key_dim; ++d) {
            dq_t[d] += scale * grads.dq[i * key_dim + d];
            dk_t[d] += grads.dk[i * key_dim + d];
          }
          std::copy_n(grads.dv.begin() + i * value_dim, value_dim, dv + at.v_row(t, h));
          d_gamma_suffix += grads.d_gamma[i];
          dg[at.gate(t, h)] = d_gamma_suffix;
          dbeta[at.gate(t, h)] = grads.d_beta[i];
        }
      }
      if (d_initial_state != nullptr) {
        std::copy(d_state.begin(), d_state.end(), d_initial_state + at.state(n, h));
      }
    }
  }
}

#define DELTAMOE_INSTANTIATE_CHUNKED(S)                                                          \
  template void gated_delta_rule_chunked_forward_ref<S>(const GatedDeltaRuleShape&, S, const S*, \
                                                        const S*, const S*, const S*, const S*,  \
                                                        const S*, S*, S*, int);                  \
  template void gated_delta_rule_chunked_forward_ref<S>(                                         \
      const GatedDeltaRuleShape&, S, const S*, const S*, const S*, const S*, const S*, const S*, \
      S*, S*, const GdnBf16Intermediates&, int);                                                 \
  template void gated_delta_rule_chunked_backward_ref<S>(                                        \
      const GatedDeltaRuleShape&, S, const S*, const S*, const S*, const S*, const S*, const S*, \
      const S*, const S*, S*, S*, S*, S*, S*, S*, int);                                          \
  template void gated_delta_rule_chunked_backward_ref<S>(                                        \
      const GatedDeltaRuleShape&, S, const S*, const S*, const S*, const S*, const S*, const S*, \
      const S*, const S*, S*, S*, S*, S*, S*, S*, const GdnBf16Intermediates&, int);
DELTAMOE_INSTANTIATE_CHUNKED(float)
DELTAMOE_INSTANTIATE_CHUNKED(double)
#undef DELTAMOE_INSTANTIATE_CHUNKED

}  // namespace deltamoe
