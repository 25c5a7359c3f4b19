// GpuEngine: uploads the checkpoint into a GpuTextModel planned for the trainer's token budget, runs
// each packed micro-batch on the device and moves weights and gradients through the trainer's
// flat host buffers (see gpu_engine.h).
#include "train/gpu/gpu_engine.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "core/cuda_check.h"
#include "core/error.h"
#include "core/log.h"
#include "kernels/token_scatter/token_scatter_cuda.h"
#include "model/text/text_params.h"
#include "model/vision/trainable_parts.h"
#include "model/vision/vision_tower.h"
#include "train/engine_factory.h"
#include "train/model_flops.h"
#include "model/text/gpu/gpu_text_model.h"
#include "model/vision/gpu/gpu_vision_model.h"
#include "train/trainable_params.h"

namespace deltamoe {

namespace {

constexpr int64_t kIgnore = -100;
// Evaluation downloads [T, V] fp32 logits to count the right argmaxes only up to this size
// (256 MiB: the demo's 1024 x 4096 is 16 MiB; a real vocabulary at 8k tokens would be 8 GiB).
constexpr int64_t kMaxAccuracyLogits = int64_t{1} << 26;

// Supervised positions whose first-maximum logit is the label (as CpuEngine counts them).
int64_t count_correct(const std::vector<float>& logits, const std::vector<int64_t>& shifted_labels, int64_t vocab) {
  int64_t correct = 0;
  for (size_t t = 0; t < shifted_labels.size(); ++t) {
    if (shifted_labels[t] == kIgnore) continue;
    const float* row = logits.data() + t * static_cast<size_t>(vocab);
    correct += std::max_element(row, row + vocab) - row == shifted_labels[t];
  }
  return correct;
}

int64_t count_supervised(const std::vector<int64_t>& shifted_labels) {
  return std::count_if(shifted_labels.begin(), shifted_labels.end(), [](int64_t label) { return label != kIgnore; });
}

double gib(size_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0); }

// The checkpoint's tensors `names` as fp32 host tensors.
template <typename Names>
ParamMap load_params(const ModelCheckpoint& checkpoint, const Names& names) {
  ParamMap params;
  for (const auto& named : names) {
    const std::string& name = named.first;
    auto it = checkpoint.params.find(name);
    CHECK(it != checkpoint.params.end(), "train: the checkpoint has no tensor '", name, "'");
    const HostTensor values = it->second.to_host().to_f32();
    params[name] = {values.shape().to_vector(),
                    std::vector<float>(values.as<float>(), values.as<float>() + values.numel())};
  }
  return params;
}

// Adds a device model's gradient of each listed tensor to the trainer's flat buffer.
template <typename Model>
void add_gradients(const Model& model, const std::vector<std::pair<std::string, int64_t>>& entries, float* grad) {
  for (const auto& [name, offset] : entries) {
    const std::vector<float> part = model.read_gradient(name);
    float* total = grad + offset;
    for (size_t i = 0; i < part.size(); ++i) total[i] += part[i];
  }
}

// Copies the trainer's master values of the listed tensors into the host parameter copies.
void copy_master(const float* master, const std::vector<std::pair<std::string, int64_t>>& entries, ParamMap* params) {
  for (const auto& [name, offset] : entries) {
    std::vector<float>& values = params->at(name).values;
    std::copy(master + offset, master + offset + static_cast<int64_t>(values.size()), values.begin());
  }
}

}  // namespace

int64_t planned_max_sequences(const EngineSizing& sizing) {
  CHECK(sizing.max_tokens > 0, "train: the GPU engine needs the micro-batch token budget, got ", sizing.max_tokens);
  if (sizing.max_samples > 0) return std::min(sizing.max_samples, sizing.max_tokens);
  return std::min(sizing.max_tokens, std::max<int64_t>(64, sizing.max_tokens / kMinTokensPerSample));
}

struct GpuEngine::State {
  ModelConfig config;
  std::string text_prefix;
  ParamLayout layout;  // the trainer's: trainable tensors only
  EngineSizing sizing;
  int64_t max_seqs = 0;
  int device = 0;
  std::string gpu_name;
  std::unique_ptr<GpuTextModel> text;
  std::unique_ptr<GpuVisionModel> vision;  // VLMs only; shares the text model's stream
  // fp32 host copies of every parameter: trainable ones are refreshed from the trainer's master,
  // frozen ones keep the checkpoint's values; uploaded whole by set_trainable_weights.
  ParamMap text_params, vision_params;
  // Trainer entries of each model: (name, offset in the trainer's flat buffer).
  std::vector<std::pair<std::string, int64_t>> text_entries, vision_entries;
  TrainableParts trainable{false, false, false};
  bool has_images = false;  // the uploaded batch's
  size_t peak_used_bytes = 0;

  void note_memory() {
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    peak_used_bytes = std::max(peak_used_bytes, total_bytes - free_bytes);
  }

  // Validates the batch and copies it to the device (images to the vision tower, their token rows
  // to the text model); returns the shifted labels.
  std::vector<int64_t> upload_batch(const MicroBatch& batch) {
    const int64_t num_tokens = batch.num_tokens();
    CHECK(num_tokens > 0, "train: empty micro-batch");
    CHECK(num_tokens <= sizing.max_tokens, "train: a micro-batch of ", num_tokens,
          " tokens, the GPU engine was planned for at most ", sizing.max_tokens, " (the micro-batch token budget)");
    const int64_t num_seqs = static_cast<int64_t>(batch.cu_seqlens.size()) - 1;
    CHECK(num_seqs <= max_seqs, "train: a micro-batch of ", num_seqs,
          " samples, the GPU engine was planned for at most ", max_seqs, " (", kMinTokensPerSample,
          " tokens per sample on average); cap the samples per micro-batch with --micro_batch_size");
    CHECK(static_cast<int64_t>(batch.positions.size()) == 3 * num_tokens, "train: micro-batch positions must be [3, ",
          num_tokens, "], got ", batch.positions.size(), " values");
    std::vector<int64_t> ids(batch.input_ids.begin(), batch.input_ids.end());
    std::vector<int64_t> shifted = shift_packed_labels(batch);
    CHECK(vision || (batch.image_grid_thw.empty() && batch.pixel_values.empty()), "train: the micro-batch has ",
          batch.image_grid_thw.size(), " image(s) but the model (", config.model_type, ") has no vision tower");
    if (vision) text->set_image_rows(upload_images(batch, ids));
    text->set_batch(ids, shifted, batch.cu_seqlens, batch.positions);
    return shifted;
  }

  // The batch's images to the vision tower; returns the <|image_pad|> rows their merged features
  // fill ([] for a text-only batch).
  std::vector<int32_t> upload_images(const MicroBatch& batch, const std::vector<int64_t>& ids) {
    has_images = !batch.image_grid_thw.empty();
    if (!has_images) {
      CHECK(batch.pixel_values.empty(), "train: the micro-batch has pixel_values but no image_grid_thw");
      return {};
    }
    const VisionConfig& vc = config.vision;
    const int64_t patch_dim = vc.patch_dim();
    const int64_t num_patches = static_cast<int64_t>(batch.pixel_values.size()) / patch_dim;
    CHECK(num_patches * patch_dim == static_cast<int64_t>(batch.pixel_values.size()),
          "train: pixel_values of the micro-batch are not whole patches of ", patch_dim, " values");
    CHECK(num_patches == batch.num_patches(), "train: the micro-batch has ", num_patches,
          " patches of pixel_values but its image_grid_thw describe ", batch.num_patches());
    const int64_t merge = vc.spatial_merge_size * vc.spatial_merge_size;
    const int64_t merged = num_patches / merge;
    CHECK(std::count(ids.begin(), ids.end(), config.video_token_id) == 0, "train: video tokens (id ",
          config.video_token_id, ") are not supported yet");
    std::vector<int32_t> rows(static_cast<size_t>(merged));
    token_scatter_pad_rows(ids.data(), static_cast<int64_t>(ids.size()), config.image_token_id, merged, rows.data());
    vision->set_images(batch.pixel_values.data(), num_patches, batch.image_grid_thw);
    return rows;
  }

  // Runs forward + backward of the uploaded batch with the loss weights given and reads the losses;
  // with vision_backward the tower's trainable parts get their gradients too.
  MicroBatchLoss run(const std::vector<int64_t>& shifted, double ce_weight, double aux_weight, bool vision_backward) {
    text->set_loss_weights(static_cast<float>(ce_weight), static_cast<float>(aux_weight));
    if (has_images) vision->forward(text->image_embeddings());
    text->forward_backward();
    if (has_images && vision_backward && trainable.vision())
      vision->backward(text->image_embedding_grads(), trainable);
    MicroBatchLoss loss;
    loss.num_tokens = static_cast<int64_t>(shifted.size());
    loss.num_supervised = count_supervised(shifted);
    // The model reports the mean over the batch's supervised tokens (0 when there are none).
    loss.ce_sum = static_cast<double>(text->read_loss()) * static_cast<double>(loss.num_supervised);
    loss.aux_loss = text->read_aux_loss();
    note_memory();
    return loss;
  }
};

GpuEngine::GpuEngine(const ModelCheckpoint& checkpoint, const ParamLayout& layout, const EngineSizing& sizing)
    : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.config = checkpoint.config;
  s.text_prefix = s.config.text_prefix();
  s.layout = layout;
  s.sizing = sizing;
  s.max_seqs = planned_max_sequences(sizing);
  CHECK(!s.config.tie_word_embeddings && !s.config.text.tie_word_embeddings,
        "train: tie_word_embeddings is not supported (Qwen3.5-MoE unties lm_head)");
  CUDA_CHECK(cudaGetDevice(&s.device));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, s.device));
  s.gpu_name = prop.name;

  std::vector<std::pair<std::string, Shape>> text_names;
  for (const NamedShape& spec : text_param_shapes(s.config.text, s.text_prefix))
    text_names.emplace_back(spec.name, Shape(spec.shape));
  s.text_params = load_params(checkpoint, text_names);
  check_text_params(s.text_params, s.config.text, s.text_prefix);
  if (s.config.has_vision) {
    CHECK(s.config.vision.out_hidden_size == s.config.text.hidden_size, "train: vision out_hidden_size ",
          s.config.vision.out_hidden_size, " differs from the text hidden size ", s.config.text.hidden_size);
    s.vision_params = load_params(checkpoint, vision_param_shapes(s.config.vision, kVisionPrefix));
  }
  for (const ParamEntry& entry : layout.entries()) {
    const bool is_text = s.text_params.count(entry.name) != 0;
    const ParamMap& owner = is_text ? s.text_params : s.vision_params;
    CHECK(owner.count(entry.name) != 0, "train: trainable tensor '", entry.name,
          "' is not a parameter of the GPU model");
    CHECK(static_cast<int64_t>(owner.at(entry.name).values.size()) == entry.numel, "train: tensor '", entry.name,
          "' has ", entry.numel, " values in the trainer's layout and ", owner.at(entry.name).values.size(),
          " in the model");
    (is_text ? s.text_entries : s.vision_entries).emplace_back(entry.name, entry.offset);
    switch (param_group(entry.name)) {
      case ParamGroup::llm: s.trainable.llm = true; break;
      case ParamGroup::vit: s.trainable.vit = true; break;
      case ParamGroup::aligner: s.trainable.aligner = true; break;
    }
  }

  GpuModelOptions options;
  options.max_tokens = sizing.max_tokens;
  options.max_seqs = s.max_seqs;
  options.loss_chunk_rows = std::min<int64_t>(1024, sizing.max_tokens);
  options.max_image_rows = s.config.has_vision ? -1 : 0;  // any token may be an image token
  // The model's own AdamW moments are not used (the trainer steps on the host): keep them small.
  options.adamw.moment_dtype = DType::bf16;
  s.text = std::make_unique<GpuTextModel>(s.config.text, s.text_prefix, options);
  s.text->upload_params(s.text_params);
  size_t vision_bytes = 0;
  if (s.config.has_vision) {
    // Planned for the worst case: every token of the budget an image token (merge^2 patches each).
    const int64_t merge = s.config.vision.spatial_merge_size * s.config.vision.spatial_merge_size;
    s.vision = std::make_unique<GpuVisionModel>(s.config.vision, kVisionPrefix, sizing.max_tokens * merge,
                                                sizing.max_tokens, s.text->stream());
    s.vision->upload_params(s.vision_params);
    vision_bytes = s.vision->activation_bytes() + static_cast<size_t>(s.vision->layout().total_numel()) * 10;
  }
  s.note_memory();
  const GpuMemoryBreakdown mem = s.text->memory();
  log_info("train: GPU engine on cuda:", s.device, " (", s.gpu_name, "), planned for ", sizing.max_tokens,
           " tokens and ", s.max_seqs, " samples per micro-batch: weights ", gib(mem.weights), " GiB, gradients ",
           gib(mem.gradients), " GiB, activations ", gib(mem.activations), " GiB, workspace ", gib(mem.workspace),
           " GiB, vision tower ", gib(vision_bytes), " GiB; device memory in use ", gib(s.peak_used_bytes), " GiB");
}

GpuEngine::~GpuEngine() = default;

std::string GpuEngine::device_name() const { return str_cat("cuda:", state_->device); }

std::string GpuEngine::accelerator_name() const { return state_->gpu_name; }

void GpuEngine::set_trainable_weights(const float* master) {
  State& s = *state_;
  // Whole models go up (frozen tensors unchanged): one upload per optimizer step.
  if (!s.text_entries.empty()) {
    copy_master(master, s.text_entries, &s.text_params);
    s.text->upload_params(s.text_params);
  }
  if (!s.vision_entries.empty()) {
    copy_master(master, s.vision_entries, &s.vision_params);
    s.vision->upload_params(s.vision_params);
  }
}

MicroBatchLoss GpuEngine::forward_backward(const MicroBatch& batch, double ce_token_weight, double aux_weight,
                                           float* grad) {
  State& s = *state_;
  const std::vector<int64_t> shifted = s.upload_batch(batch);
  // The model differentiates ce_weight * mean CE; the contract asks for ce_token_weight * CE sum,
  // which is (ce_token_weight * num_supervised) * mean.
  const double ce_weight = ce_token_weight * static_cast<double>(count_supervised(shifted));
  const MicroBatchLoss loss = s.run(shifted, ce_weight, aux_weight, /*vision_backward=*/true);
  // The device gradients were zeroed and written by this micro-batch: add them to the step's
  // total. A text-only batch gives the vision tower no gradient (nothing to add).
  add_gradients(*s.text, s.text_entries, grad);
  if (s.has_images && s.trainable.vision()) add_gradients(*s.vision, s.vision_entries, grad);
  return loss;
}

MicroBatchLoss GpuEngine::forward(const MicroBatch& batch, std::vector<float>* logits) {
  State& s = *state_;
  const std::vector<int64_t> shifted = s.upload_batch(batch);
  // GpuTextModel computes the loss inside its backward (lm_head + cross-entropy in chunks): run it
  // with zero loss weights, whose gradients are zero and never read.
  MicroBatchLoss loss = s.run(shifted, 0.0, 0.0, /*vision_backward=*/false);
  const int64_t vocab = s.config.text.vocab_size;
  if (logits != nullptr || loss.num_tokens * vocab <= kMaxAccuracyLogits) {
    std::vector<float> values = s.text->compute_logits();
    loss.num_correct = count_correct(values, shifted, vocab);
    if (logits != nullptr) *logits = std::move(values);
  }
  return loss;
}

double GpuEngine::training_flops(const MicroBatch& batch) const {
  return training_step_flops(state_->config.text, batch.cu_seqlens);
}

size_t GpuEngine::peak_memory_bytes() const { return state_->peak_used_bytes; }

std::vector<std::vector<int32_t>> GpuEngine::last_routing() const {
  std::vector<std::vector<int32_t>> routing;
  for (int64_t layer = 0; layer < state_->config.text.num_hidden_layers; ++layer)
    routing.push_back(state_->text->read_topk_idx(layer));
  return routing;
}

bool register_gpu_engine() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the error so later CUDA calls start clean
    return false;
  }
  register_gpu_train_engine([](const ModelCheckpoint& checkpoint, const ParamLayout& layout,
                               const EngineSizing& sizing) -> std::unique_ptr<TrainEngine> {
    return std::make_unique<GpuEngine>(checkpoint, layout, sizing);
  });
  return true;
}

}  // namespace deltamoe
