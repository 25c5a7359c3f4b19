// The Gated DeltaNet mixer of Qwen3.5 (as in transformers' modeling_qwen3_5_moe.py): projections to qkv, z,
// b, a; causal depthwise conv + SiLU on qkv; l2-normalised q, k; gates beta = sigmoid(b), g = -exp(A_log)
// softplus(a + dt_bias); the gated delta rule per sequence (no state crosses cu_seqlens); gated RMSNorm with
// silu(z); out_proj.
#pragma once

#include <string>

#include "model/config.h"
#include "model/text/text_batch.h"
#include "model/text/text_params.h"
#include "model/text/vector_math.h"

namespace deltamoe {

struct GdnLayerSaved {
  Activation x;                   // [T, C] layer input (already input_layernorm-ed)
  Activation mixed;               // [T, conv_dim] in_proj_qkv output, before the conv
  Activation z, a, b;             // [T, Hv * Dv], [T, Hv], [T, Hv]
  Activation q, k, v;             // after conv + SiLU: [T, Hk, Dk], [T, Hk, Dk], [T, Hv, Dv]
  Activation q_normed, k_normed;  // l2-normalised q, k
  Activation g, beta;             // [T, Hv]
  Activation core;                // [T, Hv, Dv] gated delta rule output
  Activation normed;              // [T, Hv * Dv] gated RMSNorm output (out_proj input)
};

// `names` is the layer's name prefix ("model.layers.0."). x [T, C]; returns y [T, C].
Activation gdn_layer_forward(const TextConfig& config, const ParamMap& params, const std::string& names,
                             const TextBatch& batch, const Activation& x, GdnLayerSaved* saved);

// dy [T, C] -> returns dx [T, C]; parameter gradients are added to grads (null: frozen).
Activation gdn_layer_backward(const TextConfig& config, const ParamMap& params, ParamMap* grads,
                              const std::string& names, const TextBatch& batch, const GdnLayerSaved& saved,
                              const Activation& dy);

}  // namespace deltamoe
