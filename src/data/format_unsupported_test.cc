// Forms deltamoe does not train yet are skipped, never trained as text, and each is counted under
// its own detail: videos (the "videos"/"video" keys, video parts, <video> tags), audio, grounding
// "objects", Anthropic content blocks and weighted loss_scale.
#include "data/data_pipeline.h"
#include "data/format_test_util.h"

namespace deltamoe {
namespace {

using namespace format_test;

const char* const kAnswer = R"({"role": "assistant", "content": "x"})";

TEST(FormatUnsupported, EachFormIsSkippedUnderItsOwnDetail) {
  struct Case {
    std::string line;
    std::string detail;
  };
  const std::vector<Case> cases = {
      {str_cat(R"({"messages": [{"role": "user", "content": "<video>What happens?"}, )", kAnswer, R"(], "videos": ["a.mp4"]})"), "video"},
      {str_cat(R"({"messages": [{"role": "user", "content": "What happens?"}, )", kAnswer, R"(], "video": "a.mp4"})"), "video"},
      {str_cat(R"({"messages": [{"role": "user", "content": [{"type": "video", "video": "a.mp4"}]}, )", kAnswer, "]}"), "video"},
      {str_cat(R"({"messages": [{"role": "user", "content": "<video>What happens?"}, )", kAnswer, "]}"), "video"},
      {str_cat(R"({"messages": [{"role": "user", "content": "<audio>Who speaks?"}, )", kAnswer, R"(], "audios": ["a.wav"]})"), "audio"},
      {str_cat(R"({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}, )", kAnswer, "]}"), "audio"},
      {str_cat(R"({"messages": [{"role": "user", "content": "Find <ref-object>"}, )", kAnswer,
               R"(], "objects": {"ref": ["cat"], "bbox": [[1, 2, 3, 4]]}})"), "objects"},
      {str_cat(R"({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}, )", kAnswer, "]}"),
       "anthropic_blocks"},
      {R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "loss_scale": 2.0}]})", "loss_scale"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.line);
    const Skip skip = skip_of(c.line);
    EXPECT_EQ(skip.reason, SkipReason::kUnsupported);
    EXPECT_EQ(skip.detail, c.detail);
  }
}

TEST(FormatUnsupported, ThePipelineCountsEachDetail) {
  const fs::path folder = data_test::temp_folder();
  std::string text = data_test::chat_line("fine", "yes");
  text += str_cat(R"({"messages": [{"role": "user", "content": "<video>?"}, )", kAnswer, R"(], "videos": ["a.mp4"]})", "\n");
  text += str_cat(R"({"messages": [{"role": "user", "content": "<video>?"}, )", kAnswer, R"(], "videos": ["b.mp4"]})", "\n");
  text += str_cat(R"({"messages": [{"role": "user", "content": "<audio>?"}, )", kAnswer, R"(], "audios": ["a.wav"]})", "\n");
  data_test::write_text(folder / "mixed.jsonl", text);
  PipelineOptions options;
  options.dataset_paths = {(folder / "mixed.jsonl").string()};
  options.sample = format_test::options();
  options.token_budget = 256;
  options.num_workers = 0;
  DataPipeline pipeline(options, data_test::qwen3_tokenizer());
  data_test::run_to_end(pipeline);
  const SkipStats& skips = pipeline.skip_stats();
  EXPECT_EQ(skips.count(SkipReason::kUnsupported), 3);
  EXPECT_EQ(skips.count_detail("video"), 2);
  EXPECT_EQ(skips.count_detail("audio"), 1);
  EXPECT_EQ(skips.summary(), "3 skipped (unsupported 3 [audio 1, video 2])");
}

TEST(FormatUnsupported, StrictStopsAtTheFirstSkip) {
  const fs::path folder = data_test::temp_folder();
  data_test::write_text(folder / "one_bad.jsonl", data_test::chat_line("fine", "yes") + "not json\n");
  PipelineOptions options;
  options.dataset_paths = {(folder / "one_bad.jsonl").string()};
  options.sample = format_test::options();
  options.token_budget = 256;
  options.num_workers = 0;
  options.shuffle = false;
  options.strict = true;
  DataPipeline pipeline(options, data_test::qwen3_tokenizer());
  try {
    data_test::run_to_end(pipeline);
    ADD_FAILURE() << "--strict did not stop";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("--strict: malformed_json"), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("one_bad.jsonl:2"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace deltamoe
