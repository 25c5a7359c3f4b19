// WebP decoding with libwebp (lossy and lossless, alpha dropped); the EXIF chunk comes from the
// RIFF container through libwebpdemux. Animated WebP is refused rather than cut to one frame.
#include <webp/decode.h>
#include <webp/demux.h>

#include "core/error.h"
#include "data/image_codecs.h"

namespace deltamoe {
namespace {

const char* webp_status_text(VP8StatusCode status) {
  switch (status) {
    case VP8_STATUS_OUT_OF_MEMORY: return "out of memory";
    case VP8_STATUS_INVALID_PARAM: return "invalid parameter";
    case VP8_STATUS_BITSTREAM_ERROR: return "bitstream error";
    case VP8_STATUS_UNSUPPORTED_FEATURE: return "unsupported feature";
    case VP8_STATUS_SUSPENDED: return "suspended";
    case VP8_STATUS_USER_ABORT: return "aborted";
    case VP8_STATUS_NOT_ENOUGH_DATA: return "the file ends early (truncated)";
    default: return "unknown error";
  }
}

std::vector<uint8_t> read_webp_exif(const uint8_t* data, size_t size) {
  std::vector<uint8_t> exif;
  WebPData container{data, size};
  WebPDemuxer* demux = WebPDemux(&container);
  if (demux == nullptr) return exif;
  WebPChunkIterator chunk;
  if (WebPDemuxGetChunk(demux, "EXIF", 1, &chunk)) {
    exif.assign(chunk.chunk.bytes, chunk.chunk.bytes + chunk.chunk.size);
    WebPDemuxReleaseChunkIterator(&chunk);
  }
  WebPDemuxDelete(demux);
  return exif;
}

}  // namespace

DecodedImage decode_webp(const uint8_t* data, size_t size, const std::string& name, int64_t max_pixels) {
  WebPBitstreamFeatures features;
  const VP8StatusCode status = WebPGetFeatures(data, size, &features);
  CHECK(status == VP8_STATUS_OK, "image '", name, "': corrupt or truncated WebP (", webp_status_text(status), ")");
  CHECK(!features.has_animation, "image '", name, "': animated WebP is not supported; save one frame as a still image");
  check_decoded_size(features.height, features.width, max_pixels, name);
  DecodedImage decoded;
  RgbImage& image = decoded.image;
  image.height = features.height;
  image.width = features.width;
  image.pixels.resize(static_cast<size_t>(image.height * image.width) * 3);
  const uint8_t* result = WebPDecodeRGBInto(data, size, image.pixels.data(), image.pixels.size(),
                                            static_cast<int>(image.width * 3));
  CHECK(result != nullptr, "image '", name, "': corrupt or truncated WebP (decoding failed)");
  decoded.exif = read_webp_exif(data, size);
  return decoded;
}

}  // namespace deltamoe
