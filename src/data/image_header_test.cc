// Image sizes from headers equal what the decoder produces (JPEG, PNG, WebP; EXIF orientations that
// swap the sides, in JPEG APP1 and in a PNG eXIf chunk after the image data), read without decoding:
// a header claiming a bomb is refused, a truncated header is an error, and the patch grid of
// measure_sample_image equals load_sample_image's.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "data/image_header.h"
#include "data/image_test_util.h"
#include "data/sample_image.h"
#include "data/sample_skip.h"

namespace deltamoe {
namespace {

using namespace image_test;

// PNG's chunk CRC (CRC-32, reflected 0xEDB88320), bit by bit.
uint32_t png_crc(const uint8_t* data, size_t size) {
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < size; ++i) {
    crc ^= data[i];
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  return crc ^ 0xFFFFFFFFu;
}

// A PNG with an eXIf chunk (the TIFF block of exif_block_with_orientation) inserted before IEND.
std::vector<uint8_t> png_with_exif_after_data(const RgbImage& image, int orientation) {
  std::vector<uint8_t> png = encode_png_rgb(image);
  const std::vector<uint8_t> exif = exif_block_with_orientation(orientation);
  const std::vector<uint8_t> tiff(exif.begin() + 6, exif.end());
  std::vector<uint8_t> chunk = {0, 0, 0, static_cast<uint8_t>(tiff.size()), 'e', 'X', 'I', 'f'};
  chunk.insert(chunk.end(), tiff.begin(), tiff.end());
  const uint32_t crc = png_crc(chunk.data() + 4, chunk.size() - 4);
  for (int shift = 24; shift >= 0; shift -= 8) chunk.push_back(static_cast<uint8_t>(crc >> shift));
  png.insert(png.end() - 12, chunk.begin(), chunk.end());  // IEND is the last 12 bytes
  return png;
}

void expect_header_equals_decoder(const std::vector<uint8_t>& file, const std::string& what) {
  const RgbImage decoded = decode_image(file.data(), file.size(), what);
  const ImageSize header = read_image_header(file.data(), file.size(), what, kDefaultMaxDecodedPixels);
  EXPECT_EQ(header.height, decoded.height) << what;
  EXPECT_EQ(header.width, decoded.width) << what;
}

TEST(ImageHeader, SizesEqualTheDecodersIncludingOrientation) {
  const RgbImage image = gradient_image(37, 91);
  expect_header_equals_decoder(encode_jpeg(image), "jpeg");
  expect_header_equals_decoder(encode_png_rgb(image), "png");
  expect_header_equals_decoder(encode_webp_lossless(image), "webp");
  for (int orientation : {1, 3, 5, 6, 8}) {
    SCOPED_TRACE(orientation);
    expect_header_equals_decoder(encode_jpeg(image, 90, exif_block_with_orientation(orientation)), "jpeg exif");
    expect_header_equals_decoder(png_with_exif_after_data(image, orientation), "png eXIf");
  }
  const ImageSize turned = read_image_header(encode_jpeg(image, 90, exif_block_with_orientation(6)).data(),
                                             encode_jpeg(image, 90, exif_block_with_orientation(6)).size(), "j", kDefaultMaxDecodedPixels);
  EXPECT_EQ(turned.height, 91) << "orientation 6 turns the image: the sides swap";
}

// A lossy WebP whose VP8 bitstream follows the RIFF header bare (no "VP8 " chunk header), which
// libwebp decodes: its feature parser calls the first bytes a corrupt bitstream, not too few, until
// the whole first partition is there, so the header reader must read on to the file's end before
// it gives up (found by the image_decode fuzzer).
TEST(ImageHeader, BareVp8BitstreamInRiffIsSizedAsDecoded) {
  RgbImage noise{48, 80, std::vector<uint8_t>(48 * 80 * 3)};
  uint32_t state = 12345;
  for (uint8_t& value : noise.pixels) value = static_cast<uint8_t>((state = state * 1664525u + 1013904223u) >> 24);
  const std::vector<uint8_t> webp = encode_webp_lossy(noise, 90.0f);
  ASSERT_EQ(std::string(webp.begin() + 12, webp.begin() + 16), "VP8 ");
  std::vector<uint8_t> bare(webp.begin(), webp.begin() + 12);
  bare.insert(bare.end(), webp.begin() + 20, webp.end());  // the chunk's payload without its header
  const uint32_t riff = static_cast<uint32_t>(bare.size() - 8);
  for (int i = 0; i < 4; ++i) bare[4 + i] = static_cast<uint8_t>(riff >> (8 * i));
  // The case needs a first partition longer than what the first 64 bytes hold: the frame tag's
  // bits 5..23 give its length.
  const uint32_t tag = bare[12] | (bare[13] << 8) | (bare[14] << 16);
  ASSERT_GT(tag >> 5, 64u) << "the first partition fits the first bytes: not the case under test";
  expect_header_equals_decoder(bare, "bare VP8 in RIFF");
  EXPECT_EQ(read_image_header(bare.data(), bare.size(), "bare", kDefaultMaxDecodedPixels).width, 80);
}

// The fuzz corpus holds odd files libjpeg and libpng accept (bytes between JPEG segments, 0xFF 0x00
// where a marker should be, a segment length of 1): whatever decodes has its header size.
TEST(ImageHeader, EveryDecodableCorpusFileHasItsDecodedSize) {
  int decoded = 0;
  for (const auto& entry : std::filesystem::directory_iterator("tests/fuzz/image_decode")) {
    std::ifstream in(entry.path(), std::ios::binary);
    const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    try {
      decode_image(bytes.data(), bytes.size(), entry.path().string());
    } catch (const Error&) {
      continue;
    }
    SCOPED_TRACE(entry.path().string());
    expect_header_equals_decoder(bytes, entry.path().string());
    ++decoded;
  }
  EXPECT_GE(decoded, 10);
}

TEST(ImageHeader, BombsAndTruncatedHeadersAreRefused) {
  std::vector<uint8_t> jpeg = encode_jpeg(gradient_image(16, 16), 90);
  for (size_t i = 0; i + 8 < jpeg.size(); ++i) {  // the frame header claims 30000 x 30000
    if (jpeg[i] == 0xFF && jpeg[i + 1] == 0xC0) {
      jpeg[i + 5] = 30000 >> 8, jpeg[i + 6] = 30000 & 0xFF, jpeg[i + 7] = 30000 >> 8, jpeg[i + 8] = 30000 & 0xFF;
      break;
    }
  }
  try {
    read_image_header(jpeg.data(), jpeg.size(), "bomb.jpg", kDefaultMaxDecodedPixels);
    ADD_FAILURE() << "a bomb header was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("over the limit"), std::string::npos) << error.what();
  }
  const std::vector<uint8_t> png = encode_png_rgb(gradient_image(8, 8));
  EXPECT_THROW(read_image_header(png.data(), 20, "cut.png", kDefaultMaxDecodedPixels), Error);
  EXPECT_THROW(read_image_header(jpeg.data(), 40, "cut.jpg", kDefaultMaxDecodedPixels), Error);
  const std::vector<uint8_t> gif = {'G', 'I', 'F', '8', '9', 'a', 1, 0, 1, 0};
  EXPECT_THROW(read_image_header(gif.data(), gif.size(), "a.gif", kDefaultMaxDecodedPixels), Error);
  EXPECT_THROW(read_image_header(png.data(), 0, "empty.png", kDefaultMaxDecodedPixels), Error);
}

TEST(ImageHeader, MeasuredGridEqualsTheDecodedOne) {
  ImagePreprocessConfig config;
  config.min_pixels = 32 * 32;
  config.max_pixels = 160 * 160;
  const ImageReadLimits limits;
  for (const auto& [name, bytes] : std::vector<std::pair<std::string, std::vector<uint8_t>>>{
           {"wide.jpg", encode_jpeg(gradient_image(40, 300), 90, exif_block_with_orientation(6))},
           {"tall.png", encode_png_rgb(gradient_image(333, 65))},
           {"square.webp", encode_webp_lossless(gradient_image(100, 100))}}) {
    const std::string path = write_temp_file(name, bytes);
    const ImagePatches measured = measure_sample_image(path, config, limits, "x:1");
    const ImagePatches loaded = load_sample_image(path, config, limits, "x:1");
    EXPECT_EQ(measured.grid_thw, loaded.grid_thw) << name;
    EXPECT_TRUE(measured.pixel_values.empty()) << name;
    EXPECT_FALSE(loaded.pixel_values.empty()) << name;
  }
  try {
    measure_sample_image("/dev/zero", config, limits, "x:2");
    ADD_FAILURE() << "a device was measured";
  } catch (const SampleSkip& skip) {
    EXPECT_EQ(skip.reason(), SkipReason::kBadImage);
  }
}

}  // namespace
}  // namespace deltamoe
