// PEFT adapter directories: adapter_model.safetensors (PEFT's key names, fp32) and
// adapter_config.json (a LoraConfig PeftModel.from_pretrained reads), written by LoRA runs and read
// back by `deltamoe export --adapters` and `deltamoe parity --adapters`; and the merge of an adapter
// into the base model (PEFT's merge_and_unload).
#pragma once

#include <string>

#include "checkpoint/model_checkpoint.h"
#include "model/lora/lora_adapters.h"

namespace deltamoe {

constexpr const char* kPeftAdapterWeights = "adapter_model.safetensors";
constexpr const char* kPeftAdapterConfig = "adapter_config.json";

// Writes dir/adapter_model.safetensors and dir/adapter_config.json (dir must exist). base_model is
// recorded as base_model_name_or_path. modules_to_save values come from adapters.tensors too.
void save_peft_adapter(const std::string& dir, const LoraAdapters& adapters, const std::string& base_model);

// Reads an adapter directory written by PEFT or deltamoe for a model of config: the settings, the
// targets they resolve to, and every tensor (checked: each expected key present with its shape, no
// unknown key). Throws naming the file and key.
LoraAdapters load_peft_adapter(const std::string& dir, const ModelConfig& config);

// base_model_name_or_path of dir/adapter_config.json ("" when absent).
std::string peft_adapter_base_model(const std::string& dir);

// base with every adapted weight replaced by W + delta (computed in fp32, stored in the weight's
// dtype) and every modules_to_save tensor by its trained value.
ModelCheckpoint merge_lora(const ModelCheckpoint& base, const LoraAdapters& adapters);

}  // namespace deltamoe
