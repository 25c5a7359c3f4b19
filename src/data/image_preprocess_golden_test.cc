// Compares preprocess_image_file with transformers' Qwen2VLImageProcessor through golden files made
// on the GPU machine (tools/golden/make_golden.py): tests/golden/preprocess/cases.json lists
// {name, file, min_pixels, max_pixels}; <name>.safetensors holds pixel_values, image_grid_thw and
// (optionally) PIL's decoded pixels.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "data/image_preprocess.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

// pixel_values are (v / 255 - 0.5) / 0.5, so one uint8 step of the resized image is 2/255 = 7.84e-3.
// Observed: max exactly one step (PIL's fixed-point rounding lands a value one step away now and
// then), mean 1.3e-5 to 5.3e-5. Bicubic with a = -0.75 instead of PIL's -0.5 gives max 3.1e-2 to
// 7.8e-2 and mean 2.5e-3 to 6.6e-3, far outside both bounds.
constexpr double kMaxDiff = 0.012;      // one step, not two
constexpr double kMaxMeanDiff = 2.5e-4;  // ~5x the worst observed

fs::path golden_folder() {
  const char* source = std::getenv("DELTAMOE_SOURCE_DIR");
  return fs::path(source != nullptr ? source : ".") / "tests" / "golden" / "preprocess";
}

// Just enough safetensors reading for a few small tensors (F32, I64 or U8, converted to double).
struct GoldenTensor {
  std::vector<int64_t> shape;
  std::vector<double> values;
};

// Returns nothing when the file has no tensor of that name.
std::optional<GoldenTensor> read_golden_tensor(const fs::path& path, const std::string& name) {
  std::ifstream file(path, std::ios::binary);
  if (!file.good()) throw std::runtime_error("cannot open " + path.string());
  uint64_t header_size = 0;
  file.read(reinterpret_cast<char*>(&header_size), 8);
  std::string header_text(header_size, '\0');
  file.read(header_text.data(), static_cast<std::streamsize>(header_size));
  const nlohmann::json header = nlohmann::json::parse(header_text);
  if (!header.contains(name)) return std::nullopt;
  const nlohmann::json& entry = header[name];
  GoldenTensor tensor;
  tensor.shape = entry["shape"].get<std::vector<int64_t>>();
  const uint64_t begin = entry["data_offsets"][0], end = entry["data_offsets"][1];
  std::vector<char> bytes(end - begin);
  file.seekg(static_cast<std::streamoff>(8 + header_size + begin));
  file.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  const std::string dtype = entry["dtype"];
  if (dtype == "F32") {
    for (size_t i = 0; i < bytes.size(); i += 4) {
      float value;
      std::memcpy(&value, &bytes[i], 4);
      tensor.values.push_back(value);
    }
  } else if (dtype == "U8") {
    for (char byte : bytes) tensor.values.push_back(static_cast<uint8_t>(byte));
  } else if (dtype == "I64") {
    for (size_t i = 0; i < bytes.size(); i += 8) {
      int64_t value;
      std::memcpy(&value, &bytes[i], 8);
      tensor.values.push_back(static_cast<double>(value));
    }
  } else {
    throw std::runtime_error(path.string() + ": " + name + " has dtype " + dtype + ", expected F32, I64 or U8");
  }
  return tensor;
}

TEST(ImagePreprocessGolden, MatchesTransformersQwen2VLImageProcessor) {
  const fs::path folder = golden_folder();
  const fs::path cases_path = folder / "cases.json";
  ASSERT_TRUE(fs::exists(cases_path)) << "golden files are missing: " << cases_path
                                      << " does not exist. Generate them on the GPU machine with "
                                         "tools/golden/make_golden.py (needs transformers and Pillow).";
  std::ifstream cases_file(cases_path);
  const nlohmann::json listing = nlohmann::json::parse(cases_file);
  // Either a bare list of cases or an object with the list under "cases" (plus provenance).
  const nlohmann::json cases = listing.is_array() ? listing : listing.at("cases");
  ASSERT_FALSE(cases.empty()) << cases_path << " lists no cases";
  for (const nlohmann::json& golden_case : cases) {
    const std::string name = golden_case["name"];
    SCOPED_TRACE(name);
    ImagePreprocessConfig config;
    config.min_pixels = golden_case["min_pixels"];
    config.max_pixels = golden_case["max_pixels"];
    const ImagePatches patches = preprocess_image_file((folder / golden_case["file"].get<std::string>()).string(), config);
    const fs::path expected_path = folder / (name + ".safetensors");
    const std::optional<GoldenTensor> grid_file = read_golden_tensor(expected_path, "image_grid_thw");
    const std::optional<GoldenTensor> pixels_file = read_golden_tensor(expected_path, "pixel_values");
    ASSERT_TRUE(grid_file && pixels_file) << expected_path << " lacks image_grid_thw or pixel_values";
    const GoldenTensor& grid = *grid_file;
    const GoldenTensor& pixels = *pixels_file;
    ASSERT_EQ(grid.values.size(), 3u);
    EXPECT_EQ(patches.grid_thw[0], grid.values[0]);
    EXPECT_EQ(patches.grid_thw[1], grid.values[1]);
    EXPECT_EQ(patches.grid_thw[2], grid.values[2]);
    // Where the file also holds PIL's decoded pixels ([H, W, C] before RGB conversion), compare
    // our decoder's colour channels with them for RGB and RGBA images.
    if (const std::optional<GoldenTensor> decoded = read_golden_tensor(expected_path, "decoded");
        decoded && decoded->shape.size() == 3 && decoded->shape[2] >= 3) {
      const RgbImage image = load_image_file((folder / golden_case["file"].get<std::string>()).string());
      ASSERT_EQ(image.height, decoded->shape[0]);
      ASSERT_EQ(image.width, decoded->shape[1]);
      double max_decode_diff = 0;
      for (int64_t i = 0; i < image.height * image.width; ++i) {
        for (int c = 0; c < 3; ++c) {
          max_decode_diff = std::max(max_decode_diff, std::abs(image.pixels[i * 3 + c] - decoded->values[i * decoded->shape[2] + c]));
        }
      }
      std::printf("  %-24s decoded pixels max|diff| vs PIL = %.0f\n", name.c_str(), max_decode_diff);
      EXPECT_LE(max_decode_diff, 2) << "decoder differs from PIL";
    }
    ASSERT_EQ(patches.pixel_values.size(), pixels.values.size());
    double sum_diff = 0, max_diff = 0;
    for (size_t i = 0; i < pixels.values.size(); ++i) {
      const double diff = std::abs(patches.pixel_values[i] - pixels.values[i]);
      sum_diff += diff;
      max_diff = std::max(max_diff, diff);
    }
    const double mean_diff = sum_diff / static_cast<double>(pixels.values.size());
    std::printf("  %-24s grid [%ld, %ld, %ld] mean|diff| = %.3e max|diff| = %.3e\n", name.c_str(),
                patches.grid_thw[0], patches.grid_thw[1], patches.grid_thw[2], mean_diff, max_diff);
    EXPECT_LE(mean_diff, kMaxMeanDiff) << "resize or normalisation differs from transformers";
    EXPECT_LE(max_diff, kMaxDiff) << "more than one uint8 step away from transformers somewhere";
  }
}

}  // namespace
}  // namespace deltamoe
