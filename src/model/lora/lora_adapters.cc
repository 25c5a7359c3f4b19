// Initial adapter tensors of a LoRA run (see lora_adapters.h).
#include "model/lora/lora_adapters.h"

#include <cstring>

#include "core/error.h"

namespace deltamoe {

std::vector<std::string> LoraAdapters::trained_names() const {
  std::vector<std::string> names;
  for (const LoraTarget& target : targets) {
    names.push_back(target.a_name());
    names.push_back(target.b_name());
  }
  names.insert(names.end(), modules_to_save.begin(), modules_to_save.end());
  return names;
}

LoraAdapters init_lora_adapters(const ModelConfig& config, const LoraOptions& options, uint64_t seed) {
  LoraAdapters adapters;
  adapters.options = options;
  adapters.seed = seed;
  adapters.targets = resolve_lora_targets(config, options);
  adapters.modules_to_save = resolve_modules_to_save(config, options);
  const int64_t rank = options.rank;
  for (size_t i = 0; i < adapters.targets.size(); ++i) {
    const LoraTarget& target = adapters.targets[i];
    std::vector<float> a;
    init_lora_a(target, rank, seed, static_cast<uint64_t>(i), &a);
    HostTensor a_tensor(DType::f32, Shape(target.a_shape(rank)));
    std::memcpy(a_tensor.data(), a.data(), a.size() * sizeof(float));
    HostTensor b_tensor(DType::f32, Shape(target.b_shape(rank)));
    std::memset(b_tensor.data(), 0, b_tensor.numel() * sizeof(float));
    adapters.tensors.emplace(target.a_name(), std::move(a_tensor));
    adapters.tensors.emplace(target.b_name(), std::move(b_tensor));
  }
  return adapters;
}

void attach_lora_adapters(const LoraAdapters& lora, ParamMap* text, VisionParams* vision) {
  const float scaling = static_cast<float>(lora.options.scaling());
  for (size_t index = 0; index < lora.targets.size(); ++index) {
    const LoraTarget& target = lora.targets[index];
    const bool in_vision = target.module.starts_with("model.visual.");
    CHECK(in_vision ? vision != nullptr && vision->count(target.weight_name()) != 0
                    : text->count(target.weight_name()) != 0,
          "LoRA: '", target.weight_name(), "' is not a weight of this model");
    for (const std::string& name : {target.a_name(), target.b_name()}) {
      auto it = lora.tensors.find(name);
      CHECK(it != lora.tensors.end(), "LoRA: no values for '", name, "'");
      const HostTensor values = it->second.to_f32();
      if (in_vision) {
        (*vision)[name] = values;
      } else {
        (*text)[name] = {values.shape().to_vector(),
                         std::vector<float>(values.as<float>(), values.as<float>() + values.numel())};
      }
    }
    if (in_vision) {
      HostTensor value(DType::f32, Shape{1});
      *value.as<float>() = scaling;
      (*vision)[target.scaling_name()] = std::move(value);
    } else {
      (*text)[target.scaling_name()] = {{1}, {scaling}};
    }
    // The adapter's index keys its dropout mask (model/lora/lora_dropout.h); none without dropout,
    // so that p = 0 leaves the maps (and every path) as they are.
    if (lora.options.dropout > 0 && !target.experts) {
      CHECK(index < (1u << 24), "LoRA: more than 2^24 adapters");
      if (in_vision) {
        HostTensor value(DType::f32, Shape{1});
        *value.as<float>() = static_cast<float>(index);
        (*vision)[target.index_name()] = std::move(value);
      } else {
        (*text)[target.index_name()] = {{1}, {static_cast<float>(index)}};
      }
    }
  }
}

}  // namespace deltamoe
