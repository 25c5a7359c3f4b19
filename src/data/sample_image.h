// Loads one image of a sample (a file path or a data URL) and preprocesses it into patches,
// turning every failure into a SampleSkip with the reason (missing file vs undecodable image).
#pragma once

#include <string>

#include "data/image_preprocess.h"

namespace deltamoe {

// ref: a resolved path or a data: URL (see resolve_image_ref). Throws SampleSkip naming `where`.
ImagePatches load_sample_image(const std::string& ref, const ImagePreprocessConfig& config, const std::string& where);

}  // namespace deltamoe
