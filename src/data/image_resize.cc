// smart_resize and the PIL-compatible bicubic resize (PIL's Resample.c, re-derived and rewritten).
#include "data/image_resize.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"

namespace deltamoe {
namespace {

// Fixed-point weights: 32 bits minus 8 for the pixel and 2 of headroom for overshoot.
constexpr int kPrecisionBits = 32 - 8 - 2;
constexpr double kBicubicA = -0.5;
constexpr double kBicubicSupport = 2.0;

double bicubic_weight(double x) {
  x = std::abs(x);
  if (x < 1.0) return ((kBicubicA + 2.0) * x - (kBicubicA + 3.0)) * x * x + 1.0;
  if (x < 2.0) return (((x - 5.0) * x + 8.0) * x - 4.0) * kBicubicA;
  return 0.0;
}

// For each output index: the first input index and the fixed-point weights of its taps.
struct ResampleTaps {
  std::vector<int64_t> first;
  std::vector<std::vector<int32_t>> weights;
};

ResampleTaps compute_taps(int64_t in_size, int64_t out_size) {
  const double scale = static_cast<double>(in_size) / static_cast<double>(out_size);
  // Shrinking widens the kernel so that every input pixel contributes (antialiasing).
  const double filter_scale = std::max(scale, 1.0);
  const double support = kBicubicSupport * filter_scale;
  ResampleTaps taps;
  taps.first.resize(out_size);
  taps.weights.resize(out_size);
  for (int64_t out = 0; out < out_size; ++out) {
    const double center = (static_cast<double>(out) + 0.5) * scale;
    // NOTE: PIL rounds with a C cast (truncation toward zero) of value + 0.5.
    const int64_t lo = std::max<int64_t>(static_cast<int64_t>(center - support + 0.5), 0);
    const int64_t hi = std::min<int64_t>(static_cast<int64_t>(center + support + 0.5), in_size);
    std::vector<double> weights;
    double total = 0.0;
    for (int64_t in = lo; in < hi; ++in) {
      const double weight = bicubic_weight((static_cast<double>(in) - center + 0.5) / filter_scale);
      weights.push_back(weight);
      total += weight;
    }
    taps.first[out] = lo;
    for (double weight : weights) {
      const double normalised = total != 0.0 ? weight / total : weight;
      const double fixed = normalised * (1 << kPrecisionBits);
      taps.weights[out].push_back(static_cast<int32_t>(fixed < 0 ? fixed - 0.5 : fixed + 0.5));
    }
  }
  return taps;
}

uint8_t round_fixed_to_u8(int32_t accumulator) {
  return static_cast<uint8_t>(std::clamp(accumulator >> kPrecisionBits, 0, 255));
}

RgbImage resample_horizontal(const RgbImage& image, int64_t width) {
  const ResampleTaps taps = compute_taps(image.width, width);
  RgbImage out{image.height, width, std::vector<uint8_t>(static_cast<size_t>(image.height * width) * 3)};
  for (int64_t r = 0; r < image.height; ++r) {
    for (int64_t c = 0; c < width; ++c) {
      for (int ch = 0; ch < 3; ++ch) {
        int32_t sum = 1 << (kPrecisionBits - 1);  // rounds the final shift to nearest
        for (size_t k = 0; k < taps.weights[c].size(); ++k) {
          sum += image.at(r, taps.first[c] + static_cast<int64_t>(k), ch) * taps.weights[c][k];
        }
        out.pixels[(r * width + c) * 3 + ch] = round_fixed_to_u8(sum);
      }
    }
  }
  return out;
}

RgbImage resample_vertical(const RgbImage& image, int64_t height) {
  const ResampleTaps taps = compute_taps(image.height, height);
  RgbImage out{height, image.width, std::vector<uint8_t>(static_cast<size_t>(height * image.width) * 3)};
  for (int64_t r = 0; r < height; ++r) {
    for (int64_t c = 0; c < image.width; ++c) {
      for (int ch = 0; ch < 3; ++ch) {
        int32_t sum = 1 << (kPrecisionBits - 1);
        for (size_t k = 0; k < taps.weights[r].size(); ++k) {
          sum += image.at(taps.first[r] + static_cast<int64_t>(k), c, ch) * taps.weights[r][k];
        }
        out.pixels[(r * image.width + c) * 3 + ch] = round_fixed_to_u8(sum);
      }
    }
  }
  return out;
}

}  // namespace

ImageSize smart_resize(int64_t height, int64_t width, int64_t min_pixels, int64_t max_pixels, int64_t factor,
                       const std::string& name) {
  CHECK(height > 0 && width > 0, name, ": image size ", height, "x", width, " has no pixels");
  CHECK(factor > 0, name, ": resize factor must be positive, got ", factor);
  CHECK(min_pixels > 0 && max_pixels >= min_pixels, name, ": need 0 < min_pixels <= max_pixels, got min_pixels ",
        min_pixels, " and max_pixels ", max_pixels);
  CHECK(max_pixels >= factor * factor, name, ": max_pixels ", max_pixels, " is below one ", factor, "x", factor,
        " block");
  const double h = static_cast<double>(height), w = static_cast<double>(width), f = static_cast<double>(factor);
  CHECK(std::max(h, w) / std::min(h, w) <= 200.0, name, ": aspect ratio ", height, "x", width,
        " is more than 200:1; crop or pad the image");
  // std::nearbyint rounds halves to even under the default rounding mode, like Python's round.
  int64_t h_bar = static_cast<int64_t>(std::nearbyint(h / f)) * factor;
  int64_t w_bar = static_cast<int64_t>(std::nearbyint(w / f)) * factor;
  if (h_bar * w_bar > max_pixels) {
    const double beta = std::sqrt(h * w / static_cast<double>(max_pixels));
    h_bar = std::max(factor, static_cast<int64_t>(std::floor(h / beta / f)) * factor);
    w_bar = std::max(factor, static_cast<int64_t>(std::floor(w / beta / f)) * factor);
  } else if (h_bar * w_bar < min_pixels) {
    const double beta = std::sqrt(static_cast<double>(min_pixels) / (h * w));
    h_bar = static_cast<int64_t>(std::ceil(h * beta / f)) * factor;
    w_bar = static_cast<int64_t>(std::ceil(w * beta / f)) * factor;
  }
  return {h_bar, w_bar};
}

RgbImage resize_bicubic(const RgbImage& image, int64_t height, int64_t width) {
  CHECK(height > 0 && width > 0, "resize_bicubic: target size ", height, "x", width, " has no pixels");
  RgbImage result = image;
  if (width != image.width) result = resample_horizontal(result, width);
  if (height != image.height) result = resample_vertical(result, height);
  return result;
}

}  // namespace deltamoe
