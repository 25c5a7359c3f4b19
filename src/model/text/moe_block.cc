// Forward and backward of the sparse MoE block, composed from the router, experts, shared expert,
// linear and load-balancing-loss references.
#include "model/text/moe_block.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/linear/linear.h"
#include "kernels/moe_experts/moe_experts.h"
#include "kernels/moe_router/moe_router.h"
#include "kernels/shared_expert/shared_expert.h"
#include "model/text/projection.h"

namespace deltamoe {

namespace {

MoeExpertsDims experts_dims(const TextConfig& c, int64_t num_tokens) {
  return {num_tokens, c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size};
}

// Routed experts over ranks: dispatch token rows, compute this rank's experts' rows, return them and
// combine each token's K rows in slot order from zero (moe_experts_forward_ref's arithmetic).
void routed_experts_forward_ep(const ExpertDispatcher& ep, const MoeExpertsDims& dims, const Activation& x,
                               const float* gate_up, const float* down, MoeBlockSaved* s, float* y) {
  const int64_t T = dims.num_tokens, C = dims.hidden, K = dims.top_k;
  s->ep_plan = ep.plan(s->topk_idx.data(), T, K);
  const int64_t R = s->ep_plan.recv_rows();
  s->ep_recv_x.resize(R * C);
  ep.dispatch(s->ep_plan, x.data(), C, /*per_slot=*/false, s->ep_recv_x.data());
  Activation y_rows(R * C);
  MoeExpertRowScratch<float> scratch;
  for (int64_t r = 0; r < R; ++r) {
    moe_expert_row_forward_ref(dims, s->ep_recv_x.data() + r * C, s->ep_plan.recv_expert[r], gate_up, down,
                               y_rows.data() + r * C, scratch);
  }
  Activation slot_rows(T * K * C);
  ep.combine(s->ep_plan, y_rows.data(), C, slot_rows.data());
  for (int64_t t = 0; t < T; ++t) {
    float* y_row = y + t * C;
    for (int64_t c = 0; c < C; ++c) y_row[c] = 0;
    for (int64_t k = 0; k < K; ++k) {
      const float weight = s->topk_weight[t * K + k];
      const float* y_e = slot_rows.data() + (t * K + k) * C;
      for (int64_t c = 0; c < C; ++c) y_row[c] += weight * y_e[c];
    }
  }
}

// The adjoint: (dy row, routing weight) per slot to the owner, which returns the slot's dx row and
// d weight; the source sums the dx rows in slot order from zero (moe_experts_backward_ref's arithmetic).
void routed_experts_backward_ep(const ExpertDispatcher& ep, const MoeExpertsDims& dims, const MoeBlockSaved& s,
                                const float* gate_up, const float* down, const Activation& dy, float* dx,
                                float* d_topk_weight, float* d_gate_up, float* d_down) {
  const int64_t T = dims.num_tokens, C = dims.hidden, K = dims.top_k, W = C + 1;
  const ExpertDispatchPlan& plan = s.ep_plan;
  const int64_t R = plan.recv_rows();
  Activation send_rows(T * K * W);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      float* row = send_rows.data() + (t * K + k) * W;
      std::copy(dy.data() + t * C, dy.data() + (t + 1) * C, row);
      row[C] = s.topk_weight[t * K + k];
    }
  }
  Activation recv(R * W), back(R * W);
  ep.dispatch(plan, send_rows.data(), W, /*per_slot=*/true, recv.data());
  MoeExpertRowScratch<float> scratch;
  for (int64_t r = 0; r < R; ++r) {
    const float* in = recv.data() + r * W;
    float* out = back.data() + r * W;
    moe_expert_row_backward_ref(dims, s.ep_recv_x.data() + r * C, plan.recv_expert[r], in[C], in, gate_up, down, out,
                                out + C, d_gate_up, d_down, scratch);
  }
  Activation slot_rows(T * K * W);
  ep.combine(plan, back.data(), W, slot_rows.data());
  for (int64_t t = 0; t < T; ++t) {
    float* dx_row = dx + t * C;
    for (int64_t c = 0; c < C; ++c) dx_row[c] = 0;
    for (int64_t k = 0; k < K; ++k) {
      const float* row = slot_rows.data() + (t * K + k) * W;
      for (int64_t c = 0; c < C; ++c) dx_row[c] += row[c];
      d_topk_weight[t * K + k] = row[C];
    }
  }
}

// The shared expert's four Linears of block p ("...mlp.").
struct SharedNames {
  std::string gate, up, down, expert_gate;
  explicit SharedNames(const std::string& p)
      : gate(p + "shared_expert.gate_proj"), up(p + "shared_expert.up_proj"), down(p + "shared_expert.down_proj"),
        expert_gate(p + "shared_expert_gate") {}
  bool any_drops(const ParamMap& params) const {
    return adapter_drops(params, gate) || adapter_drops(params, up) || adapter_drops(params, down) ||
           adapter_drops(params, expert_gate);
  }
};

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// The shared expert written out through the projection funnel (shared_expert_ref's arithmetic), for
// a pass where an adapter of it drops its input: gate, up, hidden [T, I], out [T, C], logit [T].
struct SharedUnmerged {
  Activation gate, up, hidden, out, logit;
};

SharedUnmerged shared_unmerged_forward(const ParamMap& params, const SharedNames& n, const float* x, int64_t T,
                                       int64_t C, int64_t I) {
  SharedUnmerged a{Activation(T * I), Activation(T * I), Activation(T * I), Activation(T * C), Activation(T)};
  project_forward(params, n.gate, x, a.gate.data(), T, C, I);
  project_forward(params, n.up, x, a.up.data(), T, C, I);
  for (int64_t i = 0; i < T * I; ++i) a.hidden[i] = a.gate[i] * sigmoid(a.gate[i]) * a.up[i];
  project_forward(params, n.down, a.hidden.data(), a.out.data(), T, I, C);
  project_forward(params, n.expert_gate, x, a.logit.data(), T, C, 1);
  return a;
}

void shared_unmerged_backward(const ParamMap& params, const LayerGrads& grad, const SharedNames& n, const float* x,
                              const float* dy, float* dx, int64_t T, int64_t C, int64_t I) {
  const SharedUnmerged a = shared_unmerged_forward(params, n, x, T, C, I);
  Activation d_out(T * C), d_logit(T);
  for (int64_t t = 0; t < T; ++t) {
    const float scale = sigmoid(a.logit[t]);
    float d_scale = 0;
    for (int64_t c = 0; c < C; ++c) {
      d_out[t * C + c] = dy[t * C + c] * scale;
      d_scale += dy[t * C + c] * a.out[t * C + c];
    }
    d_logit[t] = d_scale * scale * (1.0f - scale);
  }
  Activation d_hidden(T * I), d_gate(T * I), d_up(T * I), dx_part(T * C);
  project_backward(params, grad, n.down, a.hidden.data(), d_out.data(), d_hidden.data(), T, I, C);
  for (int64_t i = 0; i < T * I; ++i) {
    const float g = a.gate[i], s = sigmoid(g);
    d_gate[i] = d_hidden[i] * a.up[i] * s * (1.0f + g * (1.0f - s));
    d_up[i] = d_hidden[i] * g * s;
  }
  project_backward(params, grad, n.gate, x, d_gate.data(), dx, T, C, I);
  project_backward(params, grad, n.up, x, d_up.data(), dx_part.data(), T, C, I);
  for (int64_t i = 0; i < T * C; ++i) dx[i] += dx_part[i];
  project_backward(params, grad, n.expert_gate, x, d_logit.data(), dx_part.data(), T, C, 1);
  for (int64_t i = 0; i < T * C; ++i) dx[i] += dx_part[i];
}

}  // namespace

Activation moe_block_forward(const TextConfig& c, const ParamMap& params, const std::string& names, int64_t num_tokens,
                             const Activation& x, MoeBlockSaved* s, MoeAuxStats* aux_stats,
                             const int32_t* forced_topk_idx, const ExpertDispatcher* ep) {
  const std::string p = names + "mlp.";
  const int64_t T = num_tokens, C = c.hidden_size, E = c.num_experts, K = c.num_experts_per_tok;
  const int64_t Is = c.shared_expert_intermediate_size;
  s->x = x;
  Activation logits(T * E);
  project_forward(params, p + "gate", x.data(), logits.data(), T, C, E);
  s->probs.resize(T * E);
  s->topk_idx.resize(T * K);
  s->topk_weight.resize(T * K);
  if (forced_topk_idx != nullptr) {
    s->topk_idx.assign(forced_topk_idx, forced_topk_idx + T * K);
    moe_router_forward_given_choice_ref(logits.data(), s->probs.data(), s->topk_idx.data(), s->topk_weight.data(), T, E,
                                        K);
  } else {
    moe_router_forward_ref(logits.data(), s->probs.data(), s->topk_idx.data(), s->topk_weight.data(), T, E, K);
  }
  if (aux_stats != nullptr) moe_aux_loss_accumulate_ref(s->probs.data(), s->topk_idx.data(), T, E, K, aux_stats);
  Activation y(T * C), shared(T * C);
  // The fused kernels read whole weights: an adapter is merged in (as PEFT's ParamWrapper does).
  const FusedWeight gate_up(params, nullptr, p + "experts.gate_up_proj"), down(params, nullptr, p + "experts.down_proj");
  if (ep != nullptr) {
    routed_experts_forward_ep(*ep, experts_dims(c, T), x, gate_up.value(), down.value(), s, y.data());
  } else {
    moe_experts_forward_ref(experts_dims(c, T), x.data(), s->topk_idx.data(), s->topk_weight.data(), gate_up.value(),
                            down.value(), y.data());
  }
  const SharedNames shared_names(p);
  if (shared_names.any_drops(params)) {
    // LoRA dropout on an adapter's input: the unmerged Linears (y = sigmoid(logit) * out).
    const SharedUnmerged a = shared_unmerged_forward(params, shared_names, x.data(), T, C, Is);
    for (int64_t t = 0; t < T; ++t) {
      const float scale = sigmoid(a.logit[t]);
      for (int64_t i = 0; i < C; ++i) shared[t * C + i] = scale * a.out[t * C + i];
    }
    add_into(y, shared);
    return y;
  }
  const FusedWeight sg(params, nullptr, shared_names.gate + ".weight");
  const FusedWeight su(params, nullptr, shared_names.up + ".weight");
  const FusedWeight sd(params, nullptr, shared_names.down + ".weight");
  const FusedWeight sgate(params, nullptr, shared_names.expert_gate + ".weight");
  shared_expert_forward_ref(x.data(), sg.value(), su.value(), sd.value(), sgate.value(), shared.data(), T, C, Is);
  add_into(y, shared);
  return y;
}

Activation moe_block_backward(const TextConfig& c, const ParamMap& params, ParamMap* grads, const std::string& names,
                              int64_t num_tokens, const MoeBlockSaved& s, const Activation& dy,
                              const MoeAuxStats& aux_stats, float aux_weight, const ExpertDispatcher* ep) {
  LayerGrads grad(params, grads);  // grads null: frozen weights, no weight gradients
  const std::string p = names + "mlp.";
  const int64_t T = num_tokens, C = c.hidden_size, E = c.num_experts, K = c.num_experts_per_tok;
  const int64_t Is = c.shared_expert_intermediate_size;
  Activation dx(T * C), dx_part(T * C), d_topk_weight(T * K);
  FusedWeight gate_up(params, &grad, p + "experts.gate_up_proj"), down(params, &grad, p + "experts.down_proj");
  if (ep != nullptr) {
    routed_experts_backward_ep(*ep, experts_dims(c, T), s, gate_up.value(), down.value(), dy, dx.data(),
                               d_topk_weight.data(), gate_up.grad(), down.grad());
  } else {
    moe_experts_backward_ref(experts_dims(c, T), s.x.data(), s.topk_idx.data(), s.topk_weight.data(), gate_up.value(),
                             down.value(), dy.data(), dx.data(), d_topk_weight.data(), gate_up.grad(), down.grad());
  }
  gate_up.finish_backward();
  down.finish_backward();
  Activation d_logits(T * E);
  moe_router_backward_ref(s.probs.data(), s.topk_idx.data(), s.topk_weight.data(), d_topk_weight.data(),
                          d_logits.data(), T, E, K);
  if (aux_weight != 0.0f) {
    Activation d_logits_aux(T * E);
    moe_aux_loss_backward_ref(s.probs.data(), aux_stats, aux_weight, d_logits_aux.data(), T);
    add_into(d_logits, d_logits_aux);
  }
  project_backward(params, grad, p + "gate", s.x.data(), d_logits.data(), dx_part.data(), T, C, E);
  add_into(dx, dx_part);
  const SharedNames shared_names(p);
  if (shared_names.any_drops(params)) {
    shared_unmerged_backward(params, grad, shared_names, s.x.data(), dy.data(), dx_part.data(), T, C, Is);
    add_into(dx, dx_part);
    return dx;
  }
  FusedWeight sg(params, &grad, shared_names.gate + ".weight");
  FusedWeight su(params, &grad, shared_names.up + ".weight");
  FusedWeight sd(params, &grad, shared_names.down + ".weight");
  FusedWeight sgate(params, &grad, shared_names.expert_gate + ".weight");
  shared_expert_backward_ref(s.x.data(), sg.value(), su.value(), sd.value(), sgate.value(), dy.data(), dx_part.data(),
                             sg.grad(), su.grad(), sd.grad(), sgate.grad(), T, C, Is);
  for (FusedWeight* weight : {&sg, &su, &sd, &sgate}) weight->finish_backward();
  add_into(dx, dx_part);
  return dx;
}

}  // namespace deltamoe
