// `deltamoe image`: runs the Qwen3.5 image preprocessing on one file and writes what the vision
// tower reads: pixel_values (f32 [N, 1536]) and image_grid_thw (int64 [1, 3]) as safetensors.
#include <algorithm>
#include <string>

#include "checkpoint/safetensors.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/log.h"
#include "data/image_preprocess.h"

namespace deltamoe {

int cmd_image(int argc, char** argv) {
  ArgParser args("image", "preprocess one image as Qwen3.5's processor does and write pixel_values + image_grid_thw");
  args.add_required("in", "image file (JPEG, PNG or WebP)");
  args.add_required("out", "output .safetensors file");
  args.add_option("min_pixels", "smallest resized area in pixels", std::to_string(kDefaultMinPixels));
  args.add_option("max_pixels", "largest resized area in pixels", std::to_string(kDefaultMaxPixels));
  if (!args.parse(argc, argv)) return 0;

  ImagePreprocessConfig config;
  config.min_pixels = args.get_int("min_pixels");
  config.max_pixels = args.get_int("max_pixels");
  const std::string in_path = args.get("in"), out_path = args.get("out");
  const ImagePatches patches = preprocess_image_file(in_path, config);
  const int64_t rows = patches.num_patches(), dim = config.patch_dim();
  HostTensor pixel_values(DType::f32, Shape{rows, dim});
  std::copy(patches.pixel_values.begin(), patches.pixel_values.end(), pixel_values.as<float>());
  HostTensor grid_thw(DType::i64, Shape{1, 3});
  std::copy(patches.grid_thw.begin(), patches.grid_thw.end(), grid_thw.as<int64_t>());
  write_safetensors(out_path, {{"pixel_values", StoredTensor::from_host(pixel_values)},
                               {"image_grid_thw", StoredTensor::from_host(grid_thw)}});
  log_info("image: ", in_path, " -> ", out_path, ": grid_thw [", patches.grid_thw[0], ", ", patches.grid_thw[1], ", ",
           patches.grid_thw[2], "], pixel_values [", rows, ", ", dim, "], ", rows / 4, " LLM tokens");
  return 0;
}

}  // namespace deltamoe
