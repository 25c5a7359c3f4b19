// Dataset line layouts: image parts in messages and ms-swift's messages + images with <image> tags,
// relative paths, data URLs, base64, and the skip reason for each kind of bad line.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "data/base64.h"
#include "data/data_test_util.h"
#include "data/sample_skip.h"
#include "data/sft_record.h"

namespace deltamoe {
namespace {

using Json = nlohmann::json;

SkipReason reason_of(const std::string& line) {
  try {
    parse_sft_record(line, "/data", "set.jsonl:7");
  } catch (const SampleSkip& skip) {
    EXPECT_NE(std::string(skip.what()).find("set.jsonl:7"), std::string::npos) << "message must say where: " << skip.what();
    return skip.reason();
  }
  ADD_FAILURE() << "no skip for " << line;
  return SkipReason::kCount;
}

TEST(SftRecord, ImagePartsWithRelativeAbsoluteAndFileUrlPaths) {
  const SftRecord record = parse_sft_record(
      R"({"messages": [{"role": "user", "content": [{"type": "image", "image": "img/a.jpg"}, {"type": "text", "text": "Hi"},
          {"type": "image_url", "image_url": {"url": "file:///abs/b.png"}}, {"image": "/abs/c.webp"}]},
          {"role": "assistant", "content": "Yes"}]})",
      "/data/set", "x:1");
  ASSERT_EQ(record.images.size(), 3u);
  EXPECT_EQ(record.images[0], "/data/set/img/a.jpg");
  EXPECT_EQ(record.images[1], "/abs/b.png");
  EXPECT_EQ(record.images[2], "/abs/c.webp");
  const Json messages = Json::parse(record.messages_json);
  EXPECT_EQ(messages[0]["content"][0], Json({{"type", "image"}}));
  EXPECT_EQ(messages[0]["content"][1]["text"], "Hi");
  EXPECT_EQ(messages[1]["content"], "Yes");
  EXPECT_TRUE(record.tools_json.empty());
}

TEST(SftRecord, DataUrlIsKeptAndDecodes) {
  const std::string url = data_test::jpeg_data_url(32, 48);
  const SftRecord record = parse_sft_record(
      R"({"messages": [{"role": "user", "content": [{"type": "image", "image": ")" + url +
          R"("}]}, {"role": "assistant", "content": "ok"}]})",
      "/data", "x:1");
  ASSERT_EQ(record.images.size(), 1u);
  EXPECT_EQ(record.images[0], url);
  const std::vector<uint8_t> bytes = decode_data_url(record.images[0], "x:1");
  EXPECT_EQ(bytes, data_test::jpeg_bytes(32, 48));
}

TEST(SftRecord, SwiftLayoutSplitsImageTagsInOrder) {
  const SftRecord record = parse_sft_record(
      R"({"messages": [{"role": "system", "content": "Be brief."},
          {"role": "user", "content": "<image>Compare<image> and"},
          {"role": "assistant", "content": "Same."}, {"role": "user", "content": "And <image>?"},
          {"role": "assistant", "content": "Other."}], "images": ["one.jpg", {"path": "/x/two.jpg"}, "three.jpg"],
          "tools": [{"name": "f", "parameters": {}}]})",
      "/d", "x:1");
  EXPECT_EQ(record.images, (std::vector<std::string>{"/d/one.jpg", "/x/two.jpg", "/d/three.jpg"}));
  const Json messages = Json::parse(record.messages_json);
  EXPECT_EQ(messages[1]["content"],
            Json::parse(R"([{"type": "image"}, {"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": " and"}])"));
  EXPECT_EQ(messages[3]["content"], Json::parse(R"([{"type": "text", "text": "And "}, {"type": "image"}, {"type": "text", "text": "?"}])"));
  EXPECT_EQ(messages[0]["content"], "Be brief.");
  EXPECT_EQ(Json::parse(record.tools_json)[0]["name"], "f");
}

TEST(SftRecord, SwiftLayoutWithoutTagsPutsImagesBeforeTheFirstQuery) {
  const SftRecord record = parse_sft_record(
      R"({"messages": [{"role": "user", "content": "What?"}, {"role": "assistant", "content": "A."}], "images": ["a.jpg", "b.jpg"]})",
      "/d", "x:1");
  EXPECT_EQ(record.images.size(), 2u);
  EXPECT_EQ(Json::parse(record.messages_json)[0]["content"],
            Json::parse(R"([{"type": "image"}, {"type": "image"}, {"type": "text", "text": "What?"}])"));
}

TEST(SftRecord, BadLinesGiveTheirReason) {
  EXPECT_EQ(reason_of(R"({"messages": [)"), SkipReason::kMalformedJson);
  EXPECT_EQ(reason_of(R"([1, 2])"), SkipReason::kMalformedJson);
  EXPECT_EQ(reason_of(R"({"conversation": []})"), SkipReason::kBadConversation);
  EXPECT_EQ(reason_of(R"({"messages": []})"), SkipReason::kBadConversation);
  EXPECT_EQ(reason_of(R"({"messages": [{"role": "user", "content": "<image><image>"}], "images": ["a.jpg"]})"),
            SkipReason::kBadConversation);
  EXPECT_EQ(reason_of(R"({"messages": [{"role": "user", "content": "x"}], "images": 5})"), SkipReason::kBadConversation);
  EXPECT_EQ(reason_of(R"({"messages": [{"role": "user", "content": [{"type": "image"}]}]})"), SkipReason::kBadConversation);
  EXPECT_EQ(reason_of(R"({"messages": [{"role": "user", "content": [{"type": "image", "image": 3}]}]})"),
            SkipReason::kBadConversation);
  EXPECT_EQ(reason_of(R"({"messages": [{"role": "user", "content": [{"type": "image", "image": "https://x/a.jpg"}]}]})"),
            SkipReason::kMissingImage);
  EXPECT_EQ(reason_of(R"({"messages": [{"role": "user", "content": [{"type": "video", "video": "a.mp4"}]}]})"),
            SkipReason::kUnsupported);
  EXPECT_EQ(reason_of(R"({"messages": [{"role": "user", "content": "x"}], "tools": 3})"), SkipReason::kBadConversation);
}

// Found by fuzz_sft_record: a non-string "role" in the ms-swift layout threw nlohmann's
// type_error, which stopped the whole run instead of skipping the line.
TEST(SftRecord, ValuesOfUnexpectedTypesAreSkipsNotExceptions) {
  // The record itself is fine here (the chat parser refuses the role later): no exception at all.
  EXPECT_NO_THROW(parse_sft_record(
      R"({"messages": [{"role": ["user"], "content": "<image>x"}, {"role": "assistant", "content": "y"}], "images": ["a.jpg"]})",
      "/data", "set.jsonl:7"));
  EXPECT_EQ(reason_of(R"({"messages": [{"role": 7, "content": "x"}], "images": ["a.jpg"]})"), SkipReason::kBadConversation);
}

TEST(Base64, DecodesPaddedUnpaddedAndRejectsGarbage) {
  // RFC 4648 section 10 test vectors.
  const std::pair<const char*, const char*> vectors[] = {{"", ""},         {"Zg==", "f"},         {"Zm8=", "fo"},
                                                         {"Zm9v", "foo"},  {"Zm9vYg==", "foob"},  {"Zm9vYmE=", "fooba"},
                                                         {"Zm9vYmFy", "foobar"}, {"Zm9vYg", "foob"}, {"Zm9v\nYmFy", "foobar"}};
  for (const auto& [encoded, plain] : vectors) {
    const auto decoded = base64_decode(encoded);
    ASSERT_TRUE(decoded.has_value()) << encoded;
    EXPECT_EQ(std::string(decoded->begin(), decoded->end()), plain) << encoded;
  }
  for (const char* bad : {"Z", "Zm9vY", "Zm!v", "Zg==Zg", "Zg==="}) EXPECT_FALSE(base64_decode(bad).has_value()) << bad;
  EXPECT_THROW(decode_data_url("data:image/png,rawbytes", "x:1"), Error);
  EXPECT_THROW(decode_data_url("data:image/png;base64,@@", "x:1"), Error);
}

TEST(SampleSource, IndexesNonBlankLinesAndMixesFiles) {
  const auto folder = data_test::temp_folder();
  data_test::write_text(folder / "a.jsonl", "first\n\n  \r\nsecond\r\nthird");  // no final newline
  data_test::write_text(folder / "empty.jsonl", "");
  data_test::write_text(folder / "sub/b.jsonl", "x\ny\n");
  const DatasetFiles files(split_dataset_list((folder / "a.jsonl").string() + ",," + (folder / "empty.jsonl").string() + "," +
                                              (folder / "sub/b.jsonl").string()));
  ASSERT_EQ(files.size(), 5);
  const char* expected[] = {"first", "second", "third", "x", "y"};
  for (int64_t i = 0; i < 5; ++i) {
    const auto location = files.locate(i);
    EXPECT_EQ(location.source->read(location.index), expected[i]) << i;
  }
  EXPECT_EQ(files.where(1), (folder / "a.jsonl").string() + ":4");
  EXPECT_EQ(files.where(4), (folder / "sub/b.jsonl").string() + ":2");
  EXPECT_EQ(files.locate(3).source->directory(), (folder / "sub").string());
  EXPECT_THROW(DatasetFiles({(folder / "missing.jsonl").string()}), Error);
}

TEST(SampleSource, LinesAcrossReadChunks) {
  // Indexing reads 1 MiB at a time: lines (and a blank line) that straddle chunk boundaries.
  const auto folder = data_test::temp_folder();
  std::vector<std::string> lines;
  std::string text;
  for (int i = 0; i < 5; ++i) {
    lines.push_back(std::string(700 * 1024 + i * 977, static_cast<char>('a' + i)));
    text += lines.back() + (i == 2 ? "\n" + std::string(600 * 1024, ' ') + "\n" : "\n");
  }
  data_test::write_text(folder / "big.jsonl", text);
  const SampleSource source((folder / "big.jsonl").string());
  ASSERT_EQ(source.size(), 5);
  for (int64_t i = 0; i < 5; ++i) EXPECT_TRUE(source.read(i) == lines[static_cast<size_t>(i)]) << "line " << i;
  EXPECT_EQ(source.line_number(3), 5);
}

}  // namespace
}  // namespace deltamoe
