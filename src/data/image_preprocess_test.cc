// Patchify layout and normalisation of preprocess_image, checked against the layout formula of
// transformers' Qwen2VLImageProcessor written out independently here.
#include "data/image_preprocess.h"

#include <gtest/gtest.h>

#include "data/image_test_util.h"

namespace deltamoe {
namespace {

TEST(ImagePreprocess, PatchRowsFollowTheMergeBlockOrder) {
  const RgbImage image = image_test::gradient_image(64, 96);  // already a multiple of 32
  ImagePreprocessConfig config;
  config.min_pixels = 1024;
  const ImagePatches patches = preprocess_image(image, config);
  EXPECT_EQ(patches.grid_thw, (std::array<int64_t, 3>{1, 4, 6}));
  ASSERT_EQ(patches.pixel_values.size(), static_cast<size_t>(24 * 1536));
  double max_diff = 0;
  for (int64_t patch_r = 0; patch_r < 4; ++patch_r) {
    for (int64_t patch_c = 0; patch_c < 6; ++patch_c) {
      // Block raster over the 2x3 merge blocks, then 2x2 raster inside the block.
      const int64_t row = ((patch_r / 2) * 3 + patch_c / 2) * 4 + (patch_r % 2) * 2 + patch_c % 2;
      for (int ch = 0; ch < 3; ++ch) {
        for (int frame = 0; frame < 2; ++frame) {
          for (int y = 0; y < 16; ++y) {
            for (int x = 0; x < 16; ++x) {
              const double pixel = image.at(patch_r * 16 + y, patch_c * 16 + x, ch);
              const double expected = (pixel / 255.0 - 0.5) / 0.5;
              const double got = patches.pixel_values[row * 1536 + ch * 512 + frame * 256 + y * 16 + x];
              max_diff = std::max(max_diff, std::abs(got - expected));
            }
          }
        }
      }
    }
  }
  std::printf("  pixel_values max|diff| vs layout formula = %.3e\n", max_diff);
  EXPECT_LT(max_diff, 1e-6);
}

TEST(ImagePreprocess, ResizesToTheSmartResizeTarget) {
  const RgbImage image = image_test::gradient_image(100, 50);
  const ImagePatches patches = preprocess_image(image, ImagePreprocessConfig{});
  const ImageSize size = smart_resize(100, 50);
  EXPECT_EQ(patches.grid_thw, (std::array<int64_t, 3>{1, size.height / 16, size.width / 16}));
  EXPECT_EQ(patches.pixel_values.size(), static_cast<size_t>(patches.num_patches() * 1536));
  float lo = 1, hi = -1;
  for (float value : patches.pixel_values) lo = std::min(lo, value), hi = std::max(hi, value);
  EXPECT_GE(lo, -1.0f);
  EXPECT_LE(hi, 1.0f);
}

TEST(ImagePreprocess, UserPixelLimitsChangeTheGrid) {
  const RgbImage image = image_test::gradient_image(480, 640);
  ImagePreprocessConfig small;
  small.min_pixels = 32 * 32;
  small.max_pixels = 128 * 128;
  const ImagePatches patches = preprocess_image(image, small);
  const ImageSize size = smart_resize(480, 640, small.min_pixels, small.max_pixels);
  EXPECT_EQ(patches.grid_thw[1] * 16, size.height);
  EXPECT_EQ(patches.grid_thw[2] * 16, size.width);
  EXPECT_LE(patches.grid_thw[1] * patches.grid_thw[2] * 256, small.max_pixels);
}

TEST(ImagePreprocess, BatchConcatenatesRowsAndGridsInOrder) {
  ImagePreprocessConfig config;
  config.min_pixels = 1024;
  const ImagePatches first = preprocess_image(image_test::gradient_image(32, 64), config);
  const ImagePatches second = preprocess_image(image_test::gradient_image(96, 32), config);
  const ImageBatch batch = concat_image_patches({first, second}, config.patch_dim());
  EXPECT_EQ(batch.pixel_values.shape(), (Shape{8 + 12, 1536}));
  EXPECT_EQ(batch.image_grid_thw.shape(), (Shape{2, 3}));
  EXPECT_EQ(batch.image_grid_thw.as<int64_t>()[4], 6);  // second image: 96 / 16 rows
  EXPECT_EQ(batch.pixel_values.as<float>()[8 * 1536 + 5], second.pixel_values[5]);
  EXPECT_EQ(batch.pixel_values.as<float>()[7 * 1536 + 9], first.pixel_values[7 * 1536 + 9]);
}

}  // namespace
}  // namespace deltamoe
