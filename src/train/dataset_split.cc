// Seeded train/validation split of JSONL datasets (see dataset_split.h).
#include "train/dataset_split.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/rng.h"
#include "data/sample_skip.h"
#include "data/sample_source.h"
#include "data/sft_record.h"

namespace deltamoe {

namespace fs = std::filesystem;

namespace {

// A Philox stream of its own, so the split never shares random numbers with the epoch shuffle.
constexpr uint64_t kSplitStream = 0x5317;

// The line in the self-contained layout: the messages form (whatever layout the line had), image
// parts carrying their absolute path, so the file can live anywhere. Lines the parser rejects are
// returned unchanged.
std::string self_contained_line(const std::string& line, const ImageRoots& roots, const std::string& where) {
  SftRecord record;
  try {
    record = parse_sft_record(line, roots, where);
  } catch (const SampleSkip&) {
    return line;
  }
  // ordered_json throughout: tool arguments and schemas keep their key order, which is rendered.
  nlohmann::ordered_json messages = nlohmann::ordered_json::parse(record.messages_json);
  size_t image_idx = 0;
  for (auto& message : messages) {
    if (!message.is_object() || !message.contains("content") || !message["content"].is_array()) continue;
    for (auto& part : message["content"]) {
      if (part.is_object() && part.value("type", "") == "image" && image_idx < record.images.size()) {
        part["image"] = record.images[image_idx++];
      }
    }
  }
  CHECK(image_idx == record.images.size(), where, ": could not place every image while splitting the dataset");
  nlohmann::ordered_json out;
  out["messages"] = std::move(messages);
  if (!record.tools_json.empty()) out["tools"] = nlohmann::ordered_json::parse(record.tools_json);
  return out.dump();
}

}  // namespace

DatasetSplit split_dataset(const std::vector<std::string>& paths, double ratio, uint64_t seed,
                           const std::string& out_dir, const std::string& media_dir) {
  CHECK(ratio > 0 && ratio < 1, "--split_dataset_ratio must be in (0, 1), got ", ratio);
  const DatasetFiles files(paths, seed);
  const int64_t total = files.size();
  CHECK(total >= 2, "--split_dataset_ratio: the dataset has ", total, " sample(s); at least 2 are needed to split");
  const int64_t num_val = std::clamp<int64_t>(std::llround(static_cast<double>(total) * ratio), 1, total - 1);

  std::vector<int64_t> order(static_cast<size_t>(total));
  for (int64_t i = 0; i < total; ++i) order[i] = i;
  Rng rng(seed, kSplitStream);
  for (int64_t i = total - 1; i > 0; --i) std::swap(order[i], order[rng.below(static_cast<uint64_t>(i + 1))]);
  std::vector<bool> is_val(static_cast<size_t>(total), false);
  for (int64_t i = 0; i < num_val; ++i) is_val[order[i]] = true;

  fs::create_directories(out_dir);
  DatasetSplit split;
  split.train_path = (fs::path(out_dir) / "train.jsonl").string();
  split.val_path = (fs::path(out_dir) / "val.jsonl").string();
  std::ofstream train(split.train_path, std::ios::trunc), val(split.val_path, std::ios::trunc);
  CHECK(train.good() && val.good(), "--split_dataset_ratio: cannot write the split files in ", out_dir);
  for (int64_t i = 0; i < total; ++i) {
    const DatasetFiles::Location location = files.locate(i);
    const std::string& dataset_dir = location.source->directory();  // absolute
    const std::string line =
        self_contained_line(location.source->read(location.index), ImageRoots{dataset_dir, media_dir}, files.where(i));
    (is_val[i] ? val : train) << line << '\n';
    ++(is_val[i] ? split.num_val : split.num_train);
  }
  train.close();
  val.close();
  CHECK(train.good() && val.good(), "--split_dataset_ratio: writing the split files in ", out_dir, " failed");
  return split;
}

}  // namespace deltamoe
