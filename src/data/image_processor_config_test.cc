// The image configuration `train` and `data` share: preprocessor_config.json read (both size
// spellings, mean, std), command-line overrides applied, and every value that would make images
// fail one by one (or silently train on garbage) refused up front, naming the file and the value.
#include "data/image_processor_config.h"

#include <gtest/gtest.h>

#include "data/data_test_util.h"

namespace deltamoe {
namespace {

using data_test::qwen3_tokenizer;
namespace fs = std::filesystem;

VisionGeometry qwen_geometry() {
  VisionGeometry vision;
  vision.image_token_id = qwen3_tokenizer().require_token_id("<|image_pad|>");
  return vision;
}

std::string error_of(const fs::path& model_dir, const VisionGeometry& vision, const PixelOverrides& overrides = {}) {
  try {
    load_image_processor_config(model_dir.string(), vision, qwen3_tokenizer(), overrides);
  } catch (const Error& error) {
    return error.what();
  }
  return "(no error)";
}

TEST(ImageProcessorConfig, DefaultsWithoutAFile) {
  const fs::path folder = data_test::temp_folder();
  const ImagePreprocessConfig config = load_image_processor_config(folder.string(), qwen_geometry(), qwen3_tokenizer());
  EXPECT_EQ(config.min_pixels, kDefaultMinPixels);
  EXPECT_EQ(config.max_pixels, kDefaultMaxPixels);
  EXPECT_EQ(config.patch_size, 16);
  EXPECT_EQ(config.merge_size, 2);
}

TEST(ImageProcessorConfig, ReadsTheFileAndAppliesOverrides) {
  const fs::path folder = data_test::temp_folder();
  data_test::write_text(folder / "preprocessor_config.json",
                        R"({"size": {"shortest_edge": 4096, "longest_edge": 1048576}, "patch_size": 16,
                            "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.48, 0.45, 0.40],
                            "image_std": 0.25, "do_normalize": true, "rescale_factor": 0.00392156862745098})");
  ImagePreprocessConfig config = load_image_processor_config(folder.string(), qwen_geometry(), qwen3_tokenizer());
  EXPECT_EQ(config.min_pixels, 4096);
  EXPECT_EQ(config.max_pixels, 1048576);
  EXPECT_FLOAT_EQ(config.image_mean[1], 0.45f);
  EXPECT_FLOAT_EQ(config.image_std[2], 0.25f);
  config = load_image_processor_config(folder.string(), qwen_geometry(), qwen3_tokenizer(), {8192, 16384});
  EXPECT_EQ(config.min_pixels, 8192);
  EXPECT_EQ(config.max_pixels, 16384);
  // Qwen2-VL's top-level spelling.
  data_test::write_text(folder / "preprocessor_config.json", R"({"min_pixels": 3136, "max_pixels": 12845056})");
  config = load_image_processor_config(folder.string(), qwen_geometry(), qwen3_tokenizer());
  EXPECT_EQ(config.min_pixels, 3136);
  EXPECT_EQ(config.max_pixels, 12845056);
}

TEST(ImageProcessorConfig, BadValuesAreRefusedNamingFileAndValue) {
  const fs::path folder = data_test::temp_folder();
  const std::string file = (folder / "preprocessor_config.json").string();
  struct Case {
    std::string json;
    std::string message;
  };
  const std::vector<Case> cases = {
      {R"({"image_std": [0.5, 0, 0.5]})", "image_std[1] is 0; it must be a positive finite number"},
      {R"({"image_std": [0.5, 0.5, -1]})", "image_std[2] is -1"},
      {R"({"size": {"shortest_edge": 1048576, "longest_edge": 65536}})",
       "min_pixels (1048576) exceeds max_pixels (65536); every image would be refused"},
      {R"({"max_pixels": 100, "min_pixels": 50})", "max_pixels 100 is smaller than one merged patch (32x32"},
      {R"({"min_pixels": 0})", "min_pixels must be positive"},
      {R"({"patch_size": 14})", "patch_size 14 differs from config.json's vision config (16)"},
      {R"({"merge_size": "2"})", "'merge_size' must be an integer"},
      {R"({"image_mean": [0.5, 0.5]})", "'image_mean' must be a list of 3 numbers"},
      {R"({"do_normalize": false})", "'do_normalize': false is not supported"},
      {R"({"rescale_factor": 1.0})", "rescale_factor 1.0 is not supported"},
      {R"({"size": )", "not valid JSON"},
      {std::string(200, '[') + std::string(200, ']'), "nested more than 64 levels"},
  };
  for (const Case& c : cases) {
    data_test::write_text(file, c.json);
    const std::string message = error_of(folder, qwen_geometry());
    EXPECT_NE(message.find(file), std::string::npos) << c.json << ": " << message;
    EXPECT_NE(message.find(c.message), std::string::npos) << c.json << ": " << message;
  }
  // Overrides are checked the same way.
  data_test::write_text(file, "{}");
  EXPECT_NE(error_of(folder, qwen_geometry(), {70000, 65536}).find("with --min_pixels / --max_pixels: min_pixels (70000)"),
            std::string::npos)
      << error_of(folder, qwen_geometry(), {70000, 65536});
}

TEST(ImageProcessorConfig, ImageTokenIdMustBeTheTokenizers) {
  const fs::path folder = data_test::temp_folder();
  VisionGeometry vision = qwen_geometry();
  vision.image_token_id += 1;
  const std::string message = error_of(folder, vision);
  EXPECT_NE(message.find(str_cat("image_token_id ", vision.image_token_id,
                                 " differs from the tokenizer's <|image_pad|> id ", vision.image_token_id - 1)),
            std::string::npos)
      << message;
}

}  // namespace
}  // namespace deltamoe
