// Image reading for samples: bytes from a regular file or a data URL (both size-capped), then
// decode (pixel-capped) + preprocess.
#include "data/sample_image.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <new>
#include <vector>

#include "data/base64.h"
#include "data/image_header.h"
#include "data/image_resize.h"
#include "data/sample_skip.h"

namespace deltamoe {
namespace {

std::atomic<int64_t> g_images_decoded{0};

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// An image file opened for reading: only regular files within the size cap. O_NONBLOCK: opening a
// FIFO must not wait for a writer; the fstat refuses it anyway.
class ImageFile {
 public:
  ImageFile(const std::string& path, int64_t max_bytes, const std::string& where) : name_(where + ": image '" + path + "'") {
    fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd_ < 0) throw SampleSkip(SkipReason::kMissingImage, name_ + ": cannot open: " + std::strerror(errno));
    struct stat info {};
    if (::fstat(fd_, &info) != 0) {
      const std::string error = std::strerror(errno);
      ::close(fd_);
      throw SampleSkip(SkipReason::kMissingImage, name_ + ": cannot stat: " + error);
    }
    if (!S_ISREG(info.st_mode)) {
      ::close(fd_);
      throw SampleSkip(SkipReason::kBadImage, name_ + " is " + file_kind(info.st_mode) + ", not an image file");
    }
    if (info.st_size > max_bytes) {
      ::close(fd_);
      throw SampleSkip(SkipReason::kBadImage, str_cat(name_, " is ", info.st_size, " bytes, over the ", max_bytes, "-byte limit"));
    }
    size_ = static_cast<uint64_t>(info.st_size);
  }
  ~ImageFile() { ::close(fd_); }
  ImageFile(const ImageFile&) = delete;
  ImageFile& operator=(const ImageFile&) = delete;
  uint64_t size() const { return size_; }

  // Up to n bytes at offset (fewer only at the end of the file).
  size_t read(uint64_t offset, size_t n, uint8_t* out) const {
    size_t done = 0;
    while (done < n) {
      const ssize_t got = ::pread(fd_, out + done, n - done, static_cast<off_t>(offset + done));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) throw SampleSkip(SkipReason::kMissingImage, name_ + ": read failed: " + std::strerror(errno));
      if (got == 0) break;
      done += static_cast<size_t>(got);
    }
    return done;
  }

  // Exactly size() bytes: files that report 0 (procfs) read as empty and are refused by the decoder.
  std::vector<uint8_t> all() const {
    std::vector<uint8_t> bytes(static_cast<size_t>(size_));
    if (read(0, bytes.size(), bytes.data()) != bytes.size()) {
      throw SampleSkip(SkipReason::kMissingImage, name_ + ": read failed: the file shrank while read");
    }
    return bytes;
  }

 private:
  std::string name_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

std::vector<uint8_t> read_file_bytes(const std::string& path, int64_t max_bytes, const std::string& where) {
  return ImageFile(path, max_bytes, where).all();
}

// A data URL's bytes within the size cap.
std::vector<uint8_t> data_url_bytes(const std::string& ref, const ImageReadLimits& limits, const std::string& where,
                                    const std::string& name) {
  std::vector<uint8_t> bytes;
  try {
    bytes = decode_data_url(ref, where);
  } catch (const Error& error) {
    throw SampleSkip(SkipReason::kBadImage, error.what());
  }
  if (static_cast<int64_t>(bytes.size()) > limits.max_file_bytes) {
    throw SampleSkip(SkipReason::kBadImage, str_cat(name, " is ", bytes.size(), " bytes, over the ",
                                                    limits.max_file_bytes, "-byte limit"));
  }
  return bytes;
}

}  // namespace

int64_t sample_images_decoded() { return g_images_decoded.load(); }

ImagePatches load_sample_image(const std::string& ref, const ImagePreprocessConfig& config,
                               const ImageReadLimits& limits, const std::string& where) {
  ++g_images_decoded;
  const bool embedded = is_data_url(ref);
  const std::string name = embedded ? where + ": data URL image" : where + ": " + ref;
  const std::vector<uint8_t> bytes =
      embedded ? data_url_bytes(ref, limits, where, name) : read_file_bytes(ref, limits.max_file_bytes, where);
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

ImagePatches measure_sample_image(const std::string& ref, const ImagePreprocessConfig& config,
                                  const ImageReadLimits& limits, const std::string& where) {
  const bool embedded = is_data_url(ref);
  const std::string name = embedded ? where + ": data URL image" : where + ": " + ref;
  try {
    ImageSize stored;
    if (embedded) {
      const std::vector<uint8_t> bytes = data_url_bytes(ref, limits, where, name);
      stored = read_image_header(bytes.data(), bytes.size(), name, limits.max_decoded_pixels);
    } else {
      const ImageFile file(ref, limits.max_file_bytes, where);
      const ByteReader read = [&](uint64_t offset, size_t n, uint8_t* out) { return file.read(offset, n, out); };
      stored = read_image_header(read, file.size(), name, limits.max_decoded_pixels);
    }
    const ImageSize target = smart_resize(stored.height, stored.width, config.min_pixels, config.max_pixels,
                                          config.patch_size * config.merge_size, name);
    ImagePatches patches;
    patches.grid_thw = {1, target.height / config.patch_size, target.width / config.patch_size};
    return patches;
  } catch (const SampleSkip&) {
    throw;
  } catch (const Error& error) {
    throw SampleSkip(SkipReason::kBadImage, error.what());
  }
}

}  // namespace deltamoe
