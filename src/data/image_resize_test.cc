// smart_resize against hand-worked cases of every branch, and the bicubic resize against PIL's
// bicubic written independently here in double precision (Keys' kernel with a = -0.5, rounding to
// uint8 after each pass), on noise, a checkerboard and a gradient, within one step.
#include "data/image_resize.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

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

// The independent reference: Keys' cubic convolution kernel written from its textbook form,
//   W(x) = (a + 2)|x|^3 - (a + 3)|x|^2 + 1        for |x| < 1
//   W(x) = a|x|^3 - 5a|x|^2 + 8a|x| - 4a          for 1 <= |x| < 2, else 0,
// with a = -0.5 as PIL's BICUBIC (a = -0.75 is the other common choice, e.g. OpenCV's).
constexpr double kPilBicubicA = -0.5;
constexpr double kOtherBicubicA = -0.75;

double keys_cubic(double x, double a) {
  x = std::abs(x);
  if (x < 1) return (a + 2) * x * x * x - (a + 3) * x * x + 1;
  if (x < 2) return a * x * x * x - 5 * a * x * x + 8 * a * x - 4 * a;
  return 0;
}

// [out_size][in_size] resampling weights: output pixel o is centred at input coordinate
// (o + 0.5) * scale; when shrinking the kernel is stretched by the scale (so it averages every input
// pixel it covers); taps outside the image are dropped and the rest renormalised to sum to 1.
std::vector<std::vector<double>> reference_matrix(int64_t in_size, int64_t out_size, double a) {
  const double scale = static_cast<double>(in_size) / out_size, stretch = std::max(scale, 1.0);
  std::vector<std::vector<double>> matrix(out_size, std::vector<double>(in_size, 0.0));
  for (int64_t o = 0; o < out_size; ++o) {
    const double center = (o + 0.5) * scale;
    double total = 0;
    for (int64_t i = 0; i < in_size; ++i) {
      matrix[o][i] = keys_cubic((i + 0.5 - center) / stretch, a);
      total += matrix[o][i];
    }
    for (double& weight : matrix[o]) weight /= total;
  }
  return matrix;
}

uint8_t round_to_u8(double value) { return static_cast<uint8_t>(std::clamp(std::round(value), 0.0, 255.0)); }

// PIL's order of work in double precision: the horizontal pass, rounded to uint8, then the vertical
// pass, rounded to uint8 (PIL does the same with 22-bit fixed-point weights, so the two may differ by
// one step where a value lies within ~1e-4 of a rounding boundary).
RgbImage reference_resize(const RgbImage& image, int64_t height, int64_t width, double a) {
  const auto cols = reference_matrix(image.width, width, a);
  RgbImage wide{image.height, width, std::vector<uint8_t>(static_cast<size_t>(image.height * width) * 3)};
  for (int64_t r = 0; r < image.height; ++r)
    for (int64_t c = 0; c < width; ++c)
      for (int ch = 0; ch < 3; ++ch) {
        double value = 0;
        for (int64_t j = 0; j < image.width; ++j) value += cols[c][j] * image.at(r, j, ch);
        wide.pixels[(r * width + c) * 3 + ch] = round_to_u8(value);
      }
  const auto rows = reference_matrix(image.height, height, a);
  RgbImage out{height, width, std::vector<uint8_t>(static_cast<size_t>(height * width) * 3)};
  for (int64_t r = 0; r < height; ++r)
    for (int64_t c = 0; c < width; ++c)
      for (int ch = 0; ch < 3; ++ch) {
        double value = 0;
        for (int64_t i = 0; i < image.height; ++i) value += rows[r][i] * wide.at(i, c, ch);
        out.pixels[(r * width + c) * 3 + ch] = round_to_u8(value);
      }
  return out;
}

// Uniform noise and a one-pixel checkerboard: unlike a linear gradient (which every symmetric cubic
// kernel reproduces exactly), their resized values depend on the kernel's shape.
RgbImage noise_image(int64_t height, int64_t width) {
  std::mt19937 rng(20261215);
  RgbImage image{height, width, std::vector<uint8_t>(static_cast<size_t>(height * width) * 3)};
  for (uint8_t& value : image.pixels) value = static_cast<uint8_t>(rng() & 0xFF);
  return image;
}

RgbImage checkerboard_image(int64_t height, int64_t width) {
  RgbImage image{height, width, std::vector<uint8_t>(static_cast<size_t>(height * width) * 3)};
  for (int64_t r = 0; r < height; ++r)
    for (int64_t c = 0; c < width; ++c)
      for (int ch = 0; ch < 3; ++ch) image.pixels[(r * width + c) * 3 + ch] = ((r + c + ch) % 2) ? 230 : 20;
  return image;
}

struct PixelDiff {
  int max = 0;
  int64_t num_differing = 0;
};

PixelDiff pixel_diff(const RgbImage& a, const RgbImage& b) {
  PixelDiff diff;
  for (size_t i = 0; i < a.pixels.size(); ++i) {
    const int d = std::abs(int(a.pixels[i]) - int(b.pixels[i]));
    diff.max = std::max(diff.max, d);
    diff.num_differing += d != 0;
  }
  return diff;
}

struct NamedImage {
  const char* name;
  RgbImage image;
};

std::vector<NamedImage> filter_test_images() {
  return {{"noise", noise_image(37, 53)}, {"checkerboard", checkerboard_image(37, 53)},
          {"gradient", image_test::gradient_image(37, 53)}};
}

// Up, down, one axis at a time, and non-integer ratios.
const ImageSize kTargets[] = {{64, 96}, {32, 32}, {37, 20}, {90, 53}, {25, 71}};

// PIL rounds to uint8 after each pass like the reference, so they may differ by one step, rarely.
constexpr int kMaxStepDiff = 1;
constexpr double kMaxDifferingFraction = 0.01;

TEST(ResizeBicubic, MatchesAnIndependentPilBicubicOnNoiseCheckerboardAndGradient) {
  for (const NamedImage& input : filter_test_images()) {
    for (const ImageSize& target : kTargets) {
      const RgbImage resized = resize_bicubic(input.image, target.height, target.width);
      ASSERT_EQ(resized.height, target.height);
      ASSERT_EQ(resized.width, target.width);
      const PixelDiff diff = pixel_diff(resized, reference_resize(input.image, target.height, target.width, kPilBicubicA));
      const double fraction = static_cast<double>(diff.num_differing) / static_cast<double>(resized.pixels.size());
      std::printf("  %-12s %ldx%ld -> %ldx%ld: max|diff| vs reference (a = -0.5) %d, values differing %.4f\n",
                  input.name, input.image.height, input.image.width, target.height, target.width, diff.max, fraction);
      EXPECT_LE(diff.max, kMaxStepDiff) << input.name << " -> " << target.height << "x" << target.width;
      EXPECT_LE(fraction, kMaxDifferingFraction) << input.name << " -> " << target.height << "x" << target.width;
    }
  }
}

// The check above can tell kernels apart: on noise and the checkerboard, a = -0.75 moves some
// resized values by far more than the one step allowed (on the gradient it would not).
TEST(ResizeBicubic, NoiseAndCheckerboardTellKeysParameterMinus075FromPils) {
  for (const NamedImage& input : filter_test_images()) {
    if (std::string(input.name) == "gradient") continue;
    int largest_max = 0;
    for (const ImageSize& target : kTargets) {
      const PixelDiff diff =
          pixel_diff(reference_resize(input.image, target.height, target.width, kOtherBicubicA),
                     reference_resize(input.image, target.height, target.width, kPilBicubicA));
      std::printf("  %-12s -> %ldx%ld: a = -0.75 vs a = -0.5 max|diff| %d steps\n", input.name, target.height,
                  target.width, diff.max);
      largest_max = std::max(largest_max, diff.max);
    }
    EXPECT_GE(largest_max, 10 * kMaxStepDiff) << input.name;
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
