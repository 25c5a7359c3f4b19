// TensorBoard event files written without TensorFlow: TFRecord framing (length, masked CRC-32C,
// data, masked CRC-32C) around hand-encoded Event protobufs, one scalar per record, appended and
// flushed as the run goes so that TensorBoard shows a live run.
#pragma once

#include <cstdint>
#include <string>

namespace deltamoe {

class TensorBoardWriter {
 public:
  // Creates dir and dir/events.out.tfevents.<unix time>.<host>.<pid>, starting with the file
  // version record TensorBoard expects. Throws naming the file when it cannot be written.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One scalar (tag "train/loss", ...) at a step; non-finite values are written as they are.
  void add_scalar(const std::string& tag, double value, int64_t step);
  const std::string& path() const { return path_; }

 private:
  void write_event(const std::string& event);
  std::string path_;
  int fd_ = -1;
};

// CRC-32C (Castagnoli) of data, and TFRecord's masking of it: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t crc32c(const uint8_t* data, size_t size);
uint32_t masked_crc32c(const uint8_t* data, size_t size);

}  // namespace deltamoe
