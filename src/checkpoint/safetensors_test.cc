// Tests of the safetensors reader and writer: a round trip of bytes, dtypes and metadata, and one
// test per malformed-file case, each asserting that the message names the file and the tensor.
#include "checkpoint/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "checkpoint/checkpoint_test_util.h"

namespace deltamoe {
namespace {

void expect_mentions(const std::string& message, const std::vector<std::string>& needles) {
  ASSERT_FALSE(message.empty()) << "expected an error";
  std::printf("error as expected: %s\n", message.c_str());
  for (const std::string& needle : needles) {
    EXPECT_NE(message.find(needle), std::string::npos) << "message lacks '" << needle << "': " << message;
  }
}

std::string open_error(const std::string& path) {
  return error_of([&] { SafetensorsFile::open(path); });
}

// A well-formed two-tensor file: "a" F32 [2] at [0,8), "b" BF16 [3] at [8,14).
const char* kGoodHeader =
    R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[3],"data_offsets":[8,14]}})";

TEST(Safetensors, WriteThenReadRoundTripsBytesDtypesAndMetadata) {
  ScratchDir dir("st_roundtrip");
  HostTensor f32(DType::f32, {3, 5});
  for (int i = 0; i < 15; ++i) f32.as<float>()[i] = 0.25f * i - 1.0f;
  HostTensor bf(DType::bf16, {7});
  for (int i = 0; i < 7; ++i) bf.as<bf16>()[i] = bf16(static_cast<float>(i) * 3.5f);
  HostTensor ids(DType::i64, {2, 2});
  for (int i = 0; i < 4; ++i) ids.as<int64_t>()[i] = int64_t{1} << (40 + i);
  HostTensor empty(DType::bf16, {0, 4});
  std::vector<NamedTensor> tensors = {{"bf", StoredTensor::from_host(bf)},
                                      {"f32", StoredTensor::from_host(f32)},
                                      {"ids", StoredTensor::from_host(ids)},
                                      {"empty", StoredTensor::from_host(empty)}};
  const std::string path = dir.path("x.safetensors");
  write_safetensors(path, tensors, {{"note", "hello"}});
  auto file = SafetensorsFile::open(path);
  EXPECT_EQ(file->metadata().at("format"), "pt");
  EXPECT_EQ(file->metadata().at("note"), "hello");
  ASSERT_EQ(file->entries().size(), 4u);
  int64_t mismatched_bytes = 0;
  for (const NamedTensor& expected : tensors) {
    StoredTensor got = file->tensor(expected.name);
    EXPECT_EQ(got.dtype(), expected.tensor.dtype()) << expected.name;
    EXPECT_EQ(got.shape(), expected.tensor.shape()) << expected.name;
    HostTensor a = got.to_host(), b = expected.tensor.to_host();
    for (size_t i = 0; i < a.nbytes(); ++i) {
      mismatched_bytes += static_cast<const uint8_t*>(a.data())[i] != static_cast<const uint8_t*>(b.data())[i];
    }
    // Wider dtypes are written first, so every tensor starts at a multiple of its element size.
    EXPECT_EQ(file->find(expected.name)->begin % dtype_size(got.dtype()), 0u) << expected.name;
  }
  std::printf("round trip: %lld mismatched bytes\n", static_cast<long long>(mismatched_bytes));
  EXPECT_EQ(mismatched_bytes, 0);
  std::string bytes = read_file_bytes(path);
  uint64_t header_size = 0;
  std::memcpy(&header_size, bytes.data(), 8);
  EXPECT_EQ(header_size % 8, 0u) << "header must be padded to 8 bytes";
}

TEST(Safetensors, WellFormedRawFileOpens) {
  ScratchDir dir("st_good");
  const std::string path = dir.path("good.safetensors");
  write_file_bytes(path, raw_safetensors(kGoodHeader, std::string(14, '\x01')));
  auto file = SafetensorsFile::open(path);
  EXPECT_EQ(file->entries().size(), 2u);
  EXPECT_EQ(file->tensor("b").shape(), (Shape{3}));
}

TEST(Safetensors, TruncatedFileIsReported) {
  ScratchDir dir("st_trunc");
  const std::string good = raw_safetensors(kGoodHeader, std::string(14, '\x01'));
  const std::string tiny = dir.path("tiny.safetensors");
  write_file_bytes(tiny, good.substr(0, 5));
  expect_mentions(open_error(tiny), {tiny, "truncated", "8-byte header length"});
  const std::string mid_header = dir.path("mid_header.safetensors");
  write_file_bytes(mid_header, good.substr(0, 40));
  expect_mentions(open_error(mid_header), {mid_header, "truncated", "header claims"});
  // Cut inside the data region: the tensor whose bytes are gone is named.
  const std::string mid_data = dir.path("mid_data.safetensors");
  write_file_bytes(mid_data, good.substr(0, good.size() - 3));
  expect_mentions(open_error(mid_data), {mid_data, "tensor 'b'", "past the end", "truncated"});
}

TEST(Safetensors, BadHeaderJsonIsReported) {
  ScratchDir dir("st_json");
  const std::string path = dir.path("bad.safetensors");
  write_file_bytes(path, raw_safetensors(R"({"a":{"dtype":"F32",)", std::string(8, '\0')));
  expect_mentions(open_error(path), {path, "header is not valid JSON"});
  const std::string not_object = dir.path("array.safetensors");
  write_file_bytes(not_object, raw_safetensors("[1, 2]", ""));
  expect_mentions(open_error(not_object), {not_object, "must be a JSON object"});
}

// A header nested 100,000 deep is refused before it is parsed. (Before: the error message printed
// the parsed value recursively and overflowed the stack.)
TEST(Safetensors, DeeplyNestedHeaderIsReportedNotACrash) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  for (const std::string& header : {deep, R"({"t": {"dtype": "F32", "shape": )" + deep + "}}"}) {
    expect_mentions(error_of([&] { parse_safetensors_header(header, 0, "deep.safetensors", nullptr); }),
                    {"deep.safetensors", "nested more than 64 levels"});
  }
}

// Found by fuzz_safetensors: a number too large for a double made nlohmann throw out_of_range,
// which escaped as a foreign exception instead of a message naming the file.
TEST(Safetensors, NumberOverflowInTheHeaderIsReported) {
  expect_mentions(error_of([&] {
                    parse_safetensors_header(R"({"x": {"dtype": "F32", "shape": [1e99999], "data_offsets": [0, 4]}})",
                                             4, "big.safetensors", nullptr);
                  }),
                  {"big.safetensors", "not valid JSON", "number overflow"});
}

TEST(Safetensors, OffsetsPastTheEndAreReported) {
  ScratchDir dir("st_offsets");
  const std::string path = dir.path("past.safetensors");
  write_file_bytes(
      path, raw_safetensors(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[100,116]}})", std::string(16, '\0')));
  expect_mentions(open_error(path), {path, "tensor 'w'", "[100, 116]", "past the end", "16 bytes"});
}

TEST(Safetensors, UnknownDtypeIsReported) {
  ScratchDir dir("st_dtype");
  const std::string path = dir.path("dtype.safetensors");
  write_file_bytes(path,
                   raw_safetensors(R"({"w":{"dtype":"Q7","shape":[4],"data_offsets":[0,4]}})", std::string(4, '\0')));
  expect_mentions(open_error(path), {path, "tensor 'w'", "unknown dtype 'Q7'"});
}

TEST(Safetensors, OverlappingTensorsAreReported) {
  ScratchDir dir("st_overlap");
  const std::string path = dir.path("overlap.safetensors");
  write_file_bytes(path, raw_safetensors(R"({"first":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                                         R"("second":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                                         std::string(16, '\0')));
  expect_mentions(open_error(path), {path, "'first'", "'second'", "overlap"});
}

TEST(Safetensors, ShapeSizeMismatchIsReported) {
  ScratchDir dir("st_size");
  const std::string path = dir.path("size.safetensors");
  write_file_bytes(
      path, raw_safetensors(R"({"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,10]}})", std::string(10, '\0')));
  expect_mentions(open_error(path), {path, "tensor 'w'", "needs 12 bytes", "span 10", "shape/size mismatch"});
}

TEST(Safetensors, MalformedEntriesAreReported) {
  ScratchDir dir("st_entries");
  const std::string path = dir.path("entries.safetensors");
  write_file_bytes(path,
                   raw_safetensors(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", std::string(4, 0)));
  expect_mentions(open_error(path), {path, "tensor 'w'", "non-negative"});
  write_file_bytes(path, raw_safetensors(R"({"w":{"dtype":"F32","shape":[1]}})", std::string(4, 0)));
  expect_mentions(open_error(path), {path, "tensor 'w'", "data_offsets"});
  write_file_bytes(path, raw_safetensors(R"({"__metadata__":{"format":3}})", ""));
  expect_mentions(open_error(path), {path, "__metadata__", "format"});
  std::string huge(8, '\xff');
  write_file_bytes(path, huge + "{}");
  expect_mentions(open_error(path), {path, "implausible"});
}

TEST(Safetensors, MissingFileIsReported) {
  expect_mentions(open_error("/nonexistent/dir/x.safetensors"), {"/nonexistent/dir/x.safetensors", "cannot open"});
}

TEST(Safetensors, ProducerTensorsAreStreamed) {
  ScratchDir dir("st_producer");
  const int64_t n = 3 * 1000 * 1000;
  StoredTensor produced = StoredTensor::from_producer(DType::f32, {n}, [n](void* dst) {
    for (int64_t i = 0; i < n; ++i) static_cast<float*>(dst)[i] = static_cast<float>(i % 977);
  });
  const std::string path = dir.path("big.safetensors");
  write_safetensors(path, {{"big", produced}});
  HostTensor back = SafetensorsFile::open(path)->tensor("big").to_host();
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) wrong += back.as<float>()[i] != static_cast<float>(i % 977);
  std::printf("producer round trip: %lld wrong values of %lld\n", static_cast<long long>(wrong),
              static_cast<long long>(n));
  EXPECT_EQ(wrong, 0);
}

}  // namespace
}  // namespace deltamoe
