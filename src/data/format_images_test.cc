// Images in every layout: the "images" list with <image> tags (also the singular "image" key and
// ShareGPT / alpaca lines), relative paths found in the working directory (ms-swift's rule), then
// the dataset's folder, or under --media_dir; http(s) URLs and raw base64 refused with the reason;
// an <image> tag without images never trained as text.
#include <unistd.h>

#include "data/format_test_util.h"

namespace deltamoe {
namespace {

using namespace format_test;

// A folder with a 64x48 JPEG at img/a.jpg.
fs::path image_folder() {
  const fs::path folder = data_test::temp_folder();
  fs::create_directories(folder / "img");
  data_test::write_bytes(folder / "img" / "a.jpg", data_test::jpeg_bytes(48, 64));
  return folder;
}

TEST(FormatImages, ImagesListWithTagsMatchesImageParts) {
  const fs::path folder = image_folder();
  const std::string parts =
      R"({"messages": [{"role": "user", "content": [{"type": "image", "image": "img/a.jpg"}, {"type": "text", "text": "What?"}]},)"
      R"( {"role": "assistant", "content": "A box."}]})";
  for (const char* line : {R"({"messages": [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "A box."}], "images": ["img/a.jpg"]})",
                           R"({"messages": [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "A box."}], "image": "img/a.jpg"})",
                           R"({"messages": [{"role": "user", "content": "What?"}, {"role": "assistant", "content": "A box."}], "images": [{"path": "img/a.jpg"}]})",
                           R"({"conversations": [{"from": "human", "value": "<image>What?"}, {"from": "gpt", "value": "A box."}], "images": ["img/a.jpg"]})",
                           R"({"query": "<image>What?", "response": "A box.", "image": ["img/a.jpg"]})"}) {
    SCOPED_TRACE(line);
    expect_same_as_messages(line, parts, folder.string());
    EXPECT_EQ(build(line, folder.string()).images.size(), 1u);
  }
}

TEST(FormatImages, RelativePathsTryTheWorkingDirectoryThenTheDatasetFolder) {
  const fs::path data_dir = image_folder();  // has img/a.jpg
  const fs::path cwd = data_test::temp_folder();
  fs::create_directories(cwd / "img");
  data_test::write_bytes(cwd / "img" / "a.jpg", data_test::jpeg_bytes(96, 32));  // another size: tells which was read
  const fs::path before = fs::current_path();
  fs::current_path(cwd);
  const std::string line = R"({"messages": [{"role": "user", "content": "<image>?"}, {"role": "assistant", "content": "x"}], "images": ["img/a.jpg"]})";
  const SftRecord record = parse_sft_record(line, data_dir.string(), "f.jsonl:1");
  EXPECT_EQ(record.images[0], (cwd / "img" / "a.jpg").string()) << "the working directory wins (ms-swift)";
  fs::remove_all(cwd / "img");
  const SftRecord fallback = parse_sft_record(line, data_dir.string(), "f.jsonl:1");
  EXPECT_EQ(fallback.images[0], (data_dir / "img" / "a.jpg").string()) << "then the dataset's folder";
  const SftRecord media = parse_sft_record(line, ImageRoots{data_dir.string(), "/srv/media"}, "f.jsonl:1");
  EXPECT_EQ(media.images[0], "/srv/media/img/a.jpg") << "--media_dir is the only root when given";
  fs::current_path(before);
}

TEST(FormatImages, AMissingRelativeImageSaysWhereItWasLookedFor) {
  const Skip skip = skip_of(R"({"messages": [{"role": "user", "content": "<image>?"}, {"role": "assistant", "content": "x"}], "images": ["nowhere/x.png"]})",
                            data_test::temp_folder().string());
  EXPECT_EQ(skip.reason, SkipReason::kMissingImage);
  EXPECT_NE(skip.message.find("the working directory, then the dataset's folder"), std::string::npos) << skip.message;
}

TEST(FormatImages, UrlsAndRawBase64AreRefusedWithTheReason) {
  const Skip url = skip_of(R"({"messages": [{"role": "user", "content": "<image>?"}, {"role": "assistant", "content": "x"}], "images": ["https://example.com/a.jpg"]})");
  EXPECT_EQ(url.reason, SkipReason::kMissingImage);
  EXPECT_EQ(url.detail, "remote_image");
  EXPECT_NE(url.message.find("not downloaded"), std::string::npos) << url.message;
  const std::string raw = data_test::base64_encode(data_test::jpeg_bytes(32, 32));
  const Skip base64 = skip_of(R"({"messages": [{"role": "user", "content": "<image>?"}, {"role": "assistant", "content": "x"}], "images": [")" + raw + R"("]})");
  EXPECT_EQ(base64.reason, SkipReason::kMissingImage);
  EXPECT_EQ(base64.detail, "raw_base64");
  EXPECT_NE(base64.message.find("data:image/png;base64"), std::string::npos) << base64.message;
  // The same bytes as a data URL train.
  EXPECT_EQ(build(R"({"messages": [{"role": "user", "content": "<image>?"}, {"role": "assistant", "content": "x"}], "images": ["data:image/jpeg;base64,)" + raw + R"("]})").images.size(), 1u);
}

TEST(FormatImages, AnImageTagWithoutImagesIsNotTrainedAsText) {
  const Skip skip = skip_of(R"({"messages": [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "x"}]})");
  EXPECT_EQ(skip.reason, SkipReason::kBadConversation);
  EXPECT_NE(skip.message.find("lists no images"), std::string::npos) << skip.message;
}

}  // namespace
}  // namespace deltamoe
