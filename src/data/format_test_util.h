// Shared checks of the dataset-format tests (format_*_test.cc): a line in some layout must give the
// same tokens, label mask and images as the same conversation written in the messages form.
#pragma once

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/data_test_util.h"
#include "data/sample_builder.h"
#include "data/sample_skip.h"
#include "data/sft_record.h"

namespace deltamoe::format_test {

namespace fs = std::filesystem;

inline SampleOptions options() {
  SampleOptions options;
  options.image_config = data_test::small_image_config();
  return options;
}

inline SftSample build(const std::string& line, const std::string& dir = "/", const SampleOptions& sample = options()) {
  const SampleBuilder builder(data_test::qwen3_tokenizer(), sample);
  return builder.build(parse_sft_record(line, dir, "f.jsonl:1"), 0, "f.jsonl:1");
}

// The decoded text of the supervised tokens, runs joined by " | ".
inline std::string supervised_text(const SftSample& sample) {
  std::string out;
  std::vector<int32_t> run;
  for (size_t i = 0; i <= sample.labels.size(); ++i) {
    if (i < sample.labels.size() && sample.labels[i] != kIgnoreLabel) {
      run.push_back(sample.labels[i]);
    } else if (!run.empty()) {
      out += (out.empty() ? "" : " | ") + data_test::qwen3_tokenizer().decode(run);
      run.clear();
    }
  }
  return out;
}

// Same tokens, labels and image grids as the messages-form line (and something is trained).
inline void expect_same_as_messages(const std::string& line, const std::string& messages_line, const std::string& dir = "/",
                                    const SampleOptions& sample = options()) {
  const SftSample got = build(line, dir, sample), want = build(messages_line, dir, sample);
  EXPECT_EQ(data_test::qwen3_tokenizer().decode(got.input_ids), data_test::qwen3_tokenizer().decode(want.input_ids));
  EXPECT_EQ(got.input_ids, want.input_ids) << line;
  EXPECT_EQ(got.labels, want.labels) << line;
  EXPECT_GT(got.num_supervised, 0) << line;
  ASSERT_EQ(got.images.size(), want.images.size());
  for (size_t i = 0; i < got.images.size(); ++i) EXPECT_EQ(got.images[i].grid_thw, want.images[i].grid_thw);
}

// The messages a line becomes (after the layout is read).
inline nlohmann::ordered_json messages_of(const std::string& line, const std::string& dir = "/") {
  return nlohmann::ordered_json::parse(parse_sft_record(line, dir, "f.jsonl:1").messages_json);
}

struct Skip {
  SkipReason reason = SkipReason::kCount;
  std::string detail;
  std::string message;
};
inline Skip skip_of(const std::string& line, const std::string& dir = "/", const SampleOptions& sample = options()) {
  try {
    build(line, dir, sample);
  } catch (const SampleSkip& skip) {
    return {skip.reason(), skip.detail(), skip.what()};
  }
  ADD_FAILURE() << "not skipped: " << line;
  return {};
}

}  // namespace deltamoe::format_test
