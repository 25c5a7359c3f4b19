// The gated full-attention mixer of Qwen3.5 (as in transformers' modeling_qwen3_5_moe.py): q_proj gives per
// head a query and an output gate, q/k get a zero-centred RMSNorm, then partial M-RoPE, causal GQA attention
// per sequence, o * sigmoid(gate) and o_proj. Forward saves what its backward needs.
#pragma once

#include <string>

#include "model/config.h"
#include "model/text/text_batch.h"
#include "model/text/text_params.h"
#include "model/text/vector_math.h"

namespace deltamoe {

struct AttentionLayerSaved {
  Activation x;              // [T, C] layer input (already input_layernorm-ed)
  Activation q_raw, q_rstd;  // [T, Hq, D] before q_norm, [T * Hq]
  Activation gate;           // [T, Hq * D]
  Activation k_raw, k_rstd;  // [T, Hkv, D], [T * Hkv]
  Activation q, k, v;        // after norm + rope: [T, Hq, D], [T, Hkv, D]; v [T, Hkv, D]
  Activation attn, lse;      // [T, Hq, D], [T, Hq]
  Activation gated;          // [T, Hq * D] attn * sigmoid(gate)
};

// `names` is the layer's name prefix ("model.layers.3."). x [T, C]; returns y [T, C].
Activation attention_layer_forward(const TextConfig& config, const ParamMap& params, const std::string& names,
                                   const TextBatch& batch, const Activation& x, AttentionLayerSaved* saved);

// dy [T, C] -> returns dx [T, C]; the layer's parameter gradients are added to grads (null: frozen).
Activation attention_layer_backward(const TextConfig& config, const ParamMap& params, ParamMap* grads,
                                    const std::string& names, const TextBatch& batch, const AttentionLayerSaved& saved,
                                    const Activation& dy);

}  // namespace deltamoe
