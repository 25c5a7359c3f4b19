// JSONL dataset files indexed once: the byte range of every non-blank line, so that any sample can
// be read again by number (shuffle, resume) without scanning the file. Several files are mixed by
// numbering their samples one after the other.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace deltamoe {

// One JSONL file. Reading lines is thread safe (pread on one descriptor).
class SampleSource {
 public:
  // Throws deltamoe::Error naming the path when it cannot be opened or read, or is not a regular
  // file (a directory, a device such as /dev/null, a FIFO).
  explicit SampleSource(const std::string& path);
  ~SampleSource();
  SampleSource(const SampleSource&) = delete;
  SampleSource& operator=(const SampleSource&) = delete;

  int64_t size() const { return static_cast<int64_t>(offsets_.size()); }
  const std::string& path() const { return path_; }
  // Folder that relative image paths are resolved against.
  const std::string& directory() const { return directory_; }
  // Text of sample i (without the line break) and its 1-based line number in the file.
  std::string read(int64_t i) const;
  int64_t line_number(int64_t i) const { return line_numbers_[static_cast<size_t>(i)]; }
  // Bytes of sample i's line (known from the index, without reading it).
  int64_t length(int64_t i) const { return lengths_[static_cast<size_t>(i)]; }

 private:
  std::string path_, directory_;
  int fd_ = -1;
  std::vector<uint64_t> offsets_;
  std::vector<uint32_t> lengths_;
  std::vector<int64_t> line_numbers_;
};

// Several files, samples numbered file by file.
class DatasetFiles {
 public:
  explicit DatasetFiles(const std::vector<std::string>& paths);

  int64_t size() const { return total_; }
  struct Location {
    const SampleSource* source;
    int64_t index;  // within source
  };
  Location locate(int64_t sample_index) const;
  // "file:line" for messages.
  std::string where(int64_t sample_index) const;
  const std::vector<std::unique_ptr<SampleSource>>& sources() const { return sources_; }

 private:
  std::vector<std::unique_ptr<SampleSource>> sources_;
  std::vector<int64_t> starts_;  // first global index of each file
  int64_t total_ = 0;
};

// Splits "a.jsonl,b.jsonl" (empty entries ignored).
std::vector<std::string> split_dataset_list(const std::string& list);

}  // namespace deltamoe
