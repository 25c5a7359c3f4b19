// Image reading for samples: bytes from a file or a data URL, then decode + preprocess.
#include "data/sample_image.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <vector>

#include "data/base64.h"
#include "data/sample_skip.h"

namespace deltamoe {
namespace {

std::vector<uint8_t> read_file_bytes(const std::string& path, const std::string& where) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw SampleSkip(SkipReason::kMissingImage, where + ": cannot open image '" + path + "': " + std::strerror(errno));
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw SampleSkip(SkipReason::kMissingImage, where + ": cannot read image '" + path + "'");
  return bytes;
}

}  // namespace

ImagePatches load_sample_image(const std::string& ref, const ImagePreprocessConfig& config, const std::string& where) {
  const bool embedded = is_data_url(ref);
  const std::string name = embedded ? where + ": data URL image" : where + ": " + ref;
  std::vector<uint8_t> bytes;
  if (embedded) {
    try {
      bytes = decode_data_url(ref, where);
    } catch (const Error& error) {
      throw SampleSkip(SkipReason::kBadImage, error.what());
    }
  } else {
    bytes = read_file_bytes(ref, where);
  }
  try {
    return preprocess_image(decode_image(bytes.data(), bytes.size(), name), config, name);
  } catch (const SampleSkip&) {
    throw;
  } catch (const std::exception& error) {
    // Error from the decoders, or bad_alloc / length_error from absurd header sizes.
    throw SampleSkip(SkipReason::kBadImage, error.what());
  }
}

}  // namespace deltamoe
