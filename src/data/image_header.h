// An image's size from its file header (JPEG SOF, PNG IHDR, WebP VP8/VP8L/VP8X) and its EXIF
// orientation (which swaps the sides for orientations 5-8), without decoding a pixel: what the pass
// before step 1 needs to count each sample's image tokens. The sizes equal decode_image's.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "data/image_resize.h"

namespace deltamoe {

// Reads up to n bytes at offset into out; returns how many it read (fewer only at the end).
using ByteReader = std::function<size_t(uint64_t offset, size_t n, uint8_t* out)>;

// The upright size (after EXIF orientation) of the image in [0, file_size). Reads only headers:
// JPEG segments up to the frame header, PNG chunk headers (and an eXIf chunk), WebP chunk headers
// (and an EXIF chunk). Throws deltamoe::Error naming `name` for unsupported, empty or truncated
// headers, and (check_decoded_size) for a stored size over max_pixels.
ImageSize read_image_header(const ByteReader& read, uint64_t file_size, const std::string& name, int64_t max_pixels);

// The same for an in-memory file.
ImageSize read_image_header(const uint8_t* data, size_t size, const std::string& name, int64_t max_pixels);

}  // namespace deltamoe
