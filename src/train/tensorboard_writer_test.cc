// The event files TensorBoard reads: a reader written here independently of the writer (bitwise
// CRC-32C, its own protobuf decoding) checks every record's framing and checksums, the file version
// record, and each scalar's tag, value and step.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>

#include "train/tensorboard_writer.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

uint32_t bitwise_crc32c(const uint8_t* data, size_t size) {
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < size; ++i) {
    crc ^= data[i];
    for (int bit = 0; bit < 8; ++bit) crc = (crc & 1u) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
  }
  return ~crc;
}
uint32_t masked(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

struct Event {
  double wall_time = 0;
  int64_t step = -1;
  std::string file_version;
  std::string tag;
  float value = 0;
};

uint64_t varint(const std::string& s, size_t& at) {
  uint64_t value = 0;
  for (int shift = 0;; shift += 7) {
    const uint8_t byte = static_cast<uint8_t>(s.at(at++));
    value |= uint64_t{byte & 0x7Fu} << shift;
    if (!(byte & 0x80)) return value;
  }
}

// Decodes the fields the writer may use; any other wire type fails the test.
void decode(const std::string& message, Event& event, int depth) {
  size_t at = 0;
  while (at < message.size()) {
    const uint64_t key = varint(message, at);
    const int field = static_cast<int>(key >> 3), wire = static_cast<int>(key & 7);
    if (wire == 1) {
      ASSERT_EQ(field, 1);
      std::memcpy(&event.wall_time, message.data() + at, 8);
      at += 8;
    } else if (wire == 5) {
      ASSERT_EQ(depth, 2);
      ASSERT_EQ(field, 2);
      std::memcpy(&event.value, message.data() + at, 4);
      at += 4;
    } else if (wire == 0) {
      ASSERT_EQ(field, 2);
      event.step = static_cast<int64_t>(varint(message, at));
    } else {
      ASSERT_EQ(wire, 2);
      const size_t length = varint(message, at);
      const std::string payload = message.substr(at, length);
      at += length;
      if (depth == 0 && field == 3) event.file_version = payload;
      else if (depth == 0 && field == 5) decode(payload, event, 1);   // Summary
      else if (depth == 1 && field == 1) decode(payload, event, 2);   // Summary.Value
      else if (depth == 2 && field == 1) event.tag = payload;
      else FAIL() << "unexpected field " << field << " at depth " << depth;
    }
  }
}

std::vector<Event> read_events(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<Event> events;
  size_t at = 0;
  while (at < bytes.size()) {
    uint64_t length = 0;
    uint32_t length_crc = 0, data_crc = 0;
    EXPECT_LE(at + 12, bytes.size());
    std::memcpy(&length, bytes.data() + at, 8);
    std::memcpy(&length_crc, bytes.data() + at + 8, 4);
    EXPECT_EQ(length_crc, masked(bitwise_crc32c(reinterpret_cast<const uint8_t*>(bytes.data() + at), 8)));
    const std::string data = bytes.substr(at + 12, length);
    std::memcpy(&data_crc, bytes.data() + at + 12 + length, 4);
    EXPECT_EQ(data_crc, masked(bitwise_crc32c(reinterpret_cast<const uint8_t*>(data.data()), data.size())));
    Event event;
    decode(data, event, 0);
    events.push_back(event);
    at += 12 + length + 4;
  }
  EXPECT_EQ(at, bytes.size()) << "trailing bytes";
  return events;
}

TEST(TensorBoardWriter, Crc32cMatchesTheStandardCheckValue) {
  const char* text = "123456789";
  EXPECT_EQ(crc32c(reinterpret_cast<const uint8_t*>(text), 9), 0xE3069283u);  // RFC 3720's check value
  EXPECT_EQ(crc32c(reinterpret_cast<const uint8_t*>(text), 9), bitwise_crc32c(reinterpret_cast<const uint8_t*>(text), 9));
}

TEST(TensorBoardWriter, ScalarsReadBackWithTagsValuesAndSteps) {
  const fs::path dir = fs::temp_directory_path() / ("deltamoe_tb_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  std::string path;
  {
    TensorBoardWriter writer(dir.string());
    path = writer.path();
    writer.add_scalar("train/loss", 2.5, 1);
    writer.add_scalar("train/learning_rate", 1e-4, 1);
    writer.add_scalar("train/loss", 2.25, 2);
    writer.add_scalar("eval/loss", 3.0, 300000);  // a step past one varint byte
  }
  EXPECT_NE(fs::path(path).filename().string().find("events.out.tfevents."), std::string::npos);
  const std::vector<Event> events = read_events(path);
  ASSERT_EQ(events.size(), 5u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  std::map<std::pair<std::string, int64_t>, float> scalars;
  for (size_t i = 1; i < events.size(); ++i) {
    EXPECT_GT(events[i].wall_time, 1.6e9);
    scalars[{events[i].tag, events[i].step}] = events[i].value;
  }
  EXPECT_FLOAT_EQ((scalars[{"train/loss", 1}]), 2.5f);
  EXPECT_FLOAT_EQ((scalars[{"train/learning_rate", 1}]), 1e-4f);
  EXPECT_FLOAT_EQ((scalars[{"train/loss", 2}]), 2.25f);
  EXPECT_FLOAT_EQ((scalars[{"eval/loss", 300000}]), 3.0f);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace deltamoe
