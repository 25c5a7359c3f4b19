// resolve_train_options (see train_options.h): the model folder, defaults read from it, the
// renderer, image token caps and the run folder.
#include <algorithm>
#include <filesystem>

#include "checkpoint/hub_cache.h"
#include "core/error.h"
#include "core/log.h"
#include "model/config.h"
#include "tokenizer/chat_template_source.h"
#include "train/run_folder.h"
#include "train/train_options.h"

namespace deltamoe {

namespace fs = std::filesystem;

int64_t image_tokens_to_pixels(const std::string& model_dir, int64_t tokens) {
  int64_t patch = 16, merge = 2;  // Qwen3.5's geometry when there is no config.json to read
  const fs::path config_path = fs::path(model_dir) / "config.json";
  if (fs::is_regular_file(config_path)) {
    const ModelConfig config = load_model_config_file(config_path.string());
    patch = config.vision.patch_size;
    merge = config.vision.spatial_merge_size;
  }
  return tokens * (patch * merge) * (patch * merge);
}

void resolve_train_options(TrainOptions& options, const TrainOptionsRequest& request) {
  options.model_dir = resolve_model_dir(options.model_dir);
  const fs::path config_path = fs::path(options.model_dir) / "config.json";
  if (fs::is_regular_file(config_path)) {
    const ModelConfig config = load_model_config_file(config_path.string());
    if (options.max_length == 0) options.max_length = config.text.max_position_embeddings;
    CHECK(request.spatial_merge_size == 0 || request.spatial_merge_size == config.vision.spatial_merge_size,
          "SPATIAL_MERGE_SIZE=", request.spatial_merge_size, " differs from the model's spatial_merge_size ",
          config.vision.spatial_merge_size, " (", config_path.string(), "); unset it");
  }
  CHECK(request.image_max_tokens >= 0 && request.image_min_tokens >= 0, "image token numbers must be positive");
  if (request.image_max_tokens > 0) {
    const int64_t pixels = image_tokens_to_pixels(options.model_dir, request.image_max_tokens);
    options.max_pixels = options.max_pixels > 0 ? std::min(options.max_pixels, pixels) : pixels;
  }
  if (request.image_min_tokens > 0) {
    options.min_pixels = std::max(options.min_pixels, image_tokens_to_pixels(options.model_dir, request.image_min_tokens));
  }
  if (fs::is_directory(options.model_dir)) options.chat_format = resolve_chat_format(options.model_dir, request.template_name);

  if (request.add_version) {
    if (options.resume.empty()) {
      options.output_dir = new_version_dir(options.output_dir);
      log_info("train: --add_version: this run writes into ", options.output_dir);
    } else if (options.resume == "auto") {
      const std::string newest = newest_version_dir_with_checkpoint(options.output_dir);
      CHECK(!newest.empty(), "--resume auto --add_version: no vN-* folder in ", options.output_dir,
            " holds a checkpoint");
      options.output_dir = newest;
    } else {
      fs::path checkpoint = fs::path(options.resume).lexically_normal();
      if (!checkpoint.has_filename()) checkpoint = checkpoint.parent_path();  // "checkpoint-4/"
      options.output_dir = checkpoint.parent_path().string();
    }
  }
}

}  // namespace deltamoe
