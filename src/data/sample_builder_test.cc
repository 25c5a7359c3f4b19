// Samples from dataset lines: which tokens are supervised (single and multi-turn, think blocks,
// supervise-all), <|image_pad|> expansion to t*h*w/4 tokens, max_length drop/truncate, and the
// skip reason of each kind of bad sample. Uses the real Qwen3 tokenizer from tests/ref.
#include <gtest/gtest.h>

#include <algorithm>

#include "data/data_test_util.h"
#include "data/sample_builder.h"
#include "data/sample_skip.h"
#include "data/sft_record.h"

namespace deltamoe {
namespace {

using data_test::qwen3_tokenizer;

SampleOptions small_image_options() {
  SampleOptions options;
  options.image_config = data_test::small_image_config();
  return options;
}

SftSample build(const std::string& line, const SampleOptions& options = small_image_options(), const std::string& dir = "/") {
  const SampleBuilder builder(qwen3_tokenizer(), options);
  return builder.build(parse_sft_record(line, dir, "t.jsonl:1"), 0, "t.jsonl:1");
}

SkipReason skip_reason(const std::string& line, const SampleOptions& options = small_image_options(), const std::string& dir = "/") {
  try {
    build(line, options, dir);
  } catch (const SampleSkip& skip) {
    EXPECT_NE(std::string(skip.what()).find("t.jsonl:1"), std::string::npos) << skip.what();
    return skip.reason();
  }
  ADD_FAILURE() << "sample was not skipped: " << line;
  return SkipReason::kCount;
}

// Decoded text of each maximal run of supervised tokens.
std::vector<std::string> supervised_runs(const SftSample& sample) {
  std::vector<std::string> runs;
  std::vector<int32_t> run;
  for (size_t i = 0; i <= sample.labels.size(); ++i) {
    if (i < sample.labels.size() && sample.labels[i] != kIgnoreLabel) {
      EXPECT_EQ(sample.labels[i], sample.input_ids[i]) << "labels are unshifted";
      run.push_back(sample.labels[i]);
    } else if (!run.empty()) {
      runs.push_back(qwen3_tokenizer().decode(run));
      run.clear();
    }
  }
  return runs;
}

TEST(SampleBuilder, SingleTurnSupervisesTheAnswerAndImEnd) {
  const SftSample sample = build(data_test::chat_line("What is 2+2?", "It is 4."));
  EXPECT_EQ(qwen3_tokenizer().decode(sample.input_ids),
            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nIt is 4.<|im_end|>\n");
  EXPECT_EQ(supervised_runs(sample), (std::vector<std::string>{"It is 4.<|im_end|>"}));
  EXPECT_EQ(sample.num_supervised, static_cast<int64_t>(qwen3_tokenizer().encode("It is 4.<|im_end|>").size()));
  // Text only: the three position rows are 0..T-1.
  for (int64_t i = 0; i < sample.num_tokens(); ++i) {
    for (int row = 0; row < 3; ++row) EXPECT_EQ(sample.positions[static_cast<size_t>(row * sample.num_tokens() + i)], i);
  }
}

TEST(SampleBuilder, MultiTurnAndThinkBlocks) {
  const std::string line =
      R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!", "reasoning_content": "old thought"},
          {"role": "user", "content": "Sum 1 and 2"},
          {"role": "assistant", "content": "3", "reasoning_content": "1 plus 2"}]})";
  const SftSample sample = build(line);
  // The earlier turn loses its reasoning (template); the last keeps its non-empty think block.
  EXPECT_EQ(supervised_runs(sample), (std::vector<std::string>{"Hello!<|im_end|>", "<think>\n1 plus 2\n</think>\n\n3<|im_end|>"}));
  const std::string text = qwen3_tokenizer().decode(sample.input_ids);
  EXPECT_EQ(text.find("old thought"), std::string::npos);

  SampleOptions all = small_image_options();
  all.supervise_all = true;
  const SftSample everything = build(line, all);
  EXPECT_EQ(everything.labels, everything.input_ids);
  EXPECT_EQ(everything.num_supervised, everything.num_tokens());
}

TEST(SampleBuilder, EmptyThinkBlockIsNotSupervised) {
  const SftSample sample = build(
      R"({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": ""}]})");
  EXPECT_EQ(supervised_runs(sample), (std::vector<std::string>{"A<|im_end|>"}));
}

TEST(SampleBuilder, ImagePadsExpandToMergedTokenCount) {
  const auto folder = data_test::temp_folder();
  data_test::write_bytes(folder / "img/a.jpg", data_test::jpeg_bytes(64, 96));  // grid (1, 4, 6) -> 6 tokens
  const std::string url = data_test::jpeg_data_url(96, 160);                    // grid (1, 6, 10) -> 15 tokens
  const SftSample sample = build(
      R"({"messages": [{"role": "user", "content": "<image>and<image>?"}, {"role": "assistant", "content": "Two."}],
          "images": ["img/a.jpg", ")" + url + R"("]})",
      small_image_options(), folder.string());
  const int32_t pad = qwen3_tokenizer().require_token_id("<|image_pad|>");
  ASSERT_EQ(sample.images.size(), 2u);
  EXPECT_EQ(sample.images[0].grid_thw, (std::array<int64_t, 3>{1, 4, 6}));
  EXPECT_EQ(sample.images[1].grid_thw, (std::array<int64_t, 3>{1, 6, 10}));
  EXPECT_EQ(sample.num_image_tokens, 21);
  EXPECT_EQ(std::count(sample.input_ids.begin(), sample.input_ids.end(), pad), 21);
  // Each run sits between vision_start and vision_end and is never supervised.
  const int32_t start = qwen3_tokenizer().require_token_id("<|vision_start|>");
  const int32_t end = qwen3_tokenizer().require_token_id("<|vision_end|>");
  std::vector<int64_t> run_lengths;
  for (size_t i = 0; i < sample.input_ids.size(); ++i) {
    if (sample.input_ids[i] != start) continue;
    size_t j = i + 1;
    while (sample.input_ids[j] == pad) EXPECT_EQ(sample.labels[j++], kIgnoreLabel);
    EXPECT_EQ(sample.input_ids[j], end);
    run_lengths.push_back(static_cast<int64_t>(j - i - 1));
  }
  EXPECT_EQ(run_lengths, (std::vector<int64_t>{6, 15}));
  EXPECT_EQ(supervised_runs(sample), (std::vector<std::string>{"Two.<|im_end|>"}));
  // Positions: the first image starts at its vision_start + 1 and spans max(2, 3) = 3 positions.
  const size_t first_pad = static_cast<size_t>(std::find(sample.input_ids.begin(), sample.input_ids.end(), pad) - sample.input_ids.begin());
  const size_t length = sample.input_ids.size();
  const int64_t s = static_cast<int64_t>(first_pad);
  EXPECT_EQ(sample.positions[first_pad + 5], s);                 // t of the last merged token
  EXPECT_EQ(sample.positions[length + first_pad + 5], s + 1);    // h: row 1
  EXPECT_EQ(sample.positions[2 * length + first_pad + 5], s + 2);  // w: col 2
  EXPECT_EQ(sample.positions[first_pad + 6], s + 3);             // vision_end after the image
}

TEST(SampleBuilder, MaxLengthDropsOrTruncatesWithoutSplittingImages) {
  const std::string line = data_test::chat_line("Tell me a story", "Once upon a time there was a long answer.");
  const int64_t full = build(line).num_tokens();
  SampleOptions options = small_image_options();
  options.max_length = full - 3;
  EXPECT_EQ(skip_reason(line, options), SkipReason::kTooLong);
  options.truncate = true;
  const SftSample cut = build(line, options);
  EXPECT_EQ(cut.num_tokens(), full - 3);
  EXPECT_TRUE(cut.truncated);
  EXPECT_EQ(cut.positions.size(), 3u * static_cast<size_t>(full - 3));
  options.max_length = 10;  // inside the user turn: nothing left to learn
  EXPECT_EQ(skip_reason(line, options), SkipReason::kNoSupervisedToken);

  // A cut through an image's tokens removes the whole image.
  const std::string url = data_test::jpeg_data_url(64, 96);  // 6 tokens
  const std::string image_line = R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "Look"}, {"type": "image", "image": ")" +
                                 url + R"("}]}, {"role": "assistant", "content": "Nice."}]})";
  options.max_length = 7;  // <|im_start|> user \n Look <|vision_start|> = 5, then 2 of the 6 pads
  options.supervise_all = true;
  const SftSample no_image = build(image_line, options);
  EXPECT_TRUE(no_image.images.empty());
  EXPECT_EQ(no_image.num_image_tokens, 0);
  EXPECT_EQ(no_image.num_tokens(), 5);
}

TEST(SampleBuilder, BadSamplesAreSkippedWithTheirReason) {
  const auto folder = data_test::temp_folder();
  data_test::write_bytes(folder / "corrupt.jpg", {0xFF, 0xD8, 0xFF, 0xE0, 1, 2, 3});
  const std::string dir = folder.string();
  const SampleOptions options = small_image_options();
  EXPECT_EQ(skip_reason(R"({"messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}], "images": ["nope.jpg"]})",
                        options, dir),
            SkipReason::kMissingImage);
  EXPECT_EQ(skip_reason(R"({"messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}], "images": ["corrupt.jpg"]})",
                        options, dir),
            SkipReason::kBadImage);
  EXPECT_EQ(skip_reason(R"({"messages": [{"role": "user", "content": [{"type": "image", "image": "data:image/png;base64,!!"}]}, {"role": "assistant", "content": "y"}]})",
                        options, dir),
            SkipReason::kBadImage);
  EXPECT_EQ(skip_reason(data_test::chat_line("literal <|image_pad|> here", "y"), options, dir), SkipReason::kBadConversation);
  EXPECT_EQ(skip_reason(R"({"messages": [{"role": "user", "content": "only a question"}]})", options, dir),
            SkipReason::kNoSupervisedToken);
  EXPECT_EQ(skip_reason(R"({"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "late"}, {"role": "assistant", "content": "a"}]})",
                        options, dir),
            SkipReason::kBadConversation);
  EXPECT_EQ(skip_reason(R"({"messages": [{"role": "robot", "content": "q"}]})", options, dir), SkipReason::kBadConversation);
}

// A line nested 100,000 deep used to overflow the stack while its JSON was printed (in the record
// parser, the tool list and the tool-call arguments): it is a malformed_json skip now.
TEST(SampleBuilder, DeeplyNestedJsonIsSkippedNotACrash) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::string& escaped_deep = deep;  // brackets need no escaping inside a JSON string
  const std::string user = R"({"role": "user", "content": "Hi"})";
  const std::string answer = R"({"role": "assistant", "content": "Hello"})";
  EXPECT_EQ(skip_reason(R"({"messages": [{"role": "user", "content": [)" + deep + R"(]}, )" + answer + "]}"),
            SkipReason::kMalformedJson);
  EXPECT_EQ(skip_reason(R"({"messages": [)" + user + ", " + answer + R"(], "tools": )" + deep + "}"),
            SkipReason::kMalformedJson);
  EXPECT_EQ(skip_reason(R"({"messages": [)" + user + ", " + answer + R"(], "tools": ")" + escaped_deep + "\"}"),
            SkipReason::kMalformedJson);
  EXPECT_EQ(skip_reason(R"({"messages": [)" + user +
                        R"(, {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {"a": )" +
                        deep + "}}]}]}"),
            SkipReason::kMalformedJson);
  // Ordinary nesting (a tool schema a few levels deep) is untouched.
  EXPECT_NO_THROW(build(R"({"messages": [)" + user + ", " + answer +
                        R"(], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}}}}}}]})"));
}

TEST(SampleBuilder, Qwen3FormatTextOnly) {
  SampleOptions options;
  options.chat_format = ChatFormat::kQwen3;
  const SftSample sample = build(data_test::chat_line("Hi", "Hello"), options);
  const std::vector<std::string> runs = supervised_runs(sample);
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_TRUE(runs[0].ends_with("Hello<|im_end|>")) << runs[0];
  EXPECT_EQ(runs[0].find("user"), std::string::npos) << runs[0];
}

}  // namespace
}  // namespace deltamoe
