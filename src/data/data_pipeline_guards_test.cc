// The pipeline's progress and resource guarantees: an epoch that yields nothing is an error when
// more epochs would follow (never an endless loop), threads that cannot start are an error (never
// an abort), over-long lines are skipped unread, and a stop request ends a long pass at once.
// Cases that would hang or abort without the guard run in a forked child under a time limit.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fstream>

#include "data/data_pipeline.h"
#include "data/data_test_util.h"
#include "testing/error_of.h"

namespace deltamoe {
namespace {

using data_test::chat_line;
using data_test::qwen3_tokenizer;
namespace fs = std::filesystem;

PipelineOptions options_for(const fs::path& dataset) {
  PipelineOptions options;
  options.dataset_paths = {dataset.string()};
  options.sample.image_config = data_test::small_image_config();
  options.token_budget = 256;
  options.num_workers = 2;
  options.seed = 5;
  return options;
}

// Runs `body` in a forked child that is killed after limit_s seconds; the child exits 0 when
// `body` returns true.
#define EXPECT_IN_CHILD_WITHIN(limit_s, ...) \
  EXPECT_EXIT(                               \
      {                                      \
        alarm(limit_s);                      \
        _exit((__VA_ARGS__)() ? 0 : 1);      \
      },                                     \
      ::testing::ExitedWithCode(0), "")

// (Before: with the data repeating for --max_steps, next_batch looped over the skipped lines
// forever at 100% CPU.)
TEST(DataPipelineGuards, AnEpochWithNoSampleIsAnErrorWhenMoreEpochsFollow) {
  const fs::path folder = data_test::temp_folder();
  data_test::write_text(folder / "bad.jsonl", "not json\n{\"messages\": []}\n[1]\n");
  qwen3_tokenizer();  // loaded before the fork
  for (const int64_t epochs : {int64_t{0}, int64_t{3}}) {
    SCOPED_TRACE(epochs);
    EXPECT_IN_CHILD_WITHIN(30, [&] {
      PipelineOptions options = options_for(folder / "bad.jsonl");
      options.num_epochs = epochs;
      DataPipeline pipeline(options, qwen3_tokenizer());
      const std::string message = error_of([&] { pipeline.next_batch(); });
      std::fprintf(stderr, "%s\n", message.c_str());
      return message.find("every sample of the dataset (3 lines) was skipped in epoch 0") != std::string::npos &&
             message.find("malformed_json 2, bad_conversation 1") != std::string::npos;
    });
  }
  // One epoch simply ends: `deltamoe data` reports the skips.
  PipelineOptions options = options_for(folder / "bad.jsonl");
  DataPipeline pipeline(options, qwen3_tokenizer());
  EXPECT_FALSE(pipeline.next_batch().has_value());
  EXPECT_EQ(pipeline.skip_stats().total(), 3);
}

// A resumed run's first epoch starts part-way: its rest may hold only bad lines without the data
// being unusable, so that partial epoch yielding nothing is not an error.
TEST(DataPipelineGuards, APartialFirstEpochAfterResumeMayYieldNothing) {
  const fs::path folder = data_test::temp_folder();
  data_test::write_text(folder / "mixed.jsonl", chat_line("q", "a") + "not json\nnot json\nnot json\n");
  PipelineOptions options = options_for(folder / "mixed.jsonl");
  options.shuffle = false;
  options.num_epochs = 0;
  options.max_samples_per_batch = 1;  // the first batch ends before the bad lines are read
  DataPosition after_first;
  {
    DataPipeline pipeline(options, qwen3_tokenizer());
    const std::optional<MicroBatch> first = pipeline.next_batch();
    ASSERT_TRUE(first.has_value());
    after_first = first->position_after;
  }
  ASSERT_EQ(after_first.epoch, 0);
  ASSERT_GT(after_first.next_slot, 0);
  DataPipeline resumed(options, qwen3_tokenizer(), after_first);
  const std::optional<MicroBatch> next = resumed.next_batch();
  ASSERT_TRUE(next.has_value());
  EXPECT_EQ(resumed.epoch(), 1);
}

// (Before: a failed std::thread start left the started threads joinable and the process aborted.)
TEST(DataPipelineGuards, ThreadsThatCannotStartAreAnErrorNotAnAbort) {
  const fs::path folder = data_test::temp_folder();
  data_test::write_text(folder / "one.jsonl", chat_line("q", "a"));
  qwen3_tokenizer();
  EXPECT_IN_CHILD_WITHIN(30, [&] {
    // Room for a few thread stacks (8 MiB of address space each) but not for 200.
    std::ifstream status("/proc/self/status");
    int64_t vm_kib = 0;
    for (std::string line; std::getline(status, line);) {
      if (line.starts_with("VmSize:")) vm_kib = std::stoll(line.substr(7));
    }
    const rlimit limit{static_cast<rlim_t>((vm_kib + 64 * 1024) * 1024), static_cast<rlim_t>((vm_kib + 64 * 1024) * 1024)};
    setrlimit(RLIMIT_AS, &limit);
    PipelineOptions options = options_for(folder / "one.jsonl");
    options.num_workers = 200;
    const std::string message = error_of([&] { DataPipeline pipeline(options, qwen3_tokenizer()); });
    std::fprintf(stderr, "%s\n", message.c_str());
    return message.find("cannot start 200 data loader threads") != std::string::npos;
  });
}

TEST(DataPipelineGuards, LinesOverTheByteLimitAreSkippedUnread) {
  const fs::path folder = data_test::temp_folder();
  const std::string long_answer(5000, 'x');
  data_test::write_text(folder / "long.jsonl", chat_line("q", long_answer) + chat_line("q", "short"));
  PipelineOptions options = options_for(folder / "long.jsonl");
  options.max_line_bytes = 1000;
  DataPipeline pipeline(options, qwen3_tokenizer());
  const std::vector<MicroBatch> batches = data_test::run_to_end(pipeline);
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(batches[0].num_samples(), 1);
  EXPECT_EQ(pipeline.skip_stats().count(SkipReason::kTooLong), 1);
  ASSERT_EQ(pipeline.skip_stats().first_messages().size(), 1u);
  const std::string expected =
      str_cat("long.jsonl:1: the line is ", chat_line("q", long_answer).size() - 1, " bytes, over the 1000-byte limit");
  EXPECT_NE(pipeline.skip_stats().first_messages()[0].find(expected), std::string::npos)
      << pipeline.skip_stats().first_messages()[0];
}

// A stop request (the trainer's SIGTERM flag) is asked between samples, so a long pass over
// skipped lines does not delay it.
TEST(DataPipelineGuards, AStopRequestEndsALongPassAtOnce) {
  const fs::path folder = data_test::temp_folder();
  std::string lines;
  for (int i = 0; i < 2000; ++i) lines += "not json\n";
  data_test::write_text(folder / "skipped.jsonl", lines + chat_line("q", "a"));
  PipelineOptions options = options_for(folder / "skipped.jsonl");
  options.shuffle = false;
  int calls = 0;
  options.stop_requested = [&calls] { return ++calls > 100; };
  DataPipeline pipeline(options, qwen3_tokenizer());
  EXPECT_FALSE(pipeline.next_batch().has_value());
  EXPECT_LE(pipeline.skip_stats().total(), 100);
  EXPECT_FALSE(pipeline.next_batch().has_value()) << "a stopped pipeline stays stopped";
}

}  // namespace
}  // namespace deltamoe
