// Runs the CPU reference model for `deltamoe parity` (text, or vision tower + text with images):
// inputs from safetensors, weights from a model directory (either expert layout), outputs and both
// losses' gradients (frozen parts left out) to safetensors.
#include "train/parity.h"

#include <chrono>
#include <cstring>

#include "checkpoint/safetensors.h"
#include "core/error.h"
#include "core/log.h"
#include "kernels/attention/attention.h"
#include "kernels/cross_entropy/cross_entropy.h"
#include "model/text/text_model.h"
#include "model/vision/multimodal_embedding.h"

namespace deltamoe {

namespace {

HostTensor read_tensor(const SafetensorsFile& file, const std::string& name, DType dtype, int rank) {
  const SafetensorsEntry* entry = file.find(name);
  CHECK(entry != nullptr, file.path(), ": tensor '", name, "' is missing");
  CHECK(entry->dtype == dtype, file.path(), ": tensor '", name, "' is ", dtype_safetensors_name(entry->dtype),
        ", expected ", dtype_safetensors_name(dtype));
  CHECK(entry->shape.rank() == rank, file.path(), ": tensor '", name, "' has shape ", entry->shape.str(),
        ", expected rank ", rank);
  return file.tensor(name).to_host();
}

std::optional<HostTensor> read_optional(const SafetensorsFile& file, const std::string& name, DType dtype, int rank) {
  if (!file.contains(name)) return std::nullopt;
  return read_tensor(file, name, dtype, rank);
}

ParamMap text_params_f32(const ModelCheckpoint& checkpoint, const std::string& prefix) {
  ParamMap params;
  for (const NamedShape& spec : text_param_shapes(checkpoint.config.text, prefix)) {
    auto it = checkpoint.params.find(spec.name);
    CHECK(it != checkpoint.params.end(), "parity: the checkpoint has no tensor '", spec.name, "'");
    HostTensor values = it->second.to_host().to_f32();
    ParamTensor& tensor = params[spec.name];
    tensor.shape = values.shape().to_vector();
    tensor.values.assign(values.as<float>(), values.as<float>() + values.numel());
  }
  return params;
}

HostTensor to_host_tensor(const ParamTensor& tensor) {
  return HostTensor::from_f32(tensor.values, Shape(tensor.shape));
}

// What the text tower starts from: token ids (text) or, with images, the fused embeddings.
struct TextInputs {
  std::optional<MultimodalEmbedding> multimodal;  // empty: embed input_ids, text positions per sequence
  std::vector<int64_t> positions;                 // [3, T]; empty: text positions per sequence
};


// VLM hook: with pixel_values, run the vision tower, scatter its features into the <|image_pad|>
// rows of the embeddings and build the (t, h, w) positions from image_grid_thw (transformers' get_rope_index); the
// vision backward then takes d_input_embeds (see run_parity_cpu).
TextInputs build_text_inputs(const ModelCheckpoint& checkpoint, const ParityInputs& inputs,
                             const std::vector<int32_t>& cu_seqlens, const VisionParams& vision_params,
                             const float* embed_table) {
  const ModelConfig& config = checkpoint.config;
  CHECK(inputs.pixel_values.has_value() == inputs.image_grid_thw.has_value(),
        "parity: the inputs must carry pixel_values and image_grid_thw together (one of them is missing)");
  CHECK(!inputs.pixel_values || config.has_vision, "parity: the inputs carry images but the model (", config.model_type,
        ") has no vision tower");
  if (inputs.mm_token_type_ids) check_mm_token_types(inputs, config.image_token_id, config.video_token_id);
  if (!inputs.pixel_values) return {};
  const int64_t patch_dim = config.vision.patch_dim();
  CHECK(inputs.pixel_values->shape()[1] == patch_dim, "parity: pixel_values ", inputs.pixel_values->shape().str(),
        " must have ", patch_dim, " columns (3 * temporal_patch_size * patch_size^2)");
  CHECK(inputs.image_grid_thw->shape()[1] == 3, "parity: image_grid_thw ", inputs.image_grid_thw->shape().str(),
        " must be [num_images, 3]");
  TextInputs result;
  result.multimodal =
      multimodal_embed_forward(config, vision_params, embed_table, inputs.input_ids.as<int64_t>(),
                               inputs.input_ids.numel(), cu_seqlens, &*inputs.pixel_values, &*inputs.image_grid_thw);
  result.positions = result.multimodal->positions;
  return result;
}

VisionParams vision_params_f32(const ModelCheckpoint& checkpoint) {
  VisionParams params;
  if (!checkpoint.config.has_vision) return params;
  for (const auto& [name, shape] : vision_param_shapes(checkpoint.config.vision)) {
    auto it = checkpoint.params.find(name);
    CHECK(it != checkpoint.params.end(), "parity: the checkpoint has no vision tensor '", name, "'");
    params[name] = it->second.to_host().to_f32();
  }
  return params;
}

}  // namespace

void check_mm_token_types(const ParityInputs& inputs, int64_t image_token_id, int64_t video_token_id) {
  const HostTensor& types = *inputs.mm_token_type_ids;
  CHECK(types.shape() == inputs.input_ids.shape(), "parity: mm_token_type_ids ", types.shape().str(),
        " must have the shape of input_ids ", inputs.input_ids.shape().str());
  const int64_t seq_len = inputs.input_ids.shape()[1];
  for (int64_t i = 0; i < types.numel(); ++i) {
    const int64_t id = inputs.input_ids.as<int64_t>()[i], type = types.as<int64_t>()[i];
    const int64_t expected = id == image_token_id ? 1 : id == video_token_id ? 2 : 0;
    CHECK(type == expected, "parity: mm_token_type_ids[", i / seq_len, ", ", i % seq_len, "] is ", type,
          " but input_ids there is ", id, " (expected type ", expected, ": 0 text, 1 image, 2 video)");
  }
}

ParityInputs load_parity_inputs(const std::string& path) {
  const auto file = SafetensorsFile::open(path);
  ParityInputs inputs;
  inputs.input_ids = read_tensor(*file, "input_ids", DType::i64, 2);
  inputs.labels = read_tensor(*file, "labels", DType::i64, 2);
  CHECK(inputs.labels.shape() == inputs.input_ids.shape(), path, ": labels ", inputs.labels.shape().str(),
        " and input_ids ", inputs.input_ids.shape().str(), " must have the same shape [B, S]");
  inputs.cu_seqlens = read_optional(*file, "cu_seqlens", DType::i32, 1);
  if (inputs.cu_seqlens) {
    CHECK(inputs.input_ids.shape()[0] == 1, path,
          ": cu_seqlens packs sequences into one row, but input_ids has B = ", inputs.input_ids.shape()[0]);
    check_cu_seqlens(inputs.cu_seqlens->as<int32_t>(), inputs.cu_seqlens->numel() - 1, inputs.input_ids.shape()[1],
                     path.c_str());
  }
  inputs.pixel_values = read_optional(*file, "pixel_values", DType::f32, 2);
  inputs.image_grid_thw = read_optional(*file, "image_grid_thw", DType::i64, 2);
  inputs.mm_token_type_ids = read_optional(*file, "mm_token_type_ids", DType::i64, 2);
  return inputs;
}

ParityResult run_parity_cpu(const ModelCheckpoint& checkpoint, const ParityInputs& inputs,
                            const TrainableParts& trainable) {
  const TextConfig& config = checkpoint.config.text;
  CHECK(!config.tie_word_embeddings && !checkpoint.config.tie_word_embeddings,
        "parity: tie_word_embeddings is not supported (Qwen3.5-MoE unties lm_head)");
  const std::string prefix = checkpoint.config.text_prefix();
  const std::string table_name = prefix + ".embed_tokens.weight";
  const int64_t rows = inputs.input_ids.shape()[0], seq_len = inputs.input_ids.shape()[1];
  const int64_t num_tokens = rows * seq_len, vocab = config.vocab_size;

  std::vector<int32_t> cu_seqlens = row_cu_seqlens(rows, seq_len);
  if (inputs.cu_seqlens) {
    const int32_t* given = inputs.cu_seqlens->as<int32_t>();
    cu_seqlens.assign(given, given + inputs.cu_seqlens->numel());
  }
  const ParamMap params = text_params_f32(checkpoint, prefix);
  const VisionParams vision_params = inputs.pixel_values ? vision_params_f32(checkpoint) : VisionParams{};
  TextInputs text_inputs =
      build_text_inputs(checkpoint, inputs, cu_seqlens, vision_params, param_values(params, table_name));
  const TextBatch batch = make_text_batch(config, num_tokens, std::move(cu_seqlens), std::move(text_inputs.positions));
  // transformers shifts each row as a whole (packed rows too).
  std::vector<int64_t> shifted(num_tokens);
  shift_labels_ref(inputs.labels.as<int64_t>(), shifted.data(), rows, seq_len);

  TextModel model(config, prefix, &params);
  TextModelInputs model_inputs;
  model_inputs.input_ids = inputs.input_ids.as<int64_t>();
  model_inputs.input_embeds = text_inputs.multimodal ? text_inputs.multimodal->input_embeds.data() : nullptr;
  model_inputs.shifted_labels = shifted.data();
  if (inputs.forced_routing) model_inputs.forced_routing = &*inputs.forced_routing;
  const TextModelOutput out = model.forward(batch, model_inputs);
  log_info("parity: ", num_tokens, " tokens, ", out.num_supervised, " supervised, ce_loss ", out.ce_loss, ", aux_loss ",
           out.aux_loss);

  ParityResult result;
  result.ce_loss = out.ce_loss;
  result.aux_loss = out.aux_loss;
  result.logits = HostTensor::from_f32(out.logits, Shape{rows, seq_len, vocab});
  for (const DecoderLayerSaved& layer : model.saved_layers()) result.routing.push_back(layer.moe.topk_idx);
  // With images the trained vision parts need the gradient of the text model's input embeddings,
  // even when the language model itself is frozen; otherwise a frozen LLM needs no backward.
  const bool vision_trained = text_inputs.multimodal && trainable.vision();
  if (!trainable.llm && !vision_trained) return result;
  const auto start = std::chrono::steady_clock::now();
  for (const bool ce : {true, false}) {
    std::vector<float> d_embeds;
    ParamMap text_grads = model.backward(ce ? 1.0f : 0.0f, ce ? 0.0f : 1.0f, &d_embeds, trainable.llm);
    VisionParams vision_grads;
    if (text_inputs.multimodal) {
      // The text model left embed_tokens to us (it started from input_embeds): the embedding
      // backward adds the table's gradient and hands the image rows to the vision tower.
      float* d_table = trainable.llm ? param_values(text_grads, table_name) : nullptr;
      multimodal_embed_backward(checkpoint.config, vision_params, *text_inputs.multimodal,
                                inputs.input_ids.as<int64_t>(), num_tokens, d_embeds, d_table, &vision_grads,
                                trainable);
    }
    auto& grads = ce ? result.grads : result.grads_aux;
    for (auto& [name, grad] : text_grads) grads[name] = to_host_tensor(grad);
    for (auto& [name, grad] : vision_grads) grads[name] = std::move(grad);
  }
  result.backward_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

void write_parity_outputs(const std::string& path, const ParityResult& result) {
  std::vector<NamedTensor> tensors;
  auto scalar = [](double value) { return HostTensor::from_f32({static_cast<float>(value)}, Shape{}); };
  tensors.push_back({"ce_loss", StoredTensor::from_host(scalar(result.ce_loss))});
  tensors.push_back({"aux_loss", StoredTensor::from_host(scalar(result.aux_loss))});
  tensors.push_back({"logits", StoredTensor::from_host(result.logits)});
  for (const auto& [name, grad] : result.grads) tensors.push_back({"grad." + name, StoredTensor::from_host(grad)});
  for (const auto& [name, grad] : result.grads_aux)
    tensors.push_back({"grad_aux." + name, StoredTensor::from_host(grad)});
  write_safetensors(path, tensors);
}

}  // namespace deltamoe
