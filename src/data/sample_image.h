// Loads one image of a sample (a file path or a data URL) and preprocesses it into patches,
// turning every failure into a SampleSkip with the reason (missing file vs undecodable image).
#pragma once

#include <cstdint>
#include <string>

#include "data/image_decode.h"
#include "data/image_preprocess.h"

namespace deltamoe {

// What one image may cost before it is refused (a skip, never an allocation that ends the run).
struct ImageReadLimits {
  int64_t max_file_bytes = int64_t{256} << 20;          // the file (or data URL payload)
  int64_t max_decoded_pixels = kDefaultMaxDecodedPixels;  // width x height as the header states it
};

// ref: a resolved path or a data: URL (see resolve_image_ref). Only regular files are read
// (directories, FIFOs and devices are skipped without blocking). Throws SampleSkip naming `where`
// and the image.
ImagePatches load_sample_image(const std::string& ref, const ImagePreprocessConfig& config,
                               const ImageReadLimits& limits, const std::string& where);

// Calls of load_sample_image in this process so far (tests count which images a rank decodes).
int64_t sample_images_decoded();

// The same image's patch grid without its pixels: the size comes from the file's header
// (read_image_header), so nothing is decoded; pixel_values stays empty. The same files are refused
// as by load_sample_image, except those whose data is corrupt after a good header (the decode in
// training skips them).
ImagePatches measure_sample_image(const std::string& ref, const ImagePreprocessConfig& config,
                                  const ImageReadLimits& limits, const std::string& where);

}  // namespace deltamoe
