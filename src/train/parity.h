// `deltamoe parity` logic, reusable by the trainer: run the CPU fp32 reference model on a batch
// from a safetensors file (text, or images through the vision tower) and collect ce_loss, aux_loss,
// logits and the gradients of each loss for every trainable parameter (fused layout, HF names) —
// the quantities the golden files hold.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/model_checkpoint.h"
#include "core/tensor.h"
#include "model/lora/lora_adapters.h"
#include "model/vision/trainable_parts.h"

namespace deltamoe {

struct ParityInputs {
  HostTensor input_ids;                  // int64 [B, S]
  HostTensor labels;                     // int64 [B, S], unshifted, -100 ignored
  std::optional<HostTensor> cu_seqlens;  // int32 [N + 1], only with B = 1 (packed sequences)
  // Vision inputs (the VLM path; build_text_inputs in parity.cc).
  std::optional<HostTensor> pixel_values;       // f32 [Np, 1536]
  std::optional<HostTensor> image_grid_thw;     // int64 [Ni, 3]
  std::optional<HostTensor> mm_token_type_ids;  // int64 [B, S]
  // Not from the file (the CLI never sets it): experts per decoder layer (L entries of [T, K])
  // replacing the routers' top-k, e.g. to pin the CPU reference to a GPU run's choices.
  std::optional<std::vector<std::vector<int32_t>>> forced_routing;
};

struct ParityResult {
  double ce_loss = 0;                           // mean CE over supervised tokens after the shift
  double aux_loss = 0;                          // load-balancing loss before its coefficient
  HostTensor logits;                            // f32 [B, S, V]
  std::map<std::string, HostTensor> grads;      // d ce_loss / d param, f32, by HF name
  std::map<std::string, HostTensor> grads_aux;  // d aux_loss / d param
  double backward_seconds = 0;                  // wall time of both backwards (0: nothing trained)
  std::vector<std::vector<int32_t>> routing;    // experts chosen per decoder layer, L entries of [T, K]
};

// Reads and validates the inputs file (dtypes, shapes, cu_seqlens rules); errors name the file and tensor.
ParityInputs load_parity_inputs(const std::string& path);

// Throws naming the first [row, column] where mm_token_type_ids (transformers' per-token modality:
// 0 text, 1 image, 2 video) disagrees with input_ids; the positions are built from input_ids.
void check_mm_token_types(const ParityInputs& inputs, int64_t image_token_id, int64_t video_token_id);

// Runs forward and two backwards (one per loss) of the CPU reference on the checkpoint's weights.
// With pixel_values the vision tower runs too and the model.visual.* gradients are returned.
// Frozen parts (trainable) get no gradient entries and their weight gradients are not computed;
// with every part frozen that the batch touches, no backward runs at all.
// With lora the adapters are applied (model/lora/lora_adapters.h) and the gradients are those of the
// adapters only, keyed by PEFT's names (base_model.model.<module>.lora_A.weight), as PEFT's golden
// files hold them.
ParityResult run_parity_cpu(const ModelCheckpoint& checkpoint, const ParityInputs& inputs,
                            const TrainableParts& trainable = {}, const LoraAdapters* lora = nullptr);

// Writes ce_loss, aux_loss (scalars), logits, grad.<name> and grad_aux.<name> (all f32).
void write_parity_outputs(const std::string& path, const ParityResult& result);

}  // namespace deltamoe
