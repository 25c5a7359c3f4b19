// Image decoding: every format and PNG colour type to RGB as PIL's convert("RGB") would, EXIF
// orientation, and clear errors (naming the file) for empty, corrupt, truncated and unsupported files.
#include "data/image_decode.h"

#include <gtest/gtest.h>

#include <chrono>

#include "core/error.h"
#include "data/image_test_util.h"

namespace deltamoe {
namespace {

using namespace image_test;

// Runs load_image_file and returns the error text ("" if it succeeded).
std::string load_error(const std::string& path) {
  try {
    load_image_file(path);
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

int max_abs_diff(const RgbImage& a, const RgbImage& b) {
  EXPECT_EQ(a.height, b.height);
  EXPECT_EQ(a.width, b.width);
  if (a.pixels.size() != b.pixels.size()) return 256;
  int diff = 0;
  for (size_t i = 0; i < a.pixels.size(); ++i) diff = std::max(diff, std::abs(a.pixels[i] - b.pixels[i]));
  return diff;
}

TEST(ImageDecode, LosslessFormatsRoundTripExactly) {
  const RgbImage image = gradient_image(19, 23);
  for (const auto& [name, bytes] : {std::pair{"rgb.png", encode_png_rgb(image)},
                                    std::pair{"rgb.webp", encode_webp_lossless(image)}}) {
    const RgbImage decoded = load_image_file(write_temp_file(name, bytes));
    const int diff = max_abs_diff(decoded, image);
    std::printf("  %s max|diff| = %d\n", name, diff);
    EXPECT_EQ(diff, 0) << name;
  }
}

TEST(ImageDecode, JpegIsCloseToTheSource) {
  const RgbImage image = gradient_image(32, 40);
  const RgbImage decoded = decode_image(encode_jpeg(image, 100).data(), encode_jpeg(image, 100).size(), "q100.jpg");
  const int diff = max_abs_diff(decoded, image);
  std::printf("  jpeg quality 100 max|diff| = %d\n", diff);
  EXPECT_LE(diff, 16);
}

TEST(ImageDecode, PngColourTypesBecomeRgbLikePil) {
  const int h = 3, w = 4;
  std::vector<uint8_t> grey, grey_alpha, rgba, grey16, rgb16, palette_idx;
  for (int i = 0; i < h * w; ++i) {
    grey.push_back(static_cast<uint8_t>(i * 20));
    grey_alpha.insert(grey_alpha.end(), {static_cast<uint8_t>(i * 20), 7});
    rgba.insert(rgba.end(), {static_cast<uint8_t>(i), static_cast<uint8_t>(2 * i), static_cast<uint8_t>(3 * i), 0});
    const int value16 = i * 50;  // some above 255: PIL saturates 16-bit grey at 255
    grey16.insert(grey16.end(), {static_cast<uint8_t>(value16 >> 8), static_cast<uint8_t>(value16 & 255)});
    const int high = i * 21, low = 255 - i;  // 16-bit colour keeps the high byte
    rgb16.insert(rgb16.end(), {static_cast<uint8_t>(high), static_cast<uint8_t>(low), static_cast<uint8_t>(high),
                               static_cast<uint8_t>(low), static_cast<uint8_t>(high), static_cast<uint8_t>(low)});
    palette_idx.push_back(static_cast<uint8_t>(i % 3));
  }
  const std::vector<png_color> palette = {{10, 20, 30}, {40, 50, 60}, {70, 80, 90}};
  struct Case {
    const char* name;
    std::vector<uint8_t> file;
    std::function<std::array<int, 3>(int)> expected;
  };
  const std::vector<Case> cases = {
      {"grey.png", encode_png(grey, h, w, PNG_COLOR_TYPE_GRAY, 8), [](int i) { return std::array{i * 20, i * 20, i * 20}; }},
      {"grey_alpha.png", encode_png(grey_alpha, h, w, PNG_COLOR_TYPE_GRAY_ALPHA, 8),
       [](int i) { return std::array{i * 20, i * 20, i * 20}; }},
      {"rgba.png", encode_png(rgba, h, w, PNG_COLOR_TYPE_RGBA, 8), [](int i) { return std::array{i, 2 * i, 3 * i}; }},
      {"grey16.png", encode_png(grey16, h, w, PNG_COLOR_TYPE_GRAY, 16),
       [](int i) { const int v = std::min(i * 50, 255); return std::array{v, v, v}; }},
      {"rgb16.png", encode_png(rgb16, h, w, PNG_COLOR_TYPE_RGB, 16), [](int i) { return std::array{i * 21, i * 21, i * 21}; }},
      {"palette.png", encode_png(palette_idx, h, w, PNG_COLOR_TYPE_PALETTE, 8, palette),
       [&](int i) { const png_color c = palette[i % 3]; return std::array<int, 3>{c.red, c.green, c.blue}; }},
  };
  for (const Case& test_case : cases) {
    const RgbImage decoded = decode_image(test_case.file.data(), test_case.file.size(), test_case.name);
    ASSERT_EQ(decoded.height, h);
    ASSERT_EQ(decoded.width, w);
    int diff = 0;
    for (int i = 0; i < h * w; ++i) {
      const auto expected = test_case.expected(i);
      for (int c = 0; c < 3; ++c) diff = std::max(diff, std::abs(decoded.pixels[i * 3 + c] - expected[c]));
    }
    std::printf("  %-15s max|diff| = %d\n", test_case.name, diff);
    EXPECT_EQ(diff, 0) << test_case.name;
  }
}

TEST(ImageDecode, ExifOrientationRotatesLikePil) {
  // A 2x3 image with distinct pixels; orientation 6 means "rotate 90 degrees clockwise to view".
  RgbImage image{2, 3, {}};
  for (int i = 0; i < 6; ++i) image.pixels.insert(image.pixels.end(), {static_cast<uint8_t>(i), 0, 0});
  const std::vector<std::vector<int>> expected = {
      {},  {0, 1, 2, 3, 4, 5}, {2, 1, 0, 5, 4, 3}, {5, 4, 3, 2, 1, 0}, {3, 4, 5, 0, 1, 2},
      {0, 3, 1, 4, 2, 5},  // 5 transpose
      {3, 0, 4, 1, 5, 2},  // 6 rotate clockwise
      {5, 2, 4, 1, 3, 0},  // 7 transverse
      {2, 5, 1, 4, 0, 3},  // 8 rotate counter-clockwise
  };
  for (int orientation = 1; orientation <= 8; ++orientation) {
    const RgbImage turned = apply_exif_orientation(image, orientation);
    EXPECT_EQ(turned.height, orientation >= 5 ? 3 : 2);
    std::vector<int> order;
    for (int64_t i = 0; i < turned.height * turned.width; ++i) order.push_back(turned.pixels[i * 3]);
    EXPECT_EQ(order, expected[orientation]) << "orientation " << orientation;
  }
}

TEST(ImageDecode, JpegExifOrientationIsApplied) {
  const RgbImage image = gradient_image(16, 24);
  for (int orientation : {1, 3, 6, 8}) {
    const std::vector<uint8_t> exif = exif_block_with_orientation(orientation);
    EXPECT_EQ(exif_orientation(exif.data(), exif.size()), orientation);
    const std::vector<uint8_t> file = encode_jpeg(image, 100, exif);
    const RgbImage decoded = decode_image(file.data(), file.size(), "exif.jpg");
    const RgbImage expected = apply_exif_orientation(decode_image(encode_jpeg(image, 100).data(),
                                                                  encode_jpeg(image, 100).size(), "plain.jpg"),
                                                     orientation);
    EXPECT_EQ(max_abs_diff(decoded, expected), 0) << "orientation " << orientation;
  }
}

TEST(ImageDecode, EmptyFileIsAClearError) {
  const std::string path = write_temp_file("empty.png", {});
  const std::string message = load_error(path);
  std::printf("  %s\n", message.c_str());
  EXPECT_NE(message.find(path), std::string::npos);
  EXPECT_NE(message.find("empty"), std::string::npos);
}

TEST(ImageDecode, MissingFileIsAClearError) {
  const std::string message = load_error("/nonexistent/folder/picture.jpg");
  EXPECT_NE(message.find("/nonexistent/folder/picture.jpg"), std::string::npos);
  EXPECT_NE(message.find("cannot be opened"), std::string::npos);
}

TEST(ImageDecode, UnsupportedFormatsAreClearErrors) {
  const std::vector<std::pair<std::string, std::vector<uint8_t>>> files = {
      {"anim.gif", {'G', 'I', 'F', '8', '9', 'a', 1, 0, 1, 0, 0, 0, 0}},
      {"notes.txt", {'h', 'e', 'l', 'l', 'o', '\n'}},
  };
  for (const auto& [name, bytes] : files) {
    const std::string path = write_temp_file(name, bytes);
    const std::string message = load_error(path);
    std::printf("  %s\n", message.c_str());
    EXPECT_NE(message.find(path), std::string::npos);
    EXPECT_NE(message.find("not supported"), std::string::npos);
  }
}

TEST(ImageDecode, TruncatedFilesAreClearErrors) {
  const RgbImage image = gradient_image(64, 64);
  for (const auto& [name, bytes] : {std::pair{"cut.jpg", encode_jpeg(image)}, std::pair{"cut.png", encode_png_rgb(image)},
                                    std::pair{"cut.webp", encode_webp_lossless(image)}}) {
    const std::vector<uint8_t> half(bytes.begin(), bytes.begin() + bytes.size() / 2);
    const std::string path = write_temp_file(name, half);
    const std::string message = load_error(path);
    std::printf("  %s\n", message.c_str());
    EXPECT_NE(message.find(path), std::string::npos) << name;
    EXPECT_NE(message.find("truncated"), std::string::npos) << name;
  }
}

// Header sizes written into small valid files: what a decompression bomb looks like to the decoder.
uint32_t crc32_of(const uint8_t* data, size_t size) {
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < size; ++i) {
    crc ^= data[i];
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  return ~crc;
}

std::vector<uint8_t> png_claiming(uint32_t height, uint32_t width) {
  std::vector<uint8_t> png = encode_png_rgb(gradient_image(16, 16));
  // IHDR data at bytes 16..28 (width, height big-endian), its CRC over bytes 12..28 after it.
  for (int i = 0; i < 4; ++i) {
    png[16 + i] = static_cast<uint8_t>(width >> (24 - 8 * i));
    png[20 + i] = static_cast<uint8_t>(height >> (24 - 8 * i));
  }
  const uint32_t crc = crc32_of(png.data() + 12, 17);
  for (int i = 0; i < 4; ++i) png[29 + i] = static_cast<uint8_t>(crc >> (24 - 8 * i));
  return png;
}

std::vector<uint8_t> jpeg_claiming(uint16_t height, uint16_t width) {
  std::vector<uint8_t> jpeg = encode_jpeg(gradient_image(16, 16), 90);
  for (size_t i = 0; i + 8 < jpeg.size(); ++i) {
    if (jpeg[i] == 0xFF && jpeg[i + 1] == 0xC0) {  // SOF0: length, precision, height, width
      jpeg[i + 5] = height >> 8, jpeg[i + 6] = height & 0xFF, jpeg[i + 7] = width >> 8, jpeg[i + 8] = width & 0xFF;
      return jpeg;
    }
  }
  ADD_FAILURE() << "no SOF0 marker";
  return jpeg;
}

std::vector<uint8_t> webp_claiming(uint32_t height, uint32_t width) {
  std::vector<uint8_t> webp = encode_webp_lossless(gradient_image(16, 16));
  EXPECT_EQ(std::string(webp.begin() + 12, webp.begin() + 16), "VP8L");
  // After the 0x2f signature: 14 bits width - 1, 14 bits height - 1, alpha, 3 bits version.
  uint32_t bits = webp[21] | (webp[22] << 8) | (webp[23] << 16) | (static_cast<uint32_t>(webp[24]) << 24);
  bits = (bits & 0xF0000000u) | ((height - 1) << 14) | (width - 1);
  for (int i = 0; i < 4; ++i) webp[21 + i] = static_cast<uint8_t>(bits >> (8 * i));
  return webp;
}

std::string decode_error(const std::vector<uint8_t>& bytes, const std::string& name, double* seconds) {
  const auto start = std::chrono::steady_clock::now();
  std::string message = "(decoded without an error)";
  try {
    decode_image(bytes.data(), bytes.size(), name);
  } catch (const Error& error) {
    message = error.what();
  }
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return message;
}

// A small file whose header claims more pixels than PIL's limit is refused from the header alone:
// no allocation, no decoding, and the message names the file. Decoding the 20000x20000 PNG would
// take ~27 s and 2.4 GB, so a 5 s bound tells the two apart even on a loaded 2-core CI machine.
TEST(ImageDecode, DecompressionBombsAreRefusedFromTheHeader) {
  const std::vector<std::pair<std::string, std::vector<uint8_t>>> bombs = {
      {"bomb.png", png_claiming(20000, 20000)},
      {"huge.png", png_claiming(1000000, 1000000)},
      {"bomb.jpg", jpeg_claiming(30000, 30000)},
      {"bomb.webp", webp_claiming(16384, 16384)},
  };
  for (const auto& [name, bytes] : bombs) {
    double seconds = 0;
    const std::string message = decode_error(bytes, name, &seconds);
    std::printf("  %s (%zu bytes, %.3f s): %s\n", name.c_str(), bytes.size(), seconds, message.c_str());
    EXPECT_NE(message.find("image '" + name + "'"), std::string::npos) << message;
    EXPECT_NE(message.find("over the limit of 178956970"), std::string::npos) << message;
    EXPECT_LT(seconds, 5.0) << name;
  }
  // The limit is a parameter: a tighter one refuses an ordinary image.
  const std::vector<uint8_t> small = encode_png_rgb(gradient_image(64, 64));
  EXPECT_THROW(decode_image(small.data(), small.size(), "small.png", 64 * 63), Error);
  EXPECT_EQ(decode_image(small.data(), small.size(), "small.png", 64 * 64).height, 64);
}

// A JPEG whose scan ends before the image does (here: a 16x16 scan under a 4000x4000 header, the
// EOI marker where data should be) is a truncated image, refused at the first missing block (libjpeg
// only warns "premature end of data segment" and pads with grey, which must not reach training).
TEST(ImageDecode, JpegWhoseDataEndsAtAMarkerIsTruncated) {
  double seconds = 0;
  const std::string message = decode_error(jpeg_claiming(4000, 4000), "short.jpg", &seconds);
  std::printf("  %.3f s: %s\n", seconds, message.c_str());
  EXPECT_NE(message.find("image 'short.jpg': truncated JPEG"), std::string::npos) << message;
  EXPECT_LT(seconds, 5.0);
}

TEST(ImageDecode, CorruptFilesAreClearErrors) {
  const RgbImage image = gradient_image(64, 64);
  for (const auto& [name, bytes] : {std::pair{"bad.jpg", encode_jpeg(image)}, std::pair{"bad.png", encode_png_rgb(image)},
                                    std::pair{"bad.webp", encode_webp_lossless(image)}}) {
    // Keep the signature (so the format is recognised) and scramble everything after it.
    std::vector<uint8_t> broken = bytes;
    for (size_t i = 16; i < broken.size(); ++i) broken[i] = static_cast<uint8_t>(i * 131 + 7);
    const std::string path = write_temp_file(name, broken);
    const std::string message = load_error(path);
    std::printf("  %s\n", message.c_str());
    EXPECT_NE(message.find(path), std::string::npos) << name;
    EXPECT_NE(message.find("corrupt"), std::string::npos) << name;
  }
}

}  // namespace
}  // namespace deltamoe
