// decode_image: format sniffing, the per-format decoders, EXIF orientation; and load_image_file.
#include "data/image_decode.h"

#include <libexif/exif-data.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>

#include "core/error.h"
#include "data/image_codecs.h"

namespace deltamoe {
namespace {

bool starts_with(const uint8_t* data, size_t size, const char* magic, size_t magic_size, size_t offset = 0) {
  return size >= offset + magic_size && std::memcmp(data + offset, magic, magic_size) == 0;
}

// Names formats we recognise but do not decode, so that the error says what the file is.
const char* unsupported_format_name(const uint8_t* data, size_t size) {
  if (starts_with(data, size, "GIF8", 4)) return "GIF";
  if (starts_with(data, size, "BM", 2)) return "BMP";
  if (starts_with(data, size, "II*\0", 4) || starts_with(data, size, "MM\0*", 4)) return "TIFF";
  if (starts_with(data, size, "ftyp", 4, 4)) return "HEIF/AVIF";
  return nullptr;
}

}  // namespace

ImageFormat sniff_image_format(const uint8_t* data, size_t size) {
  if (starts_with(data, size, "\xFF\xD8\xFF", 3)) return ImageFormat::jpeg;
  if (starts_with(data, size, "\x89PNG\r\n\x1A\n", 8)) return ImageFormat::png;
  if (starts_with(data, size, "RIFF", 4) && starts_with(data, size, "WEBP", 4, 8)) return ImageFormat::webp;
  return ImageFormat::unknown;
}

int exif_orientation(const uint8_t* data, size_t size) {
  if (data == nullptr || size == 0) return 1;
  // libexif wants the APP1 form; PNG eXIf and most WebP EXIF chunks hold the bare TIFF block.
  std::vector<uint8_t> block;
  if (!starts_with(data, size, "Exif\0\0", 6)) block.assign({'E', 'x', 'i', 'f', 0, 0});
  block.insert(block.end(), data, data + size);
  ExifData* exif = exif_data_new_from_data(block.data(), static_cast<unsigned int>(block.size()));
  if (exif == nullptr) return 1;
  int orientation = 1;
  // PIL reads the tag from IFD0 only (the thumbnail's IFD1 may carry its own).
  if (ExifEntry* entry = exif_content_get_entry(exif->ifd[EXIF_IFD_0], EXIF_TAG_ORIENTATION);
      entry != nullptr && entry->format == EXIF_FORMAT_SHORT && entry->components >= 1 && entry->data != nullptr) {
    orientation = exif_get_short(entry->data, exif_data_get_byte_order(exif));
  }
  exif_data_unref(exif);
  return orientation;
}

RgbImage apply_exif_orientation(const RgbImage& image, int orientation) {
  if (orientation < 2 || orientation > 8) return image;
  const int64_t h = image.height, w = image.width;
  const bool swaps_axes = orientation >= 5;
  RgbImage out;
  out.height = swaps_axes ? w : h;
  out.width = swaps_axes ? h : w;
  out.pixels.resize(image.pixels.size());
  for (int64_t r = 0; r < out.height; ++r) {
    for (int64_t c = 0; c < out.width; ++c) {
      int64_t src_r = r, src_c = c;
      switch (orientation) {
        case 2: src_c = w - 1 - c; break;                       // mirror left-right
        case 3: src_r = h - 1 - r; src_c = w - 1 - c; break;    // rotate 180
        case 4: src_r = h - 1 - r; break;                       // mirror top-bottom
        case 5: src_r = c; src_c = r; break;                    // transpose
        case 6: src_r = h - 1 - c; src_c = r; break;            // rotate 90 clockwise
        case 7: src_r = h - 1 - c; src_c = w - 1 - r; break;    // transverse
        case 8: src_r = c; src_c = w - 1 - r; break;            // rotate 90 counter-clockwise
      }
      for (int ch = 0; ch < 3; ++ch) out.pixels[(r * out.width + c) * 3 + ch] = image.at(src_r, src_c, ch);
    }
  }
  return out;
}

void check_decoded_size(int64_t height, int64_t width, int64_t max_pixels, const std::string& name) {
  CHECK(height <= max_pixels && width <= max_pixels && height * width <= max_pixels, "image '", name, "' is ", width,
        "x", height, " = ", height * width, " pixels, over the limit of ", max_pixels,
        " (a decompression bomb? --max_decoded_pixels raises the limit)");
}

RgbImage decode_image(const uint8_t* data, size_t size, const std::string& name, int64_t max_pixels) {
  CHECK(size > 0, "image '", name, "' is empty (0 bytes)");
  DecodedImage decoded;
  switch (sniff_image_format(data, size)) {
    case ImageFormat::jpeg: decoded = decode_jpeg(data, size, name, max_pixels); break;
    case ImageFormat::png: decoded = decode_png(data, size, name, max_pixels); break;
    case ImageFormat::webp: decoded = decode_webp(data, size, name, max_pixels); break;
    case ImageFormat::unknown: {
      const char* known = unsupported_format_name(data, size);
      RAISE("image '", name, "': ", known != nullptr ? str_cat(known, " images are") : std::string("this format is"),
            " not supported (supported: JPEG, PNG, WebP)");
    }
  }
  CHECK(decoded.image.height > 0 && decoded.image.width > 0, "image '", name, "' has no pixels (",
        decoded.image.height, "x", decoded.image.width, ")");
  return apply_exif_orientation(decoded.image, exif_orientation(decoded.exif.data(), decoded.exif.size()));
}

RgbImage load_image_file(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  CHECK(file.good(), "image '", path, "' cannot be opened (missing or unreadable)");
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  CHECK(!file.bad(), "image '", path, "': read error");
  return decode_image(bytes.data(), bytes.size(), path);
}

}  // namespace deltamoe
