// Optimizer-state file: safetensors layout (u64 header length, JSON header, raw tensor bytes)
// with our metadata (counters, hyper-parameters, parameter layout, checksums) in __metadata__.
#include "optim/optimizer_state.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "optim/checksum.h"

namespace deltamoe {
namespace {

using nlohmann::json;

constexpr const char* kFormatName = "deltamoe.optimizer_state";
constexpr const char* kFormatVersion = "1";
// safetensors rejects headers above 100 MB; so do we, which also stops a garbage length early.
constexpr uint64_t kMaxHeaderBytes = 100u << 20;

struct TensorBytes {
  std::string name;
  DType dtype;
  int64_t numel;
  const void* data;  // for writing
};

std::string format_double(double value) {
  char text[40];
  std::snprintf(text, sizeof(text), "%.17g", value);
  return text;
}

// The layout as JSON text, so that a mismatch on load can name the tensor that differs.
std::string layout_json(const ParamLayout& layout) {
  json entries = json::array();
  for (const ParamEntry& entry : layout.entries()) {
    entries.push_back({{"name", entry.name}, {"shape", entry.shape}, {"offset", entry.offset}, {"decay", entry.decay}});
  }
  return entries.dump();
}

uint64_t metadata_checksum(json metadata) {
  metadata.erase("metadata_checksum");
  const std::string text = metadata.dump();  // keys are sorted, so the text is canonical
  return checksum64(text.data(), text.size());
}

// ---- reading helpers: every failure names the file ----

class StateFileReader {
 public:
  explicit StateFileReader(const std::string& path) : path_(path) {}

  [[noreturn]] void fail(const std::string& what) const {
    RAISE("optimizer state ", path_, ": ", what, " (the file is corrupt or not an optimizer state; resume from another checkpoint)");
  }

  const std::string& meta_string(const json& metadata, const std::string& key) const {
    auto it = metadata.find(key);
    if (it == metadata.end() || !it->is_string()) fail(str_cat("metadata '", key, "' is missing or not a string"));
    return it->get_ref<const std::string&>();
  }

  int64_t meta_int(const json& metadata, const std::string& key) const {
    const std::string& text = meta_string(metadata, key);
    char* end = nullptr;
    errno = 0;
    const long long value = std::strtoll(text.c_str(), &end, 10);
    if (text.empty() || errno != 0 || *end != '\0') fail(str_cat("metadata '", key, "' = '", text, "' is not an integer"));
    return value;
  }

  double meta_double(const json& metadata, const std::string& key) const {
    const std::string& text = meta_string(metadata, key);
    char* end = nullptr;
    const double value = std::strtod(text.c_str(), &end);
    if (text.empty() || *end != '\0') fail(str_cat("metadata '", key, "' = '", text, "' is not a number"));
    return value;
  }

 private:
  std::string path_;
};

void check_layout_matches(const StateFileReader& reader, const std::string& path, const std::string& saved_layout_text,
                          const ParamLayout& layout) {
  json saved;
  try {
    saved = json::parse(saved_layout_text);
  } catch (const json::exception& error) {
    reader.fail(str_cat("metadata 'param_layout' is not valid JSON: ", error.what()));
  }
  if (!saved.is_array()) reader.fail("metadata 'param_layout' is not a JSON array");
  const json expected = json::parse(layout_json(layout));
  for (size_t i = 0; i < std::min(saved.size(), expected.size()); ++i) {
    if (saved[i] != expected[i]) {
      RAISE("optimizer state ", path, " was saved for a different model: parameter ", i, " is ", saved[i].dump(),
            " in the file but ", expected[i].dump(), " in this run (resume with the same model and tuner settings)");
    }
  }
  if (saved.size() != expected.size()) {
    RAISE("optimizer state ", path, " was saved for ", saved.size(), " parameter tensors, this run has ", expected.size(),
          " (resume with the same model and tuner settings)");
  }
}

void warn_if_changed(const char* flag, double saved, double now) {
  if (saved != now) log_warn("resume: ", flag, " was ", saved, " in the saved run and is ", now, " now");
}

}  // namespace

void save_optimizer_state(const std::string& path, const AdamW& optimizer, const OptimizerProgress& progress,
                          const float* master) {
  const AdamWConfig& config = optimizer.config();
  const int64_t numel = optimizer.range().size();
  std::vector<TensorBytes> tensors = {
      {"exp_avg", config.moment_dtype, numel, optimizer.exp_avg().data},
      {"exp_avg_sq", config.moment_dtype, numel, optimizer.exp_avg_sq().data},
  };
  if (master != nullptr) tensors.push_back({"master_weights", DType::f32, numel, master});

  json metadata = {
      {"format", kFormatName},
      {"format_version", kFormatVersion},
      {"adam_step", std::to_string(optimizer.adam_step())},
      {"schedule_step", std::to_string(progress.schedule_step)},
      {"skipped_steps", std::to_string(progress.skipped_steps)},
      {"moment_dtype", std::string(dtype_name(config.moment_dtype))},
      {"range_begin", std::to_string(optimizer.range().begin)},
      {"range_end", std::to_string(optimizer.range().end)},
      {"total_numel", std::to_string(optimizer.layout().total_numel())},
      {"adam_beta1", format_double(config.beta1)},
      {"adam_beta2", format_double(config.beta2)},
      {"adam_epsilon", format_double(config.eps)},
      {"weight_decay", format_double(config.weight_decay)},
      {"param_layout", layout_json(optimizer.layout())},
  };
  json header = json::object();
  uint64_t offset = 0;
  for (const TensorBytes& tensor : tensors) {
    const uint64_t nbytes = static_cast<uint64_t>(tensor.numel) * dtype_size(tensor.dtype);
    header[tensor.name] = {{"dtype", std::string(dtype_safetensors_name(tensor.dtype))},
                           {"shape", {tensor.numel}},
                           {"data_offsets", {offset, offset + nbytes}}};
    metadata["checksum_" + tensor.name] = checksum_hex(checksum64(tensor.data, nbytes));
    offset += nbytes;
  }
  metadata["metadata_checksum"] = checksum_hex(metadata_checksum(metadata));
  header["__metadata__"] = metadata;
  std::string header_text = header.dump();
  header_text.append((8 - header_text.size() % 8) % 8, ' ');  // keeps the data 8-byte aligned

  const std::string temp_path = path + ".tmp";
  {
    std::ofstream out(temp_path, std::ios::binary | std::ios::trunc);
    CHECK(out.good(), "cannot create optimizer state file ", temp_path, ": ", std::strerror(errno));
    const uint64_t header_size = header_text.size();
    uint8_t size_bytes[8];
    for (int i = 0; i < 8; ++i) size_bytes[i] = static_cast<uint8_t>(header_size >> (8 * i));  // little-endian
    out.write(reinterpret_cast<const char*>(size_bytes), 8);
    out.write(header_text.data(), static_cast<std::streamsize>(header_text.size()));
    for (const TensorBytes& tensor : tensors) {
      out.write(static_cast<const char*>(tensor.data),
                static_cast<std::streamsize>(static_cast<uint64_t>(tensor.numel) * dtype_size(tensor.dtype)));
    }
    out.close();
    CHECK(!out.fail(), "writing optimizer state file ", temp_path, " failed (disk full?)");
  }
  // Flush to disk before the rename, so that after a crash the real name holds a complete file.
  const int fd = ::open(temp_path.c_str(), O_RDONLY);
  CHECK(fd >= 0 && ::fsync(fd) == 0, "cannot flush optimizer state file ", temp_path, ": ", std::strerror(errno));
  ::close(fd);
  std::error_code error;
  std::filesystem::rename(temp_path, path, error);
  CHECK(!error, "cannot rename ", temp_path, " to ", path, ": ", error.message());
}

OptimizerProgress load_optimizer_state(const std::string& path, AdamW* optimizer, float* master) {
  CHECK(optimizer != nullptr, "load_optimizer_state: optimizer is null");
  StateFileReader reader(path);
  std::error_code error;
  const uint64_t file_size = std::filesystem::file_size(path, error);
  CHECK(!error, "cannot read optimizer state file ", path, ": ", error.message());
  std::ifstream in(path, std::ios::binary);
  CHECK(in.good(), "cannot open optimizer state file ", path, ": ", std::strerror(errno));

  if (file_size < 8) reader.fail(str_cat("file has ", file_size, " bytes, too short for a header"));
  uint8_t size_bytes[8];
  in.read(reinterpret_cast<char*>(size_bytes), 8);
  uint64_t header_size = 0;
  for (int i = 0; i < 8; ++i) header_size |= static_cast<uint64_t>(size_bytes[i]) << (8 * i);
  if (header_size > kMaxHeaderBytes || header_size > file_size - 8) {
    reader.fail(str_cat("header length ", header_size, " does not fit in a file of ", file_size, " bytes"));
  }
  std::string header_text(header_size, '\0');
  in.read(header_text.data(), static_cast<std::streamsize>(header_size));
  if (!in) reader.fail("could not read the header");
  json header;
  try {
    header = json::parse(header_text);
  } catch (const json::exception& parse_error) {
    reader.fail(str_cat("header is not valid JSON: ", parse_error.what()));
  }
  if (!header.is_object() || !header.contains("__metadata__") || !header["__metadata__"].is_object()) {
    reader.fail("header has no __metadata__ object");
  }
  const json& metadata = header["__metadata__"];
  if (reader.meta_string(metadata, "format") != kFormatName) {
    reader.fail(str_cat("format is '", reader.meta_string(metadata, "format"), "', expected '", kFormatName, "'"));
  }
  if (reader.meta_string(metadata, "format_version") != kFormatVersion) {
    reader.fail(str_cat("format_version ", reader.meta_string(metadata, "format_version"),
                        " is not supported by this build (it reads version ", kFormatVersion, ")"));
  }
  if (reader.meta_string(metadata, "metadata_checksum") != checksum_hex(metadata_checksum(metadata))) {
    reader.fail("metadata checksum does not match");
  }

  // The file must describe this optimizer: same layout, same slice of it, same moment dtype.
  const AdamWConfig& config = optimizer->config();
  check_layout_matches(reader, path, reader.meta_string(metadata, "param_layout"), optimizer->layout());
  const FlatRange saved_range{reader.meta_int(metadata, "range_begin"), reader.meta_int(metadata, "range_end")};
  CHECK(saved_range == optimizer->range(), "optimizer state ", path, " holds flat elements [", saved_range.begin, ", ",
        saved_range.end, ") but this rank owns [", optimizer->range().begin, ", ", optimizer->range().end,
        "): resume with the same number of data-parallel ranks");
  const std::string& saved_dtype = reader.meta_string(metadata, "moment_dtype");
  CHECK(saved_dtype == dtype_name(config.moment_dtype), "optimizer state ", path, " stores ", saved_dtype,
        " moments but this run uses ", dtype_name(config.moment_dtype), ": resume with the same optimizer-state dtype");

  const int64_t adam_step = reader.meta_int(metadata, "adam_step");
  OptimizerProgress progress;
  progress.schedule_step = reader.meta_int(metadata, "schedule_step");
  progress.skipped_steps = reader.meta_int(metadata, "skipped_steps");
  if (adam_step < 0 || progress.skipped_steps < 0 || progress.schedule_step != adam_step + progress.skipped_steps) {
    reader.fail(str_cat("counters are inconsistent: adam_step ", adam_step, " + skipped_steps ", progress.skipped_steps,
                        " != schedule_step ", progress.schedule_step));
  }

  // Tensors: each must have the expected dtype and length, lie inside the file and match its checksum.
  const uint64_t data_start = 8 + header_size;
  const uint64_t data_size = file_size - data_start;
  const int64_t numel = optimizer->range().size();
  struct Destination {
    const char* name;
    DType dtype;
    void* data;
  };
  std::vector<Destination> destinations = {
      {"exp_avg", config.moment_dtype, optimizer->exp_avg().data},
      {"exp_avg_sq", config.moment_dtype, optimizer->exp_avg_sq().data},
  };
  if (master != nullptr) {
    if (!header.contains("master_weights")) {
      RAISE("optimizer state ", path, " has no master weights (it was saved without them); cannot restore fp32 master weights");
    }
    destinations.push_back({"master_weights", DType::f32, master});
  }
  for (const Destination& destination : destinations) {
    if (!header.contains(destination.name) || !header[destination.name].is_object()) {
      reader.fail(str_cat("tensor '", destination.name, "' is missing"));
    }
    const json& entry = header[destination.name];
    const uint64_t nbytes = static_cast<uint64_t>(numel) * dtype_size(destination.dtype);
    const json expected_shape = {numel};
    if (!entry.contains("dtype") || entry["dtype"] != std::string(dtype_safetensors_name(destination.dtype)) ||
        !entry.contains("shape") || entry["shape"] != expected_shape) {
      reader.fail(str_cat("tensor '", destination.name, "' is ", entry.dump(), ", expected dtype ",
                          dtype_safetensors_name(destination.dtype), " and shape [", numel, "]"));
    }
    const json& offsets = entry.value("data_offsets", json());
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) {
      reader.fail(str_cat("tensor '", destination.name, "' has no valid data_offsets"));
    }
    const uint64_t begin = offsets[0].get<uint64_t>();
    const uint64_t end = offsets[1].get<uint64_t>();
    if (end < begin || end - begin != nbytes) {
      reader.fail(str_cat("tensor '", destination.name, "' has data_offsets [", begin, ", ", end, "] for ", nbytes, " bytes"));
    }
    if (end > data_size) {
      reader.fail(str_cat("file is truncated: tensor '", destination.name, "' ends at data byte ", end, " but the file has ",
                          data_size, " data bytes"));
    }
    in.seekg(static_cast<std::streamoff>(data_start + begin));
    in.read(static_cast<char*>(destination.data), static_cast<std::streamsize>(nbytes));
    if (!in) reader.fail(str_cat("could not read tensor '", destination.name, "'"));
    const std::string checksum_key = str_cat("checksum_", destination.name);
    if (reader.meta_string(metadata, checksum_key) != checksum_hex(checksum64(destination.data, nbytes))) {
      reader.fail(str_cat("tensor '", destination.name, "' does not match its checksum"));
    }
  }
  optimizer->set_adam_step(adam_step);

  warn_if_changed("--adam_beta1", reader.meta_double(metadata, "adam_beta1"), config.beta1);
  warn_if_changed("--adam_beta2", reader.meta_double(metadata, "adam_beta2"), config.beta2);
  warn_if_changed("--adam_epsilon", reader.meta_double(metadata, "adam_epsilon"), config.eps);
  warn_if_changed("--weight_decay", reader.meta_double(metadata, "weight_decay"), config.weight_decay);
  return progress;
}

}  // namespace deltamoe
