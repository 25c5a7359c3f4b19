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

namespace deltamoe {

struct MoeBlockSaved {
  Activation x;                   // [T, C] block input (already post_attention_layernorm-ed)
  Activation probs;               // [T, E] router softmax
  std::vector<int32_t> topk_idx;  // [T, K]
  Activation topk_weight;         // [T, K] renormalised
};

// `names` is the layer's name prefix. x [T, C] -> returns y [T, C]. When aux_stats is not null the
// block's routing is added to it (for the load-balancing loss). forced_topk_idx ([T, K] or null)
// replaces the router's own top-k choice (weights still come from this router's softmax).
Activation moe_block_forward(const TextConfig& config, const ParamMap& params, const std::string& names,
                             int64_t num_tokens, const Activation& x, MoeBlockSaved* saved, MoeAuxStats* aux_stats,
                             const int32_t* forced_topk_idx = nullptr);

// dy [T, C] -> returns dx [T, C]; parameter gradients added to grads (null: frozen). When aux_weight != 0 the
// gradient of aux_weight * aux_loss (pooled statistics in aux_stats) flows in through the router.
Activation moe_block_backward(const TextConfig& config, const ParamMap& params, ParamMap* grads,
                              const std::string& names, int64_t num_tokens, const MoeBlockSaved& saved,
                              const Activation& dy, const MoeAuxStats& aux_stats, float aux_weight);

}  // namespace deltamoe
