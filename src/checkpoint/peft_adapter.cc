// PEFT adapter directories and merging (see peft_adapter.h).
#include "checkpoint/peft_adapter.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.h"
#include "core/error.h"

namespace deltamoe {

namespace fs = std::filesystem;

namespace {

// Every tensor of the adapter file by PEFT key -> the name in the CPU model's maps.
std::map<std::string, std::string> peft_keys(const LoraAdapters& adapters) {
  std::map<std::string, std::string> keys;
  for (const LoraTarget& target : adapters.targets) {
    keys[peft_adapter_key(target, adapters.targets, "lora_A")] = target.a_name();
    keys[peft_adapter_key(target, adapters.targets, "lora_B")] = target.b_name();
  }
  for (const std::string& name : adapters.modules_to_save) keys[peft_model_key(name)] = name;
  return keys;
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  CHECK(in.good(), path.string(), " is missing (not a PEFT adapter directory?)");
  std::stringstream text;
  text << in.rdbuf();
  try {
    return nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::exception& error) {
    RAISE(path.string(), ": not valid JSON: ", error.what());
  }
}

std::vector<std::string> string_list(const nlohmann::json& value, const std::string& where) {
  if (value.is_null()) return {};
  if (value.is_string()) return {value.get<std::string>()};
  CHECK(value.is_array(), where, " must be a list of names or a string");
  std::vector<std::string> names;
  for (const auto& entry : value) {
    CHECK(entry.is_string(), where, " must hold names");
    names.push_back(entry.get<std::string>());
  }
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

void save_peft_adapter(const std::string& dir, const LoraAdapters& adapters, const std::string& base_model) {
  std::vector<NamedTensor> tensors;
  for (const auto& [key, name] : peft_keys(adapters)) {
    auto it = adapters.tensors.find(name);
    CHECK(it != adapters.tensors.end(), "save adapter: no values for '", name, "'");
    tensors.push_back({key, StoredTensor::from_host(it->second.to_f32())});
  }
  write_safetensors((fs::path(dir) / kPeftAdapterWeights).string(), tensors);
  // target_modules lists the adapted modules by full name (what PEFT's all-linear resolves to);
  // PEFT matches a full name exactly.
  nlohmann::ordered_json config;
  std::vector<std::string> modules, parameters;
  for (const LoraTarget& target : adapters.targets) (target.experts ? parameters : modules).push_back(target.module);
  const LoraOptions& o = adapters.options;
  config["peft_type"] = "LORA";
  config["task_type"] = "CAUSAL_LM";
  config["base_model_name_or_path"] = base_model;
  config["r"] = o.rank;
  config["lora_alpha"] = o.alpha;
  config["lora_dropout"] = o.dropout;
  config["use_rslora"] = o.use_rslora;
  config["target_modules"] = modules;
  config["target_parameters"] = parameters.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(parameters);
  config["modules_to_save"] = o.modules_to_save.empty() ? nlohmann::ordered_json(nullptr)
                                                         : nlohmann::ordered_json(o.modules_to_save);
  config["bias"] = "none";
  config["fan_in_fan_out"] = false;
  config["init_lora_weights"] = true;
  config["use_dora"] = false;
  config["inference_mode"] = true;
  config["rank_pattern"] = nlohmann::ordered_json::object();
  config["alpha_pattern"] = nlohmann::ordered_json::object();
  const fs::path path = fs::path(dir) / kPeftAdapterConfig;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  CHECK(out.good(), "cannot create ", path.string(), ": ", std::strerror(errno));
  out << config.dump(2) << "\n";
  CHECK(out.good(), "writing ", path.string(), " failed (disk full?)");
}

std::string peft_adapter_base_model(const std::string& dir) {
  const nlohmann::json config = read_json(fs::path(dir) / kPeftAdapterConfig);
  const auto it = config.find("base_model_name_or_path");
  return it != config.end() && it->is_string() ? it->get<std::string>() : "";
}

LoraAdapters load_peft_adapter(const std::string& dir, const ModelConfig& model_config) {
  const fs::path config_path = fs::path(dir) / kPeftAdapterConfig;
  const nlohmann::json config = read_json(config_path);
  const std::string where = config_path.string();
  CHECK(config.value("peft_type", "LORA") == "LORA", where, ": peft_type ", config.value("peft_type", ""),
        " is not supported (LORA only)");
  CHECK(!config.value("use_dora", false), where, ": DoRA adapters are not supported");
  CHECK(config.value("bias", "none") == "none", where, ": bias ", config.value("bias", ""), " is not supported");
  CHECK(!config.value("fan_in_fan_out", false), where, ": fan_in_fan_out adapters are not supported");
  for (const char* pattern : {"rank_pattern", "alpha_pattern"}) {
    const auto it = config.find(pattern);
    CHECK(it == config.end() || it->is_null() || it->empty(), where, ": ", pattern,
          " (per-module ranks or alphas) is not supported");
  }
  LoraAdapters adapters;
  LoraOptions& o = adapters.options;
  try {
    o.rank = config.at("r").get<int64_t>();
    o.alpha = config.at("lora_alpha").get<double>();
    o.use_rslora = config.value("use_rslora", false);
    o.target_modules = string_list(config.value("target_modules", nlohmann::json()), where + " target_modules");
    o.target_parameters =
        string_list(config.value("target_parameters", nlohmann::json()), where + " target_parameters");
    o.modules_to_save = string_list(config.value("modules_to_save", nlohmann::json()), where + " modules_to_save");
  } catch (const nlohmann::json::exception& error) {
    RAISE(where, ": malformed LoRA config: ", error.what());
  }
  o.dropout = 0;  // training-time only: a saved adapter applies without it
  try {
    adapters.targets = resolve_lora_targets(model_config, o);
    adapters.modules_to_save = resolve_modules_to_save(model_config, o);
  } catch (const Error& error) {
    RAISE(where, " does not fit the base model: ", error.what());
  }
  const std::string weights_path = (fs::path(dir) / kPeftAdapterWeights).string();
  CHECK(fs::is_regular_file(weights_path), weights_path, " is missing");
  const auto file = SafetensorsFile::open(weights_path);
  const std::map<std::string, std::string> keys = peft_keys(adapters);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const LoraTarget& target : adapters.targets) {
    shapes[target.a_name()] = target.a_shape(o.rank);
    shapes[target.b_name()] = target.b_shape(o.rank);
  }
  for (const SafetensorsEntry& entry : file->entries()) {
    CHECK(keys.count(entry.name), weights_path, ": tensor '", entry.name, "' belongs to no target of ", where);
  }
  for (const auto& [key, name] : keys) {
    CHECK(file->contains(key), weights_path, ": tensor '", key, "' is missing");
    HostTensor values = file->tensor(key).to_host().to_f32();
    if (auto shape = shapes.find(name); shape != shapes.end()) {
      CHECK(values.shape().to_vector() == shape->second, weights_path, ": '", key, "' has shape ", values.shape().str(),
            ", expected ", Shape(shape->second).str());
    }
    adapters.tensors.emplace(name, std::move(values));
  }
  return adapters;
}

ModelCheckpoint merge_lora(const ModelCheckpoint& base, const LoraAdapters& adapters) {
  ModelCheckpoint merged = base;
  const int64_t rank = adapters.options.rank;
  for (const LoraTarget& target : adapters.targets) {
    auto it = merged.params.find(target.weight_name());
    CHECK(it != merged.params.end(), "merge: the base model has no weight '", target.weight_name(), "'");
    const DType dtype = it->second.dtype();
    HostTensor weight = it->second.to_host().to_f32();
    HostTensor delta(DType::f32, weight.shape());
    lora_delta(target, rank, adapters.tensors.at(target.a_name()).as<float>(),
               adapters.tensors.at(target.b_name()).as<float>(), adapters.options.scaling(), delta.as<float>());
    for (int64_t i = 0; i < weight.numel(); ++i) weight.as<float>()[i] += delta.as<float>()[i];
    it->second = StoredTensor::from_host(dtype == DType::f32 ? weight : weight.to_dtype(dtype));
  }
  for (const std::string& name : adapters.modules_to_save) {
    auto it = merged.params.find(name);
    CHECK(it != merged.params.end(), "merge: the base model has no tensor '", name, "'");
    const DType dtype = it->second.dtype();
    const HostTensor& value = adapters.tensors.at(name);
    it->second = StoredTensor::from_host(dtype == DType::f32 ? value.to_f32() : value.to_f32().to_dtype(dtype));
  }
  return merged;
}

}  // namespace deltamoe
