// Qwen2-VL's smart_resize (the target size: multiples of patch * merge within a pixel budget) and
// a bicubic resize that follows PIL's Image.resize(BICUBIC) on 8-bit RGB.
#pragma once

#include <cstdint>
#include <string>

#include "data/image_decode.h"

namespace deltamoe {

struct ImageSize {
  int64_t height = 0;
  int64_t width = 0;
  bool operator==(const ImageSize&) const = default;
};

// Qwen3.5 defaults (preprocessor_config.json: size.shortest_edge / size.longest_edge).
constexpr int64_t kDefaultMinPixels = 65536;
constexpr int64_t kDefaultMaxPixels = 16777216;
constexpr int64_t kImageSizeFactor = 32;  // patch 16 * spatial merge 2

// transformers' smart_resize: round each side to a multiple of `factor` (Python round, ties to
// even), then scale both sides to fit [min_pixels, max_pixels] keeping the aspect ratio.
// Throws naming `name` when the aspect ratio exceeds 200 or the limits are inconsistent.
ImageSize smart_resize(int64_t height, int64_t width, int64_t min_pixels = kDefaultMinPixels,
                       int64_t max_pixels = kDefaultMaxPixels, int64_t factor = kImageSizeFactor,
                       const std::string& name = "image");

// Separable bicubic (a = -0.5, support widened by the scale when shrinking), horizontal pass first,
// 22-bit fixed-point weights and rounding to uint8 after each pass, as PIL does.
RgbImage resize_bicubic(const RgbImage& image, int64_t height, int64_t width);

}  // namespace deltamoe
