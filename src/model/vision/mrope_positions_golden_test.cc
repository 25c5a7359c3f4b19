// compute_mrope_positions against transformers' get_rope_index on the VLM golden cases
// (tests/golden/vlm_*: inputs.safetensors input_ids, mm_token_type_ids, image_grid_thw;
// expected.safetensors mrope_position_ids [3, B, S]). Rows of the batch are packed as samples.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/vision/mrope_positions.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

// Just enough safetensors reading for small F32 / I64 tensors, as int64.
std::vector<int64_t> read_ints(const fs::path& path, const std::string& name, std::vector<int64_t>* shape) {
  std::ifstream file(path, std::ios::binary);
  EXPECT_TRUE(file.good()) << "cannot open " << path;
  uint64_t header_size = 0;
  file.read(reinterpret_cast<char*>(&header_size), 8);
  std::string header_text(header_size, '\0');
  file.read(header_text.data(), static_cast<std::streamsize>(header_size));
  const nlohmann::json entry = nlohmann::json::parse(header_text).at(name);
  *shape = entry["shape"].get<std::vector<int64_t>>();
  const uint64_t begin = entry["data_offsets"][0], end = entry["data_offsets"][1];
  std::vector<char> bytes(end - begin);
  file.seekg(static_cast<std::streamoff>(8 + header_size + begin));
  file.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  std::vector<int64_t> values;
  const bool is_float = entry["dtype"] == "F32";
  for (size_t i = 0; i < bytes.size(); i += is_float ? 4 : 8) {
    if (is_float) {
      float value;
      std::memcpy(&value, &bytes[i], 4);
      values.push_back(static_cast<int64_t>(value));
    } else {
      int64_t value;
      std::memcpy(&value, &bytes[i], 8);
      values.push_back(value);
    }
  }
  return values;
}

void check_case(const std::string& name) {
  const char* source = std::getenv("DELTAMOE_SOURCE_DIR");
  const fs::path folder = fs::path(source != nullptr ? source : ".") / "tests" / "golden" / name;
  ASSERT_TRUE(fs::exists(folder / "inputs.safetensors")) << "golden files are missing: " << folder
                                                         << " (made by tools/golden/make_golden.py)";
  const ModelConfig config = load_model_config_file((folder / "model" / "config.json").string());
  std::vector<int64_t> ids_shape, types_shape, grid_shape, expected_shape;
  const std::vector<int64_t> ids = read_ints(folder / "inputs.safetensors", "input_ids", &ids_shape);
  const std::vector<int64_t> types = read_ints(folder / "inputs.safetensors", "mm_token_type_ids", &types_shape);
  const std::vector<int64_t> grid_values = read_ints(folder / "inputs.safetensors", "image_grid_thw", &grid_shape);
  const std::vector<int64_t> expected = read_ints(folder / "expected.safetensors", "mrope_position_ids", &expected_shape);
  const int64_t rows = ids_shape[0], length = ids_shape[1], tokens = rows * length;
  ASSERT_EQ(expected_shape, (std::vector<int64_t>{3, rows, length}));
  std::vector<int32_t> cu_seqlens;
  for (int64_t r = 0; r <= rows; ++r) cu_seqlens.push_back(static_cast<int32_t>(r * length));
  std::vector<GridThw> grids;
  for (size_t i = 0; i < grid_values.size(); i += 3) grids.push_back({grid_values[i], grid_values[i + 1], grid_values[i + 2]});
  const int64_t merge = config.vision.spatial_merge_size;

  const std::vector<int64_t> from_ids = compute_mrope_positions(ids.data(), tokens, cu_seqlens, grids, {}, merge,
                                                                config.image_token_id, config.video_token_id);
  std::vector<MmTokenType> type_values;
  for (int64_t type : types) type_values.push_back(static_cast<MmTokenType>(type));
  const std::vector<int64_t> from_types = compute_mrope_positions(type_values.data(), tokens, cu_seqlens, grids, {}, merge);
  int64_t mismatches_ids = 0, mismatches_types = 0;
  for (int64_t i = 0; i < 3 * tokens; ++i) {
    mismatches_ids += from_ids[i] != expected[i];
    mismatches_types += from_types[i] != expected[i];
  }
  std::printf("  %s: %ld positions, mismatches from input_ids %ld, from mm_token_type_ids %ld\n", name.c_str(),
              3 * tokens, mismatches_ids, mismatches_types);
  EXPECT_EQ(mismatches_ids, 0);
  EXPECT_EQ(mismatches_types, 0);
}

TEST(MropePositionsGolden, TwoImagesInOneSample) { check_case("vlm_two_images"); }
TEST(MropePositionsGolden, ImageFirstAndTwoRows) { check_case("vlm_image_first"); }

}  // namespace
}  // namespace deltamoe
