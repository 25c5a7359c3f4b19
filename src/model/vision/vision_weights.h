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
  bool vit_trained() const;     // any block, the patch embedding or the position table trains
  bool merger_trained() const;  // any merger (aligner) tensor trains
};

// Binds every tensor of vision_param_table(config, prefix); throws naming a tensor the binding misses.
VisionWeights bind_vision_weights(const VisionConfig& config, const std::string& prefix,
                                  const DeviceParamLookup& lookup);

// The vision tensors GpuVisionModel reads in fp32 (LayerNorms, the position table).
std::set<std::string> vision_params_read_in_f32(const VisionConfig& config, const std::string& prefix);

}  // namespace deltamoe
