// Optimizer-state file: safetensors layout (u64 header length, JSON header, raw tensor bytes) with
// our metadata (counters, hyper-parameters, the pieces, checksums) in __metadata__. Records are
// streamed through one bounded host buffer; the header is written first with placeholder checksums
// of fixed width and rewritten in place once the data is out.
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
#include <map>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/error.h"
#include "core/json_depth.h"
#include "core/kill_point.h"
#include "core/log.h"
#include "optim/checksum.h"

namespace deltamoe {
namespace {

using nlohmann::json;

constexpr const char* kFormatName = "deltamoe.optimizer_state";
constexpr const char* kFormatVersion = "2";
// safetensors rejects headers above 100 MB; so do we, which also stops a garbage length early.
constexpr uint64_t kMaxHeaderBytes = 100u << 20;
// Host staging per copy: large enough for full-speed transfers, small next to any model.
constexpr int64_t kStagingBytes = int64_t{64} << 20;
constexpr const char* kPlaceholderChecksum = "0000000000000000";

std::string format_double(double value) {
  char text[40];
  std::snprintf(text, sizeof(text), "%.17g", value);
  return text;
}

std::string record_key(StateKind kind, const std::string& name, int64_t begin, int64_t end) {
  return str_cat(state_kind_name(kind), "/", name, "/", begin, ":", end);
}

// The pieces as JSON, so that a mismatch on load can name the tensor that differs.
json pieces_json(const ParamLayout& layout) {
  json entries = json::array();
  for (const ParamEntry& e : layout.entries()) {
    entries.push_back({{"name", e.name},
                       {"shape", e.shape},
                       {"begin", e.tensor_begin},
                       {"end", e.tensor_begin + e.numel},
                       {"decay", e.decay}});
  }
  return entries;
}

uint64_t metadata_checksum(json metadata) {
  metadata.erase("metadata_checksum");
  const std::string text = metadata.dump();  // keys are sorted, so the text is canonical
  return checksum64(text.data(), text.size());
}

struct Record {
  std::string key;
  StateKind kind;
  int index;  // piece of the layout
  DType dtype;
  uint64_t nbytes;
};

std::vector<Record> records_of(const TrainStateStore& state) {
  std::vector<Record> records;
  const ParamLayout& layout = state.layout();
  for (StateKind kind : kStateKinds) {
    const DType dtype = state_dtype(kind, state.adamw_config());
    for (int i = 0; i < layout.num_tensors(); ++i) {
      const ParamEntry& e = layout.entry(i);
      records.push_back({record_key(kind, e.name, e.tensor_begin, e.tensor_begin + e.numel), kind, i, dtype,
                         static_cast<uint64_t>(e.numel) * dtype_size(dtype)});
    }
  }
  return records;
}

// The header text for these records and checksums (placeholders while writing), padded so that
// the data starts 8-byte aligned.
std::string header_text(const TrainStateStore& state, const OptimizerProgress& progress,
                        const std::vector<Record>& records, const std::vector<std::string>& checksums) {
  const AdamWConfig& config = state.adamw_config();
  json metadata = {
      {"format", kFormatName},
      {"format_version", kFormatVersion},
      {"adam_step", std::to_string(state.adam_step())},
      {"schedule_step", std::to_string(progress.schedule_step)},
      {"skipped_steps", std::to_string(progress.skipped_steps)},
      {"moment_dtype", std::string(dtype_name(config.moment_dtype))},
      {"adam_beta1", format_double(config.beta1)},
      {"adam_beta2", format_double(config.beta2)},
      {"adam_epsilon", format_double(config.eps)},
      {"weight_decay", format_double(config.weight_decay)},
      {"pieces", pieces_json(state.layout()).dump()},
  };
  json header = json::object();
  uint64_t offset = 0;
  for (size_t r = 0; r < records.size(); ++r) {
    const Record& record = records[r];
    header[record.key] = {{"dtype", std::string(dtype_safetensors_name(record.dtype))},
                          {"shape", {record.nbytes / dtype_size(record.dtype)}},
                          {"data_offsets", {offset, offset + record.nbytes}}};
    metadata["checksum_" + record.key] = checksums[r];
    offset += record.nbytes;
  }
  metadata["metadata_checksum"] =
      checksums.empty() || checksums[0] != kPlaceholderChecksum ? checksum_hex(metadata_checksum(metadata))
                                                                : std::string(kPlaceholderChecksum);
  header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

void write_all(int fd, const void* data, size_t nbytes, const std::string& path) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  while (nbytes > 0) {
    const ssize_t written = ::write(fd, bytes, nbytes);
    if (written < 0 && errno == EINTR) continue;
    CHECK(written > 0, "writing optimizer state file ", path, " failed: ", std::strerror(errno),
          errno == ENOSPC ? " (the disk is full)" : "");
    bytes += written;
    nbytes -= static_cast<size_t>(written);
  }
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

void warn_if_changed(const char* flag, double saved, double now) {
  if (saved != now) log_warn("resume: ", flag, " was ", saved, " in the saved run and is ", now, " now");
}

}  // namespace

uint64_t optimizer_state_file_bytes(const TrainStateStore& state) {
  const std::vector<Record> records = records_of(state);
  const std::vector<std::string> checksums(records.size(), kPlaceholderChecksum);
  uint64_t bytes = 8 + header_text(state, OptimizerProgress{}, records, checksums).size();
  for (const Record& record : records) bytes += record.nbytes;
  return bytes + 64;  // the counters' digits may grow a little
}

void save_optimizer_state(const std::string& path, const TrainStateStore& state, const OptimizerProgress& progress) {
  const std::vector<Record> records = records_of(state);
  std::vector<std::string> checksums(records.size(), kPlaceholderChecksum);
  const std::string placeholder_header = header_text(state, progress, records, checksums);

  const std::string temp_path = path + ".tmp";
  const int fd = ::open(temp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  CHECK(fd >= 0, "cannot create optimizer state file ", temp_path, ": ", std::strerror(errno));
  try {
    uint8_t size_bytes[8];
    const uint64_t header_size = placeholder_header.size();
    for (int i = 0; i < 8; ++i) size_bytes[i] = static_cast<uint8_t>(header_size >> (8 * i));  // little-endian
    write_all(fd, size_bytes, 8, temp_path);
    write_all(fd, placeholder_header.data(), placeholder_header.size(), temp_path);
    uint64_t largest = 0;
    for (const Record& record : records) largest = std::max(largest, record.nbytes);
    std::vector<uint8_t> staging(static_cast<size_t>(std::min<uint64_t>(kStagingBytes, largest)));
    for (size_t r = 0; r < records.size(); ++r) {
      const Record& record = records[r];
      const size_t element = dtype_size(record.dtype);
      const int64_t numel = static_cast<int64_t>(record.nbytes / element);
      const int64_t per_copy = kStagingBytes / static_cast<int64_t>(element);
      Checksum64 checksum;
      for (int64_t first = 0; first < numel; first += per_copy) {
        const int64_t count = std::min(per_copy, numel - first);
        state.read_state(record.kind, record.index, first, count, staging.data());
        checksum.update(staging.data(), static_cast<size_t>(count) * element);
        write_all(fd, staging.data(), static_cast<size_t>(count) * element, temp_path);
      }
      checksums[r] = checksum_hex(checksum.finish());
      if (r == 0) kill_point("optimizer_partial");  // test hook: a kill with the file half written
    }
    const std::string header = header_text(state, progress, records, checksums);
    CHECK(header.size() == placeholder_header.size(), "optimizer state: the header changed size while writing");
    CHECK(::pwrite(fd, header.data(), header.size(), 8) == static_cast<ssize_t>(header.size()),
          "writing optimizer state file ", temp_path, " failed: ", std::strerror(errno));
    // Flush to disk before the rename, so that after a crash the real name holds a complete file.
    CHECK(::fsync(fd) == 0, "cannot flush optimizer state file ", temp_path, ": ", std::strerror(errno));
    CHECK(::close(fd) == 0, "cannot close optimizer state file ", temp_path, ": ", std::strerror(errno));
  } catch (...) {
    ::close(fd);
    std::error_code ignored;
    std::filesystem::remove(temp_path, ignored);
    throw;
  }
  std::error_code error;
  std::filesystem::rename(temp_path, path, error);
  if (error) std::filesystem::remove(temp_path, error);
  CHECK(!error, "cannot rename ", temp_path, " to ", path, ": ", error.message());
}

namespace {

// Element ranges of each of state's pieces that a file's records filled (by piece index).
using Coverage = std::vector<std::vector<std::pair<int64_t, int64_t>>>;

// One file into state. covered null: the file alone must hold every tensor of state and cover every
// piece exactly. Else (one of several files, each written by one rank): the file may hold any of
// the trained tensors, and the ranges it filled are added to *covered for the caller's check.
OptimizerProgress load_state_file(const std::string& path, TrainStateStore* state, const ParamLayout* trained,
                                  Coverage* covered) {
  CHECK(state != nullptr, "load_optimizer_state: state is null");
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
  if (json_nesting_depth(header_text) > kMaxJsonDepth) reader.fail("header nests deeper than any optimizer state");
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

  const AdamWConfig& config = state->adamw_config();
  const std::string& saved_dtype = reader.meta_string(metadata, "moment_dtype");
  CHECK(saved_dtype == dtype_name(config.moment_dtype), "optimizer state ", path, " stores ", saved_dtype,
        " moments but this run uses ", dtype_name(config.moment_dtype), ": resume with the same optimizer-state dtype");

  // The saved pieces: the same tensors (shape, decay) as this run's, each covered exactly once.
  json saved_pieces;
  try {
    saved_pieces = json::parse(reader.meta_string(metadata, "pieces"));
  } catch (const json::exception& parse_error) {
    reader.fail(str_cat("metadata 'pieces' is not valid JSON: ", parse_error.what()));
  }
  if (!saved_pieces.is_array()) reader.fail("metadata 'pieces' is not a JSON array");
  struct SavedPiece {
    int64_t begin, end;
  };
  std::map<std::string, std::vector<SavedPiece>> saved_by_name;
  std::map<std::string, json> saved_tensor;
  for (const json& piece : saved_pieces) {
    if (!piece.is_object() || !piece.contains("name") || !piece["name"].is_string() || !piece.contains("begin") ||
        !piece["begin"].is_number_integer() || !piece.contains("end") || !piece["end"].is_number_integer()) {
      reader.fail(str_cat("metadata 'pieces' has a malformed entry ", piece.dump()));
    }
    const std::string name = piece["name"];
    saved_by_name[name].push_back({piece["begin"].get<int64_t>(), piece["end"].get<int64_t>()});
    saved_tensor[name] = {{"shape", piece.value("shape", json())}, {"decay", piece.value("decay", json())}};
  }
  const ParamLayout& layout = state->layout();
  std::map<std::string, bool> ours;
  for (const ParamEntry& e : (trained != nullptr ? *trained : layout).entries()) ours[e.name] = true;
  for (const ParamEntry& e : layout.entries()) {
    auto it = saved_tensor.find(e.name);
    if (it == saved_tensor.end() && covered != nullptr) continue;  // another rank's file holds it
    if (it == saved_tensor.end()) {
      RAISE("optimizer state ", path, " was saved for a different model or tuner settings: it has no state for '",
            e.name, "' (resume with the same model, freeze and tuner settings)");
    }
    const json expected = {{"shape", e.shape}, {"decay", e.decay}};
    if (it->second != expected) {
      RAISE("optimizer state ", path, " was saved for a different model: '", e.name, "' is ", it->second.dump(),
            " in the file but ", expected.dump(), " in this run (resume with the same model and tuner settings)");
    }
  }
  for (const auto& [name, unused] : saved_tensor) {
    if (!ours.count(name)) {
      RAISE("optimizer state ", path, " holds state for '", name, "', which this run does not train (resume with ",
            "the same freeze and tuner settings)");
    }
  }
  for (int i = 0; i < layout.num_tensors(); ++i) {
    const ParamEntry& e = layout.entry(i);
    int64_t count = 0;
    for (const SavedPiece& saved : saved_by_name[e.name]) {
      const int64_t a = std::max(saved.begin, e.tensor_begin), b = std::min(saved.end, e.tensor_begin + e.numel);
      if (a >= b) continue;
      count += b - a;
      if (covered != nullptr) (*covered)[static_cast<size_t>(i)].emplace_back(a, b);
    }
    CHECK(covered != nullptr || count == e.numel, "optimizer state ", path, " covers ", count, " of the ", e.numel,
          " elements of '", e.name, "' [", e.tensor_begin, ", ", e.tensor_begin + e.numel, ") this run needs");
  }

  const int64_t adam_step = reader.meta_int(metadata, "adam_step");
  OptimizerProgress progress;
  progress.schedule_step = reader.meta_int(metadata, "schedule_step");
  progress.skipped_steps = reader.meta_int(metadata, "skipped_steps");
  if (adam_step < 0 || progress.skipped_steps < 0 || progress.schedule_step != adam_step + progress.skipped_steps) {
    reader.fail(str_cat("counters are inconsistent: adam_step ", adam_step, " + skipped_steps ", progress.skipped_steps,
                        " != schedule_step ", progress.schedule_step));
  }

  // Stream every record that overlaps one of our pieces, checking its checksum, and copy the
  // overlap into the state.
  const uint64_t data_start = 8 + header_size;
  const uint64_t data_size = file_size - data_start;
  std::vector<uint8_t> staging(static_cast<size_t>(std::min<uint64_t>(kStagingBytes, data_size)));
  for (StateKind kind : kStateKinds) {
    const DType dtype = state_dtype(kind, config);
    const size_t element = dtype_size(dtype);
    for (const auto& [name, pieces] : saved_by_name) {
      for (const SavedPiece& saved : pieces) {
        std::vector<int> targets;
        for (int i = 0; i < layout.num_tensors(); ++i) {
          const ParamEntry& e = layout.entry(i);
          if (e.name == name && saved.begin < e.tensor_begin + e.numel && saved.end > e.tensor_begin) targets.push_back(i);
        }
        if (targets.empty()) continue;
        const std::string key = record_key(kind, name, saved.begin, saved.end);
        if (!header.contains(key) || !header[key].is_object()) reader.fail(str_cat("tensor '", key, "' is missing"));
        const json& entry = header[key];
        const int64_t numel = saved.end - saved.begin;
        const uint64_t nbytes = static_cast<uint64_t>(numel) * element;
        const json expected_shape = {numel};
        if (!entry.contains("dtype") || entry["dtype"] != std::string(dtype_safetensors_name(dtype)) ||
            !entry.contains("shape") || entry["shape"] != expected_shape) {
          reader.fail(str_cat("tensor '", key, "' is ", entry.dump(), ", expected dtype ", dtype_safetensors_name(dtype),
                              " and shape [", numel, "]"));
        }
        const json& offsets = entry.value("data_offsets", json());
        if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
            !offsets[1].is_number_unsigned()) {
          reader.fail(str_cat("tensor '", key, "' has no valid data_offsets"));
        }
        const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
        if (end < begin || end - begin != nbytes) {
          reader.fail(str_cat("tensor '", key, "' has data_offsets [", begin, ", ", end, "] for ", nbytes, " bytes"));
        }
        if (end > data_size) {
          reader.fail(str_cat("file is truncated: tensor '", key, "' ends at data byte ", end, " but the file has ",
                              data_size, " data bytes"));
        }
        in.seekg(static_cast<std::streamoff>(data_start + begin));
        Checksum64 checksum;
        const int64_t per_copy = kStagingBytes / static_cast<int64_t>(element);
        for (int64_t first = 0; first < numel; first += per_copy) {
          const int64_t count = std::min(per_copy, numel - first);
          in.read(reinterpret_cast<char*>(staging.data()), static_cast<std::streamsize>(count * element));
          if (!in) reader.fail(str_cat("could not read tensor '", key, "'"));
          checksum.update(staging.data(), static_cast<size_t>(count) * element);
          // Tensor elements [saved.begin + first, + count) are in the staging buffer.
          const int64_t lo = saved.begin + first, hi = lo + count;
          for (int index : targets) {
            const ParamEntry& e = layout.entry(index);
            const int64_t a = std::max(lo, e.tensor_begin), b = std::min(hi, e.tensor_begin + e.numel);
            if (a >= b) continue;
            state->write_state(kind, index, a - e.tensor_begin, b - a, staging.data() + (a - lo) * element);
          }
        }
        if (reader.meta_string(metadata, "checksum_" + key) != checksum_hex(checksum.finish())) {
          reader.fail(str_cat("tensor '", key, "' does not match its checksum"));
        }
      }
    }
  }
  state->set_adam_step(adam_step);
  if (covered == nullptr) state->state_restored();

  warn_if_changed("--adam_beta1", reader.meta_double(metadata, "adam_beta1"), config.beta1);
  warn_if_changed("--adam_beta2", reader.meta_double(metadata, "adam_beta2"), config.beta2);
  warn_if_changed("--adam_epsilon", reader.meta_double(metadata, "adam_epsilon"), config.eps);
  warn_if_changed("--weight_decay", reader.meta_double(metadata, "weight_decay"), config.weight_decay);
  return progress;
}

}  // namespace

OptimizerProgress load_optimizer_state(const std::string& path, TrainStateStore* state, const ParamLayout* trained) {
  return load_state_file(path, state, trained, nullptr);
}

OptimizerProgress load_optimizer_state_files(const std::vector<std::string>& paths, TrainStateStore* state,
                                             const ParamLayout* trained) {
  CHECK(state != nullptr && !paths.empty(), "load_optimizer_state_files: no files or no state");
  const ParamLayout& layout = state->layout();
  Coverage covered(static_cast<size_t>(layout.num_tensors()));
  OptimizerProgress progress;
  int64_t adam_step = -1;
  for (size_t f = 0; f < paths.size(); ++f) {
    const OptimizerProgress here = load_state_file(paths[f], state, trained, &covered);
    CHECK(f == 0 || (here.schedule_step == progress.schedule_step && here.skipped_steps == progress.skipped_steps &&
                     state->adam_step() == adam_step),
          "optimizer state ", paths[f], " is at step ", here.schedule_step, " but ", paths[0], " at step ",
          progress.schedule_step, ": the files come from different saves");
    progress = here;
    adam_step = state->adam_step();
  }
  // Replicas of an expert block write the same records; every element needs at least one.
  for (int i = 0; i < layout.num_tensors(); ++i) {
    const ParamEntry& e = layout.entry(i);
    std::vector<std::pair<int64_t, int64_t>>& ranges = covered[static_cast<size_t>(i)];
    std::sort(ranges.begin(), ranges.end());
    int64_t reached = e.tensor_begin;
    for (const auto& [a, b] : ranges) {
      if (a > reached) break;
      reached = std::max(reached, b);
    }
    CHECK(reached == e.tensor_begin + e.numel, "optimizer state files ", paths[0], " ... (", paths.size(),
          " files) hold no state for elements [", reached, ", ", e.tensor_begin + e.numel, ") of '", e.name,
          "' (a rank's file is missing or from another save)");
  }
  state->state_restored();
  return progress;
}

}  // namespace deltamoe
