// GPU parity run: upload the checkpoint's weights, one forward, one backward per loss; with images
// the vision tower's output fills the text model's image-token rows and its backward takes their
// gradient. Input checks mirror run_parity_cpu's (parity.cc) so both refuse the same inputs.
#include "train/gpu/gpu_parity.h"

#include <algorithm>
#include <chrono>
#include <memory>

#include "core/error.h"
#include "core/log.h"
#include "kernels/cross_entropy/cross_entropy.h"
#include "kernels/token_scatter/token_scatter_cuda.h"
#include "model/text/text_batch.h"
#include "model/vision/mrope_positions.h"
#include "model/vision/vision_tower.h"
#include "model/text/gpu/gpu_text_model.h"
#include "model/vision/gpu/gpu_vision_model.h"
#include "train/trainable_params.h"

namespace deltamoe {

namespace {

// The checkpoint's tensors `names` as fp32 host tensors.
ParamMap checkpoint_params(const ModelCheckpoint& checkpoint, const std::vector<std::pair<std::string, Shape>>& names) {
  ParamMap params;
  for (const auto& [name, shape] : names) {
    const auto found = checkpoint.params.find(name);
    CHECK(found != checkpoint.params.end(), "parity --device cuda: the checkpoint has no tensor '", name, "'");
    const HostTensor values = found->second.to_host().to_f32();
    ParamTensor& tensor = params[name];
    tensor.shape = values.shape().to_vector();
    tensor.values.assign(values.as<float>(), values.as<float>() + values.numel());
  }
  return params;
}

std::vector<std::pair<std::string, Shape>> text_names(const TextConfig& config, const std::string& prefix) {
  std::vector<std::pair<std::string, Shape>> names;
  for (const NamedShape& named : text_param_shapes(config, prefix)) names.emplace_back(named.name, Shape(named.shape));
  return names;
}


// The image side of a batch, validated: grids, patch count, the <|image_pad|> rows, 3-D positions.
struct ImageInputs {
  std::vector<GridThw> grids;
  int64_t num_patches = 0;
  std::vector<int32_t> pad_rows;   // [M] token rows the merged features go to
  std::vector<int64_t> positions;  // [3, T]
};

ImageInputs image_inputs(const ModelConfig& config, const ParityInputs& inputs, const std::vector<int32_t>& cu_seqlens) {
  const int64_t* ids = inputs.input_ids.as<int64_t>();
  const int64_t T = inputs.input_ids.numel();
  CHECK(config.has_vision, "parity: the inputs carry images but the model (", config.model_type,
        ") has no vision tower");
  CHECK(config.vision.out_hidden_size == config.text.hidden_size, "parity: vision out_hidden_size ",
        config.vision.out_hidden_size, " differs from the text hidden size ", config.text.hidden_size);
  CHECK(std::find(ids, ids + T, config.video_token_id) == ids + T, "parity: video tokens (id ", config.video_token_id,
        ") are not supported yet");
  const HostTensor& pixels = *inputs.pixel_values;
  const HostTensor& grid_thw = *inputs.image_grid_thw;
  CHECK(pixels.shape()[1] == config.vision.patch_dim(), "parity: pixel_values ", pixels.shape().str(), " must have ",
        config.vision.patch_dim(), " columns (3 * temporal_patch_size * patch_size^2)");
  CHECK(grid_thw.shape()[1] == 3, "parity: image_grid_thw ", grid_thw.shape().str(), " must be [num_images, 3]");
  ImageInputs result;
  const int64_t* values = grid_thw.as<int64_t>();
  for (int64_t i = 0; i < grid_thw.shape()[0]; ++i) result.grids.push_back({values[3 * i], values[3 * i + 1], values[3 * i + 2]});
  result.num_patches = pixels.shape()[0];
  const int64_t m = config.vision.spatial_merge_size;
  const int64_t merged = vision_num_merged_tokens(grid_thw, m);
  CHECK(merged * m * m == result.num_patches, "parity: image_grid_thw describes ", merged * m * m,
        " patches, pixel_values has ", result.num_patches, " rows");
  result.pad_rows.resize(static_cast<size_t>(merged));
  token_scatter_pad_rows(ids, T, config.image_token_id, merged, result.pad_rows.data());
  result.positions = compute_mrope_positions(ids, T, cu_seqlens, result.grids, {}, m, config.image_token_id,
                                             config.video_token_id);
  return result;
}

HostTensor host_tensor(std::vector<float> values, const std::vector<int64_t>& shape) {
  return HostTensor::from_f32(values, Shape(shape));
}

}  // namespace

ParityResult run_parity_gpu(const ModelCheckpoint& checkpoint, const ParityInputs& inputs,
                            const TrainableParts& trainable) {
  const ModelConfig& model_config = checkpoint.config;
  const TextConfig& config = model_config.text;
  CHECK(!config.tie_word_embeddings && !model_config.tie_word_embeddings,
        "parity --device cuda: tie_word_embeddings is not supported (Qwen3.5-MoE unties lm_head)");
  CHECK(inputs.pixel_values.has_value() == inputs.image_grid_thw.has_value(),
        "parity: the inputs must carry pixel_values and image_grid_thw together (one of them is missing)");
  if (inputs.mm_token_type_ids) check_mm_token_types(inputs, model_config.image_token_id, model_config.video_token_id);
  CHECK(!inputs.forced_routing, "parity --device cuda: forced routing is a CPU reference hook (pin the CPU run to "
        "the GPU's routing instead)");
  const std::string prefix = model_config.text_prefix();
  const int64_t rows = inputs.input_ids.shape()[0], seq_len = inputs.input_ids.shape()[1];
  const int64_t T = rows * seq_len, V = config.vocab_size;
  std::vector<int32_t> cu_seqlens = row_cu_seqlens(rows, seq_len);
  if (inputs.cu_seqlens) {
    const int32_t* given = inputs.cu_seqlens->as<int32_t>();
    cu_seqlens.assign(given, given + inputs.cu_seqlens->numel());
  }
  // Labels are shifted per row, as transformers does (packed rows too).
  std::vector<int64_t> shifted(static_cast<size_t>(T));
  shift_labels_ref(inputs.labels.as<int64_t>(), shifted.data(), rows, seq_len);
  const int64_t* ids = inputs.input_ids.as<int64_t>();
  const bool has_images = inputs.pixel_values.has_value();
  const ImageInputs images = has_images ? image_inputs(model_config, inputs, cu_seqlens) : ImageInputs{};
  const int64_t num_image_rows = static_cast<int64_t>(images.pad_rows.size());

  GpuModelOptions options;
  options.max_tokens = T;
  options.max_seqs = static_cast<int64_t>(cu_seqlens.size()) - 1;
  options.max_image_rows = num_image_rows;
  GpuTextModel model(config, prefix, options);
  model.upload_params(checkpoint_params(checkpoint, text_names(config, prefix)));
  model.set_image_rows(images.pad_rows);
  model.set_batch(std::vector<int64_t>(ids, ids + T), shifted, cu_seqlens, images.positions);

  // The vision tower shares the text model's stream, so its output and gradient need no extra sync.
  std::unique_ptr<GpuVisionModel> vision;
  if (has_images) {
    vision = std::make_unique<GpuVisionModel>(model_config.vision, kVisionPrefix, images.num_patches,
                                              static_cast<int64_t>(images.grids.size()), model.stream());
    vision->upload_params(checkpoint_params(checkpoint, vision_param_shapes(model_config.vision, kVisionPrefix)));
    vision->set_images(inputs.pixel_values->as<float>(), images.num_patches, images.grids);
    // The slot is only read by the text model, so one vision forward serves both losses.
    vision->forward(model.image_embeddings());
  }

  // As run_parity_cpu: with images a trained vision part needs the text model's input gradient even
  // when the language model is frozen; otherwise a frozen language model needs no gradients.
  const bool vision_trained = has_images && trainable.vision();
  const bool any_gradient = trainable.llm || vision_trained;
  ParityResult result;
  const auto start = std::chrono::steady_clock::now();
  for (const bool ce : {true, false}) {
    model.set_loss_weights(ce ? 1.0f : 0.0f, ce ? 0.0f : 1.0f);
    // The loss is formed by the fused lm_head + cross-entropy of the backward, so even a run
    // without gradients goes through forward_backward once.
    model.forward_backward();
    if (ce) {
      for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer)
        result.routing.push_back(model.read_topk_idx(layer));
      result.ce_loss = model.read_loss();
      result.aux_loss = model.read_aux_loss();
      result.logits = HostTensor::from_f32(model.compute_logits(), Shape{rows, seq_len, V});
    }
    if (!any_gradient) break;
    auto& grads = ce ? result.grads : result.grads_aux;
    if (trainable.llm)
      for (const ParamEntry& entry : model.layout().entries())
        grads[entry.name] = host_tensor(model.read_gradient(entry.name), entry.shape);
    if (vision_trained) {
      vision->backward(model.image_embedding_grads(), trainable);
      for (const ParamEntry& entry : vision->layout().entries()) {
        const ParamGroup group = param_group(entry.name);
        if (group == ParamGroup::aligner ? !trainable.aligner : !trainable.vit) continue;  // frozen: no entry
        grads[entry.name] = host_tensor(vision->read_gradient(entry.name), entry.shape);
      }
    }
  }
  if (any_gradient)
    result.backward_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  log_info("parity --device cuda: ", T, " tokens", has_images ? str_cat(", ", images.grids.size(), " images") : "",
           ", ce_loss ", result.ce_loss, ", aux_loss ", result.aux_loss);
  return result;
}

}  // namespace deltamoe
