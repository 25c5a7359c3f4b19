// The sparse MoE block of every Qwen3.5 decoder layer (as in transformers' modeling_qwen3_5_moe.py): router
// (softmax, top-k, renormalise), routed SiLU experts in the fused layout, and the sigmoid-gated shared
// expert.
#pragma once

#include <string>
#include <vector>

#include "kernels/moe_aux_loss/moe_aux_loss.h"
#include "model/config.h"
#include "model/text/text_params.h"
#include "model/text/vector_math.h"
#include "parallel/expert_dispatch.h"

namespace deltamoe {

struct MoeBlockSaved {
  Activation x;                   // [T, C] block input (already post_attention_layernorm-ed)
  Activation probs;               // [T, E] router softmax
  std::vector<int32_t> topk_idx;  // [T, K]
  Activation topk_weight;         // [T, K] renormalised
  // Expert parallel only: the layer's exchange plan and the token rows this rank's experts received
  // (kept for their backward).
  ExpertDispatchPlan ep_plan;
  Activation ep_recv_x;           // [plan.recv_rows(), C]
};

// `names` is the layer's name prefix. x [T, C] -> returns y [T, C]. When aux_stats is not null the
// block's routing is added to it (for the load-balancing loss). forced_topk_idx ([T, K] or null)
// replaces the router's own top-k choice (weights still come from this router's softmax).
// With `ep` (expert parallel; a collective over its communicator) each routed (token, slot) row is
// computed by the rank that owns its expert, which reads only its own experts' weights; the result
// is bitwise the one-rank result.
Activation moe_block_forward(const TextConfig& config, const ParamMap& params, const std::string& names,
                             int64_t num_tokens, const Activation& x, MoeBlockSaved* saved, MoeAuxStats* aux_stats,
                             const int32_t* forced_topk_idx = nullptr, const ExpertDispatcher* ep = nullptr);

// dy [T, C] -> returns dx [T, C]; parameter gradients added to grads (null: frozen). When aux_weight != 0 the
// gradient of aux_weight * aux_loss (pooled statistics in aux_stats) flows in through the router.
// With `ep` (the forward's): routed-expert gradients are added only for this rank's experts, in
// (source rank, token, slot) order of their rows.
Activation moe_block_backward(const TextConfig& config, const ParamMap& params, ParamMap* grads,
                              const std::string& names, int64_t num_tokens, const MoeBlockSaved& saved,
                              const Activation& dy, const MoeAuxStats& aux_stats, float aux_weight,
                              const ExpertDispatcher* ep = nullptr);

}  // namespace deltamoe
