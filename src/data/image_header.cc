// Image sizes from headers (see image_header.h): each reader walks only the container structure
// that the full decoder would read before the pixels, and finds the EXIF block the decoder would use.
#include "data/image_header.h"

#include <webp/decode.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "data/image_codecs.h"

namespace deltamoe {
namespace {

constexpr size_t kMaxExifBytes = size_t{1} << 20;  // an orientation tag needs a few bytes; cap what is read

class HeaderReader {
 public:
  HeaderReader(const ByteReader& read, uint64_t size, const std::string& name) : read_(read), size_(size), name_(name) {}
  uint64_t size() const { return size_; }
  // Exactly n bytes at offset, or an error saying the header is truncated.
  std::vector<uint8_t> bytes(uint64_t offset, size_t n, const char* what) const {
    CHECK(offset <= size_ && n <= size_ - offset, "image '", name_, "': truncated ", what, " (the file ends at byte ",
          size_, ")");
    std::vector<uint8_t> out(n);
    const size_t got = n == 0 ? 0 : read_(offset, n, out.data());
    CHECK(got == n, "image '", name_, "': truncated ", what, " (read ", got, " of ", n, " bytes at ", offset, ")");
    return out;
  }

 private:
  const ByteReader& read_;
  uint64_t size_;
  const std::string& name_;
};

uint32_t be16(const uint8_t* p) { return (uint32_t{p[0]} << 8) | p[1]; }
uint32_t be32(const uint8_t* p) { return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3]; }
uint32_t le32(const uint8_t* p) { return uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24); }

struct StoredSize {
  int64_t height = 0, width = 0;
  std::vector<uint8_t> exif;
};

// JPEG: markers up to the start of scan, as jpeg_read_header reads them; the frame header gives the
// size, the first APP1 "Exif" block the orientation (as the decoder and PIL take it).
StoredSize jpeg_size(const HeaderReader& in, const std::string& name) {
  StoredSize out;
  uint64_t at = 2;  // after SOI
  bool have_frame = false;
  for (;;) {
    std::vector<uint8_t> marker = in.bytes(at, 2, "JPEG header");
    // As libjpeg's next_marker: bytes before a 0xFF are skipped, fill bytes (0xFF repeated) too,
    // and 0xFF 0x00 is no marker (skipped with a warning there).
    if (marker[0] != 0xFF || marker[1] == 0xFF) {
      ++at;
      continue;
    }
    if (marker[1] == 0x00) {
      at += 2;
      continue;
    }
    const uint8_t code = marker[1];
    at += 2;
    if (code == 0xD8 || code == 0x01 || (code >= 0xD0 && code <= 0xD7)) continue;  // no length
    CHECK(code != 0xD9, "image '", name, "': corrupt JPEG (the image ends before its frame header)");
    const uint32_t length = be16(in.bytes(at, 2, "JPEG segment").data());
    if (code == 0xDA) break;  // start of scan: the header is over
    const bool frame = (code >= 0xC0 && code <= 0xCF) && code != 0xC4 && code != 0xC8 && code != 0xCC;
    CHECK(!frame || length >= 8, "image '", name, "': corrupt JPEG (frame header length ", length, ")");
    if (length < 2) {  // a bogus length: libjpeg reads no data and goes on after the length bytes
      at += 2;
      continue;
    }
    if (frame) {
      const std::vector<uint8_t> header = in.bytes(at + 2, 5, "JPEG frame header");
      out.height = be16(header.data() + 1);
      out.width = be16(header.data() + 3);
      have_frame = true;
    } else if (code == 0xE1 && length >= 8 && out.exif.empty()) {
      const std::vector<uint8_t> head = in.bytes(at + 2, 6, "JPEG APP1 segment");
      if (std::memcmp(head.data(), "Exif\0\0", 6) == 0) out.exif = in.bytes(at + 2, std::min<size_t>(length - 2, kMaxExifBytes), "EXIF block");
    }
    at += length;
  }
  CHECK(have_frame, "image '", name, "': corrupt JPEG (no frame header before the image data)");
  return out;
}

// PNG: IHDR gives the size; an eXIf chunk anywhere before IEND the orientation (libpng reads it
// after the image data too).
StoredSize png_size(const HeaderReader& in, const std::string& name) {
  StoredSize out;
  const std::vector<uint8_t> ihdr = in.bytes(8, 25, "PNG header");
  CHECK(std::memcmp(ihdr.data() + 4, "IHDR", 4) == 0, "image '", name, "': corrupt PNG (IHDR is not the first chunk)");
  out.width = be32(ihdr.data() + 8);
  out.height = be32(ihdr.data() + 12);
  uint64_t at = 8;
  while (at + 8 <= in.size()) {
    const std::vector<uint8_t> chunk = in.bytes(at, 8, "PNG chunk");
    const uint64_t length = be32(chunk.data());
    if (std::memcmp(chunk.data() + 4, "IEND", 4) == 0) break;
    if (std::memcmp(chunk.data() + 4, "eXIf", 4) == 0) {
      out.exif = in.bytes(at + 8, std::min<uint64_t>(length, kMaxExifBytes), "PNG eXIf chunk");
      break;
    }
    at += 12 + length;
  }
  return out;
}

// WebP: libwebp's feature parser on the first bytes; the EXIF chunk of an extended (VP8X) file.
StoredSize webp_size(const HeaderReader& in, const std::string& name) {
  StoredSize out;
  // The features usually sit in the first 64 bytes; an extended file with large chunks before the
  // image (ICC profile) needs more, read in growing steps. Any status but OK reads on: for a bare
  // VP8 bitstream after the RIFF header (no "VP8 " chunk) libwebp reports a corrupt bitstream,
  // not missing data, until its whole first partition is in the buffer, and the decoder, which
  // has the whole file, decodes it. The file's end decides, as it does for the decoder.
  std::vector<uint8_t> head;
  WebPBitstreamFeatures features;
  VP8StatusCode status = VP8_STATUS_NOT_ENOUGH_DATA;
  for (uint64_t n = std::min<uint64_t>(in.size(), 64); status != VP8_STATUS_OK;
       n = std::min<uint64_t>(in.size(), n * 16)) {
    head = in.bytes(0, static_cast<size_t>(n), "WebP header");
    status = WebPGetFeatures(head.data(), head.size(), &features);
    if (n == in.size()) break;
  }
  CHECK(status == VP8_STATUS_OK, "image '", name, "': corrupt or truncated WebP header");
  CHECK(!features.has_animation, "image '", name, "': animated WebP is not supported; save one frame as a still image");
  out.height = features.height;
  out.width = features.width;
  if (head.size() >= 16 && std::memcmp(head.data() + 12, "VP8X", 4) == 0) {
    uint64_t at = 12;
    const uint64_t end = std::min<uint64_t>(in.size(), 8 + uint64_t{le32(head.data() + 4)});
    while (at + 8 <= end) {
      const std::vector<uint8_t> chunk = in.bytes(at, 8, "WebP chunk");
      const uint64_t length = le32(chunk.data() + 4);
      if (std::memcmp(chunk.data(), "EXIF", 4) == 0) {
        out.exif = in.bytes(at + 8, std::min<uint64_t>({length, kMaxExifBytes, in.size() - at - 8}), "WebP EXIF chunk");
        break;
      }
      at += 8 + length + (length & 1);
    }
  }
  return out;
}

}  // namespace

ImageSize read_image_header(const ByteReader& read, uint64_t file_size, const std::string& name, int64_t max_pixels) {
  CHECK(file_size > 0, "image '", name, "' is empty (0 bytes)");
  const HeaderReader in(read, file_size, name);
  const std::vector<uint8_t> magic = in.bytes(0, static_cast<size_t>(std::min<uint64_t>(file_size, 16)), "image header");
  StoredSize stored;
  switch (sniff_image_format(magic.data(), magic.size())) {
    case ImageFormat::jpeg: stored = jpeg_size(in, name); break;
    case ImageFormat::png: stored = png_size(in, name); break;
    case ImageFormat::webp: stored = webp_size(in, name); break;
    case ImageFormat::unknown: RAISE("image '", name, "': not a JPEG, PNG or WebP file (the supported formats)");
  }
  CHECK(stored.height > 0 && stored.width > 0, "image '", name, "' has no pixels (", stored.height, "x", stored.width, ")");
  // PNG allows sides up to 2^31 - 1 (JPEG 2^16, WebP 2^24): larger ones are corrupt, and their
  // product would not fit the size check.
  constexpr int64_t kMaxSide = (int64_t{1} << 31) - 1;
  CHECK(stored.height <= kMaxSide && stored.width <= kMaxSide, "image '", name, "': corrupt header (", stored.width,
        "x", stored.height, ")");
  check_decoded_size(stored.height, stored.width, max_pixels, name);
  const int orientation = exif_orientation(stored.exif.data(), stored.exif.size());
  return orientation >= 5 && orientation <= 8 ? ImageSize{stored.width, stored.height}
                                              : ImageSize{stored.height, stored.width};
}

ImageSize read_image_header(const uint8_t* data, size_t size, const std::string& name, int64_t max_pixels) {
  const ByteReader read = [&](uint64_t offset, size_t n, uint8_t* out) -> size_t {
    if (offset >= size) return 0;
    const size_t count = std::min<size_t>(n, size - offset);
    std::memcpy(out, data + offset, count);
    return count;
  };
  return read_image_header(read, size, name, max_pixels);
}

}  // namespace deltamoe
