// The Qwen3.5-MoE text tower on the CPU in fp32: embedding, decoder layers, final norm, lm_head,
// the causal-LM loss and the load-balancing loss; forward keeps the activations and backward
// returns the gradient of any mix of the two losses for every parameter (by HF name).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kernels/moe_aux_loss/moe_aux_loss.h"
#include "model/config.h"
#include "model/text/decoder.h"
#include "model/text/text_batch.h"
#include "model/text/text_params.h"

namespace deltamoe {

struct TextModelInputs {
  // Token ids [T]. Used for the embedding lookup unless input_embeds is given.
  const int64_t* input_ids = nullptr;
  // Hook for the VLM: [T, C] embeddings with image features already scattered in. When given, the
  // model starts from these and backward returns their gradient instead of touching embed_tokens
  // (the caller owns the embedding/vision backward).
  const float* input_embeds = nullptr;
  // Labels [T] already shifted (shift_labels_ref per row); -100 ignored. Null: ce_loss is 0.
  const int64_t* shifted_labels = nullptr;
  // Optional expert choice per layer (L entries of [T, K]) replacing the routers' top-k, e.g. to
  // pin routing across near-ties in finite-difference tests or GPU-vs-CPU comparisons.
  const std::vector<std::vector<int32_t>>* forced_routing = nullptr;
  // Expert parallel (moe_block.h): the routed experts are computed by their owners over this
  // dispatcher's communicator; forward and backward are then collectives (every rank of it calls
  // them, each with its own micro-batch). Must outlive the backward. Null: all experts local.
  const ExpertDispatcher* expert_parallel = nullptr;
};

struct TextModelOutput {
  std::vector<float> logits;  // [T, V]
  double ce_loss = 0;         // mean over supervised tokens
  double aux_loss = 0;        // load-balancing loss over all layers, before its coefficient
  int64_t num_supervised = 0;
};

class TextModel {
 public:
  // `params` must hold every text_param_shapes(config, prefix) tensor (checked) and outlive the model.
  TextModel(const TextConfig& config, std::string prefix, const ParamMap* params);

  // Runs the forward pass and keeps what backward needs (replacing any earlier pass).
  TextModelOutput forward(const TextBatch& batch, const TextModelInputs& inputs);

  // Gradients of ce_weight * ce_loss + aux_weight * aux_loss of the last forward, for every
  // parameter. May be called several times per forward. When the forward started from
  // input_embeds, d_input_embeds ([T, C]) receives their gradient. With weight_grads false (frozen
  // language model, e.g. to train only the vision tower) it returns no gradients and skips the
  // weight products, still carrying the gradient back to d_input_embeds.
  ParamMap backward(float ce_weight, float aux_weight, std::vector<float>* d_input_embeds = nullptr,
                    bool weight_grads = true) const;
  // The same, adding the gradients onto `grads` (every parameter present, e.g. a running total
  // over micro-batches; null: frozen language model). Each token's contribution lands on the total
  // directly, so accumulating micro-batches performs the fp32 additions of one larger batch in the
  // same order.
  void backward_into(ParamMap* grads, float ce_weight, float aux_weight,
                     std::vector<float>* d_input_embeds = nullptr) const;

  const TextConfig& config() const { return config_; }
  const std::string& prefix() const { return prefix_; }
  // Activations of the last forward, one entry per decoder layer (routing decisions, for tests).
  const std::vector<DecoderLayerSaved>& saved_layers() const { return layers_; }

 private:
  TextConfig config_;
  std::string prefix_;
  const ParamMap* params_;
  // Saved by forward.
  TextBatch batch_;
  std::vector<int64_t> input_ids_;       // empty when the forward used input_embeds
  std::vector<int64_t> shifted_labels_;  // empty: no CE
  std::vector<DecoderLayerSaved> layers_;
  const ExpertDispatcher* expert_parallel_ = nullptr;
  Activation final_hidden_, final_rstd_, final_normed_, logits_, lse_;
  MoeAuxStats aux_stats_;
};

}  // namespace deltamoe
