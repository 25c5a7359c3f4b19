// Forward and backward of one decoder layer: pre-norm mixer and pre-norm MoE with residual adds.
#include "model/text/decoder.h"

#include "kernels/rms_norm/rms_norm.h"

namespace deltamoe {

Activation decoder_layer_forward(const TextConfig& c, const ParamMap& params, int64_t layer_idx,
                                 const std::string& prefix, const TextBatch& batch, const Activation& x,
                                 DecoderLayerSaved* s, MoeAuxStats* aux_stats, const int32_t* forced_topk_idx,
                                 const ExpertDispatcher* ep) {
  const std::string names = layer_prefix(prefix, layer_idx);
  const int64_t T = batch.num_tokens, C = c.hidden_size;
  s->type = c.layer_types[layer_idx];
  s->x = x;
  Activation normed(T * C);
  s->rstd_in.resize(T);
  rms_norm_forward_ref(x.data(), param_values(params, names + "input_layernorm.weight"), normed.data(),
                       s->rstd_in.data(), T, C, c.rms_norm_eps);
  s->h = s->type == LayerType::linear_attention ? gdn_layer_forward(c, params, names, batch, normed, &s->gdn)
                                                : attention_layer_forward(c, params, names, batch, normed, &s->attn);
  add_into(s->h, x);
  s->rstd_post.resize(T);
  rms_norm_forward_ref(s->h.data(), param_values(params, names + "post_attention_layernorm.weight"), normed.data(),
                       s->rstd_post.data(), T, C, c.rms_norm_eps);
  Activation y = moe_block_forward(c, params, names, T, normed, &s->moe, aux_stats, forced_topk_idx, ep);
  add_into(y, s->h);
  return y;
}

Activation decoder_layer_backward(const TextConfig& c, const ParamMap& params, ParamMap* grads, int64_t layer_idx,
                                  const std::string& prefix, const TextBatch& batch, const DecoderLayerSaved& s,
                                  const Activation& dy, const MoeAuxStats& aux_stats, float aux_weight,
                                  const ExpertDispatcher* ep) {
  LayerGrads grad(params, grads);  // grads null: frozen weights, no weight gradients
  const std::string names = layer_prefix(prefix, layer_idx);
  const int64_t T = batch.num_tokens, C = c.hidden_size;
  // Residual: dh = dy + d(post norm input) from the MoE branch.
  Activation d_normed = moe_block_backward(c, params, grads, names, T, s.moe, dy, aux_stats, aux_weight, ep);
  Activation dh(T * C);
  rms_norm_backward_ref(s.h.data(), param_values(params, names + "post_attention_layernorm.weight"), s.rstd_post.data(),
                        d_normed.data(), dh.data(), grad.of(names + "post_attention_layernorm.weight"), T, C);
  add_into(dh, dy);
  d_normed = s.type == LayerType::linear_attention
                 ? gdn_layer_backward(c, params, grads, names, batch, s.gdn, dh)
                 : attention_layer_backward(c, params, grads, names, batch, s.attn, dh);
  Activation dx(T * C);
  rms_norm_backward_ref(s.x.data(), param_values(params, names + "input_layernorm.weight"), s.rstd_in.data(),
                        d_normed.data(), dx.data(), grad.of(names + "input_layernorm.weight"), T, C);
  add_into(dx, dh);
  return dx;
}

}  // namespace deltamoe
