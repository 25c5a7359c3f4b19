// A directory of safetensors weights: one model.safetensors, or shards
// model-0000i-of-0000n.safetensors listed by model.safetensors.index.json {metadata: {total_size},
// weight_map: {tensor: file}}. Reading maps every file; writing splits by a byte budget.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"

namespace deltamoe {

constexpr const char* kSingleWeightsFile = "model.safetensors";
constexpr const char* kWeightsIndexFile = "model.safetensors.index.json";

// All tensors of a weights directory, by name, each backed by its mmapped file.
struct WeightsDir {
  std::string dir;
  bool sharded = false;
  std::vector<std::shared_ptr<SafetensorsFile>> files;
  std::map<std::string, StoredTensor> tensors;
  std::map<std::string, std::string> file_of;  // tensor name -> file name (inside dir)
};

// Opens model.safetensors.index.json (and every shard it names) or model.safetensors.
// Checks that the index names existing files, that each tensor is in the file the index says,
// and that no tensor appears twice; errors name the file and tensor.
WeightsDir open_weights_dir(const std::string& dir);

// How write_weights_dir splits tensors over files: each file's name and the tensors (indices into
// the list, in order) it holds, and the index's text ("" for one model.safetensors).
struct WeightsDirPlan {
  struct File {
    std::string name;
    std::vector<size_t> tensors;
  };
  std::vector<File> files;
  std::string index_text;
  // The tensors of file `file`, in order.
  std::vector<NamedTensor> tensors_of(size_t file, const std::vector<NamedTensor>& tensors) const;
};
WeightsDirPlan plan_weights_dir(const std::vector<NamedTensor>& tensors, uint64_t max_shard_bytes);
// Writes the plan's model.safetensors.index.json into dir (nothing for a single file).
void write_weights_index(const std::string& dir, const WeightsDirPlan& plan);

// Writes tensors (in order) to dir: one model.safetensors if they fit in max_shard_bytes (or
// max_shard_bytes == 0), else shards of at most max_shard_bytes (a larger tensor gets a shard of
// its own) plus the index. Removes stale weight files of an earlier save in dir first.
// Returns the file names written.
std::vector<std::string> write_weights_dir(const std::string& dir, const std::vector<NamedTensor>& tensors,
                                           uint64_t max_shard_bytes);

}  // namespace deltamoe
