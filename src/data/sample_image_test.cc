// Image paths that are not image files: a directory, endless or unreadable devices, procfs files
// and a FIFO are skipped with their reason, at once, inside the per-sample skip logic; files over
// the byte cap are skipped unread. Each case runs in a forked child with a time and memory limit
// (without the checks they blocked forever or read until memory ran out).
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "data/data_test_util.h"
#include "data/sample_builder.h"
#include "data/sample_skip.h"
#include "data/sft_record.h"

namespace deltamoe {
namespace {

using data_test::qwen3_tokenizer;
namespace fs = std::filesystem;

std::string image_line(const std::string& path) {
  return R"({"messages": [{"role": "user", "content": [{"type": "image", "image": ")" + path +
         R"("}, {"type": "text", "text": "What is it?"}]}, {"role": "assistant", "content": "A thing."}]})";
}

// The skip message for a sample with this image, or what went wrong instead.
std::string skip_message(const std::string& path, const SampleOptions& options, SkipReason* reason) {
  const SampleBuilder builder(qwen3_tokenizer(), options);
  try {
    builder.build(parse_sft_record(image_line(path), "/", "set.jsonl:3"), 0, "set.jsonl:3");
  } catch (const SampleSkip& skip) {
    *reason = skip.reason();
    return skip.what();
  } catch (const std::exception& error) {
    return std::string("not a skip: ") + error.what();
  }
  return "(no skip)";
}

TEST(SampleImage, NonImageFilesAreSkippedAtOnceWithTheirReason) {
  const fs::path folder = data_test::temp_folder();
  ASSERT_EQ(::mkfifo((folder / "pipe.png").c_str(), 0644), 0);
  struct Case {
    std::string path;
    std::string says;
  };
  const std::vector<Case> cases = {
      {folder.string(), "is a directory, not an image file"},
      {"/dev/zero", "is a character device, not an image file"},
      {"/dev/urandom", "is a character device, not an image file"},
      {"/proc/self/mem", "is empty (0 bytes)"},
      {(folder / "pipe.png").string(), "is a FIFO, not an image file"},
      {(folder / "missing.png").string(), "cannot open: No such file or directory"},
  };
  qwen3_tokenizer();  // loaded before the forks
  for (const Case& c : cases) {
    SCOPED_TRACE(c.path);
    EXPECT_EXIT(
        {
          alarm(20);
          rlimit memory;
          memory.rlim_cur = memory.rlim_max = rlim_t{4} << 30;
          setrlimit(RLIMIT_AS, &memory);
          SkipReason reason = SkipReason::kCount;
          const std::string message = skip_message(c.path, SampleOptions{}, &reason);
          std::fprintf(stderr, "%s\n", message.c_str());
          bool ok = message.find("set.jsonl:3") != std::string::npos && message.find(c.path) != std::string::npos;
          ok = ok && message.find(c.says) != std::string::npos;
          ok = ok && (reason == SkipReason::kBadImage || reason == SkipReason::kMissingImage);
          _exit(ok ? 0 : 1);
        },
        ::testing::ExitedWithCode(0), "");
  }
}

TEST(SampleImage, FilesOverTheByteCapAreSkippedUnread) {
  const fs::path folder = data_test::temp_folder();
  data_test::write_bytes(folder / "big.jpg", data_test::jpeg_bytes(64, 64));
  SampleOptions options;
  options.image_limits.max_file_bytes = 100;
  SkipReason reason = SkipReason::kCount;
  const std::string message = skip_message((folder / "big.jpg").string(), options, &reason);
  EXPECT_EQ(reason, SkipReason::kBadImage);
  EXPECT_NE(message.find("over the 100-byte limit"), std::string::npos) << message;
  // Embedded images have the same cap.
  const SampleBuilder builder(qwen3_tokenizer(), options);
  EXPECT_THROW(builder.build(parse_sft_record(image_line(data_test::jpeg_data_url(64, 64)), "/", "set.jsonl:4"), 0,
                             "set.jsonl:4"),
               SampleSkip);
}

}  // namespace
}  // namespace deltamoe
