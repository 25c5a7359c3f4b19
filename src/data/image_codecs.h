// Per-format decoders behind decode_image (image_decode.cc): each turns one in-memory file into
// 8-bit RGB as PIL's convert("RGB") would, and hands back the raw EXIF block for orientation.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/image_decode.h"

namespace deltamoe {

struct DecodedImage {
  RgbImage image;
  std::vector<uint8_t> exif;  // the EXIF block as stored (may be empty)
};

// Each throws deltamoe::Error naming `name` on corrupt or truncated data, and (through
// check_decoded_size, before allocating pixels) when the header's width x height exceeds max_pixels.
DecodedImage decode_jpeg(const uint8_t* data, size_t size, const std::string& name, int64_t max_pixels);
DecodedImage decode_png(const uint8_t* data, size_t size, const std::string& name, int64_t max_pixels);
DecodedImage decode_webp(const uint8_t* data, size_t size, const std::string& name, int64_t max_pixels);

// Throws the "over the pixel limit" error naming the image and both sizes.
void check_decoded_size(int64_t height, int64_t width, int64_t max_pixels, const std::string& name);

}  // namespace deltamoe
