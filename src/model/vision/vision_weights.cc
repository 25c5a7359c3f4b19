// bind_vision_weights: the one place where the GPU vision tower's fields meet the tensor names.
#include "model/vision/vision_weights.h"

#include "core/error.h"
#include "model/param_table.h"

namespace deltamoe {

bool VisionWeights::vit_trained() const {
  bool trained = patch_weight.trained() || patch_bias.trained() || pos_embed.trained();
  for (const VisionBlockWeights& b : blocks) trained = trained || b.qkv_weight.trained() || b.norm1_weight.trained();
  return trained;
}

bool VisionWeights::merger_trained() const {
  return merger_norm_weight.trained() || merger_fc1_weight.trained() || merger_fc2_weight.trained();
}

VisionWeights bind_vision_weights(const VisionConfig& config, const std::string& prefix,
                                  const DeviceParamLookup& lookup) {
  std::set<std::string> bound;
  auto get = [&](const std::string& name, bool needs_f32) {
    bound.insert(name);
    return lookup(name, needs_f32);
  };
  VisionWeights w;
  const std::string q = prefix + ".";
  w.patch_weight = get(q + "patch_embed.proj.weight", false);
  w.patch_bias = get(q + "patch_embed.proj.bias", false);
  w.pos_embed = get(q + "pos_embed.weight", true);  // interpolated in fp32 into the fp32 stream
  for (int64_t j = 0; j < config.depth; ++j) {
    const std::string p = str_cat(q, "blocks.", j, ".");
    VisionBlockWeights b;
    b.norm1_weight = get(p + "norm1.weight", true);
    b.norm1_bias = get(p + "norm1.bias", true);
    b.norm2_weight = get(p + "norm2.weight", true);
    b.norm2_bias = get(p + "norm2.bias", true);
    b.qkv_weight = get(p + "attn.qkv.weight", false);
    b.qkv_bias = get(p + "attn.qkv.bias", false);
    b.proj_weight = get(p + "attn.proj.weight", false);
    b.proj_bias = get(p + "attn.proj.bias", false);
    b.fc1_weight = get(p + "mlp.linear_fc1.weight", false);
    b.fc1_bias = get(p + "mlp.linear_fc1.bias", false);
    b.fc2_weight = get(p + "mlp.linear_fc2.weight", false);
    b.fc2_bias = get(p + "mlp.linear_fc2.bias", false);
    w.blocks.push_back(b);
  }
  w.merger_norm_weight = get(q + "merger.norm.weight", true);
  w.merger_norm_bias = get(q + "merger.norm.bias", true);
  w.merger_fc1_weight = get(q + "merger.linear_fc1.weight", false);
  w.merger_fc1_bias = get(q + "merger.linear_fc1.bias", false);
  w.merger_fc2_weight = get(q + "merger.linear_fc2.weight", false);
  w.merger_fc2_bias = get(q + "merger.linear_fc2.bias", false);
  const std::vector<ParamSpec> table = vision_param_table(config, prefix);
  for (const ParamSpec& spec : table) {
    CHECK(bound.count(spec.name) == 1, "gpu vision model: the parameter table has '", spec.name,
          "', which no field of VisionWeights binds");
  }
  CHECK(bound.size() == table.size(), "gpu vision model: ", bound.size(), " tensors bound, the parameter table has ",
        table.size());
  return w;
}

std::set<std::string> vision_params_read_in_f32(const VisionConfig& config, const std::string& prefix) {
  std::set<std::string> names;
  bind_vision_weights(config, prefix, [&](const std::string& name, bool needs_f32) {
    if (needs_f32) names.insert(name);
    return DeviceParam{};
  });
  return names;
}

}  // namespace deltamoe
