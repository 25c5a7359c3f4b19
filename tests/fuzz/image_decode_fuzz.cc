// libFuzzer target: the input as an image file through decode_image (format sniffing, JPEG / PNG /
// WebP, EXIF orientation) and, when it decodes, the Qwen3.5 resize and patchify.
#include <cstdint>

#include "core/error.h"
#include "data/image_decode.h"
#include "data/image_preprocess.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  deltamoe::ImagePreprocessConfig config;
  config.min_pixels = 32 * 32;
  config.max_pixels = 128 * 128;
  try {
    // A 4-megapixel cap keeps each input fast; the header check is the same at any cap.
    const deltamoe::RgbImage image = deltamoe::decode_image(data, size, "fuzz", 4 << 20);
    deltamoe::preprocess_image(image, config, "fuzz");
  } catch (const deltamoe::Error&) {
  }
  return 0;
}
