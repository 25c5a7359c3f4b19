// CPU reference engine: multimodal embedding -> text model forward/backward -> flat gradients ->
// clipping and the CPU AdamW on the host master weights.
#include "train/cpu_engine.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "core/error.h"
#include "optim/grad_clip.h"
#include "train/batch_plan.h"
#include "model/text/text_batch.h"
#include "model/text/text_model.h"
#include "train/trainable_params.h"
#include "model/vision/multimodal_embedding.h"

namespace deltamoe {

std::vector<int64_t> shift_packed_labels(const MicroBatch& batch) {
  const int64_t num_tokens = batch.num_tokens();
  std::vector<int64_t> shifted(static_cast<size_t>(num_tokens), kIgnoreLabel);
  for (size_t s = 0; s + 1 < batch.cu_seqlens.size(); ++s) {
    for (int64_t t = batch.cu_seqlens[s]; t + 1 < batch.cu_seqlens[s + 1]; ++t) shifted[t] = batch.labels[t + 1];
  }
  return shifted;
}

namespace {

// The vision tower's [N, patch_dim] input, from a batch that carries its images as one concatenated
// pixel_values or as per-image patches.
template <typename Batch>
void gather_pixel_values(const Batch& batch, std::vector<float>* out) {
  if constexpr (requires { batch.pixel_values; }) {
    out->assign(batch.pixel_values.begin(), batch.pixel_values.end());
  } else {
    for (const auto& image : batch.images) out->insert(out->end(), image.pixel_values.begin(), image.pixel_values.end());
  }
}

// Supervised positions whose argmax over the vocabulary (first maximum) equals the label.
int64_t count_correct(const std::vector<float>& logits, const std::vector<int64_t>& shifted_labels, int64_t vocab) {
  int64_t correct = 0;
  for (size_t t = 0; t < shifted_labels.size(); ++t) {
    if (shifted_labels[t] == kIgnoreLabel) continue;
    const float* row = logits.data() + t * static_cast<size_t>(vocab);
    correct += std::max_element(row, row + vocab) - row == shifted_labels[t];
  }
  return correct;
}

}  // namespace

struct CpuEngine::Pass {
  std::vector<int64_t> input_ids;
  std::vector<int64_t> shifted_labels;
  std::optional<HostTensor> pixel_values, image_grid_thw;
  MultimodalEmbedding embedding;  // VLM only
  std::optional<TextModel> model;
};

CpuEngine::CpuEngine(const ModelCheckpoint& checkpoint, const EngineOptions& options)
    : config_(checkpoint.config),
      text_prefix_(checkpoint.config.text_prefix()),
      aux_coef_(options.aux_coef),
      state_(options.lora != nullptr ? lora_layout(checkpoint, *options.lora) : trainable_layout(checkpoint, options.freeze),
             options.adamw) {
  const ParamLayout& layout = state_.layout();
  grad_.assign(static_cast<size_t>(layout.total_numel()), 0.0f);
  CHECK(!config_.tie_word_embeddings && !config_.text.tie_word_embeddings,
        "train: tie_word_embeddings is not supported (Qwen3.5-MoE unties lm_head)");
  for (const NamedShape& spec : text_param_shapes(config_.text, text_prefix_)) {
    auto it = checkpoint.params.find(spec.name);
    CHECK(it != checkpoint.params.end(), "train: the checkpoint has no tensor '", spec.name, "'");
    const HostTensor values = it->second.to_host().to_f32();
    text_params_[spec.name] = {values.shape().to_vector(),
                               std::vector<float>(values.as<float>(), values.as<float>() + values.numel())};
  }
  check_text_params(text_params_, config_.text, text_prefix_);
  if (config_.has_vision) {
    for (const auto& [name, shape] : vision_param_shapes(config_.vision)) {
      auto it = checkpoint.params.find(name);
      CHECK(it != checkpoint.params.end(), "train: the checkpoint has no vision tensor '", name, "'");
      vision_params_[name] = it->second.to_host().to_f32();
    }
  }
  if (options.lora != nullptr) attach_lora_adapters(*options.lora, &text_params_, config_.has_vision ? &vision_params_ : nullptr);
  trainable_ = TrainableParts{false, false, false};
  trainable_.base_weights = options.lora == nullptr;
  for (const ParamEntry& entry : layout.entries()) {
    const bool known = text_params_.count(entry.name) != 0 || vision_params_.count(entry.name) != 0;
    CHECK(known, "train: trainable tensor '", entry.name, "' is not a parameter of the CPU model");
    switch (param_group(entry.name)) {
      case ParamGroup::llm: trainable_.llm = true; break;
      case ParamGroup::vit: trainable_.vit = true; break;
      case ParamGroup::aligner: trainable_.aligner = true; break;
    }
    // The master starts as the checkpoint's values (fp32 copies made above).
    const auto text = text_params_.find(entry.name);
    const float* values = text != text_params_.end() ? text->second.values.data()
                                                     : vision_params_.at(entry.name).as<float>();
    std::memcpy(state_.master().data() + entry.offset, values, static_cast<size_t>(entry.numel) * sizeof(float));
  }
  state_.set_restore_hook([this] { use_master_weights(); });
}

void CpuEngine::use_master_weights() {
  const float* master = state_.master().data();
  for (const ParamEntry& entry : state_.layout().entries()) {
    const float* source = master + entry.offset;
    const size_t bytes = static_cast<size_t>(entry.numel) * sizeof(float);
    auto text = text_params_.find(entry.name);
    if (text != text_params_.end()) {
      std::memcpy(text->second.values.data(), source, bytes);
    } else {
      std::memcpy(vision_params_.at(entry.name).data(), source, bytes);
    }
  }
}

MicroBatchLoss CpuEngine::run_forward(const MicroBatch& batch, Pass* pass, std::vector<float>* logits) {
  const int64_t num_tokens = batch.num_tokens();
  CHECK(num_tokens > 0, "train: empty micro-batch");
  CHECK(static_cast<int64_t>(batch.positions.size()) == 3 * num_tokens, "train: micro-batch positions must be [3, ",
        num_tokens, "]");
  pass->input_ids.assign(batch.input_ids.begin(), batch.input_ids.end());
  pass->shifted_labels = shift_packed_labels(batch);

  TextModelInputs inputs;
  inputs.input_ids = pass->input_ids.data();
  inputs.shifted_labels = pass->shifted_labels.data();
  if (!forced_routing_.empty()) inputs.forced_routing = &forced_routing_;
  if (config_.has_vision) {
    if (!batch.image_grid_thw.empty()) {
      const int64_t num_images = static_cast<int64_t>(batch.image_grid_thw.size());
      const int64_t patch_dim = config_.vision.patch_dim();
      std::vector<float> pixels;
      gather_pixel_values(batch, &pixels);
      const int64_t num_patches = static_cast<int64_t>(pixels.size()) / patch_dim;
      CHECK(num_patches * patch_dim == static_cast<int64_t>(pixels.size()),
            "train: pixel_values of the micro-batch are not whole patches of ", patch_dim, " values");
      pass->pixel_values.emplace(DType::f32, Shape(std::vector<int64_t>{num_patches, patch_dim}));
      std::memcpy(pass->pixel_values->data(), pixels.data(), pixels.size() * sizeof(float));
      pass->image_grid_thw.emplace(DType::i64, Shape(std::vector<int64_t>{num_images, 3}));
      std::memcpy(pass->image_grid_thw->data(), batch.image_grid_thw.data(), static_cast<size_t>(num_images) * 24);
    }
    pass->embedding = multimodal_embed_forward(
        config_, vision_params_, param_values(text_params_, text_prefix_ + ".embed_tokens.weight"),
        pass->input_ids.data(), num_tokens, batch.cu_seqlens, pass->pixel_values ? &*pass->pixel_values : nullptr,
        pass->image_grid_thw ? &*pass->image_grid_thw : nullptr);
    inputs.input_embeds = pass->embedding.input_embeds.data();
  } else {
    CHECK(batch.image_grid_thw.empty(), "train: the batch has images but the model (", config_.model_type,
          ") has no vision tower");
  }
  pass->model.emplace(config_.text, text_prefix_, &text_params_);
  TextModelOutput out =
      pass->model->forward(make_text_batch(config_.text, num_tokens, batch.cu_seqlens, batch.positions), inputs);
  MicroBatchLoss loss;
  loss.num_supervised = out.num_supervised;
  loss.ce_sum = out.ce_loss * static_cast<double>(out.num_supervised);
  loss.aux_loss = out.aux_loss;
  loss.num_tokens = num_tokens;
  loss.num_correct = count_correct(out.logits, pass->shifted_labels, config_.text.vocab_size);
  if (logits != nullptr) *logits = std::move(out.logits);
  return loss;
}

MicroBatchLoss CpuEngine::evaluate(const MicroBatch& batch, std::vector<float>* logits) {
  Pass pass;
  return run_forward(batch, &pass, logits);
}

StepResult CpuEngine::train_step(const std::vector<MicroBatch>& batches, double lr, double max_grad_norm) {
  StepResult result;
  result.num_micro_batches = static_cast<int64_t>(batches.size());
  for (const MicroBatch& batch : batches) result.num_supervised += batch.num_supervised;
  // The engine adds the gradient of the CE sum and the step divides it by S once, so that no
  // per-token weight depends on how the step is split into micro-batches (batch_plan.h).
  const MicroBatchWeights weights = micro_batch_weights(result.num_supervised, result.num_micro_batches, aux_coef_);
  std::fill(grad_.begin(), grad_.end(), 0.0f);
  result.num_correct = 0;
  for (const MicroBatch& batch : batches) {
    const MicroBatchLoss part = forward_backward(batch, weights.ce_token_weight, weights.aux_weight, grad_.data());
    result.ce_sum += part.ce_sum;
    result.aux_loss_sum += part.aux_loss;
    result.num_tokens += part.num_tokens;
    result.num_correct = result.num_correct < 0 || part.num_correct < 0 ? -1 : result.num_correct + part.num_correct;
  }
  divide_gradient(grad_.data(), grad_.size(), weights.gradient_divisor);
  const GradClipResult clip =
      grad_clip_from_sum_of_squares(sum_of_squares_f64(grad_.data(), static_cast<int64_t>(grad_.size())), max_grad_norm);
  result.grad_norm = clip.grad_norm;
  result.clip_coef = clip.clip_coef;
  result.skipped = !clip.finite;
  if (clip.finite) {
    if (clip.clipped()) scale_in_place(grad_.data(), static_cast<int64_t>(grad_.size()), clip.clip_coef);
    state_.optimizer().step(lr, state_.master().data(), grad_.data());
    use_master_weights();
  }
  return result;
}

MicroBatchLoss CpuEngine::forward_backward(const MicroBatch& batch, double ce_token_weight, double aux_weight,
                                           float* grad) {
  Pass pass;
  const MicroBatchLoss loss = run_forward(batch, &pass, nullptr);
  // The model's CE is a mean over this micro-batch's supervised tokens; the gradient of
  // ce_token_weight * ce_sum is that of (ce_token_weight * num_supervised) * mean. The model divides
  // that seed by num_supervised in fp32: with the trainer's ce_token_weight 1 each token's weight is
  // n / n = 1 exactly in any micro-batch, where 1 / S would give fl(fl(n / S) / n), 1 ulp off for some n.
  const double ce_weight = ce_token_weight * static_cast<double>(loss.num_supervised);
  // A frozen language model still carries the gradient back to the vision tower, without its
  // weight products; a frozen tower is not run backward at all.
  const bool vision_backward = config_.has_vision && trainable_.vision();
  // The model adds each token's contribution straight onto the running totals of the step (copied
  // in from `grad` and back out, both exact), so micro-batches of 1 perform the same fp32 additions
  // in the same order as one micro-batch of all their samples: accumulation changes no rounding.
  // Gradient totals exist for the trained tensors only (a frozen weight, e.g. a LoRA base weight,
  // gets no entry, so its weight product is skipped).
  ParamMap text_grads;
  VisionParams vision_grads;
  for (const ParamEntry& entry : state_.layout().entries()) {
    const float* source = grad + entry.offset;
    if (auto text = text_params_.find(entry.name); text != text_params_.end()) {
      text_grads[entry.name] = {text->second.shape, std::vector<float>(source, source + entry.numel)};
    } else if (vision_params_.count(entry.name) != 0) {
      HostTensor total(DType::f32, vision_params_.at(entry.name).shape());
      std::copy(source, source + entry.numel, total.as<float>());
      vision_grads.emplace(entry.name, std::move(total));
    }
  }
  std::vector<float> d_embeds;
  pass.model->backward_into(trainable_.llm ? &text_grads : nullptr, static_cast<float>(ce_weight),
                            static_cast<float>(aux_weight), config_.has_vision ? &d_embeds : nullptr);
  if (config_.has_vision && (vision_backward || trainable_.llm)) {
    // The text model left embed_tokens untouched (it started from input_embeds); the embedding
    // backward adds the table's gradient and routes image rows into the vision tower.
    auto table = text_grads.find(text_prefix_ + ".embed_tokens.weight");
    float* table_grad = table != text_grads.end() ? table->second.values.data() : nullptr;
    multimodal_embed_backward(config_, vision_params_, pass.embedding, pass.input_ids.data(), batch.num_tokens(),
                              d_embeds, table_grad, &vision_grads, trainable_);
  }
  for (const ParamEntry& entry : state_.layout().entries()) {
    const float* total = nullptr;
    if (auto text = text_grads.find(entry.name); text != text_grads.end()) {
      total = text->second.values.data();
    } else if (auto vision = vision_grads.find(entry.name); vision != vision_grads.end()) {
      total = vision->second.as<float>();
    }
    if (total != nullptr) std::copy(total, total + entry.numel, grad + entry.offset);
  }
  return loss;
}

}  // namespace deltamoe
