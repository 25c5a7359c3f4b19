// One training sample, ready to pack: token ids with their labels and 3-D positions, and the
// preprocessed images whose features replace the sample's <|image_pad|> tokens.
#pragma once

#include <cstdint>
#include <vector>

#include "data/image_preprocess.h"

namespace deltamoe {

constexpr int32_t kIgnoreLabel = -100;

struct SftSample {
  int64_t sample_index = -1;        // index in the dataset files (file after file)
  std::vector<int32_t> input_ids;   // [T]
  std::vector<int32_t> labels;      // [T], unshifted (label i belongs to token i), kIgnoreLabel if not trained
  std::vector<int64_t> positions;   // [3, T]: rows t, h, w
  std::vector<ImagePatches> images; // in the order of their token runs
  int64_t num_image_tokens = 0;
  int64_t num_supervised = 0;
  bool truncated = false;

  int64_t num_tokens() const { return static_cast<int64_t>(input_ids.size()); }
};

}  // namespace deltamoe
