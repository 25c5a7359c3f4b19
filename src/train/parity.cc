// Runs the CPU reference text model for `deltamoe parity`: inputs from safetensors, weights from a
// model directory (either expert layout), outputs and both losses' gradients to safetensors.
#include "train/parity.h"

#include <cstring>

#include "checkpoint/safetensors.h"
#include "core/error.h"
#include "core/log.h"
#include "kernels/attention/attention.h"
#include "kernels/cross_entropy/cross_entropy.h"
#include "model/text/text_model.h"

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

// What the text tower starts from: token ids (text) or fused embeddings (VLM), and the 3-D positions.
struct TextInputs {
  std::vector<float> input_embeds;  // empty: embed input_ids
  std::vector<int64_t> positions;   // [3, T]; empty: text positions per sequence
};

// VLM hook: with pixel_values, run the vision tower, scatter its features into the <|image_pad|>
// rows of the embeddings and build the (t, h, w) positions from image_grid_thw and
// mm_token_type_ids (spec §5.5); the vision backward then takes d_input_embeds. Text only for now.
TextInputs build_text_inputs(const ModelCheckpoint& checkpoint, const ParityInputs& inputs) {
  CHECK(!inputs.pixel_values.has_value() && !inputs.image_grid_thw.has_value(),
        "parity: the inputs carry images, but the CPU reference has no vision tower yet (see build_text_inputs in ",
        "src/train/parity.cc)");
  return {};
}

}  // namespace

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

ParityResult run_parity_cpu(const ModelCheckpoint& checkpoint, const ParityInputs& inputs) {
  const TextConfig& config = checkpoint.config.text;
  CHECK(!config.tie_word_embeddings && !checkpoint.config.tie_word_embeddings,
        "parity: tie_word_embeddings is not supported (Qwen3.5-MoE unties lm_head)");
  const std::string prefix = checkpoint.config.text_prefix();
  const int64_t rows = inputs.input_ids.shape()[0], seq_len = inputs.input_ids.shape()[1];
  const int64_t num_tokens = rows * seq_len, vocab = config.vocab_size;

  std::vector<int32_t> cu_seqlens = row_cu_seqlens(rows, seq_len);
  if (inputs.cu_seqlens) {
    const int32_t* given = inputs.cu_seqlens->as<int32_t>();
    cu_seqlens.assign(given, given + inputs.cu_seqlens->numel());
  }
  TextInputs text_inputs = build_text_inputs(checkpoint, inputs);
  const TextBatch batch = make_text_batch(config, num_tokens, std::move(cu_seqlens), std::move(text_inputs.positions));
  // transformers shifts each row as a whole (packed rows too).
  std::vector<int64_t> shifted(num_tokens);
  shift_labels_ref(inputs.labels.as<int64_t>(), shifted.data(), rows, seq_len);

  const ParamMap params = text_params_f32(checkpoint, prefix);
  TextModel model(config, prefix, &params);
  TextModelInputs model_inputs;
  model_inputs.input_ids = inputs.input_ids.as<int64_t>();
  model_inputs.input_embeds = text_inputs.input_embeds.empty() ? nullptr : text_inputs.input_embeds.data();
  model_inputs.shifted_labels = shifted.data();
  const TextModelOutput out = model.forward(batch, model_inputs);
  log_info("parity: ", num_tokens, " tokens, ", out.num_supervised, " supervised, ce_loss ", out.ce_loss, ", aux_loss ",
           out.aux_loss);

  ParityResult result;
  result.ce_loss = out.ce_loss;
  result.aux_loss = out.aux_loss;
  result.logits = HostTensor::from_f32(out.logits, Shape{rows, seq_len, vocab});
  std::vector<float> d_embeds;
  for (auto& [name, grad] : model.backward(1.0f, 0.0f, &d_embeds)) result.grads[name] = to_host_tensor(grad);
  for (auto& [name, grad] : model.backward(0.0f, 1.0f, &d_embeds)) result.grads_aux[name] = to_host_tensor(grad);
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
