// libFuzzer target: the input as an image file through decode_image (format sniffing, JPEG / PNG /
// WebP, EXIF orientation) and, when it decodes, the Qwen3.5 resize and patchify; the header reader
// must give every decodable image its decoded size.
#include <cstdint>

#include "core/error.h"
#include "data/image_decode.h"
#include "data/image_header.h"
#include "data/image_preprocess.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  deltamoe::ImagePreprocessConfig config;
  config.min_pixels = 32 * 32;
  config.max_pixels = 128 * 128;
  // The size the pass before step 1 reads from the header (read_image_header).
  bool header_ok = false;
  deltamoe::ImageSize header;
  try {
    header = deltamoe::read_image_header(data, size, "fuzz", 4 << 20);
    header_ok = true;
  } catch (const deltamoe::Error&) {
  }
  try {
    // A 4-megapixel cap keeps each input fast; the header check is the same at any cap.
    const deltamoe::RgbImage image = deltamoe::decode_image(data, size, "fuzz", 4 << 20);
    // Whatever decodes must have been sized the same from its header: the step count and the
    // engine's sizing rest on it.
    if (!header_ok || header.height != image.height || header.width != image.width) __builtin_trap();
    deltamoe::preprocess_image(image, config, "fuzz");
  } catch (const deltamoe::Error&) {
  }
  return 0;
}
