// Image reading for samples: bytes from a regular file or a data URL (both size-capped), then
// decode (pixel-capped) + preprocess.
#include "data/sample_image.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <vector>

#include "data/base64.h"
#include "data/sample_skip.h"

namespace deltamoe {
namespace {

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// O_NONBLOCK: opening a FIFO must not wait for a writer; the fstat below refuses it anyway.
std::vector<uint8_t> read_file_bytes(const std::string& path, int64_t max_bytes, const std::string& where) {
  const std::string name = where + ": image '" + path + "'";
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw SampleSkip(SkipReason::kMissingImage, name + ": cannot open: " + std::strerror(errno));
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat info {};
  if (::fstat(fd, &info) != 0) throw SampleSkip(SkipReason::kMissingImage, name + ": cannot stat: " + std::strerror(errno));
  if (!S_ISREG(info.st_mode)) throw SampleSkip(SkipReason::kBadImage, name + " is " + file_kind(info.st_mode) + ", not an image file");
  if (info.st_size > max_bytes) {
    throw SampleSkip(SkipReason::kBadImage, str_cat(name, " is ", info.st_size, " bytes, over the ", max_bytes, "-byte limit"));
  }
  // Exactly st_size bytes: files that report 0 (procfs) read as empty and are refused by the decoder.
  std::vector<uint8_t> bytes(static_cast<size_t>(info.st_size));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t got = ::pread(fd, bytes.data() + done, bytes.size() - done, static_cast<off_t>(done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      throw SampleSkip(SkipReason::kMissingImage,
                       name + ": read failed: " + (got == 0 ? std::string("the file shrank while read") : std::strerror(errno)));
    }
    done += static_cast<size_t>(got);
  }
  return bytes;
}

}  // namespace

ImagePatches load_sample_image(const std::string& ref, const ImagePreprocessConfig& config,
                               const ImageReadLimits& limits, const std::string& where) {
  const bool embedded = is_data_url(ref);
  const std::string name = embedded ? where + ": data URL image" : where + ": " + ref;
  std::vector<uint8_t> bytes;
  if (embedded) {
    try {
      bytes = decode_data_url(ref, where);
    } catch (const Error& error) {
      throw SampleSkip(SkipReason::kBadImage, error.what());
    }
    if (static_cast<int64_t>(bytes.size()) > limits.max_file_bytes) {
      throw SampleSkip(SkipReason::kBadImage, str_cat(name, " is ", bytes.size(), " bytes, over the ",
                                                      limits.max_file_bytes, "-byte limit"));
    }
  } else {
    bytes = read_file_bytes(ref, limits.max_file_bytes, where);
  }
  try {
    return preprocess_image(decode_image(bytes.data(), bytes.size(), name, limits.max_decoded_pixels), config, name);
  } catch (const SampleSkip&) {
    throw;
  } catch (const Error& error) {
    throw SampleSkip(SkipReason::kBadImage, error.what());  // the decoders' messages name the image
  } catch (const std::bad_alloc&) {
    throw SampleSkip(SkipReason::kBadImage, "image '" + name + "': out of memory while decoding");
  } catch (const std::exception& error) {
    throw SampleSkip(SkipReason::kBadImage, "image '" + name + "': " + error.what());
  }
}

}  // namespace deltamoe
