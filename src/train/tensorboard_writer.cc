// TFRecord + Event protobuf encoding for TensorBoard (see tensorboard_writer.h). The messages used
// (tensorflow/core/util/event.proto, framework/summary.proto):
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }    Value { string tag = 1; float simple_value = 2; }
#include "train/tensorboard_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace deltamoe {

namespace {

const std::array<uint32_t, 256> kCrcTable = [] {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
    table[i] = crc;
  }
  return table;
}();

void put_varint(std::string& out, uint64_t value) {
  while (value >= 0x80) {
    out += static_cast<char>((value & 0x7F) | 0x80);
    value >>= 7;
  }
  out += static_cast<char>(value);
}

void put_fixed(std::string& out, const void* bytes, size_t size) {  // little-endian host (x86-64, aarch64)
  out.append(static_cast<const char*>(bytes), size);
}

void put_length_delimited(std::string& out, uint32_t field, const std::string& payload) {
  put_varint(out, (field << 3) | 2);
  put_varint(out, payload.size());
  out += payload;
}

double wall_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Event header: wall_time (field 1, fixed64) and step (field 2, varint).
std::string event_head(int64_t step) {
  std::string event;
  const double time = wall_time();
  put_varint(event, (1 << 3) | 1);
  put_fixed(event, &time, 8);
  put_varint(event, (2 << 3) | 0);
  put_varint(event, static_cast<uint64_t>(step));
  return event;
}

}  // namespace

uint32_t crc32c(const uint8_t* data, size_t size) {
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < size; ++i) crc = kCrcTable[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const uint8_t* data, size_t size) {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::filesystem::create_directories(dir);
  char host[256] = "localhost";
  ::gethostname(host, sizeof(host) - 1);
  path_ = (std::filesystem::path(dir) /
           str_cat("events.out.tfevents.", static_cast<int64_t>(wall_time()), ".", host, ".", ::getpid()))
              .string();
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  CHECK(fd_ >= 0, "--report_to tensorboard: cannot create ", path_, ": ", std::strerror(errno));
  std::string event = event_head(0);
  put_length_delimited(event, 3, "brain.Event:2");
  write_event(event);
}

TensorBoardWriter::~TensorBoardWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  std::string summary_value;
  put_length_delimited(summary_value, 1, tag);
  const float simple = static_cast<float>(value);
  put_varint(summary_value, (2 << 3) | 5);
  put_fixed(summary_value, &simple, 4);
  std::string summary;
  put_length_delimited(summary, 1, summary_value);
  std::string event = event_head(step);
  put_length_delimited(event, 5, summary);
  write_event(event);
}

void TensorBoardWriter::write_event(const std::string& event) {
  std::string record;
  const uint64_t length = event.size();
  put_fixed(record, &length, 8);
  const uint32_t length_crc = masked_crc32c(reinterpret_cast<const uint8_t*>(record.data()), 8);
  put_fixed(record, &length_crc, 4);
  record += event;
  const uint32_t data_crc = masked_crc32c(reinterpret_cast<const uint8_t*>(event.data()), event.size());
  put_fixed(record, &data_crc, 4);
  // One write per record with O_APPEND: a crash loses at most the record being written.
  size_t done = 0;
  while (done < record.size()) {
    const ssize_t written = ::write(fd_, record.data() + done, record.size() - done);
    if (written < 0 && errno == EINTR) continue;
    CHECK(written > 0, "writing ", path_, " failed: ", std::strerror(errno), " (disk full?)");
    done += static_cast<size_t>(written);
  }
}

}  // namespace deltamoe
