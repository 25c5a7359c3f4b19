// PNG decoding with libpng, converted to RGB the way PIL's convert("RGB") does: palettes and low
// bit depths expand, alpha is dropped (not blended), 16-bit colour keeps the high byte, and 16-bit
// grey saturates at 255 (PIL's "I;16" -> "RGB" clips; see docs/vision.md).
#include <png.h>

#include <algorithm>
#include <csetjmp>
#include <cstdio>
#include <cstring>

#include "core/error.h"
#include "data/image_codecs.h"

namespace deltamoe {
namespace {

struct PngReader {
  const uint8_t* data = nullptr;
  size_t size = 0;
  size_t offset = 0;
  char message[256] = {};
  int64_t max_pixels = 0;
  bool too_large = false;  // the header's size is over max_pixels (stopped before any allocation)
};

void on_png_error(png_structp png, png_const_charp message) {
  auto* reader = static_cast<PngReader*>(png_get_error_ptr(png));
  std::snprintf(reader->message, sizeof(reader->message), "%s", message);
  png_longjmp(png, 1);
}

void on_png_warning(png_structp, png_const_charp) {}

void read_png_bytes(png_structp png, png_bytep out, png_size_t count) {
  auto* reader = static_cast<PngReader*>(png_get_io_ptr(png));
  if (reader->size - reader->offset < count) png_error(png, "the file ends early (truncated)");
  std::memcpy(out, reader->data + reader->offset, count);
  reader->offset += count;
}

struct PngLayout {
  int64_t height = 0, width = 0;
  int channels = 0;         // after the transforms: 1 grey, 2 grey+alpha, 3 RGB, 4 RGBA
  bool grey16 = false;      // 16-bit grey kept at 16 bits (big-endian samples)
};

// All libpng calls live here so that png_longjmp crosses no C++ destructors.
bool run_png_decoder(png_structp png, png_infop info, std::vector<uint8_t>& pixels, std::vector<png_bytep>& rows,
                     std::vector<uint8_t>& exif, PngLayout& layout) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_set_read_fn(png, png_get_error_ptr(png), read_png_bytes);
  png_read_info(png, info);
  auto* reader = static_cast<PngReader*>(png_get_io_ptr(png));
  layout.height = png_get_image_height(png, info);
  layout.width = png_get_image_width(png, info);
  if (layout.height * layout.width > reader->max_pixels) {
    reader->too_large = true;
    return false;
  }
  const int color_type = png_get_color_type(png, info);
  const int bit_depth = png_get_bit_depth(png, info);
  if (color_type == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png);
  if (color_type == PNG_COLOR_TYPE_GRAY && bit_depth < 8) png_set_expand_gray_1_2_4_to_8(png);
  layout.grey16 = color_type == PNG_COLOR_TYPE_GRAY && bit_depth == 16;
  if (bit_depth == 16 && !layout.grey16) png_set_strip_16(png);
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  layout.height = png_get_image_height(png, info);
  layout.width = png_get_image_width(png, info);
  layout.channels = png_get_channels(png, info);
  const size_t row_bytes = png_get_rowbytes(png, info);
  pixels.resize(row_bytes * layout.height);
  rows.resize(layout.height);
  for (int64_t r = 0; r < layout.height; ++r) rows[r] = pixels.data() + row_bytes * r;
  png_read_image(png, rows.data());
  png_read_end(png, info);  // the eXIf chunk may follow the image data
  png_uint_32 exif_size = 0;
  png_bytep exif_data = nullptr;
  if (png_get_eXIf_1(png, info, &exif_size, &exif_data) != 0 && exif_data != nullptr) {
    exif.assign(exif_data, exif_data + exif_size);
  }
  return true;
}

}  // namespace

DecodedImage decode_png(const uint8_t* data, size_t size, const std::string& name, int64_t max_pixels) {
  PngReader reader{data, size, 0, {}, max_pixels, false};
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &reader, on_png_error, on_png_warning);
  CHECK(png != nullptr, "image '", name, "': libpng could not start");
  png_infop info = png_create_info_struct(png);
  std::vector<uint8_t> pixels;
  std::vector<png_bytep> rows;
  DecodedImage decoded;
  PngLayout layout;
  const bool ok = info != nullptr && run_png_decoder(png, info, pixels, rows, decoded.exif, layout);
  png_destroy_read_struct(&png, info != nullptr ? &info : nullptr, nullptr);
  if (reader.too_large) check_decoded_size(layout.height, layout.width, max_pixels, name);
  CHECK(ok, "image '", name, "': corrupt or truncated PNG (", reader.message, ")");

  RgbImage& image = decoded.image;
  image.height = layout.height;
  image.width = layout.width;
  const int64_t count = layout.height * layout.width;
  image.pixels.resize(static_cast<size_t>(count) * 3);
  for (int64_t i = 0; i < count; ++i) {
    uint8_t* out = &image.pixels[i * 3];
    if (layout.grey16) {
      const int value = (pixels[i * 2] << 8) | pixels[i * 2 + 1];
      std::fill(out, out + 3, static_cast<uint8_t>(std::min(value, 255)));
    } else if (layout.channels <= 2) {  // grey (+ alpha, dropped)
      std::fill(out, out + 3, pixels[i * layout.channels]);
    } else {  // RGB (+ alpha, dropped)
      std::copy(&pixels[i * layout.channels], &pixels[i * layout.channels] + 3, out);
    }
  }
  return decoded;
}

}  // namespace deltamoe
