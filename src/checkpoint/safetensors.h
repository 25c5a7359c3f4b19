// safetensors files: a validating mmap reader and a streamed writer.
// Format: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets},
// "__metadata__": {str: str}}, then the data region; offsets are relative to the data region.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/stored_tensor.h"
#include "core/dtype.h"
#include "core/tensor.h"

namespace deltamoe {

struct SafetensorsEntry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin = 0;  // byte offsets in the data region
  uint64_t end = 0;
};

// A read-only memory mapping of one safetensors file. open() validates everything (header length,
// JSON, dtypes, shapes, offsets inside the file, sizes matching shapes, no overlaps) and throws a
// deltamoe::Error naming the file and tensor on the first violation. Pages are read lazily by
// the OS, so opening a 70 GB file costs no RAM.
class SafetensorsFile : public std::enable_shared_from_this<SafetensorsFile> {
 public:
  static std::shared_ptr<SafetensorsFile> open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // Entries sorted by their position in the data region.
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const SafetensorsEntry* find(const std::string& name) const;
  bool contains(const std::string& name) const { return find(name) != nullptr; }
  // The tensor's bytes as a StoredTensor that keeps this mapping alive. Throws if absent.
  // NOTE: the bytes may be unaligned (the header length need not be a multiple of 8).
  StoredTensor tensor(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  const uint8_t* map_ = nullptr;
  size_t file_size_ = 0;
  const uint8_t* data_ = nullptr;  // start of the data region
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// Parses and validates a header (the JSON text) against a data region of `data_size` bytes.
// `where` is the file name used in messages. Exposed for tests and for sharded index checks.
std::vector<SafetensorsEntry> parse_safetensors_header(const std::string& header_json, uint64_t data_size,
                                                       const std::string& where,
                                                       std::map<std::string, std::string>* metadata);

struct NamedTensor {
  std::string name;
  StoredTensor tensor;
};

// Where write_safetensors puts each tensor: the file's first bytes (the 8-byte header length and
// the JSON header padded to 8 bytes) and the file offset of each tensor's bytes. The prefix
// followed by every tensor's bytes at its offset is write_safetensors' file byte for byte, which
// is how several processes write parts of one file (checkpoint/model_dir_writer.h).
struct SafetensorsLayout {
  std::string prefix;            // length field + header
  std::vector<size_t> order;     // input indices in data order
  std::vector<uint64_t> offsets; // per input tensor: the file offset of its first byte
  uint64_t file_size = 0;
};
// `path` names the file in messages (duplicate names are refused).
SafetensorsLayout safetensors_layout(const std::vector<NamedTensor>& tensors,
                                     const std::map<std::string, std::string>& metadata, const std::string& path);

// Writes bytes [begin, end) of tensor (whole elements) to fd at file_offset with pwrite, streamed
// in pieces; messages name path and the tensor.
void pwrite_tensor_bytes(int fd, const StoredTensor& tensor, uint64_t begin, uint64_t end, uint64_t file_offset,
                         const std::string& path, const std::string& name);

// Writes `tensors` (in the given order) to `path`, streaming each tensor's bytes, so memory stays
// bounded by one piece. `__metadata__` gets `metadata` ({"format": "pt"} is always added). The file
// is written as path + ".tmp" and renamed at the end, so a crash never leaves a half file under
// the real name. The header is padded with spaces to a multiple of 8 bytes.
void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace deltamoe
