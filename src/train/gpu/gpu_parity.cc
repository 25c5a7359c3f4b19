// GPU parity run: upload the checkpoint's text weights, one forward, one backward per loss.
#include "train/gpu/gpu_parity.h"

#include <chrono>

#include "core/error.h"
#include "core/log.h"
#include "kernels/cross_entropy/cross_entropy.h"
#include "model/text/text_batch.h"
#include "train/gpu/gpu_text_model.h"

namespace deltamoe {

namespace {

// The checkpoint's text tower as fp32 host tensors under the layout's names.
ParamMap checkpoint_text_params(const ModelCheckpoint& checkpoint, const std::string& prefix) {
  ParamMap params;
  for (const NamedShape& named : text_param_shapes(checkpoint.config.text, prefix)) {
    const auto found = checkpoint.params.find(named.name);
    CHECK(found != checkpoint.params.end(), "parity --device cuda: the checkpoint has no tensor '", named.name, "'");
    const HostTensor values = found->second.to_host().to_f32();
    ParamTensor& tensor = params[named.name];
    tensor.shape = values.shape().to_vector();
    tensor.values.assign(values.as<float>(), values.as<float>() + values.numel());
  }
  return params;
}

}  // namespace

ParityResult run_parity_gpu(const ModelCheckpoint& checkpoint, const ParityInputs& inputs) {
  CHECK(!inputs.pixel_values, "parity --device cuda: image inputs are not supported on the GPU yet (text only)");
  const TextConfig& config = checkpoint.config.text;
  CHECK(!config.tie_word_embeddings && !checkpoint.config.tie_word_embeddings,
        "parity --device cuda: tie_word_embeddings is not supported (Qwen3.5-MoE unties lm_head)");
  const std::string prefix = checkpoint.config.text_prefix();
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

  GpuModelOptions options;
  options.max_tokens = T;
  options.max_seqs = static_cast<int64_t>(cu_seqlens.size()) - 1;
  GpuTextModel model(config, prefix, options);
  model.upload_params(checkpoint_text_params(checkpoint, prefix));
  model.set_batch(std::vector<int64_t>(ids, ids + T), shifted, cu_seqlens);

  ParityResult result;
  const auto start = std::chrono::steady_clock::now();
  for (const bool ce : {true, false}) {
    model.set_loss_weights(ce ? 1.0f : 0.0f, ce ? 0.0f : 1.0f);
    model.forward_backward();
    auto& grads = ce ? result.grads : result.grads_aux;
    for (const ParamEntry& entry : model.layout().entries())
      grads[entry.name] = HostTensor::from_f32(model.read_gradient(entry.name), Shape(entry.shape));
    if (ce) {
      result.ce_loss = model.read_loss();
      result.aux_loss = model.read_aux_loss();
      result.logits = HostTensor::from_f32(model.compute_logits(), Shape{rows, seq_len, V});
    }
  }
  result.backward_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  log_info("parity --device cuda: ", T, " tokens, ce_loss ", result.ce_loss, ", aux_loss ", result.aux_loss);
  return result;
}

}  // namespace deltamoe
