// Forward/backward schedule of the text tower: layers in order, then the loss heads; backward in
// reverse through the saved activations.
#include "model/text/text_model.h"

#include "core/error.h"
#include "kernels/cross_entropy/cross_entropy.h"
#include "kernels/embedding/embedding.h"
#include "kernels/rms_norm/rms_norm.h"
#include "model/text/projection.h"

namespace deltamoe {

TextModel::TextModel(const TextConfig& config, std::string prefix, const ParamMap* params)
    : config_(config), prefix_(std::move(prefix)), params_(params) {
  check_text_params(*params_, config_, prefix_);
}

TextModelOutput TextModel::forward(const TextBatch& batch, const TextModelInputs& inputs) {
  const TextConfig& c = config_;
  const ParamMap& params = *params_;
  const int64_t T = batch.num_tokens, C = c.hidden_size, V = c.vocab_size;
  CHECK(inputs.input_ids != nullptr || inputs.input_embeds != nullptr,
        "text model: forward needs input_ids or input_embeds");
  batch_ = batch;
  Activation x(T * C);
  if (inputs.input_embeds != nullptr) {
    input_ids_.clear();
    x.assign(inputs.input_embeds, inputs.input_embeds + T * C);
  } else {
    input_ids_.assign(inputs.input_ids, inputs.input_ids + T);
    embedding_forward_ref(inputs.input_ids, param_values(params, prefix_ + ".embed_tokens.weight"), x.data(), T, V, C);
  }
  aux_stats_ = MoeAuxStats{};
  expert_parallel_ = inputs.expert_parallel;
  layers_.assign(static_cast<size_t>(c.num_hidden_layers), DecoderLayerSaved{});
  if (inputs.forced_routing != nullptr) {
    CHECK(static_cast<int64_t>(inputs.forced_routing->size()) == c.num_hidden_layers, "text model: forced routing has ",
          inputs.forced_routing->size(), " layers, the model ", c.num_hidden_layers);
    for (const auto& layer : *inputs.forced_routing)
      CHECK(static_cast<int64_t>(layer.size()) == T * c.num_experts_per_tok, "text model: forced routing of ",
            layer.size(), " entries, expected T * K = ", T * c.num_experts_per_tok);
  }
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const int32_t* forced = inputs.forced_routing != nullptr ? (*inputs.forced_routing)[i].data() : nullptr;
    x = decoder_layer_forward(c, params, i, prefix_, batch_, x, &layers_[i], &aux_stats_, forced,
                              inputs.expert_parallel);
  }
  final_hidden_ = std::move(x);
  final_normed_.resize(T * C);
  final_rstd_.resize(T);
  rms_norm_forward_ref(final_hidden_.data(), param_values(params, prefix_ + ".norm.weight"), final_normed_.data(),
                       final_rstd_.data(), T, C, c.rms_norm_eps);
  logits_.resize(T * V);
  project_forward(params, "lm_head", final_normed_.data(), logits_.data(), T, C, V);

  TextModelOutput out;
  out.logits = logits_;
  out.aux_loss = moe_aux_loss_value(aux_stats_);
  lse_.resize(T);
  if (inputs.shifted_labels != nullptr) {
    shifted_labels_.assign(inputs.shifted_labels, inputs.shifted_labels + T);
    out.ce_loss =
        cross_entropy_forward_ref(logits_.data(), shifted_labels_.data(), lse_.data(), T, V, &out.num_supervised);
  } else {
    shifted_labels_.clear();
  }
  return out;
}

ParamMap TextModel::backward(float ce_weight, float aux_weight, std::vector<float>* d_input_embeds,
                             bool weight_grads) const {
  ParamMap grads = weight_grads ? zeros_like(*params_) : ParamMap{};
  backward_into(weight_grads ? &grads : nullptr, ce_weight, aux_weight, d_input_embeds);
  return grads;
}

void TextModel::backward_into(ParamMap* grads_or_frozen, float ce_weight, float aux_weight,
                              std::vector<float>* d_input_embeds) const {
  const TextConfig& c = config_;
  const ParamMap& params = *params_;
  const int64_t T = batch_.num_tokens, C = c.hidden_size, V = c.vocab_size;
  CHECK(static_cast<int64_t>(layers_.size()) == c.num_hidden_layers, "text model: backward called before forward");
  LayerGrads grad(params, grads_or_frozen);
  Activation d_logits(T * V, 0.0f);
  if (!shifted_labels_.empty() && ce_weight != 0.0f)
    cross_entropy_backward_ref(logits_.data(), shifted_labels_.data(), lse_.data(), ce_weight, d_logits.data(), T, V);
  Activation d_normed(T * C), dx(T * C);
  project_backward(params, grad, "lm_head", final_normed_.data(), d_logits.data(), d_normed.data(), T, C, V);
  rms_norm_backward_ref(final_hidden_.data(), param_values(params, prefix_ + ".norm.weight"), final_rstd_.data(),
                        d_normed.data(), dx.data(), grad.of(prefix_ + ".norm.weight"), T, C);
  for (int64_t i = c.num_hidden_layers - 1; i >= 0; --i)
    dx = decoder_layer_backward(c, params, grads_or_frozen, i, prefix_, batch_, layers_[i], dx, aux_stats_, aux_weight,
                                expert_parallel_);
  if (input_ids_.empty()) {
    CHECK(d_input_embeds != nullptr, "text model: the forward started from input_embeds, so backward needs ",
          "d_input_embeds to return their gradient");
    *d_input_embeds = std::move(dx);
  } else {
    // The embedding backward only forms the table's gradient: nothing to do when it is frozen.
    if (float* d_table = grad.of(prefix_ + ".embed_tokens.weight")) {
      embedding_backward_ref(input_ids_.data(), dx.data(), d_table, T, V, C);
    }
    if (d_input_embeds != nullptr) *d_input_embeds = std::move(dx);
  }
}

}  // namespace deltamoe
