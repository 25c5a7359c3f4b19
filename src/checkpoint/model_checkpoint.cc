// Loading and saving model directories: key matching against the parameter table, both expert
// layouts (fused <-> per-expert by listing byte ranges, no copies), passthrough of mtp.* tensors.
#include "checkpoint/model_checkpoint.h"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>

#include "checkpoint/finite_check.h"
#include "checkpoint/sharded.h"
#include "core/error.h"
#include "core/log.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

bool is_floating(DType dtype) {
  return dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16 || dtype == DType::f64;
}

bool is_fused_expert_spec(const ModelConfig& config, const ParamSpec& spec) {
  return spec.component == Component::routed_experts && (spec.name == fused_gate_up_name(config, spec.layer_idx) ||
                                                         spec.name == fused_down_name(config, spec.layer_idx));
}

// Per-expert tensor names of the main model (mtp.* has its own experts and is passed through).
bool is_per_expert_key(const std::string& name) {
  static const std::regex kPerExpert(R"(.*\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight)");
  return !is_passthrough_tensor(name) && std::regex_match(name, kPerExpert);
}
bool is_fused_key(const std::string& name) {
  static const std::regex kFused(R"(.*\.mlp\.experts\.(gate_up_proj|down_proj))");
  return !is_passthrough_tensor(name) && std::regex_match(name, kFused);
}

// The per-expert pieces that make up one fused tensor, in fused byte order.
struct ExpertPiece {
  std::string name;
  Shape shape;
};
std::vector<ExpertPiece> pieces_of(const ModelConfig& config, const ParamSpec& spec) {
  const TextConfig& t = config.text;
  const int64_t H = t.hidden_size, I = t.moe_intermediate_size;
  std::vector<ExpertPiece> pieces;
  const bool gate_up = spec.name == fused_gate_up_name(config, spec.layer_idx);
  for (int64_t e = 0; e < t.num_experts; ++e) {
    if (gate_up) {
      // gate_up_proj[e] = concat(gate_proj_e, up_proj_e) along rows.
      pieces.push_back({per_expert_name(config, spec.layer_idx, e, "gate_proj"), Shape{I, H}});
      pieces.push_back({per_expert_name(config, spec.layer_idx, e, "up_proj"), Shape{I, H}});
    } else {
      pieces.push_back({per_expert_name(config, spec.layer_idx, e, "down_proj"), Shape{H, I}});
    }
  }
  return pieces;
}

constexpr const char* kLanguageModelPrefix = "model.language_model.";
constexpr const char* kVisualPrefix = "model.visual.";

bool starts_with(const std::string& text, const char* prefix) { return text.rfind(prefix, 0) == 0; }

// True when the text tower's keys sit under model.language_model.* (a VLM-style file) and not under model.*.
bool uses_language_model_prefix(const WeightsDir& weights) {
  bool vlm_style = false, text_style = false;
  for (const auto& [name, tensor] : weights.tensors) {
    vlm_style |= starts_with(name, kLanguageModelPrefix);
    text_style |=
        starts_with(name, "model.") && !starts_with(name, kLanguageModelPrefix) && !starts_with(name, kVisualPrefix);
  }
  return vlm_style && !text_style;
}

// model.language_model.X -> model.X, as transformers' text-only class does on load.
void rename_language_model_keys(WeightsDir* weights) {
  std::map<std::string, StoredTensor> tensors;
  std::map<std::string, std::string> file_of;
  for (const auto& [name, tensor] : weights->tensors) {
    std::string renamed =
        starts_with(name, kLanguageModelPrefix) ? "model." + name.substr(std::strlen(kLanguageModelPrefix)) : name;
    tensors[renamed] = tensor;
    file_of[renamed] = weights->file_of.at(name);
  }
  weights->tensors = std::move(tensors);
  weights->file_of = std::move(file_of);
}

// The on-disk name of a parameter (undoes rename_language_model_keys when the checkpoint had it).
std::string disk_name(const ModelCheckpoint& checkpoint, const std::string& name) {
  if (checkpoint.text_keys_under_language_model && starts_with(name, "model.")) {
    return kLanguageModelPrefix + name.substr(std::strlen("model."));
  }
  return name;
}

void append_limited(std::string* out, const std::string& title, const std::vector<std::string>& names) {
  if (names.empty()) return;
  constexpr size_t kMaxListed = 40;
  *out += str_cat("  ", title, " (", names.size(), "):\n");
  for (size_t i = 0; i < names.size() && i < kMaxListed; ++i) *out += "    " + names[i] + "\n";
  if (names.size() > kMaxListed) *out += str_cat("    ... and ", names.size() - kMaxListed, " more\n");
}

}  // namespace

void check_weights_finite(const ModelCheckpoint& checkpoint, const std::string& dir) {
  std::vector<std::pair<std::string, const StoredTensor*>> tensors;
  uint64_t total_bytes = 0;
  for (const auto* group : {&checkpoint.params, &checkpoint.passthrough}) {
    for (const auto& [name, tensor] : *group) {
      tensors.emplace_back(name, &tensor);
      total_bytes += tensor.nbytes();
    }
  }
  // Large models take a while at disk speed: say so every few seconds.
  constexpr uint64_t kQuietBytes = uint64_t{4} << 30;
  const auto start = std::chrono::steady_clock::now();
  auto last_report = start;
  uint64_t done_bytes = 0;
  for (const auto& [name, tensor] : tensors) {
    const int64_t bad = first_non_finite_element(*tensor);
    CHECK(bad < 0, dir, ": tensor '", disk_name(checkpoint, name), "' ", tensor->shape().str(), " holds NaN or Inf (first at ",
          "element ", bad, "); the checkpoint is damaged or was saved from a diverged run, and training from it ",
          "would skip every step");
    done_bytes += tensor->nbytes();
    const auto now = std::chrono::steady_clock::now();
    if (total_bytes > kQuietBytes && now - last_report > std::chrono::seconds(5)) {
      last_report = now;
      log_info("checking weights for NaN/Inf: ", done_bytes >> 20, " of ", total_bytes >> 20, " MiB (",
               std::chrono::duration<double>(now - start).count(), " s)");
    }
  }
}

const char* expert_layout_name(ExpertLayout layout) { return layout == ExpertLayout::fused ? "fused" : "per_expert"; }

ExpertLayout parse_expert_layout(const std::string& text, const std::string& where) {
  if (text == "fused") return ExpertLayout::fused;
  if (text == "per_expert") return ExpertLayout::per_expert;
  RAISE(where, ": expert layout '", text, "' is not one of fused, per_expert");
}

bool is_passthrough_tensor(const std::string& name) { return name.rfind("mtp.", 0) == 0; }

std::string CheckpointReport::describe(const std::string& dir) const {
  if (ok()) return "";
  std::string out = str_cat(dir, ": the checkpoint does not match its config.json:\n");
  append_limited(&out, "missing tensors", missing);
  append_limited(&out, "unexpected tensors", unexpected);
  append_limited(&out, "tensors with the wrong shape", wrong_shape);
  append_limited(&out, "tensors with the wrong dtype", wrong_dtype);
  return out;
}

ModelCheckpoint load_model_dir(const std::string& dir) {
  CheckpointReport report;
  ModelCheckpoint checkpoint = load_model_dir(dir, &report);
  CHECK(report.ok(), report.describe(dir));
  check_weights_finite(checkpoint, dir);
  return checkpoint;
}

ModelCheckpoint load_model_dir(const std::string& dir, CheckpointReport* report) {
  CHECK(report != nullptr, "load_model_dir: report must not be null");
  ModelCheckpoint checkpoint;
  checkpoint.config = load_model_config_file((fs::path(dir) / "config.json").string());
  WeightsDir weights = open_weights_dir(dir);
  const ModelConfig& config = checkpoint.config;
  if (!config.has_vision && uses_language_model_prefix(weights)) {
    checkpoint.text_keys_under_language_model = true;
    rename_language_model_keys(&weights);
  }
  auto is_carried = [&](const std::string& name) {
    return is_passthrough_tensor(name) ||
           (checkpoint.text_keys_under_language_model && name.rfind(kVisualPrefix, 0) == 0);
  };

  bool any_per_expert = false, any_fused = false;
  for (const auto& [name, tensor] : weights.tensors) {
    any_per_expert |= is_per_expert_key(name);
    any_fused |= is_fused_key(name);
  }
  CHECK(!(any_per_expert && any_fused), dir,
        ": routed experts are stored both fused (mlp.experts.gate_up_proj) and per expert (mlp.experts.{e}.*); "
        "a checkpoint must use one layout");
  checkpoint.expert_layout = any_per_expert ? ExpertLayout::per_expert : ExpertLayout::fused;

  std::set<std::string> consumed;
  auto check_tensor = [&](const std::string& name, const Shape& shape, const StoredTensor& tensor) {
    if (tensor.shape() != shape) {
      report->wrong_shape.push_back(str_cat(disk_name(checkpoint, name), ": has ", tensor.shape().str(), ", expected ",
                                            shape.str(), " (in ", weights.file_of.at(name), ")"));
      return false;
    }
    if (!is_floating(tensor.dtype())) {
      report->wrong_dtype.push_back(str_cat(disk_name(checkpoint, name), ": has ",
                                            dtype_safetensors_name(tensor.dtype()), ", expected a floating dtype (in ",
                                            weights.file_of.at(name), ")"));
      return false;
    }
    return true;
  };

  for (const ParamSpec& spec : build_param_table(config)) {
    if (checkpoint.expert_layout == ExpertLayout::per_expert && is_fused_expert_spec(config, spec)) {
      std::vector<StoredTensor> parts;
      bool complete = true;
      for (const ExpertPiece& piece : pieces_of(config, spec)) {
        auto found = weights.tensors.find(piece.name);
        if (found == weights.tensors.end()) {
          report->missing.push_back(disk_name(checkpoint, piece.name));
          complete = false;
          continue;
        }
        consumed.insert(piece.name);
        if (!check_tensor(piece.name, piece.shape, found->second)) {
          complete = false;
          continue;
        }
        if (!parts.empty() && found->second.dtype() != parts.front().dtype()) {
          report->wrong_dtype.push_back(str_cat(piece.name, ": has ", dtype_safetensors_name(found->second.dtype()),
                                                " but the other experts of this layer have ",
                                                dtype_safetensors_name(parts.front().dtype())));
          complete = false;
          continue;
        }
        parts.push_back(found->second);
      }
      if (complete) checkpoint.params[spec.name] = StoredTensor::concat(parts.front().dtype(), spec.shape, parts);
      continue;
    }
    auto found = weights.tensors.find(spec.name);
    if (found == weights.tensors.end()) {
      report->missing.push_back(disk_name(checkpoint, spec.name));
      continue;
    }
    consumed.insert(spec.name);
    if (check_tensor(spec.name, spec.shape, found->second)) checkpoint.params[spec.name] = found->second;
  }

  for (const auto& [name, tensor] : weights.tensors) {
    if (consumed.count(name)) continue;
    if (is_carried(name)) {
      checkpoint.passthrough[name] = tensor;
    } else {
      report->unexpected.push_back(disk_name(checkpoint, name) + " (in " + weights.file_of.at(name) + ")");
    }
  }
  return checkpoint;
}

ModelDirContents model_dir_contents(const ModelCheckpoint& checkpoint, const SaveOptions& options,
                                    const std::string& dir) {
  const ModelConfig& config = checkpoint.config;
  const ExpertLayout layout = options.expert_layout.value_or(checkpoint.expert_layout);
  ModelDirContents contents;
  auto add = [&](const std::string& name, const StoredTensor& tensor, const std::string& param, uint64_t offset) {
    contents.tensors.push_back({name, tensor});
    contents.sources.push_back({param, offset});
  };
  std::set<std::string> written;
  for (const ParamSpec& spec : build_param_table(config)) {
    auto found = checkpoint.params.find(spec.name);
    CHECK(found != checkpoint.params.end(), "saving to ", dir, ": the checkpoint lacks parameter '", spec.name, "'");
    const StoredTensor& tensor = found->second;
    CHECK(tensor.shape() == spec.shape, "saving to ", dir, ": parameter '", spec.name, "' has shape ",
          tensor.shape().str(), ", the config says ", spec.shape.str());
    written.insert(spec.name);
    if (layout == ExpertLayout::per_expert && is_fused_expert_spec(config, spec)) {
      // Split the fused tensor back into the per-expert tensors it is the concatenation of.
      size_t offset = 0;
      for (const ExpertPiece& piece : pieces_of(config, spec)) {
        StoredTensor part = tensor.slice_bytes(offset, piece.shape);
        add(disk_name(checkpoint, piece.name), part, spec.name, offset);
        offset += part.nbytes();
      }
      continue;
    }
    add(disk_name(checkpoint, spec.name), tensor, spec.name, 0);
  }
  for (const auto& [name, tensor] : checkpoint.params) {
    CHECK(written.count(name), "saving to ", dir, ": parameter '", name, "' is not part of a ", config.model_type,
          " model with this config");
  }
  for (const auto& [name, tensor] : checkpoint.passthrough) add(name, tensor, "", 0);
  contents.config_text = config.original_json.empty() ? model_config_to_json(config) : config.original_json;
  return contents;
}

void write_model_config(const ModelDirContents& contents, const std::string& dir) {
  const fs::path path = fs::path(dir) / "config.json";
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  CHECK(out.good(), "cannot create ", path.string(), ": ", std::strerror(errno));
  out << contents.config_text;
  CHECK(out.good(), "writing ", path.string(), " failed (disk full?)");
}

void save_model_dir(const ModelCheckpoint& checkpoint, const std::string& dir, const SaveOptions& options) {
  const ModelDirContents contents = model_dir_contents(checkpoint, options, dir);
  fs::create_directories(dir);
  write_model_config(contents, dir);
  write_weights_dir(dir, contents.tensors, options.max_shard_bytes);
}

void copy_side_files(const std::string& src_dir, const std::string& dst_dir) {
  static const std::regex kWeights(R"(.*\.safetensors(\.index\.json)?|.*\.tmp|config\.json)");
  fs::create_directories(dst_dir);
  if (fs::equivalent(src_dir, dst_dir)) return;
  for (const fs::directory_entry& entry : fs::directory_iterator(src_dir)) {
    if (!entry.is_regular_file()) continue;
    const std::string name = entry.path().filename().string();
    if (std::regex_match(name, kWeights)) continue;
    fs::copy_file(entry.path(), fs::path(dst_dir) / name, fs::copy_options::overwrite_existing);
  }
}

}  // namespace deltamoe
