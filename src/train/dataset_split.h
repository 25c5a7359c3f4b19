// --split_dataset_ratio: a seeded split of the training files into a training and a validation
// file, written under the output directory with image references made absolute, so the data
// pipeline reads them like any other dataset (and a resumed run regenerates identical files).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace deltamoe {

struct DatasetSplit {
  std::string train_path;
  std::string val_path;
  int64_t num_train = 0;
  int64_t num_val = 0;
};

// Samples of `paths` (file after file) are shuffled with the seed (Philox Fisher-Yates, the same on
// every platform); the first round(N * ratio) (at least 1) go to validation, the rest to training,
// each in their original order. Lines that do not parse are copied unchanged (the pipeline then
// skips and counts them). ratio must be in (0, 1); throws naming --split_dataset_ratio otherwise
// or when the data has fewer than 2 samples.
// media_dir: --media_dir, the root of relative image paths (see resolve_image_ref).
DatasetSplit split_dataset(const std::vector<std::string>& paths, double ratio, uint64_t seed,
                           const std::string& out_dir, const std::string& media_dir = "");

}  // namespace deltamoe
