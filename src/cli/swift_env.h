// The environment variables of ms-swift's Qwen-VL recipes (MAX_PIXELS, IMAGE_MAX_TOKEN_NUM, ...): read
// into the image settings where they mean the same, noted where they change nothing here, and
// refused where deltamoe cannot honour them — never ignored in silence.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace deltamoe {

struct SwiftEnv {
  std::optional<int64_t> max_pixels, min_pixels;                    // MAX_PIXELS, MIN_PIXELS
  std::optional<int64_t> image_max_token_num, image_min_token_num;  // IMAGE_MAX_TOKEN_NUM, IMAGE_MIN_TOKEN_NUM
  std::optional<int64_t> spatial_merge_size;                        // SPATIAL_MERGE_SIZE (must match config.json)
  std::vector<std::string> notes;     // variables that change nothing here, one line each
  std::vector<std::string> problems;  // malformed values, one line each
};

// Reads the variables through `getenv` (the process environment by default).
SwiftEnv read_swift_env(const std::function<const char*(const char*)>& getenv = nullptr);

}  // namespace deltamoe
