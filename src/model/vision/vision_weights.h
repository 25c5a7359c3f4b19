// The vision tower's parameters as typed views (patch embedding, position table, blocks, merger),
// bound once from the parameter table's names and read by GpuVisionModel by field.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/device_param.h"

namespace deltamoe {

struct VisionBlockWeights {
  DeviceParam norm1_weight, norm1_bias, norm2_weight, norm2_bias;
  DeviceParam qkv_weight, qkv_bias, proj_weight, proj_bias;
  DeviceParam fc1_weight, fc1_bias, fc2_weight, fc2_bias;
};

struct VisionWeights {
  DeviceParam patch_weight, patch_bias, pos_embed;
  std::vector<VisionBlockWeights> blocks;
  DeviceParam merger_norm_weight, merger_norm_bias, merger_fc1_weight, merger_fc1_bias, merger_fc2_weight,
      merger_fc2_bias;
  // Any block, the patch embedding or the position table trains, or a block's Linear carries a
  // trained LoRA adapter (the blocks' backward runs either way).
  bool vit_trained() const;
  bool merger_trained() const;  // any merger (aligner) tensor trains, or a trained adapter on its Linears
  int64_t lora_rank() const;    // the largest adapter rank on the tower's Linears (0: none)
};

// Whether GpuVisionModel applies a LoRA adapter on this module (model.visual.*): the blocks'
// attn.qkv, attn.proj, mlp.linear_fc1/fc2 and the merger's linear_fc1/fc2.
bool gpu_vision_applies_lora_adapter(const std::string& module);

// Binds every tensor of vision_param_table(config, prefix); throws naming a tensor the binding misses.
// lora (optional) attaches adapters to the Linears GpuVisionModel projects through its funnel
// (blocks' attn.qkv, attn.proj, mlp.linear_fc1/fc2, merger.linear_fc1/fc2); one on any other weight
// is refused with its name.
VisionWeights bind_vision_weights(const VisionConfig& config, const std::string& prefix,
                                  const DeviceParamLookup& lookup, const DeviceLoraLookup& lora = nullptr);

// The vision tensors GpuVisionModel reads in fp32 (LayerNorms, the position table).
std::set<std::string> vision_params_read_in_f32(const VisionConfig& config, const std::string& prefix);

}  // namespace deltamoe
