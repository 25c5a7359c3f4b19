// Normalisation and patch layout of the Qwen2-VL image processor (see image_preprocess.h).
#include "data/image_preprocess.h"

#include <algorithm>

#include "core/error.h"

namespace deltamoe {

ImagePatches patchify_image(const RgbImage& image, const ImagePreprocessConfig& config) {
  const int64_t p = config.patch_size, m = config.merge_size, tp = config.temporal_patch_size;
  CHECK(image.height % (p * m) == 0 && image.width % (p * m) == 0, "patchify_image: size ", image.height, "x",
        image.width, " is not a multiple of ", p * m);
  // transformers rescales in float64 then stores float32, and normalises in float32.
  const double rescale = 1.0 / 255.0;
  std::array<std::array<float, 256>, 3> normalised{};
  for (int ch = 0; ch < 3; ++ch) {
    for (int v = 0; v < 256; ++v) {
      const float scaled = static_cast<float>(v * rescale);
      normalised[ch][v] = (scaled - config.image_mean[ch]) / config.image_std[ch];
    }
  }
  ImagePatches patches;
  const int64_t grid_h = image.height / p, grid_w = image.width / p;
  // A still image is repeated to fill one temporal patch (Tp identical frames, t = 1).
  patches.grid_thw = {1, grid_h, grid_w};
  const int64_t dim = config.patch_dim();
  patches.pixel_values.resize(static_cast<size_t>(grid_h * grid_w * dim));
  int64_t row_idx = 0;
  for (int64_t block_r = 0; block_r < grid_h / m; ++block_r) {
    for (int64_t block_c = 0; block_c < grid_w / m; ++block_c) {
      for (int64_t inner_r = 0; inner_r < m; ++inner_r) {
        for (int64_t inner_c = 0; inner_c < m; ++inner_c, ++row_idx) {
          const int64_t top = (block_r * m + inner_r) * p, left = (block_c * m + inner_c) * p;
          float* row = &patches.pixel_values[row_idx * dim];
          for (int ch = 0; ch < 3; ++ch) {
            for (int64_t frame = 0; frame < tp; ++frame) {
              for (int64_t y = 0; y < p; ++y) {
                for (int64_t x = 0; x < p; ++x) {
                  row[((ch * tp + frame) * p + y) * p + x] = normalised[ch][image.at(top + y, left + x, ch)];
                }
              }
            }
          }
        }
      }
    }
  }
  return patches;
}

ImagePatches preprocess_image(const RgbImage& image, const ImagePreprocessConfig& config, const std::string& name) {
  const ImageSize size = smart_resize(image.height, image.width, config.min_pixels, config.max_pixels,
                                      config.patch_size * config.merge_size, name);
  return patchify_image(resize_bicubic(image, size.height, size.width), config);
}

ImagePatches preprocess_image_file(const std::string& path, const ImagePreprocessConfig& config) {
  return preprocess_image(load_image_file(path), config, str_cat("image '", path, "'"));
}

ImageBatch concat_image_patches(const std::vector<ImagePatches>& images, int64_t patch_dim) {
  int64_t rows = 0;
  for (const ImagePatches& image : images) rows += image.num_patches();
  ImageBatch batch{HostTensor(DType::f32, Shape{rows, patch_dim}),
                   HostTensor(DType::i64, Shape{static_cast<int64_t>(images.size()), 3})};
  float* out = batch.pixel_values.as<float>();
  int64_t* grids = batch.image_grid_thw.as<int64_t>();
  for (size_t i = 0; i < images.size(); ++i) {
    CHECK(static_cast<int64_t>(images[i].pixel_values.size()) == images[i].num_patches() * patch_dim,
          "concat_image_patches: image ", i, " has ", images[i].pixel_values.size(), " values for grid [",
          images[i].grid_thw[0], ", ", images[i].grid_thw[1], ", ", images[i].grid_thw[2], "]");
    out = std::copy(images[i].pixel_values.begin(), images[i].pixel_values.end(), out);
    std::copy(images[i].grid_thw.begin(), images[i].grid_thw.end(), grids + 3 * i);
  }
  return batch;
}

}  // namespace deltamoe
