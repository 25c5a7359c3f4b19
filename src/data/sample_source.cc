// Line indexing and positional reads of JSONL files.
#include "data/sample_source.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>

#include "core/error.h"

namespace deltamoe {
namespace {

bool is_blank(const char* begin, const char* end) {
  return std::all_of(begin, end, [](char c) { return c == ' ' || c == '\t' || c == '\r'; });
}

}  // namespace

SampleSource::SampleSource(const std::string& path) : path_(path) {
  directory_ = std::filesystem::absolute(std::filesystem::path(path)).parent_path().string();
  fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);  // O_NONBLOCK: a FIFO must not block here
  CHECK(fd_ >= 0, "cannot open dataset '", path, "': ", std::strerror(errno));
  struct stat info {};
  const bool regular = ::fstat(fd_, &info) == 0 && S_ISREG(info.st_mode);
  if (!regular) {
    const bool directory = S_ISDIR(info.st_mode);
    ::close(fd_);
    fd_ = -1;
    RAISE("dataset '", path, "' is ", directory ? "a directory" : "not a regular file (a device or FIFO?)",
          "; give JSONL files");
  }
  // One pass in large chunks; a line may span chunks, so only its start offset is carried over.
  std::vector<char> chunk(1 << 20);
  uint64_t chunk_offset = 0, line_start = 0;
  int64_t line_number = 1;
  bool pending_blank = true;  // the current line has only white space so far (it may span chunks)
  const auto finish_line = [&](uint64_t end) {
    if (!pending_blank) {
      CHECK(end - line_start <= std::numeric_limits<uint32_t>::max(), path, ":", line_number, ": line longer than 4 GiB");
      offsets_.push_back(line_start);
      lengths_.push_back(static_cast<uint32_t>(end - line_start));
      line_numbers_.push_back(line_number);
    }
    pending_blank = true;
  };
  for (;;) {
    const ssize_t got = ::pread(fd_, chunk.data(), chunk.size(), static_cast<off_t>(chunk_offset));
    CHECK(got >= 0, "cannot read dataset '", path, "': ", std::strerror(errno));
    if (got == 0) break;
    const char* data = chunk.data();
    size_t pos = 0;
    while (pos < static_cast<size_t>(got)) {
      const void* newline = std::memchr(data + pos, '\n', static_cast<size_t>(got) - pos);
      const size_t end = newline ? static_cast<size_t>(static_cast<const char*>(newline) - data) : static_cast<size_t>(got);
      if (pending_blank && !is_blank(data + pos, data + end)) pending_blank = false;
      if (!newline) break;
      finish_line(chunk_offset + end);
      ++line_number;
      line_start = chunk_offset + end + 1;
      pos = end + 1;
    }
    chunk_offset += static_cast<uint64_t>(got);
  }
  finish_line(chunk_offset);
}

SampleSource::~SampleSource() {
  if (fd_ >= 0) ::close(fd_);
}

std::string SampleSource::read(int64_t i) const {
  CHECK(i >= 0 && i < size(), "sample ", i, " out of range for '", path_, "' (", size(), " samples)");
  std::string text(lengths_[static_cast<size_t>(i)], '\0');
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t got = ::pread(fd_, text.data() + done, text.size() - done,
                                static_cast<off_t>(offsets_[static_cast<size_t>(i)] + done));
    CHECK(got > 0, "cannot read '", path_, "' line ", line_numbers_[static_cast<size_t>(i)], ": ",
          got == 0 ? "file shrank since it was indexed" : std::strerror(errno));
    done += static_cast<size_t>(got);
  }
  if (!text.empty() && text.back() == '\r') text.pop_back();
  return text;
}

DatasetFiles::DatasetFiles(const std::vector<std::string>& paths) {
  CHECK(!paths.empty(), "no dataset files given");
  for (const std::string& path : paths) {
    sources_.push_back(std::make_unique<SampleSource>(path));
    starts_.push_back(total_);
    total_ += sources_.back()->size();
  }
}

DatasetFiles::Location DatasetFiles::locate(int64_t sample_index) const {
  CHECK(sample_index >= 0 && sample_index < total_, "sample ", sample_index, " out of range (", total_, " samples)");
  const size_t file = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), sample_index) - starts_.begin()) - 1;
  // Empty files share a start with the next one; upper_bound lands on the last of them, which holds the sample.
  return {sources_[file].get(), sample_index - starts_[file]};
}

std::string DatasetFiles::where(int64_t sample_index) const {
  const Location location = locate(sample_index);
  return str_cat(location.source->path(), ":", location.source->line_number(location.index));
}

std::vector<std::string> split_dataset_list(const std::string& list) {
  std::vector<std::string> paths;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    if (comma > start) paths.push_back(list.substr(start, comma - start));
    start = comma + 1;
  }
  return paths;
}

}  // namespace deltamoe
