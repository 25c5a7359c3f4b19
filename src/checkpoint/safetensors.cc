// safetensors: header validation, the mmap reader and the streamed writer.
#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/json_depth.h"
#include "core/kill_point.h"

namespace deltamoe {
namespace {

using nlohmann::json;

// Larger headers are not plausible (the reference implementation refuses > 100 MB as well).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

uint64_t read_u64_le(const uint8_t* bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | bytes[i];
  return value;
}

std::string supported_dtypes() { return "F32, BF16, F16, F64, I32, I64, U8, BOOL"; }

// One tensor entry of the header; throws naming the file and tensor.
SafetensorsEntry parse_entry(const std::string& name, const json& value, uint64_t data_size, const std::string& where) {
  auto fail_prefix = [&] { return str_cat(where, ": tensor '", name, "': "); };
  CHECK(value.is_object(), fail_prefix(), "header entry must be an object with dtype, shape and data_offsets, got ",
        value.dump());
  SafetensorsEntry entry;
  entry.name = name;
  CHECK(value.contains("dtype") && value["dtype"].is_string(), fail_prefix(), "missing or non-string 'dtype'");
  std::string dtype_text = value["dtype"].get<std::string>();
  CHECK(dtype_from_safetensors_name(dtype_text, &entry.dtype), fail_prefix(), "unknown dtype '", dtype_text,
        "' (supported: ", supported_dtypes(), ")");

  CHECK(value.contains("shape") && value["shape"].is_array(), fail_prefix(), "missing or non-list 'shape'");
  const json& shape = value["shape"];
  CHECK(shape.size() <= static_cast<size_t>(kMaxDims), fail_prefix(), "rank ", shape.size(), " exceeds ", kMaxDims);
  std::vector<int64_t> dims;
  // Track the byte count in unsigned 128-bit-safe steps so absurd shapes fail cleanly, not overflow.
  uint64_t bytes = dtype_size(entry.dtype);
  bool overflow = false;
  for (const json& dim : shape) {
    CHECK(dim.is_number_integer() && dim.get<int64_t>() >= 0, fail_prefix(), "shape ", shape.dump(),
          " must hold non-negative integers");
    uint64_t d = dim.get<uint64_t>();
    if (d != 0 && bytes > std::numeric_limits<uint64_t>::max() / d) overflow = true;
    bytes *= d;
    dims.push_back(static_cast<int64_t>(d));
  }
  CHECK(!overflow, fail_prefix(), "shape ", shape.dump(), " is too large");
  entry.shape = Shape(dims);

  CHECK(value.contains("data_offsets") && value["data_offsets"].is_array() && value["data_offsets"].size() == 2 &&
            value["data_offsets"][0].is_number_unsigned() && value["data_offsets"][1].is_number_unsigned(),
        fail_prefix(), "'data_offsets' must be [begin, end] with non-negative integers, got ",
        value.contains("data_offsets") ? value["data_offsets"].dump() : std::string("nothing"));
  entry.begin = value["data_offsets"][0].get<uint64_t>();
  entry.end = value["data_offsets"][1].get<uint64_t>();
  CHECK(entry.begin <= entry.end, fail_prefix(), "data_offsets [", entry.begin, ", ", entry.end,
        "] end before they begin");
  CHECK(entry.end <= data_size, fail_prefix(), "data_offsets [", entry.begin, ", ", entry.end,
        "] run past the end of the file's data region (", data_size,
        " bytes): the file is truncated or its header is wrong");
  CHECK(entry.end - entry.begin == bytes, fail_prefix(), "shape ", entry.shape.str(), " of ", dtype_text, " needs ",
        bytes, " bytes but data_offsets [", entry.begin, ", ", entry.end, "] span ", entry.end - entry.begin,
        " (shape/size mismatch)");
  return entry;
}

// `tensor`: the tensor whose bytes these are (for the message when they cannot be read).
void write_all(int fd, const uint8_t* data, size_t size, const std::string& path, const std::string& tensor = "") {
  while (size > 0) {
    ssize_t written = ::write(fd, data, size);
    if (written < 0 && errno == EINTR) continue;
    // EFAULT: the source bytes are a view of a file that has since shrunk (its pages are gone).
    CHECK(written > 0 || errno != EFAULT, "writing ", path, ": the bytes of tensor '", tensor,
          "' can no longer be read: the file they are mapped from (the --model weights?) was truncated or replaced ",
          "after it was loaded. Keep the input model unchanged while a run uses it");
    CHECK(written > 0, "writing ", path, " failed: ", std::strerror(errno), " (disk full?)");
    data += written;
    size -= static_cast<size_t>(written);
  }
}

}  // namespace

std::vector<SafetensorsEntry> parse_safetensors_header(const std::string& header_json, uint64_t data_size,
                                                       const std::string& where,
                                                       std::map<std::string, std::string>* metadata) {
  // Bounded before parsing: printing a deeply nested value (in the messages below) recurses per level.
  CHECK(json_nesting_depth(header_json) <= kMaxJsonDepth, where, ": the safetensors header is nested more than ",
        kMaxJsonDepth, " levels deep; this is not a safetensors file or it is corrupt");
  json header;
  try {
    header = json::parse(header_json);
  } catch (const json::exception& error) {  // parse_error, and out_of_range for a number that overflows
    RAISE(where, ": the safetensors header is not valid JSON (", error.what(), ")");
  }
  CHECK(header.is_object(), where, ": the safetensors header must be a JSON object, got ", header.dump().substr(0, 80));
  std::vector<SafetensorsEntry> entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      CHECK(it.value().is_object(), where, ": __metadata__ must be an object of strings");
      for (auto meta = it.value().begin(); meta != it.value().end(); ++meta) {
        CHECK(meta.value().is_string(), where, ": __metadata__ value for '", meta.key(), "' must be a string, got ",
              meta.value().dump());
        if (metadata) (*metadata)[meta.key()] = meta.value().get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(it.key(), it.value(), data_size, where));
  }
  std::sort(entries.begin(), entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  for (size_t i = 1; i < entries.size(); ++i) {
    const SafetensorsEntry& prev = entries[i - 1];
    const SafetensorsEntry& next = entries[i];
    // Zero-size tensors occupy no bytes and cannot overlap anything.
    if (prev.begin == prev.end || next.begin == next.end) continue;
    CHECK(next.begin >= prev.end, where, ": tensors '", prev.name, "' [", prev.begin, ", ", prev.end, ") and '",
          next.name, "' [", next.begin, ", ", next.end, ") overlap");
  }
  return entries;
}

std::shared_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  std::shared_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  CHECK(fd >= 0, "cannot open ", path, ": ", std::strerror(errno));
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    int saved = errno;
    ::close(fd);
    RAISE("cannot stat ", path, ": ", std::strerror(saved));
  }
  file->file_size_ = static_cast<size_t>(info.st_size);
  if (file->file_size_ > 0) {
    void* map = ::mmap(nullptr, file->file_size_, PROT_READ, MAP_PRIVATE, fd, 0);
    int saved = errno;
    ::close(fd);
    CHECK(map != MAP_FAILED, "cannot mmap ", path, ": ", std::strerror(saved));
    file->map_ = static_cast<const uint8_t*>(map);
  } else {
    ::close(fd);
  }
  const size_t size = file->file_size_;
  CHECK(size >= 8, path, ": truncated: ", size, " bytes, too short for the 8-byte header length of a safetensors file");
  uint64_t header_size = read_u64_le(file->map_);
  CHECK(header_size <= kMaxHeaderBytes, path, ": header length ", header_size,
        " is implausible (limit 100 MB); this is not a safetensors file or it is corrupt");
  CHECK(header_size <= size - 8, path, ": truncated: the header claims ", header_size, " bytes but only ", size - 8,
        " follow the length field");
  std::string header(reinterpret_cast<const char*>(file->map_ + 8), header_size);
  file->data_ = file->map_ + 8 + header_size;
  file->entries_ = parse_safetensors_header(header, size - 8 - header_size, path, &file->metadata_);
  for (size_t i = 0; i < file->entries_.size(); ++i) file->index_[file->entries_[i].name] = i;
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(const_cast<uint8_t*>(map_), file_size_);
}

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

StoredTensor SafetensorsFile::tensor(const std::string& name) const {
  const SafetensorsEntry* entry = find(name);
  CHECK(entry != nullptr, path_, ": no tensor named '", name, "'");
  return StoredTensor::from_mapped_file(entry->dtype, entry->shape, data_ + entry->begin, shared_from_this());
}

SafetensorsLayout safetensors_layout(const std::vector<NamedTensor>& tensors,
                                     const std::map<std::string, std::string>& metadata, const std::string& path) {
  // Wider dtypes first (stable otherwise), as the reference writer does: with the header padded to
  // 8 bytes every tensor then starts at a multiple of its element size.
  SafetensorsLayout layout;
  for (size_t i = 0; i < tensors.size(); ++i) layout.order.push_back(i);
  std::stable_sort(layout.order.begin(), layout.order.end(), [&](size_t a, size_t b) {
    return dtype_size(tensors[a].tensor.dtype()) > dtype_size(tensors[b].tensor.dtype());
  });

  // The header is assembled as text: nlohmann's insertion-ordered object searches linearly, which
  // would make a 30k-tensor per-expert file quadratic. Entries appear in data order.
  std::map<std::string, std::string> meta = metadata;
  meta["format"] = "pt";
  std::string header = "{\"__metadata__\":" + json(meta).dump();
  std::set<std::string> seen;
  std::vector<uint64_t> data_offsets(tensors.size());
  uint64_t offset = 0;
  for (const size_t index : layout.order) {
    const NamedTensor& tensor = tensors[index];
    CHECK(seen.insert(tensor.name).second, path, ": tensor '", tensor.name, "' given twice");
    CHECK(tensor.name != "__metadata__", path, ": '__metadata__' is not a valid tensor name");
    uint64_t nbytes = tensor.tensor.nbytes();
    json entry = {{"dtype", std::string(dtype_safetensors_name(tensor.tensor.dtype()))},
                  {"shape", tensor.tensor.shape().to_vector()},
                  {"data_offsets", {offset, offset + nbytes}}};
    header += "," + json(tensor.name).dump() + ":" + entry.dump();
    data_offsets[index] = offset;
    offset += nbytes;
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  const uint64_t header_size = header.size();
  layout.prefix.resize(8);
  for (int i = 0; i < 8; ++i) layout.prefix[static_cast<size_t>(i)] = static_cast<char>(header_size >> (8 * i));
  layout.prefix += header;
  layout.offsets.resize(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) layout.offsets[i] = layout.prefix.size() + data_offsets[i];
  layout.file_size = layout.prefix.size() + offset;
  return layout;
}

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  const SafetensorsLayout layout = safetensors_layout(tensors, metadata, path);
  const std::string tmp_path = path + ".tmp";
  int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  CHECK(fd >= 0, "cannot create ", tmp_path, ": ", std::strerror(errno));
  try {
    write_all(fd, reinterpret_cast<const uint8_t*>(layout.prefix.data()), layout.prefix.size(), tmp_path);
    kill_point("safetensors_partial");  // test hook: a kill with the file half written
    for (const size_t index : layout.order) {
      const NamedTensor& tensor = tensors[index];
      tensor.tensor.for_each_piece(
          [&](const uint8_t* data, size_t n) { write_all(fd, data, n, tmp_path, tensor.name); });
    }
    CHECK(::fsync(fd) == 0, "fsync of ", tmp_path, " failed: ", std::strerror(errno));
  } catch (...) {
    ::close(fd);
    std::remove(tmp_path.c_str());
    throw;
  }
  CHECK(::close(fd) == 0, "closing ", tmp_path, " failed: ", std::strerror(errno));
  CHECK(std::rename(tmp_path.c_str(), path.c_str()) == 0, "cannot rename ", tmp_path, " to ", path, ": ",
        std::strerror(errno));
}

void pwrite_tensor_bytes(int fd, const StoredTensor& tensor, uint64_t begin, uint64_t end, uint64_t file_offset,
                         const std::string& path, const std::string& name) {
  CHECK(begin <= end && end <= tensor.nbytes(), path, ": bytes [", begin, ", ", end, ") of tensor '", name,
        "' are outside its ", tensor.nbytes(), " bytes");
  const size_t element = dtype_size(tensor.dtype());
  CHECK(begin % element == 0 && end % element == 0, path, ": bytes [", begin, ", ", end, ") of tensor '", name,
        "' do not cover whole elements");
  if (begin == end) return;
  const StoredTensor range = tensor.slice_bytes(begin, Shape({static_cast<int64_t>((end - begin) / element)}));
  uint64_t position = file_offset;
  range.for_each_piece([&](const uint8_t* data, size_t n) {
    while (n > 0) {
      const ssize_t written = ::pwrite(fd, data, n, static_cast<off_t>(position));
      if (written < 0 && errno == EINTR) continue;
      CHECK(written > 0, "writing ", path, " (tensor '", name, "') failed: ", std::strerror(errno), " (disk full?)");
      data += written;
      n -= static_cast<size_t>(written);
      position += static_cast<uint64_t>(written);
    }
  });
}

}  // namespace deltamoe
