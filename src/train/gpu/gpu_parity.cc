// GPU parity run on the GPU engine the trainer uses: the checkpoint's weights, one forward and one
// backward per loss; with images the vision tower's output fills the text model's image-token rows
// and its backward takes their gradient. Input checks mirror run_parity_cpu's (parity.cc) so both
// refuse the same inputs.
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
#include "train/gpu/gpu_engine.h"
#include "train/trainable_params.h"

namespace deltamoe {

namespace {

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

  // The engine the trainer runs, sized for this batch, with the parts frozen that `trainable` says.
  EngineOptions options;
  options.freeze = FreezeOptions{!trainable.vit, !trainable.aligner, !trainable.llm};
  options.max_tokens = T;
  options.max_samples = static_cast<int64_t>(cu_seqlens.size()) - 1;
  options.print_memory_plan = false;
  // Parity trains nothing: a frozen whole model is allowed here (the loss alone is compared).
  GpuEngine engine(checkpoint, options);
  DeviceBatch batch;
  batch.ids.assign(ids, ids + T);
  batch.shifted_labels = shifted;
  batch.cu_seqlens = cu_seqlens;
  batch.positions = images.positions;
  if (has_images) {
    batch.pixel_values = inputs.pixel_values->as<float>();
    batch.num_patches = images.num_patches;
    batch.grid_thw = images.grids;
    batch.image_rows = images.pad_rows;
  }

  // As run_parity_cpu: with images a trained vision part needs the text model's input gradient even
  // when the language model is frozen; otherwise a frozen language model needs no gradients.
  const bool vision_trained = has_images && trainable.vision();
  const bool any_gradient = trainable.llm || vision_trained;
  ParityResult result;
  const auto start = std::chrono::steady_clock::now();
  for (const bool ce : {true, false}) {
    engine.zero_gradients();
    const MicroBatchLoss loss = engine.forward_backward(batch, ce ? 1.0 : 0.0, ce ? 0.0 : 1.0);
    if (ce) {
      result.routing = engine.last_routing();
      result.ce_loss = loss.num_supervised > 0 ? loss.ce_sum / static_cast<double>(loss.num_supervised) : 0.0;
      result.aux_loss = loss.aux_loss;
      result.logits = HostTensor::from_f32(engine.text_model().compute_logits(), Shape{rows, seq_len, V});
    }
    if (!any_gradient) break;
    auto& grads = ce ? result.grads : result.grads_aux;
    const ParamLayout& trained = engine.state().layout();
    for (const ParamEntry& entry : trained.entries()) {
      const ParamGroup group = param_group(entry.name);
      if (group != ParamGroup::llm && !has_images) continue;  // a text batch gives the tower no gradient
      grads[entry.name] = host_tensor(engine.read_gradient(entry.name), entry.shape);
    }
  }
  if (any_gradient)
    result.backward_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  log_info("parity --device cuda: ", T, " tokens", has_images ? str_cat(", ", images.grids.size(), " images") : "",
           ", ce_loss ", result.ce_loss, ", aux_loss ", result.aux_loss);
  return result;
}

}  // namespace deltamoe
