// JPEG decoding with libjpeg(-turbo): grey and YCbCr come out as RGB, Adobe CMYK/YCCK is turned
// into RGB with PIL's formula. A file that ends early is an error (PIL refuses truncated files too).
#include <algorithm>
#include <csetjmp>
#include <cstdio>
// NOTE: jpeglib.h needs size_t and FILE declared before it.
#include <jerror.h>
#include <jpeglib.h>

#include "core/error.h"
#include "data/image_codecs.h"

namespace deltamoe {
namespace {

struct JpegErrorManager {
  jpeg_error_mgr base;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX] = {};
  bool truncated = false;
  int64_t max_pixels = 0;
  bool too_large = false;  // the header's size is over max_pixels (stopped before decoding)
};

[[noreturn]] void on_jpeg_error(j_common_ptr cinfo) {
  auto* manager = reinterpret_cast<JpegErrorManager*>(cinfo->err);
  cinfo->err->format_message(cinfo, manager->message);
  std::longjmp(manager->jump, 1);
}

// Warnings are ignored (as PIL does), except missing data: at the end of the file (JPEG_EOF) or
// of a scan (HIT_MARKER) libjpeg would pad the rest of the image with grey, which must not silently
// become training data. Decoding stops right there (a 700-byte file may claim a huge image).
void on_jpeg_message(j_common_ptr cinfo, int level) {
  auto* manager = reinterpret_cast<JpegErrorManager*>(cinfo->err);
  if (level < 0 && (cinfo->err->msg_code == JWRN_JPEG_EOF || cinfo->err->msg_code == JWRN_HIT_MARKER)) {
    manager->truncated = true;
    cinfo->err->format_message(cinfo, manager->message);
    std::longjmp(manager->jump, 1);
  }
}

// PIL's cmyk2rgb: channel = (255 - k) - (c * (255 - k)) / 255, with PIL's rounded division.
uint8_t cmyk_channel(int ink, int black) {
  const int not_black = 255 - black;
  const int product = ink * not_black + 128;
  const int scaled = ((product >> 8) + product) >> 8;
  return static_cast<uint8_t>(not_black - scaled);
}

// All libjpeg calls live here so that longjmp crosses no C++ destructors. Returns false with
// manager.message set on error; `planar` receives rows of `components` bytes per pixel.
bool run_jpeg_decoder(const uint8_t* data, size_t size, JpegErrorManager& manager, jpeg_decompress_struct& cinfo,
                      std::vector<uint8_t>& pixels, std::vector<uint8_t>& exif, int& components, bool& inverted_cmyk) {
  if (setjmp(manager.jump)) {
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(size));
  jpeg_save_markers(&cinfo, JPEG_APP0 + 1, 0xFFFF);
  jpeg_read_header(&cinfo, TRUE);
  if (static_cast<int64_t>(cinfo.image_width) * cinfo.image_height > manager.max_pixels) {
    manager.too_large = true;
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  for (jpeg_saved_marker_ptr marker = cinfo.marker_list; marker != nullptr; marker = marker->next) {
    if (marker->marker == JPEG_APP0 + 1 && marker->data_length >= 6 && std::equal(marker->data, marker->data + 6, "Exif\0\0")) {
      exif.assign(marker->data, marker->data + marker->data_length);
      break;
    }
  }
  const bool cmyk = cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK;
  cinfo.out_color_space = cmyk ? JCS_CMYK : JCS_RGB;
  inverted_cmyk = cmyk && cinfo.saw_Adobe_marker;
  jpeg_start_decompress(&cinfo);
  components = cinfo.output_components;
  const size_t row_bytes = static_cast<size_t>(cinfo.output_width) * components;
  pixels.resize(row_bytes * cinfo.output_height);
  while (cinfo.output_scanline < cinfo.output_height) {
    JSAMPROW row = pixels.data() + row_bytes * cinfo.output_scanline;
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  return true;
}

}  // namespace

DecodedImage decode_jpeg(const uint8_t* data, size_t size, const std::string& name, int64_t max_pixels) {
  JpegErrorManager manager;
  manager.max_pixels = max_pixels;
  jpeg_decompress_struct cinfo{};
  cinfo.err = jpeg_std_error(&manager.base);
  manager.base.error_exit = on_jpeg_error;
  manager.base.emit_message = on_jpeg_message;
  std::vector<uint8_t> pixels;
  DecodedImage decoded;
  int components = 0;
  bool inverted_cmyk = false;
  if (!run_jpeg_decoder(data, size, manager, cinfo, pixels, decoded.exif, components, inverted_cmyk)) {
    if (manager.too_large) check_decoded_size(cinfo.image_height, cinfo.image_width, max_pixels, name);
    if (manager.truncated) {
      RAISE("image '", name, "': truncated JPEG (the image data ends early: ", manager.message, ")");
    }
    RAISE("image '", name, "': corrupt or truncated JPEG (", manager.message, ")");
  }
  RgbImage& image = decoded.image;
  image.height = cinfo.output_height;
  image.width = cinfo.output_width;
  if (components == 3) {
    image.pixels = std::move(pixels);
    return decoded;
  }
  CHECK(components == 4, "image '", name, "': JPEG with ", components, " output channels is not supported");
  image.pixels.resize(static_cast<size_t>(image.height * image.width) * 3);
  for (int64_t i = 0; i < image.height * image.width; ++i) {
    int ink[4];
    for (int c = 0; c < 4; ++c) ink[c] = inverted_cmyk ? 255 - pixels[i * 4 + c] : pixels[i * 4 + c];
    for (int c = 0; c < 3; ++c) image.pixels[i * 3 + c] = cmyk_channel(ink[c], ink[3]);
  }
  return decoded;
}

}  // namespace deltamoe
