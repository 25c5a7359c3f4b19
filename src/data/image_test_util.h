// Test helpers for the image code: encoders that make small JPEG/PNG/WebP files in memory (so
// tests generate their inputs, good or broken) and a temporary-file writer.
#pragma once

#include <jpeglib.h>
#include <png.h>
#include <webp/encode.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data/image_decode.h"

namespace deltamoe::image_test {

// An image whose channels vary smoothly and differently along rows and columns.
inline RgbImage gradient_image(int64_t height, int64_t width) {
  RgbImage image{height, width, std::vector<uint8_t>(static_cast<size_t>(height * width) * 3)};
  for (int64_t r = 0; r < height; ++r) {
    for (int64_t c = 0; c < width; ++c) {
      image.pixels[(r * width + c) * 3 + 0] = static_cast<uint8_t>((r * 255) / std::max<int64_t>(height - 1, 1));
      image.pixels[(r * width + c) * 3 + 1] = static_cast<uint8_t>((c * 255) / std::max<int64_t>(width - 1, 1));
      image.pixels[(r * width + c) * 3 + 2] = static_cast<uint8_t>(((r + c) * 255) / std::max<int64_t>(height + width - 2, 1));
    }
  }
  return image;
}

// PNG of any colour type / bit depth from raw rows (samples already in PNG layout, 16-bit big-endian).
inline std::vector<uint8_t> encode_png(const std::vector<uint8_t>& samples, int height, int width, int color_type,
                                       int bit_depth, const std::vector<png_color>& palette = {}) {
  std::vector<uint8_t> out;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  png_set_write_fn(
      png, &out,
      [](png_structp p, png_bytep data, png_size_t n) {
        auto* buffer = static_cast<std::vector<uint8_t>*>(png_get_io_ptr(p));
        buffer->insert(buffer->end(), data, data + n);
      },
      nullptr);
  png_set_IHDR(png, info, width, height, bit_depth, color_type, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  if (!palette.empty()) png_set_PLTE(png, info, palette.data(), static_cast<int>(palette.size()));
  png_write_info(png, info);
  const size_t row_bytes = samples.size() / height;
  for (int r = 0; r < height; ++r) png_write_row(png, samples.data() + row_bytes * r);
  png_write_end(png, info);
  png_destroy_write_struct(&png, &info);
  return out;
}

inline std::vector<uint8_t> encode_png_rgb(const RgbImage& image) {
  return encode_png(image.pixels, static_cast<int>(image.height), static_cast<int>(image.width), PNG_COLOR_TYPE_RGB, 8);
}

// Baseline JPEG; `app1` (an EXIF block with its "Exif\0\0" prefix) is written when not empty.
inline std::vector<uint8_t> encode_jpeg(const RgbImage& image, int quality = 95, const std::vector<uint8_t>& app1 = {}) {
  jpeg_compress_struct cinfo;
  jpeg_error_mgr error;
  cinfo.err = jpeg_std_error(&error);
  jpeg_create_compress(&cinfo);
  unsigned char* buffer = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&cinfo, &buffer, &size);
  cinfo.image_width = static_cast<JDIMENSION>(image.width);
  cinfo.image_height = static_cast<JDIMENSION>(image.height);
  cinfo.input_components = 3;
  cinfo.in_color_space = JCS_RGB;
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, quality, TRUE);
  jpeg_start_compress(&cinfo, TRUE);
  if (!app1.empty()) jpeg_write_marker(&cinfo, JPEG_APP0 + 1, app1.data(), static_cast<unsigned int>(app1.size()));
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW row = const_cast<uint8_t*>(image.pixels.data()) + cinfo.next_scanline * image.width * 3;
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  std::vector<uint8_t> out(buffer, buffer + size);
  std::free(buffer);
  return out;
}

inline std::vector<uint8_t> encode_webp_lossless(const RgbImage& image) {
  uint8_t* buffer = nullptr;
  const size_t size = WebPEncodeLosslessRGB(image.pixels.data(), static_cast<int>(image.width),
                                            static_cast<int>(image.height), static_cast<int>(image.width * 3), &buffer);
  std::vector<uint8_t> out(buffer, buffer + size);
  WebPFree(buffer);
  return out;
}

inline std::vector<uint8_t> encode_webp_lossy(const RgbImage& image, float quality) {
  uint8_t* buffer = nullptr;
  const size_t size = WebPEncodeRGB(image.pixels.data(), static_cast<int>(image.width), static_cast<int>(image.height),
                                    static_cast<int>(image.width * 3), quality, &buffer);
  std::vector<uint8_t> out(buffer, buffer + size);
  WebPFree(buffer);
  return out;
}

// A big-endian EXIF block ("Exif\0\0" + TIFF header + IFD0 with one Orientation entry).
inline std::vector<uint8_t> exif_block_with_orientation(int orientation) {
  return {'E', 'x', 'i', 'f', 0, 0,
          'M', 'M', 0, 42, 0, 0, 0, 8,                                  // TIFF header, IFD0 at offset 8
          0, 1,                                                         // one entry
          0x01, 0x12, 0, 3, 0, 0, 0, 1, 0, static_cast<uint8_t>(orientation), 0, 0,  // tag 0x0112 SHORT x1
          0, 0, 0, 0};                                                  // no next IFD
}

// Writes bytes to a fresh file under the test temp folder and returns its path.
inline std::string write_temp_file(const std::string& name, const std::vector<uint8_t>& bytes) {
  const std::filesystem::path folder = std::filesystem::temp_directory_path() / "deltamoe_image_test";
  std::filesystem::create_directories(folder);
  const std::string path = (folder / name).string();
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  return path;
}

}  // namespace deltamoe::image_test
