// CPU reference engine: multimodal embedding -> text model forward/backward -> flat gradients ->
// clipping and the CPU AdamW on the host master weights.
#include "train/cpu_engine.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>

#include "core/error.h"
#include "optim/grad_clip.h"
#include "train/batch_plan.h"
#include "model/lora/lora_dropout.h"
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
    : CpuEngine(checkpoint, options, nullptr, ParallelOptions{}) {}

CpuEngine::CpuEngine(const ModelCheckpoint& checkpoint, const EngineOptions& options, Communicator* world,
                     const ParallelOptions& parallel)
    : config_(checkpoint.config),
      text_prefix_(checkpoint.config.text_prefix()),
      aux_coef_(options.aux_coef),
      full_layout_(options.lora != nullptr ? lora_layout(checkpoint, *options.lora)
                                           : trainable_layout(checkpoint, options.freeze)),
      world_(world != nullptr && world->size() > 1 ? world : nullptr),
      parallel_(world_ != nullptr ? std::make_unique<ParallelLayout>(full_layout_, world_->rank(), world_->size(),
                                                                     checkpoint.config.text.num_experts, parallel)
                                  : nullptr),
      state_(parallel_ != nullptr ? parallel_->state() : full_layout_, options.adamw) {
  if (world_ == nullptr) {
    CHECK(parallel.expert_parallel_size == 1, "--expert_model_parallel_size ", parallel.expert_parallel_size,
          " needs as many ranks (this process runs alone)");
  } else if (parallel_->expert_parallel_size() > 1) {
    // Consecutive groups of EP ranks exchange tokens; the replicas of one expert block (same rank
    // mod EP) all-reduce its gradient.
    const int ep = parallel_->expert_parallel_size(), rank = world_->rank();
    ep_comm_ = world_->split(rank / ep, rank, "ep");
    dispatcher_ = std::make_unique<ExpertDispatcher>(*ep_comm_, config_.text.num_experts);
    if (parallel_->expert_replicas() > 1) expert_dp_comm_ = world_->split(rank % ep, rank, "expert_dp");
  }
  const ParamLayout& layout = state_.layout();
  grad_.assign(static_cast<size_t>(layout.total_numel()), 0.0f);
  if (world_ != nullptr) micro_grad_.assign(static_cast<size_t>(full_layout_.total_numel()), 0.0f);
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
  lora_ = options.lora;
  if (options.lora != nullptr) attach_lora_adapters(*options.lora, &text_params_, config_.has_vision ? &vision_params_ : nullptr);
  trainable_ = TrainableParts{false, false, false};
  trainable_.base_weights = options.lora == nullptr;
  for (const ParamEntry& entry : full_layout_.entries()) {
    const bool known = text_params_.count(entry.name) != 0 || vision_params_.count(entry.name) != 0;
    CHECK(known, "train: trainable tensor '", entry.name, "' is not a parameter of the CPU model");
    switch (param_group(entry.name)) {
      case ParamGroup::llm: trainable_.llm = true; break;
      case ParamGroup::vit: trainable_.vit = true; break;
      case ParamGroup::aligner: trainable_.aligner = true; break;
    }
  }
  for (const ParamEntry& entry : layout.entries()) {
    // The master starts as the checkpoint's values (fp32 copies made above).
    const auto text = text_params_.find(entry.name);
    const float* values = text != text_params_.end() ? text->second.values.data()
                                                     : vision_params_.at(entry.name).as<float>();
    std::memcpy(state_.master().data() + entry.offset, values + entry.tensor_begin,
                static_cast<size_t>(entry.numel) * sizeof(float));
  }
  if (dispatcher_ != nullptr) {
    // Other ranks' experts are never read here (their owners compute their rows) and this copy of
    // them is never updated: NaN makes any accidental use visible at once.
    const int64_t first = dispatcher_->first_local_expert(), count = dispatcher_->experts_per_rank();
    for (auto& [name, param] : text_params_) {
      if (!is_routed_expert_tensor(name)) continue;
      const int64_t per_expert = static_cast<int64_t>(param.values.size()) / config_.text.num_experts;
      for (int64_t e = 0; e < config_.text.num_experts; ++e) {
        if (e >= first && e < first + count) continue;
        std::fill(param.values.begin() + e * per_expert, param.values.begin() + (e + 1) * per_expert,
                  std::numeric_limits<float>::quiet_NaN());
      }
    }
  }
  state_.set_restore_hook([this] {
    use_master_weights();
    if (world_ != nullptr) gather_dense_weights();  // a collective: every rank restores together
  });
}

void CpuEngine::use_master_weights() {
  // This rank's pieces; on several ranks gather_dense_weights() brings the others' dense pieces.
  const float* master = state_.master().data();
  for (const ParamEntry& entry : state_.layout().entries()) {
    const float* source = master + entry.offset;
    const size_t bytes = static_cast<size_t>(entry.numel) * sizeof(float);
    auto text = text_params_.find(entry.name);
    float* target = text != text_params_.end() ? text->second.values.data() : vision_params_.at(entry.name).as<float>();
    std::memcpy(target + entry.tensor_begin, source, bytes);
  }
}

void CpuEngine::gather_dense_weights() {
  const ParallelLayout& layout = *parallel_;
  const int world = world_->size();
  std::vector<float> piece, gathered;
  for (int b = 0; b < layout.num_buckets(); ++b) {
    const int64_t n = layout.piece_elements(b);
    piece.assign(static_cast<size_t>(n), 0.0f);
    for (const ParallelLayout::OwnSegment& own : layout.own_piece_in_state(b)) {
      std::memcpy(piece.data() + own.in_piece, state_.master().data() + own.state_offset,
                  static_cast<size_t>(own.count) * sizeof(float));
    }
    gathered.resize(static_cast<size_t>(n * world));
    world_->all_gather(piece.data(), gathered.data(), n, DType::f32);
    for (int r = 0; r < world; ++r) {
      for (const ParallelLayout::Segment& segment : layout.piece_segments(b, r)) {
        set_working_weights(segment.full_entry, segment.tensor_begin, segment.count,
                            gathered.data() + r * n + segment.in_piece);
      }
    }
  }
}

void CpuEngine::set_working_weights(int full_entry, int64_t tensor_begin, int64_t count, const float* values) {
  const ParamEntry& entry = full_layout_.entry(full_entry);
  auto text = text_params_.find(entry.name);
  float* target = text != text_params_.end() ? text->second.values.data() : vision_params_.at(entry.name).as<float>();
  std::memcpy(target + tensor_begin, values, static_cast<size_t>(count) * sizeof(float));
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
  inputs.expert_parallel = dispatcher_.get();
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
  if (world_ != nullptr) return train_step_parallel(batches, lr, max_grad_norm);
  StepResult result;
  result.num_micro_batches = static_cast<int64_t>(batches.size());
  for (const MicroBatch& batch : batches) result.num_supervised += batch.num_supervised;
  // The engine adds the gradient of the CE sum and the step divides it by S once, so that no
  // per-token weight depends on how the step is split into micro-batches (batch_plan.h).
  const MicroBatchWeights weights = micro_batch_weights(result.num_supervised, result.num_micro_batches, aux_coef_);
  std::fill(grad_.begin(), grad_.end(), 0.0f);
  result.num_correct = 0;
  for (size_t m = 0; m < batches.size(); ++m) {
    const MicroBatchLoss part = forward_backward(batches[m], weights.ce_token_weight, weights.aux_weight, grad_.data(),
                                                 static_cast<int64_t>(m));
    result.ce_sum += part.ce_sum;
    result.aux_loss_sum += part.aux_loss;
    result.num_tokens += part.num_tokens;
    result.num_correct = result.num_correct < 0 || part.num_correct < 0 ? -1 : result.num_correct + part.num_correct;
  }
  divide_gradient(grad_.data(), grad_.size(), weights.gradient_divisor);
  const GradClipResult clip =
      grad_clip_from_sum_of_squares(sum_of_squares_f64(grad_.data(), static_cast<int64_t>(grad_.size())), max_grad_norm);
  if (clip_and_step(clip, lr, result)) use_master_weights();
  return result;
}

bool CpuEngine::clip_and_step(const GradClipResult& clip, double lr, StepResult& result) {
  result.grad_norm = clip.grad_norm;
  result.clip_coef = clip.clip_coef;
  result.skipped = !clip.finite;
  if (!clip.finite) return false;
  if (clip.clipped()) scale_in_place(grad_.data(), static_cast<int64_t>(grad_.size()), clip.clip_coef);
  state_.optimizer().step(lr, state_.master().data(), grad_.data());
  return true;
}

StepResult CpuEngine::train_step_parallel(const std::vector<MicroBatch>& batches, double lr, double max_grad_norm) {
  const ParallelLayout& layout = *parallel_;
  const int world = world_->size();
  // Every rank takes the same number of micro-batches (its share of the global batch).
  const int64_t local = static_cast<int64_t>(batches.size());
  int64_t counts[2] = {local, -local};
  world_->all_reduce(counts, counts, 2, DType::i64, ReduceOp::max);
  CHECK(counts[0] == -counts[1], "train: the ranks hold different numbers of micro-batches for this step (", -counts[1],
        " to ", counts[0], "); each rank must take micro-batches g * world + rank of the global batch");
  StepResult result;
  result.num_micro_batches = local * world;
  int64_t supervised = 0;
  for (const MicroBatch& batch : batches) supervised += batch.num_supervised;
  world_->all_reduce(&supervised, &result.num_supervised, 1, DType::i64, ReduceOp::sum);
  // The same per-token seeding and divisor as one rank taking all micro-batches of the step.
  const MicroBatchWeights weights = micro_batch_weights(result.num_supervised, result.num_micro_batches, aux_coef_);
  std::fill(grad_.begin(), grad_.end(), 0.0f);
  std::fill(micro_grad_.begin(), micro_grad_.end(), 0.0f);
  // Per micro-batch, in (g, rank) order once gathered: ce_sum, aux, tokens, correct.
  std::vector<double> parts(static_cast<size_t>(4 * local));
  std::vector<float> padded, reduced;
  for (int64_t g = 0; g < local; ++g) {
    // Dense gradients start from zero every micro-batch (ZeRO-2 reduces each micro-batch's); the
    // experts' stay running totals on their owner, as on one rank.
    for (const int index : layout.dense_entries()) {
      const ParamEntry& entry = full_layout_.entry(index);
      std::fill(micro_grad_.begin() + entry.offset, micro_grad_.begin() + entry.offset + entry.numel, 0.0f);
    }
    world_->set_activity(str_cat("train step: micro-batch ", g, " forward/backward"));
    const MicroBatchLoss part =
        forward_backward(batches[g], weights.ce_token_weight, weights.aux_weight, micro_grad_.data(),
                         g * world_->size() + world_->rank());
    parts[4 * g] = part.ce_sum;
    parts[4 * g + 1] = part.aux_loss;
    parts[4 * g + 2] = static_cast<double>(part.num_tokens);
    parts[4 * g + 3] = static_cast<double>(part.num_correct);
    world_->set_activity(str_cat("train step: micro-batch ", g, " gradient reduce-scatter"));
    for (int b = 0; b < layout.num_buckets(); ++b) {
      const int64_t n = layout.piece_elements(b);
      padded.resize(static_cast<size_t>(n * world));
      reduced.resize(static_cast<size_t>(n));
      layout.pack_bucket(b, micro_grad_.data(), padded.data());
      world_->reduce_scatter(padded.data(), reduced.data(), n, DType::f32, ReduceOp::sum);
      for (const ParallelLayout::OwnSegment& own : layout.own_piece_in_state(b)) {
        for (int64_t i = 0; i < own.count; ++i) grad_[own.state_offset + i] += reduced[own.in_piece + i];
      }
    }
  }
  for (const auto& [state_index, full_index] : layout.expert_pieces()) {
    const ParamEntry& piece = state_.layout().entry(state_index);
    const float* source = micro_grad_.data() + full_layout_.entry(full_index).offset + piece.tensor_begin;
    std::copy(source, source + piece.numel, grad_.begin() + piece.offset);
    if (expert_dp_comm_ != nullptr) {
      world_->set_activity("train step: expert gradient all-reduce");
      expert_dp_comm_->all_reduce(grad_.data() + piece.offset, grad_.data() + piece.offset, piece.numel, DType::f32,
                                  ReduceOp::sum);
    }
  }
  // Losses in the order one rank would add them: micro-batch g * world + r.
  std::vector<double> all_parts(parts.size() * world);
  world_->all_gather(parts.data(), all_parts.data(), static_cast<int64_t>(parts.size()), DType::f64);
  result.num_correct = 0;
  for (int64_t g = 0; g < local; ++g) {
    for (int r = 0; r < world; ++r) {
      const double* part = all_parts.data() + (r * local + g) * 4;
      result.ce_sum += part[0];
      result.aux_loss_sum += part[1];
      result.num_tokens += static_cast<int64_t>(part[2]);
      result.num_correct = result.num_correct < 0 || part[3] < 0 ? -1 : result.num_correct + static_cast<int64_t>(part[3]);
    }
  }
  divide_gradient(grad_.data(), grad_.size(), weights.gradient_divisor);
  // Each rank's fp64 sum of squares over its pieces (replicated expert pieces counted by their first
  // replica only), summed in rank order.
  const int64_t counted_from = layout.first_expert_replica() ? 0 : layout.dense_state_begin();
  double sum_of_squares =
      sum_of_squares_f64(grad_.data() + counted_from, static_cast<int64_t>(grad_.size()) - counted_from);
  world_->all_reduce(&sum_of_squares, &sum_of_squares, 1, DType::f64, ReduceOp::sum);
  const GradClipResult clip = grad_clip_from_sum_of_squares(sum_of_squares, max_grad_norm);
  if (clip_and_step(clip, lr, result)) {
    world_->set_activity("train step: weight all-gather");
    use_master_weights();
    gather_dense_weights();
  }
  return result;
}

MicroBatchLoss CpuEngine::forward_backward(const MicroBatch& batch, double ce_token_weight, double aux_weight,
                                           float* grad, int64_t micro_batch) {
  // LoRA dropout drops in this training pass only (evaluate opens no scope); its masks are keyed by
  // the run's seed, the updates applied so far and the micro-batch, so --resume needs no RNG state.
  const double dropout = lora_ != nullptr ? lora_->options.dropout : 0.0;
  const LoraDropoutScope dropout_scope(dropout, lora_ != nullptr ? lora_->seed : 0,
                                       static_cast<uint64_t>(state_.optimizer().adam_step()),
                                       static_cast<uint64_t>(micro_batch));
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
  for (const ParamEntry& entry : full_layout_.entries()) {
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
  for (const ParamEntry& entry : full_layout_.entries()) {
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
