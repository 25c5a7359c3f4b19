// The one image configuration `train` and `data` share: the vision tower's patch geometry (from
// config.json, passed in) plus preprocessor_config.json (pixel limits, mean, std) and the
// command-line pixel overrides, validated before any sample is read.
#pragma once

#include <cstdint>
#include <string>

#include "data/image_preprocess.h"
#include "tokenizer/tokenizer.h"

namespace deltamoe {

// What config.json fixes about images (the data layer does not read model configs itself).
struct VisionGeometry {
  int64_t patch_size = 16;
  int64_t temporal_patch_size = 2;
  int64_t merge_size = 2;
  int64_t image_token_id = -1;  // config.json's image_token_id (-1: no config.json, nothing to check)
};

// Command-line overrides (0: keep the file's value).
struct PixelOverrides {
  int64_t min_pixels = 0;
  int64_t max_pixels = 0;
};

// Reads model_dir/preprocessor_config.json when it exists (size.shortest_edge / longest_edge or
// min_pixels / max_pixels, image_mean, image_std; patch, temporal patch and merge sizes must agree
// with `vision`), applies `overrides`, and validates the result (see validate_image_config).
// Also checks that vision.image_token_id is the tokenizer's <|image_pad|>. Throws naming the file
// or flag.
ImagePreprocessConfig load_image_processor_config(const std::string& model_dir, const VisionGeometry& vision,
                                                  const Tokenizer& tokenizer, const PixelOverrides& overrides = {});

// 0 < min_pixels <= max_pixels, max_pixels holds at least one merged patch, positive sizes,
// finite means and finite positive stds. `where` names the source in messages.
void validate_image_config(const ImagePreprocessConfig& config, const std::string& where);

}  // namespace deltamoe
