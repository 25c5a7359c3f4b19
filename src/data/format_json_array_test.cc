// .json dataset files holding one JSON array: every element is a sample (nested brackets, strings
// with brackets, commas and escaped quotes, elements over several lines), named by the line where it
// starts, and trained exactly like the same lines in a JSONL file.
#include <gtest/gtest.h>

#include <set>

#include "data/data_pipeline.h"
#include "data/data_test_util.h"
#include "data/format_test_util.h"
#include "data/sample_source.h"

namespace deltamoe {
namespace {

using namespace format_test;

const std::vector<std::string> kLines = {
    R"({"messages": [{"role": "user", "content": "a [tricky], \"quoted\" {line}"}, {"role": "assistant", "content": "]}"}]})",
    R"({"instruction": "Say hi.", "output": "Hi."})",
    R"({"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y\\"}]})",
};

TEST(FormatJsonArray, ElementsAreIndexedWithTheirLines) {
  const fs::path folder = data_test::temp_folder();
  std::string text = "\xEF\xBB\xBF  [\n";  // a byte-order mark and white space before the array
  // NOTE: append() only; operator+ chains trip GCC 12's -Wrestrict false positive.
  for (size_t i = 0; i < kLines.size(); ++i) text.append("  ").append(kLines[i]).append(i + 1 < kLines.size() ? ",\n\n" : "\n");
  text += "]\n";
  data_test::write_text(folder / "set.json", text);
  const SampleSource source((folder / "set.json").string());
  EXPECT_TRUE(source.is_json_array());
  ASSERT_EQ(source.size(), 3);
  for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(source.read(i), kLines[static_cast<size_t>(i)]);
  EXPECT_EQ(source.line_number(0), 2);
  EXPECT_EQ(source.line_number(1), 4);
  EXPECT_EQ(source.line_number(2), 6);
}

TEST(FormatJsonArray, TrainsLikeTheSameJsonlLines) {
  const fs::path folder = data_test::temp_folder();
  std::string array = "[", jsonl;
  for (size_t i = 0; i < kLines.size(); ++i) {
    array.append(kLines[i]).append(i + 1 < kLines.size() ? "," : "]");
    jsonl.append(kLines[i]).append("\n");
  }
  data_test::write_text(folder / "set.json", array);
  data_test::write_text(folder / "set.jsonl", jsonl);
  auto tokens_of = [&](const std::string& name) {
    PipelineOptions options;
    options.dataset_paths = {(folder / name).string()};
    options.sample = format_test::options();
    options.token_budget = 256;
    options.num_workers = 0;
    options.shuffle = false;
    DataPipeline pipeline(options, data_test::qwen3_tokenizer());
    std::vector<int32_t> ids, labels;
    for (const MicroBatch& batch : data_test::run_to_end(pipeline)) {
      ids.insert(ids.end(), batch.input_ids.begin(), batch.input_ids.end());
      labels.insert(labels.end(), batch.labels.begin(), batch.labels.end());
    }
    EXPECT_EQ(pipeline.skip_stats().total(), 0) << pipeline.skip_stats().summary();
    return std::make_pair(ids, labels);
  };
  const auto from_array = tokens_of("set.json"), from_lines = tokens_of("set.jsonl");
  EXPECT_FALSE(from_array.first.empty());
  EXPECT_EQ(from_array, from_lines);
}

TEST(FormatJsonArray, AJsonlFileWhoseFirstLineIsAnArrayStaysJsonl) {
  const fs::path folder = data_test::temp_folder();
  data_test::write_text(folder / "lines.jsonl", std::string("[1, 2]\n").append(kLines[0]).append("\n").append(kLines[1]).append("\n"));
  const SampleSource source((folder / "lines.jsonl").string());
  EXPECT_FALSE(source.is_json_array());
  EXPECT_EQ(source.size(), 3);  // the array line stays a (malformed) sample, counted when read
}

TEST(FormatJsonArray, AnArrayCutShortKeepsItsCompleteElements) {
  const fs::path folder = data_test::temp_folder();
  data_test::write_text(folder / "cut.json", std::string("[").append(kLines[0]).append(", ").append(kLines[1].substr(0, 10)));
  const SampleSource source((folder / "cut.json").string());
  ASSERT_EQ(source.size(), 2);
  EXPECT_EQ(source.read(0), kLines[0]);
  EXPECT_EQ(skip_of(source.read(1)).reason, SkipReason::kMalformedJson);
}

TEST(DatasetSpec, HashNDrawsOrRepeatsSamples) {
  const fs::path folder = data_test::temp_folder();
  std::string text;
  for (int i = 0; i < 10; ++i) text += data_test::chat_line(std::string("q").append(std::to_string(i)), "a");
  data_test::write_text(folder / "ten.jsonl", text);
  const std::string path = (folder / "ten.jsonl").string();
  EXPECT_EQ(parse_dataset_spec(path + "#4").sample_count, 4);
  EXPECT_EQ(parse_dataset_spec(path + "#4").path, path);
  EXPECT_EQ(parse_dataset_spec(path).sample_count, -1);
  const auto lines_of = [](const DatasetFiles& files) {
    std::vector<int64_t> lines;
    for (int64_t i = 0; i < files.size(); ++i) lines.push_back(files.locate(i).index);
    return lines;
  };
  const DatasetFiles four({path + "#4"}, 7);
  const std::vector<int64_t> drawn = lines_of(four);
  ASSERT_EQ(drawn.size(), 4u);
  EXPECT_EQ(std::set<int64_t>(drawn.begin(), drawn.end()).size(), 4u) << "distinct samples below the count";
  EXPECT_EQ(lines_of(DatasetFiles({path + "#4"}, 7)), drawn) << "the draw depends only on the seed";
  EXPECT_NE(lines_of(DatasetFiles({path + "#4"}, 8)), drawn);
  const DatasetFiles twenty_five({path + "#25"}, 7);
  ASSERT_EQ(twenty_five.size(), 25);
  std::vector<int> times(10, 0);
  for (int64_t line : lines_of(twenty_five)) ++times[static_cast<size_t>(line)];
  for (int count : times) EXPECT_TRUE(count == 2 || count == 3) << "every sample twice, five of them a third time";
  // A file that really is named with a #N keeps its name.
  data_test::write_text(folder / "odd#3", text);
  EXPECT_EQ(DatasetFiles({(folder / "odd#3").string()}).size(), 10);
}

}  // namespace
}  // namespace deltamoe
