// Dataset files indexed once: the byte range of every non-blank JSONL line, or of every element of a
// file holding one JSON array ([{...}, {...}], as .json datasets do), so that any sample can be read
// again by number (shuffle, resume) without scanning the file. Several files are mixed by numbering
// their samples one after the other; "file#N" (ms-swift's suffix) takes N of a file's samples.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace deltamoe {

// One JSONL file or JSON array file. Reading samples is thread safe (pread on one descriptor).
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
  // Whether the file is one JSON array (its elements are the samples) rather than JSONL.
  bool is_json_array() const { return json_array_; }
  // Text of sample i (without the line break) and the 1-based line number where it starts.
  std::string read(int64_t i) const;
  int64_t line_number(int64_t i) const { return line_numbers_[static_cast<size_t>(i)]; }
  // Bytes of sample i's line (known from the index, without reading it).
  int64_t length(int64_t i) const { return lengths_[static_cast<size_t>(i)]; }

 private:
  void index_lines();
  bool index_json_array(uint64_t start);  // false: not one array (a JSONL file starting with one)

  std::string path_, directory_;
  int fd_ = -1;
  bool json_array_ = false;
  std::vector<uint64_t> offsets_;
  std::vector<uint32_t> lengths_;
  std::vector<int64_t> line_numbers_;
};

// "data.jsonl#500": the file and how many of its samples to take (-1: all). A path that exists as
// written is taken whole even when it ends in #N.
struct DatasetSpec {
  std::string path;
  int64_t sample_count = -1;
};
DatasetSpec parse_dataset_spec(const std::string& spec);

// Several files, samples numbered file by file. A spec with #N takes N samples of its file as
// ms-swift does: N below the file's count draws N distinct ones, above it repeats the whole file
// N / count times plus N % count drawn ones; the draw depends only on (sample_seed, file position).
class DatasetFiles {
 public:
  explicit DatasetFiles(const std::vector<std::string>& specs, uint64_t sample_seed = 42);

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
  std::vector<std::vector<int64_t>> selections_;  // per file: its samples taken (#N), empty = all in order
  std::vector<int64_t> starts_;  // first global index of each file
  int64_t total_ = 0;
};

// Splits "a.jsonl,b.jsonl" (empty entries ignored).
std::vector<std::string> split_dataset_list(const std::string& list);

}  // namespace deltamoe
