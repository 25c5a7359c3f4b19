// Image files to 8-bit RGB: JPEG, PNG and WebP decoding, EXIF orientation, and the conversion to
// RGB that PIL's Image.convert("RGB") performs (which is what transformers feeds its processors).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace deltamoe {

// Interleaved 8-bit RGB, rows top to bottom: pixels[(row * width + col) * 3 + channel].
struct RgbImage {
  int64_t height = 0;
  int64_t width = 0;
  std::vector<uint8_t> pixels;

  uint8_t at(int64_t row, int64_t col, int channel) const { return pixels[(row * width + col) * 3 + channel]; }
};

enum class ImageFormat { unknown, jpeg, png, webp };

// Largest width x height decoded by default: PIL's Image.MAX_IMAGE_PIXELS. The header's size is
// checked before any pixel memory is allocated, so a small file claiming a huge image (a
// decompression bomb) costs nothing.
constexpr int64_t kDefaultMaxDecodedPixels = 178'956'970;

// Recognises the format from the first bytes (never from the file name).
ImageFormat sniff_image_format(const uint8_t* data, size_t size);

// Decodes an in-memory file and applies its EXIF orientation. `name` only appears in errors.
// Throws deltamoe::Error naming `name` for empty, truncated, corrupt or unsupported data, and for
// images over max_pixels (width x height).
RgbImage decode_image(const uint8_t* data, size_t size, const std::string& name,
                      int64_t max_pixels = kDefaultMaxDecodedPixels);

// Reads and decodes a file (see decode_image).
RgbImage load_image_file(const std::string& path);

// Rotates/flips an image as EXIF orientation 1..8 asks (PIL's ImageOps.exif_transpose);
// other values leave it unchanged.
RgbImage apply_exif_orientation(const RgbImage& image, int orientation);

// Reads the EXIF orientation tag from an EXIF block (with or without the "Exif\0\0" prefix);
// returns 1 (upright) when the block is absent, unreadable, or has no orientation.
int exif_orientation(const uint8_t* data, size_t size);

}  // namespace deltamoe
