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
#include "core/log.h"
#include "core/rng.h"

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
  // A file whose first character (after a byte-order mark and white space) is '[' is one JSON array.
  std::vector<char> head(4096);
  const ssize_t got = ::pread(fd_, head.data(), head.size(), 0);
  CHECK(got >= 0, "cannot read dataset '", path, "': ", std::strerror(errno));
  size_t first = got >= 3 && std::memcmp(head.data(), "\xEF\xBB\xBF", 3) == 0 ? 3 : 0;
  while (first < static_cast<size_t>(got) && std::strchr(" \t\r\n", head[first]) != nullptr) ++first;
  json_array_ = first < static_cast<size_t>(got) && head[first] == '[' && index_json_array(first);
  if (!json_array_) index_lines();
}

void SampleSource::index_lines() {
  // One pass in large chunks; a line may span chunks, so only its start offset is carried over.
  std::vector<char> chunk(1 << 20);
  uint64_t chunk_offset = 0, line_start = 0;
  int64_t line_number = 1;
  bool pending_blank = true;  // the current line has only white space so far (it may span chunks)
  const auto finish_line = [&](uint64_t end) {
    if (!pending_blank) {
      CHECK(end - line_start <= std::numeric_limits<uint32_t>::max(), path_, ":", line_number, ": line longer than 4 GiB");
      offsets_.push_back(line_start);
      lengths_.push_back(static_cast<uint32_t>(end - line_start));
      line_numbers_.push_back(line_number);
    }
    pending_blank = true;
  };
  for (;;) {
    const ssize_t got = ::pread(fd_, chunk.data(), chunk.size(), static_cast<off_t>(chunk_offset));
    CHECK(got >= 0, "cannot read dataset '", path_, "': ", std::strerror(errno));
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


// The elements of one top-level JSON array: each element's byte range and starting line, found by
// tracking nesting and strings in one pass (elements are parsed only when read).
bool SampleSource::index_json_array(uint64_t start) {
  std::vector<char> chunk(1 << 20);
  uint64_t chunk_offset = start + 1;  // after the '['
  int64_t line_number = 1;
  for (uint64_t i = 0; i < start; ) {  // lines before the '['
    const ssize_t got = ::pread(fd_, chunk.data(), std::min<uint64_t>(chunk.size(), start - i), static_cast<off_t>(i));
    CHECK(got > 0, "cannot read dataset '", path_, "'");
    line_number += std::count(chunk.data(), chunk.data() + got, '\n');
    i += static_cast<uint64_t>(got);
  }
  int64_t depth = 0;  // nesting inside the current element
  bool in_string = false, escaped = false, in_element = false, closed = false;
  uint64_t after_close = 0;
  uint64_t element_start = 0, element_end = 0;  // end: one past the last non-white character
  int64_t element_line = 0;
  const auto finish = [&] {
    CHECK(element_end - element_start <= std::numeric_limits<uint32_t>::max(), path_, ":", element_line,
          ": element longer than 4 GiB");
    offsets_.push_back(element_start);
    lengths_.push_back(static_cast<uint32_t>(element_end - element_start));
    line_numbers_.push_back(element_line);
    in_element = false;
  };
  while (!closed) {
    const ssize_t got = ::pread(fd_, chunk.data(), chunk.size(), static_cast<off_t>(chunk_offset));
    CHECK(got >= 0, "cannot read dataset '", path_, "': ", std::strerror(errno));
    if (got == 0) break;
    for (ssize_t k = 0; k < got && !closed; ++k) {
      const char c = chunk[static_cast<size_t>(k)];
      const uint64_t at = chunk_offset + static_cast<uint64_t>(k);
      if (c == '\n') ++line_number;
      if (in_string) {
        if (escaped) escaped = false;
        else if (c == '\\') escaped = true;
        else if (c == '"') in_string = false;
        element_end = at + 1;
        continue;
      }
      if (c == ' ' || c == '\t' || c == '\r' || c == '\n') continue;
      if (depth == 0 && (c == ',' || c == ']')) {
        if (in_element) finish();
        if (c == ']') {
          closed = true;
          after_close = at + 1;
        }
        continue;
      }
      if (!in_element) {
        in_element = true;
        element_start = at;
        element_line = line_number;
      }
      if (c == '"') in_string = true;
      else if (c == '{' || c == '[') ++depth;
      else if (c == '}' || c == ']') --depth;
      element_end = at + 1;
    }
    chunk_offset += static_cast<uint64_t>(got);
  }
  if (in_element) finish();  // an array cut short: its last element fails to parse and is skipped
  if (!closed) log_warn("dataset '", path_, "': the JSON array is not closed (the file ends early?)");
  // Anything but white space after the array: a JSONL file whose first line is an array.
  for (uint64_t at = closed ? after_close : chunk_offset;;) {
    const ssize_t got = ::pread(fd_, chunk.data(), chunk.size(), static_cast<off_t>(at));
    CHECK(got >= 0, "cannot read dataset '", path_, "': ", std::strerror(errno));
    if (got == 0) break;
    if (!std::all_of(chunk.data(), chunk.data() + got, [](char c) { return std::strchr(" \t\r\n", c) != nullptr; })) {
      offsets_.clear();
      lengths_.clear();
      line_numbers_.clear();
      return false;
    }
    at += static_cast<uint64_t>(got);
  }
  return true;
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

DatasetSpec parse_dataset_spec(const std::string& spec) {
  const size_t hash = spec.rfind('#');
  if (hash == std::string::npos || hash + 1 >= spec.size() || std::filesystem::exists(spec)) return {spec, -1};
  const std::string count = spec.substr(hash + 1);
  if (!std::all_of(count.begin(), count.end(), [](char c) { return c >= '0' && c <= '9'; }) || count.size() > 12) {
    return {spec, -1};
  }
  return {spec.substr(0, hash), std::stoll(count)};
}

namespace {

// A Philox stream of its own for the #N draws (not shared with the epoch shuffle or the split).
constexpr uint64_t kSampleStream = 0x5a3d;

// ms-swift's dataset_sample: N below the count draws N distinct samples; above it, every sample
// N / count times plus N % count drawn ones. Sorted, so reads stay in file order.
std::vector<int64_t> select_samples(int64_t count, int64_t wanted, uint64_t seed, size_t file_index) {
  std::vector<int64_t> selection;
  if (count == 0) return selection;
  for (int64_t repeat = 0; repeat < wanted / count; ++repeat) {
    for (int64_t i = 0; i < count; ++i) selection.push_back(i);
  }
  const int64_t drawn = wanted % count;
  std::vector<int64_t> order(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) order[static_cast<size_t>(i)] = i;
  Rng rng(seed + file_index, kSampleStream);
  for (int64_t i = 0; i < drawn; ++i) {  // a partial Fisher-Yates: the first `drawn` of a permutation
    const int64_t j = i + static_cast<int64_t>(rng.below(static_cast<uint64_t>(count - i)));
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  selection.insert(selection.end(), order.begin(), order.begin() + drawn);
  std::sort(selection.begin(), selection.end());
  return selection;
}

}  // namespace

DatasetFiles::DatasetFiles(const std::vector<std::string>& specs, uint64_t sample_seed) {
  CHECK(!specs.empty(), "no dataset files given");
  for (const std::string& text : specs) {
    const DatasetSpec spec = parse_dataset_spec(text);
    sources_.push_back(std::make_unique<SampleSource>(spec.path));
    selections_.push_back(spec.sample_count >= 0 ? select_samples(sources_.back()->size(), spec.sample_count,
                                                                  sample_seed, sources_.size() - 1)
                                                 : std::vector<int64_t>{});
    CHECK(spec.sample_count <= 0 || sources_.back()->size() > 0, "dataset '", text, "': ", spec.path,
          " holds no samples to take ", spec.sample_count, " from");
    starts_.push_back(total_);
    total_ += spec.sample_count >= 0 ? spec.sample_count : sources_.back()->size();
  }
}

DatasetFiles::Location DatasetFiles::locate(int64_t sample_index) const {
  CHECK(sample_index >= 0 && sample_index < total_, "sample ", sample_index, " out of range (", total_, " samples)");
  const size_t file = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), sample_index) - starts_.begin()) - 1;
  // Empty files share a start with the next one; upper_bound lands on the last of them, which holds the sample.
  const int64_t index = sample_index - starts_[file];
  const std::vector<int64_t>& selection = selections_[file];
  return {sources_[file].get(), selection.empty() && index < sources_[file]->size() ? index
                                                                                     : selection[static_cast<size_t>(index)]};
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
