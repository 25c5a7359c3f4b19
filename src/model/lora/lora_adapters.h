// The adapter tensors of a LoRA run (PEFT's LoRA, model/lora/lora.h): the settings, the targets they
// resolve to, and the fp32 values of every trained tensor (each target's A and B, the parameters of
// --modules_to_save) by their names in the CPU model's parameter maps.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"
#include "model/lora/lora.h"
#include "model/text/text_params.h"
#include "model/vision/vision_tower.h"

namespace deltamoe {

struct LoraAdapters {
  LoraOptions options;
  std::vector<LoraTarget> targets;
  std::vector<std::string> modules_to_save;   // parameter names trained whole
  std::map<std::string, HostTensor> tensors;  // f32; A and B of each target (modules_to_save: see below)
  uint64_t seed = 0;                          // the run's --seed: A's initialisation and dropout's masks

  // The trained tensors' names in a fixed order: A and B of each target (target order), then
  // modules_to_save.
  std::vector<std::string> trained_names() const;
};

// Resolves options on config and initialises as PEFT does (A Kaiming-uniform, seeded per target;
// B zero). modules_to_save values are not filled here (they start as the base model's weights).
LoraAdapters init_lora_adapters(const ModelConfig& config, const LoraOptions& options, uint64_t seed);

// Puts each target's A, B (from lora.tensors), scaling and, with --lora_dropout > 0, its index in
// targets (M.lora_index, which keys its dropout mask) next to its weight in the map of its tower
// (model.visual.* in vision, the rest in text; names as in model/lora/lora.h), so that the model's
// projections apply them. vision may be null for a text-only model. Throws naming a target whose
// weight the maps lack.
void attach_lora_adapters(const LoraAdapters& lora, ParamMap* text, VisionParams* vision);

}  // namespace deltamoe
