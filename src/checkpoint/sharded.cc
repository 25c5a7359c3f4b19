// Weights directories: model.safetensors or shards with model.safetensors.index.json, both ways.
#include "checkpoint/sharded.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "core/error.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string read_text_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  CHECK(in.good(), "cannot open ", path.string(), ": ", std::strerror(errno));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void write_text_file(const fs::path& path, const std::string& text) {
  const std::string tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    CHECK(out.good(), "cannot create ", tmp, ": ", std::strerror(errno));
    out << text;
    out.flush();
    CHECK(out.good(), "writing ", tmp, " failed (disk full?)");
  }
  fs::rename(tmp, path);
}

// Reads weight_map from the index; every value must be a file name (no directories).
std::map<std::string, std::string> read_index(const fs::path& index_path) {
  const std::string where = index_path.string();
  json index;
  try {
    index = json::parse(read_text_file(index_path));
  } catch (const json::exception& error) {  // parse_error, and out_of_range for a number that overflows
    RAISE(where, ": not valid JSON (", error.what(), ")");
  }
  CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(), where,
        ": must be an object with a 'weight_map' object {tensor name: shard file}");
  std::map<std::string, std::string> weight_map;
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
    CHECK(it.value().is_string(), where, ": weight_map['", it.key(), "'] must be a file name, got ", it.value().dump());
    std::string file = it.value().get<std::string>();
    CHECK(!file.empty() && file.find('/') == std::string::npos && file != "." && file != "..", where, ": weight_map['",
          it.key(), "'] = '", file, "' must be a plain file name inside the checkpoint directory");
    weight_map[it.key()] = file;
  }
  return weight_map;
}

std::string shard_name(size_t index, size_t count) {
  char name[64];
  std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return name;
}

// Removes the weight files an earlier save may have left (other shard counts would be stale).
void remove_old_weights(const fs::path& dir) {
  static const std::regex kShard(R"(model-\d{5}-of-\d{5}\.safetensors)");
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    std::string name = entry.path().filename().string();
    if (name == kSingleWeightsFile || name == kWeightsIndexFile || std::regex_match(name, kShard)) {
      fs::remove(entry.path());
    }
  }
}

}  // namespace

WeightsDir open_weights_dir(const std::string& dir) {
  WeightsDir weights;
  weights.dir = dir;
  const fs::path index_path = fs::path(dir) / kWeightsIndexFile;
  const fs::path single_path = fs::path(dir) / kSingleWeightsFile;
  if (fs::exists(index_path)) {
    weights.sharded = true;
    std::map<std::string, std::string> weight_map = read_index(index_path);
    std::map<std::string, std::shared_ptr<SafetensorsFile>> files;
    for (const auto& [name, file_name] : weight_map) {
      if (files.count(file_name)) continue;
      const fs::path shard = fs::path(dir) / file_name;
      CHECK(fs::exists(shard), index_path.string(), ": tensor '", name, "' is listed in ", file_name,
            ", which does not exist");
      files[file_name] = SafetensorsFile::open(shard.string());
    }
    for (const auto& [file_name, file] : files) {
      weights.files.push_back(file);
      for (const SafetensorsEntry& entry : file->entries()) {
        auto listed = weight_map.find(entry.name);
        CHECK(listed != weight_map.end(), file->path(), ": tensor '", entry.name, "' is not listed in ",
              kWeightsIndexFile, " (stale or foreign shard?)");
        CHECK(listed->second == file_name, file->path(), ": tensor '", entry.name, "' is listed in ", kWeightsIndexFile,
              " under ", listed->second, " but found in ", file_name);
      }
    }
    for (const auto& [name, file_name] : weight_map) {
      const std::shared_ptr<SafetensorsFile>& file = files.at(file_name);
      CHECK(file->contains(name), index_path.string(), ": tensor '", name, "' is listed in ", file_name,
            " but that file does not contain it");
      weights.tensors[name] = file->tensor(name);
      weights.file_of[name] = file_name;
    }
  } else if (fs::exists(single_path)) {
    std::shared_ptr<SafetensorsFile> file = SafetensorsFile::open(single_path.string());
    weights.files.push_back(file);
    for (const SafetensorsEntry& entry : file->entries()) {
      weights.tensors[entry.name] = file->tensor(entry.name);
      weights.file_of[entry.name] = kSingleWeightsFile;
    }
  } else {
    RAISE(dir, ": no weights found (expected ", kSingleWeightsFile, " or ", kWeightsIndexFile, ")");
  }
  return weights;
}

WeightsDirPlan plan_weights_dir(const std::vector<NamedTensor>& tensors, uint64_t max_shard_bytes) {
  // Greedy split in the given order; a tensor larger than the budget gets a shard of its own.
  std::vector<std::vector<size_t>> shards(1);
  uint64_t shard_bytes = 0, total_bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    uint64_t nbytes = tensors[i].tensor.nbytes();
    if (max_shard_bytes > 0 && !shards.back().empty() && shard_bytes + nbytes > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += nbytes;
    total_bytes += nbytes;
  }
  WeightsDirPlan plan;
  if (shards.size() == 1) {
    plan.files.push_back({kSingleWeightsFile, shards[0]});
    return plan;
  }
  json weight_map = json::object();  // sorted by name, as transformers writes it
  uint64_t num_params = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string name = shard_name(i, shards.size());
    for (const size_t t : shards[i]) {
      weight_map[tensors[t].name] = name;
      num_params += static_cast<uint64_t>(tensors[t].tensor.numel());
    }
    plan.files.push_back({name, shards[i]});
  }
  nlohmann::ordered_json index;
  index["metadata"] = {{"total_size", total_bytes}, {"total_parameters", num_params}};
  index["weight_map"] = weight_map;
  plan.index_text = index.dump(2) + "\n";
  return plan;
}

std::vector<NamedTensor> WeightsDirPlan::tensors_of(size_t file, const std::vector<NamedTensor>& tensors) const {
  std::vector<NamedTensor> out;
  for (const size_t t : files[file].tensors) out.push_back(tensors[t]);
  return out;
}

void write_weights_index(const std::string& dir, const WeightsDirPlan& plan) {
  if (!plan.index_text.empty()) write_text_file(fs::path(dir) / kWeightsIndexFile, plan.index_text);
}

std::vector<std::string> write_weights_dir(const std::string& dir, const std::vector<NamedTensor>& tensors,
                                           uint64_t max_shard_bytes) {
  fs::create_directories(dir);
  remove_old_weights(dir);
  const WeightsDirPlan plan = plan_weights_dir(tensors, max_shard_bytes);
  std::vector<std::string> written;
  for (size_t i = 0; i < plan.files.size(); ++i) {
    write_safetensors((fs::path(dir) / plan.files[i].name).string(), plan.tensors_of(i, tensors));
    written.push_back(plan.files[i].name);
  }
  if (!plan.index_text.empty()) {
    write_weights_index(dir, plan);
    written.push_back(kWeightsIndexFile);
  }
  return written;
}

}  // namespace deltamoe
