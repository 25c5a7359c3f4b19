// ms-swift's environment variables (see swift_env.h).
#include "cli/swift_env.h"

#include <cstdlib>

#include "core/error.h"

namespace deltamoe {
namespace {

// Variables that exist for videos, which deltamoe skips (counted as `video`).
const char* const kVideoVariables[] = {"VIDEO_MAX_PIXELS", "VIDEO_MIN_PIXELS", "VIDEO_MAX_TOKEN_NUM",
                                       "VIDEO_MIN_TOKEN_NUM", "VIDEO_TOTAL_PIXELS", "FPS", "FPS_MIN_FRAMES",
                                       "FPS_MAX_FRAMES", "FRAME_FACTOR"};

struct NoEffect {
  const char* name;
  const char* reason;
};
const NoEffect kNoEffect[] = {
    {"PYTORCH_CUDA_ALLOC_CONF", "deltamoe plans its GPU memory itself, without PyTorch's allocator"},
    {"SWIFT_USE_MCORE_GDN", "the Gated DeltaNet layers run deltamoe's own kernels"},
    {"QWENVL_BBOX_FORMAT", "grounding 'objects' fields are not read (such lines are skipped as `objects`)"},
    {"USE_HF", "models are looked up in both the Hugging Face and the ModelScope caches"},
    {"USE_MODELSCOPE_HUB", "models are looked up in both the Hugging Face and the ModelScope caches"},
};

}  // namespace

SwiftEnv read_swift_env(const std::function<const char*(const char*)>& getenv_fn) {
  const auto get = [&](const char* name) -> const char* {
    const char* value = getenv_fn ? getenv_fn(name) : std::getenv(name);
    return value != nullptr && value[0] != '\0' ? value : nullptr;
  };
  SwiftEnv env;
  const auto read_positive = [&](const char* name, std::optional<int64_t>& out) {
    const char* text = get(name);
    if (text == nullptr) return;
    try {
      size_t used = 0;
      const long long value = std::stoll(text, &used);
      if (used == std::string(text).size() && value > 0) {
        out = value;
        return;
      }
    } catch (const std::exception&) {
    }
    env.problems.push_back(str_cat("environment variable ", name, "=", text, " must be a positive integer"));
  };
  read_positive("MAX_PIXELS", env.max_pixels);
  read_positive("MIN_PIXELS", env.min_pixels);
  read_positive("IMAGE_MAX_TOKEN_NUM", env.image_max_token_num);
  read_positive("IMAGE_MIN_TOKEN_NUM", env.image_min_token_num);
  read_positive("SPATIAL_MERGE_SIZE", env.spatial_merge_size);
  for (const char* name : kVideoVariables) {
    if (const char* value = get(name)) {
      env.notes.push_back(str_cat(name, "=", value, ": no effect (videos are not supported yet; lines with videos are "
                                  "skipped and counted as `video`)"));
    }
  }
  for (const NoEffect& entry : kNoEffect) {
    if (const char* value = get(entry.name)) env.notes.push_back(str_cat(entry.name, "=", value, ": no effect (", entry.reason, ")"));
  }
  return env;
}

}  // namespace deltamoe
