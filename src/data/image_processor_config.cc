// preprocessor_config.json reading and the checks of the image configuration.
#include "data/image_processor_config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/json_depth.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

int64_t read_int(const Json& object, const char* key, int64_t fallback, const std::string& where) {
  if (!object.contains(key) || object[key].is_null()) return fallback;
  CHECK(object[key].is_number_integer(), where, ": '", key, "' must be an integer, got ", object[key].dump());
  return object[key].get<int64_t>();
}

std::array<float, 3> read_triple(const Json& object, const char* key, const std::array<float, 3>& fallback,
                                 const std::string& where) {
  if (!object.contains(key) || object[key].is_null()) return fallback;
  const Json& value = object[key];
  // A single number applies to all three channels (transformers accepts both).
  if (value.is_number()) return {value.get<float>(), value.get<float>(), value.get<float>()};
  CHECK(value.is_array() && value.size() == 3 && value[0].is_number() && value[1].is_number() && value[2].is_number(),
        where, ": '", key, "' must be a list of 3 numbers, got ", value.dump());
  return {value[0].get<float>(), value[1].get<float>(), value[2].get<float>()};
}

// Processing steps we always perform; a file that turns one off asks for something we do not do.
void check_supported_steps(const Json& json, const std::string& where) {
  for (const char* key : {"do_rescale", "do_normalize", "do_convert_rgb", "do_resize"}) {
    if (json.contains(key) && !json[key].is_null()) {
      CHECK(json[key].is_boolean() && json[key].get<bool>(), where, ": '", key, "': ", json[key].dump(),
            " is not supported (deltamoe always resizes, converts to RGB, rescales by 1/255 and normalises)");
    }
  }
  if (json.contains("rescale_factor") && !json["rescale_factor"].is_null()) {
    CHECK(json["rescale_factor"].is_number() && std::abs(json["rescale_factor"].get<double>() * 255.0 - 1.0) < 1e-6,
          where, ": rescale_factor ", json["rescale_factor"].dump(), " is not supported (only 1/255)");
  }
}

}  // namespace

void validate_image_config(const ImagePreprocessConfig& config, const std::string& where) {
  CHECK(config.patch_size > 0 && config.temporal_patch_size > 0 && config.merge_size > 0, where,
        ": patch_size, temporal_patch_size and merge_size must be positive, got ", config.patch_size, ", ",
        config.temporal_patch_size, ", ", config.merge_size);
  CHECK(config.min_pixels > 0, where, ": min_pixels must be positive, got ", config.min_pixels);
  CHECK(config.min_pixels <= config.max_pixels, where, ": min_pixels (", config.min_pixels, ") exceeds max_pixels (",
        config.max_pixels, "); every image would be refused");
  const int64_t factor = config.patch_size * config.merge_size;
  CHECK(config.max_pixels >= factor * factor, where, ": max_pixels ", config.max_pixels,
        " is smaller than one merged patch (", factor, "x", factor, " = ", factor * factor, " pixels)");
  for (int c = 0; c < 3; ++c) {
    CHECK(std::isfinite(config.image_mean[c]), where, ": image_mean[", c, "] is ", config.image_mean[c],
          "; it must be a finite number");
    CHECK(std::isfinite(config.image_std[c]) && config.image_std[c] > 0, where, ": image_std[", c, "] is ",
          config.image_std[c], "; it must be a positive finite number (pixels are divided by it)");
  }
}

ImagePreprocessConfig load_image_processor_config(const std::string& model_dir, const VisionGeometry& vision,
                                                  const Tokenizer& tokenizer, const PixelOverrides& overrides) {
  ImagePreprocessConfig config;
  config.patch_size = vision.patch_size;
  config.temporal_patch_size = vision.temporal_patch_size;
  config.merge_size = vision.merge_size;
  const int32_t pad = tokenizer.require_token_id("<|image_pad|>");
  CHECK(vision.image_token_id < 0 || pad == vision.image_token_id, (fs::path(model_dir) / "config.json").string(), ": image_token_id ", vision.image_token_id,
        " differs from the tokenizer's <|image_pad|> id ", pad, "; the tokenizer does not belong to this model");

  std::string where = "the default image settings";
  const fs::path path = fs::path(model_dir) / "preprocessor_config.json";
  if (fs::exists(path)) {
    where = path.string();
    std::ifstream in(path, std::ios::binary);
    CHECK(in.good(), "cannot read ", where);
    std::stringstream text;
    text << in.rdbuf();
    CHECK(json_nesting_depth(text.str()) <= kMaxJsonDepth, where, ": nested more than ", kMaxJsonDepth, " levels deep");
    Json json;
    try {
      json = Json::parse(text.str());
    } catch (const Json::exception& error) {
      RAISE(where, ": not valid JSON (", error.what(), ")");
    }
    CHECK(json.is_object(), where, ": must hold one JSON object");
    if (json.contains("size") && json["size"].is_object()) {
      config.min_pixels = read_int(json["size"], "shortest_edge", config.min_pixels, where);
      config.max_pixels = read_int(json["size"], "longest_edge", config.max_pixels, where);
    }
    config.min_pixels = read_int(json, "min_pixels", config.min_pixels, where);
    config.max_pixels = read_int(json, "max_pixels", config.max_pixels, where);
    config.image_mean = read_triple(json, "image_mean", config.image_mean, where);
    config.image_std = read_triple(json, "image_std", config.image_std, where);
    const std::pair<const char*, int64_t> geometry[] = {{"patch_size", vision.patch_size},
                                                        {"temporal_patch_size", vision.temporal_patch_size},
                                                        {"merge_size", vision.merge_size}};
    for (const auto& [key, expected] : geometry) {
      const int64_t value = read_int(json, key, expected, where);
      CHECK(value == expected, where, ": ", key, " ", value, " differs from config.json's vision config (", expected,
            "); the files do not belong to the same model");
    }
    check_supported_steps(json, where);
  }
  if (overrides.min_pixels > 0) config.min_pixels = overrides.min_pixels;
  if (overrides.max_pixels > 0) config.max_pixels = overrides.max_pixels;
  if (overrides.min_pixels > 0 || overrides.max_pixels > 0) where += " with --min_pixels / --max_pixels";
  validate_image_config(config, where);
  return config;
}

}  // namespace deltamoe
