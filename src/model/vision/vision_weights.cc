// bind_vision_weights: the one place where the GPU vision tower's fields meet the tensor names.
#include "model/vision/vision_weights.h"

#include <algorithm>

#include "core/error.h"
#include "model/param_table.h"

namespace deltamoe {

namespace {

bool adapter_trained(const DeviceParam& p) { return p.lora.grad_a != nullptr; }

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

// Every nn.Linear of the tower goes through GpuVisionModel::project; the patch embedding is a Conv3d,
// which PEFT's all-linear leaves out.
bool gpu_vision_applies_lora_adapter(const std::string& module) {
  if (module.rfind("model.visual.", 0) != 0) return false;
  for (const char* name : {".attn.qkv", ".attn.proj", ".mlp.linear_fc1", ".mlp.linear_fc2", ".merger.linear_fc1",
                           ".merger.linear_fc2"})
    if (ends_with(module, name)) return true;
  return false;
}

bool VisionWeights::vit_trained() const {
  bool trained = patch_weight.trained() || patch_bias.trained() || pos_embed.trained();
  for (const VisionBlockWeights& b : blocks) {
    trained = trained || b.qkv_weight.trained() || b.norm1_weight.trained();
    for (const DeviceParam* p : {&b.qkv_weight, &b.proj_weight, &b.fc1_weight, &b.fc2_weight})
      trained = trained || adapter_trained(*p);
  }
  return trained;
}

bool VisionWeights::merger_trained() const {
  return merger_norm_weight.trained() || merger_fc1_weight.trained() || merger_fc2_weight.trained() ||
         adapter_trained(merger_fc1_weight) || adapter_trained(merger_fc2_weight);
}

int64_t VisionWeights::lora_rank() const {
  int64_t rank = std::max(merger_fc1_weight.lora.rank, merger_fc2_weight.lora.rank);
  for (const VisionBlockWeights& b : blocks)
    for (const DeviceParam* p : {&b.qkv_weight, &b.proj_weight, &b.fc1_weight, &b.fc2_weight})
      rank = std::max(rank, p->lora.rank);
  return rank;
}

VisionWeights bind_vision_weights(const VisionConfig& config, const std::string& prefix,
                                  const DeviceParamLookup& lookup, const DeviceLoraLookup& lora) {
  std::set<std::string> bound;
  auto get = [&](const std::string& name, bool needs_f32) {
    bound.insert(name);
    DeviceParam param = lookup(name, needs_f32);
    if (lora && ends_with(name, ".weight")) {
      const std::string module = name.substr(0, name.size() - 7);
      const DeviceLoraViews views = lora(module);
      if (views.attached()) {
        CHECK(gpu_vision_applies_lora_adapter(module), "gpu vision model: a LoRA adapter on '", module, "', which is not a ",
              "Linear of the vision tower (adapters go on the blocks' attn.qkv, attn.proj, mlp.linear_fc1/fc2 and ",
              "the merger's linear_fc1/fc2)");
        CHECK(views.a != nullptr && views.b != nullptr, "gpu vision model: the adapter of '", module, "' lacks A or B");
        param.lora = views;
      }
    }
    return param;
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
