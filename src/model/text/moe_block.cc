// Forward and backward of the sparse MoE block, composed from the router, experts, shared expert,
// linear and load-balancing-loss references.
#include "model/text/moe_block.h"

#include "kernels/moe_experts/moe_experts.h"
#include "kernels/moe_router/moe_router.h"
#include "kernels/shared_expert/shared_expert.h"
#include "model/text/projection.h"

namespace deltamoe {

namespace {

MoeExpertsDims experts_dims(const TextConfig& c, int64_t num_tokens) {
  return {num_tokens, c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size};
}

}  // namespace

Activation moe_block_forward(const TextConfig& c, const ParamMap& params, const std::string& names, int64_t num_tokens,
                             const Activation& x, MoeBlockSaved* s, MoeAuxStats* aux_stats,
                             const int32_t* forced_topk_idx) {
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
  moe_experts_forward_ref(experts_dims(c, T), x.data(), s->topk_idx.data(), s->topk_weight.data(), gate_up.value(),
                          down.value(), y.data());
  const FusedWeight sg(params, nullptr, p + "shared_expert.gate_proj.weight");
  const FusedWeight su(params, nullptr, p + "shared_expert.up_proj.weight");
  const FusedWeight sd(params, nullptr, p + "shared_expert.down_proj.weight");
  const FusedWeight sgate(params, nullptr, p + "shared_expert_gate.weight");
  shared_expert_forward_ref(x.data(), sg.value(), su.value(), sd.value(), sgate.value(), shared.data(), T, C, Is);
  add_into(y, shared);
  return y;
}

Activation moe_block_backward(const TextConfig& c, const ParamMap& params, ParamMap* grads, const std::string& names,
                              int64_t num_tokens, const MoeBlockSaved& s, const Activation& dy,
                              const MoeAuxStats& aux_stats, float aux_weight) {
  LayerGrads grad(params, grads);  // grads null: frozen weights, no weight gradients
  const std::string p = names + "mlp.";
  const int64_t T = num_tokens, C = c.hidden_size, E = c.num_experts, K = c.num_experts_per_tok;
  const int64_t Is = c.shared_expert_intermediate_size;
  Activation dx(T * C), dx_part(T * C), d_topk_weight(T * K);
  FusedWeight gate_up(params, &grad, p + "experts.gate_up_proj"), down(params, &grad, p + "experts.down_proj");
  moe_experts_backward_ref(experts_dims(c, T), s.x.data(), s.topk_idx.data(), s.topk_weight.data(), gate_up.value(),
                           down.value(), dy.data(), dx.data(), d_topk_weight.data(), gate_up.grad(), down.grad());
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
  FusedWeight sg(params, &grad, p + "shared_expert.gate_proj.weight");
  FusedWeight su(params, &grad, p + "shared_expert.up_proj.weight");
  FusedWeight sd(params, &grad, p + "shared_expert.down_proj.weight");
  FusedWeight sgate(params, &grad, p + "shared_expert_gate.weight");
  shared_expert_backward_ref(s.x.data(), sg.value(), su.value(), sd.value(), sgate.value(), dy.data(), dx_part.data(),
                             sg.grad(), su.grad(), sd.grad(), sgate.grad(), T, C, Is);
  for (FusedWeight* weight : {&sg, &su, &sd, &sgate}) weight->finish_backward();
  add_into(dx, dx_part);
  return dx;
}

}  // namespace deltamoe
