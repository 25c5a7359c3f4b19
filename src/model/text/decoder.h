// One Qwen3.5 decoder layer (as in transformers' modeling_qwen3_5_moe.py): x + mixer(input_layernorm(x)),
// then h + moe(post_attention_layernorm(h)), where the mixer is Gated DeltaNet or gated attention by the
// config's layer_types.
#pragma once

#include <string>

#include "model/text/attention_layer.h"
#include "model/text/gdn_layer.h"
#include "model/text/moe_block.h"

namespace deltamoe {

struct DecoderLayerSaved {
  LayerType type = LayerType::linear_attention;
  Activation x;              // [T, C] layer input
  Activation rstd_in;        // [T] input_layernorm
  Activation h;              // [T, C] after the mixer's residual add
  Activation rstd_post;      // [T] post_attention_layernorm
  GdnLayerSaved gdn;         // used when type is linear_attention
  AttentionLayerSaved attn;  // used when type is full_attention
  MoeBlockSaved moe;
};

Activation decoder_layer_forward(const TextConfig& config, const ParamMap& params, int64_t layer_idx,
                                 const std::string& prefix, const TextBatch& batch, const Activation& x,
                                 DecoderLayerSaved* saved, MoeAuxStats* aux_stats,
                                 const int32_t* forced_topk_idx = nullptr, const ExpertDispatcher* ep = nullptr);

// ep: expert parallel (moe_block.h). dy [T, C] -> returns dx [T, C]; gradients added to grads (null: frozen weights, only dx is formed).
Activation decoder_layer_backward(const TextConfig& config, const ParamMap& params, ParamMap* grads, int64_t layer_idx,
                                  const std::string& prefix, const TextBatch& batch, const DecoderLayerSaved& saved,
                                  const Activation& dy, const MoeAuxStats& aux_stats, float aux_weight,
                                  const ExpertDispatcher* ep = nullptr);

}  // namespace deltamoe
