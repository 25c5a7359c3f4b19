// `deltamoe image`: runs the Qwen3.5 image preprocessing on one file and writes what the vision
// tower reads: pixel_values (f32 [N, 1536]) and image_grid_thw (int64 [1, 3]) as safetensors.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/log.h"
#include "data/image_preprocess.h"

namespace deltamoe {
namespace {

struct RawTensor {
  std::string name;
  std::string dtype;  // safetensors dtype name
  std::vector<int64_t> shape;
  const void* data;
  size_t nbytes;
};

// A minimal safetensors writer (little-endian host assumed, header padded to 8 bytes).
// TODO(vision): use checkpoint/safetensors.h's write_safetensors once its implementation lands.
void write_raw_safetensors(const std::string& path, const std::vector<RawTensor>& tensors) {
  nlohmann::ordered_json header;
  header["__metadata__"] = {{"format", "pt"}};
  size_t offset = 0;
  for (const RawTensor& tensor : tensors) {
    header[tensor.name] = {{"dtype", tensor.dtype}, {"shape", tensor.shape}, {"data_offsets", {offset, offset + tensor.nbytes}}};
    offset += tensor.nbytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  CHECK(file.good(), "cannot create '", path, "'; check the folder exists and is writable");
  const uint64_t header_size = text.size();
  file.write(reinterpret_cast<const char*>(&header_size), sizeof(header_size));
  file.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const RawTensor& tensor : tensors) {
    file.write(static_cast<const char*>(tensor.data), static_cast<std::streamsize>(tensor.nbytes));
  }
  file.close();
  CHECK(file.good(), "writing '", path, "' failed (disk full?)");
}

}  // namespace

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
  write_raw_safetensors(out_path, {
      {"pixel_values", "F32", {rows, dim}, patches.pixel_values.data(), patches.pixel_values.size() * sizeof(float)},
      {"image_grid_thw", "I64", {1, 3}, patches.grid_thw.data(), sizeof(patches.grid_thw)},
  });
  log_info("image: ", in_path, " -> ", out_path, ": grid_thw [", patches.grid_thw[0], ", ", patches.grid_thw[1], ", ",
           patches.grid_thw[2], "], pixel_values [", rows, ", ", dim, "], ", rows / 4, " LLM tokens");
  return 0;
}

}  // namespace deltamoe
