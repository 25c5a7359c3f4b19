// Qwen3.5 image preprocessing (transformers' Qwen2VLImageProcessor): smart_resize, bicubic resize,
// rescale + normalise, duplicate to the temporal patch, and patchify into pixel_values rows.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "data/image_decode.h"
#include "data/image_resize.h"

namespace deltamoe {

struct ImagePreprocessConfig {
  int64_t min_pixels = kDefaultMinPixels;
  int64_t max_pixels = kDefaultMaxPixels;
  int64_t patch_size = 16;          // P
  int64_t temporal_patch_size = 2;  // Tp
  int64_t merge_size = 2;           // m
  std::array<float, 3> image_mean{0.5f, 0.5f, 0.5f};
  std::array<float, 3> image_std{0.5f, 0.5f, 0.5f};

  int64_t patch_dim() const { return 3 * temporal_patch_size * patch_size * patch_size; }
};

// One image's rows of the processor output.
struct ImagePatches {
  std::vector<float> pixel_values;  // [N, 3 * Tp * P * P], N = t * h * w
  std::array<int64_t, 3> grid_thw{};  // (t, h, w) in patches, before merging
  int64_t num_patches() const { return grid_thw[0] * grid_thw[1] * grid_thw[2]; }
};

// Resizes, normalises and patchifies one RGB image. Rows are in merge-block order (block raster,
// then the m x m patches inside a block); each row is channel, then frame, then y, then x.
ImagePatches preprocess_image(const RgbImage& image, const ImagePreprocessConfig& config,
                              const std::string& name = "image");

// Normalises and patchifies an image that already has the target size (multiples of P * m).
ImagePatches patchify_image(const RgbImage& image, const ImagePreprocessConfig& config);

// load_image_file + preprocess_image.
ImagePatches preprocess_image_file(const std::string& path, const ImagePreprocessConfig& config);

// The processor's batch output for several images: rows concatenated in image order.
struct ImageBatch {
  HostTensor pixel_values;    // f32 [sum N_i, 3 * Tp * P * P]
  HostTensor image_grid_thw;  // int64 [I, 3]
};
ImageBatch concat_image_patches(const std::vector<ImagePatches>& images, int64_t patch_dim);

}  // namespace deltamoe
