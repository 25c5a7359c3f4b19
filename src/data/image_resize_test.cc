// smart_resize against hand-worked cases of every branch, and the bicubic resize against a plain
// floating-point convolution written independently here (PIL rounds to uint8 between passes, so
// the two may differ by one step).
#include "data/image_resize.h"

#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "data/image_test_util.h"

namespace deltamoe {
namespace {

TEST(SmartResize, RoundsHalvesToEven) {
  // 48/32 = 1.5 -> 2 and 80/32 = 2.5 -> 2 (Python's round), 112/32 = 3.5 -> 4; budget not binding.
  EXPECT_EQ(smart_resize(48, 80, 1, 1 << 30), (ImageSize{64, 64}));
  EXPECT_EQ(smart_resize(112, 80, 1, 1 << 30), (ImageSize{128, 64}));
  EXPECT_EQ(smart_resize(47, 81, 1, 1 << 30), (ImageSize{32, 96}));
}

TEST(SmartResize, ShrinksToTheMaxPixelBudget) {
  // beta = sqrt(4000*3000/1e6) = 3.4641; floor(4000/beta/32) = 36, floor(3000/beta/32) = 27.
  const ImageSize size = smart_resize(4000, 3000, kDefaultMinPixels, 1000000);
  EXPECT_EQ(size, (ImageSize{36 * 32, 27 * 32}));
  EXPECT_LE(size.height * size.width, 1000000);
}

TEST(SmartResize, ThinImagesKeepOneBlockUnderTheMaxBudget) {
  // beta = sqrt(20*4000/32768) = 1.5625: the short side floors to 0 and is clamped to 32.
  EXPECT_EQ(smart_resize(20, 4000, 1024, 32768), (ImageSize{32, 80 * 32}));
}

TEST(SmartResize, GrowsToTheMinPixelBudget) {
  // 100x50 rounds to 96x64 = 6144 < 65536; beta = sqrt(65536/5000) = 3.6204 -> ceil 12 and 6 blocks.
  const ImageSize size = smart_resize(100, 50);
  EXPECT_EQ(size, (ImageSize{12 * 32, 6 * 32}));
  EXPECT_GE(size.height * size.width, kDefaultMinPixels);
}

TEST(SmartResize, DefaultsLeaveOrdinaryImagesNearTheirSize) {
  EXPECT_EQ(smart_resize(480, 640), (ImageSize{480, 640}));
  EXPECT_EQ(smart_resize(1080, 1920), (ImageSize{1088, 1920}));
}

TEST(SmartResize, RejectsExtremeAspectRatios) {
  EXPECT_NO_THROW(smart_resize(10, 2000));  // exactly 200:1 is allowed
  try {
    smart_resize(10, 2001, kDefaultMinPixels, kDefaultMaxPixels, kImageSizeFactor, "image 'strip.png'");
    FAIL() << "aspect ratio 200.1 accepted";
  } catch (const Error& error) {
    std::printf("  %s\n", error.what());
    EXPECT_NE(std::string(error.what()).find("strip.png"), std::string::npos);
    EXPECT_NE(std::string(error.what()).find("aspect ratio"), std::string::npos);
  }
}

TEST(SmartResize, RejectsInconsistentLimits) {
  EXPECT_THROW(smart_resize(100, 100, 5000, 4000), Error);
  EXPECT_THROW(smart_resize(100, 100, 0, 4000), Error);
  EXPECT_THROW(smart_resize(100, 100, 1, 100), Error);  // below one 32x32 block
}

// Bicubic (a = -0.5) with the support scaled when shrinking, computed in double without any
// intermediate rounding.
double reference_weight(double x) {
  x = std::abs(x);
  if (x < 1) return (1.5 * x - 2.5) * x * x + 1;
  if (x < 2) return ((-0.5 * x + 2.5) * x - 4) * x + 2;
  return 0;
}

std::vector<std::vector<double>> reference_matrix(int64_t in_size, int64_t out_size) {
  const double scale = static_cast<double>(in_size) / out_size, stretch = std::max(scale, 1.0);
  std::vector<std::vector<double>> matrix(out_size, std::vector<double>(in_size, 0.0));
  for (int64_t o = 0; o < out_size; ++o) {
    const double center = (o + 0.5) * scale;
    double total = 0;
    for (int64_t i = 0; i < in_size; ++i) {
      if (std::abs(i + 0.5 - center) >= 2 * stretch) continue;  // outside the support
      matrix[o][i] = reference_weight((i + 0.5 - center) / stretch);
      total += matrix[o][i];
    }
    for (double& weight : matrix[o]) weight /= total;
  }
  return matrix;
}

TEST(ResizeBicubic, MatchesAFloatingPointConvolutionWithinOneStep) {
  const RgbImage image = image_test::gradient_image(37, 53);
  for (const ImageSize& target : {ImageSize{64, 96}, ImageSize{32, 32}, ImageSize{37, 20}, ImageSize{90, 53}}) {
    const RgbImage resized = resize_bicubic(image, target.height, target.width);
    ASSERT_EQ(resized.height, target.height);
    ASSERT_EQ(resized.width, target.width);
    const auto rows = reference_matrix(image.height, target.height);
    const auto cols = reference_matrix(image.width, target.width);
    double max_diff = 0;
    for (int64_t r = 0; r < target.height; ++r) {
      for (int64_t c = 0; c < target.width; ++c) {
        for (int ch = 0; ch < 3; ++ch) {
          double value = 0;
          for (int64_t i = 0; i < image.height; ++i) {
            if (rows[r][i] == 0) continue;
            for (int64_t j = 0; j < image.width; ++j) value += rows[r][i] * cols[c][j] * image.at(i, j, ch);
          }
          value = std::clamp(value, 0.0, 255.0);
          max_diff = std::max(max_diff, std::abs(value - resized.at(r, c, ch)));
        }
      }
    }
    std::printf("  %ldx%ld -> %ldx%ld max|diff| vs float convolution = %.3f\n", image.height, image.width,
                target.height, target.width, max_diff);
    EXPECT_LE(max_diff, 1.5);
  }
}

TEST(ResizeBicubic, KeepsConstantImagesAndIdentitySizes) {
  RgbImage flat{20, 30, std::vector<uint8_t>(20 * 30 * 3, 200)};
  const RgbImage resized = resize_bicubic(flat, 64, 7);
  int max_diff = 0;
  for (uint8_t value : resized.pixels) max_diff = std::max(max_diff, std::abs(value - 200));
  EXPECT_EQ(max_diff, 0);
  const RgbImage image = image_test::gradient_image(12, 9);
  EXPECT_EQ(resize_bicubic(image, 12, 9).pixels, image.pixels);
}

}  // namespace
}  // namespace deltamoe
