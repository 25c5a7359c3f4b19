// The pass before step 1 reads image sizes from headers but must count exactly what training reads:
// the same micro-batches, samples, skips and longest sample as a full pass that decodes every image
// (text and image samples of several sizes and EXIF orientations, a bomb, a missing file, a malformed
// line), with every skip written to the skips file; then the skip-ratio check and the engine's token
// budget.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "data/data_test_util.h"
#include "data/image_test_util.h"
#include "train/train_data.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

using data_test::image_line;

PipelineOptions mixed_dataset(const fs::path& folder) {
  const int64_t sides[][2] = {{40, 300}, {333, 65}, {100, 100}, {64, 64}, {500, 20}, {90, 30}};
  std::string text;
  for (int i = 0; i < 6; ++i) {
    const std::string name = "img" + std::to_string(i) + ".jpg";
    const std::vector<uint8_t> exif = i % 2 ? image_test::exif_block_with_orientation(6) : std::vector<uint8_t>{};
    data_test::write_bytes(folder / name, image_test::encode_jpeg(image_test::gradient_image(sides[i][0], sides[i][1]), 90, exif));
    text += image_line(name, "A gradient number " + std::to_string(i) + ".");
    text += data_test::chat_line("Question " + std::to_string(i) + "?", std::string(static_cast<size_t>(5 + 7 * i), 'x'));
  }
  std::vector<uint8_t> bomb = image_test::encode_jpeg(image_test::gradient_image(16, 16), 90);
  for (size_t i = 0; i + 8 < bomb.size(); ++i) {
    if (bomb[i] == 0xFF && bomb[i + 1] == 0xC0) {
      bomb[i + 5] = 0x75, bomb[i + 6] = 0x30, bomb[i + 7] = 0x75, bomb[i + 8] = 0x30;  // 30000 x 30000
      break;
    }
  }
  data_test::write_bytes(folder / "bomb.jpg", bomb);
  text += image_line("bomb.jpg", "no");
  text += image_line("missing.jpg", "no");
  text += "not json\n";
  data_test::write_text(folder / "mixed.jsonl", text);
  PipelineOptions options;
  options.dataset_paths = {(folder / "mixed.jsonl").string()};
  options.sample.image_config = data_test::small_image_config();
  options.sample.image_config.max_pixels = 128 * 128;
  options.token_budget = 60;
  options.num_workers = 2;
  options.seed = 3;
  return options;
}

TEST(TrainData, TheSurveyCountsWhatTrainingReads) {
  const fs::path folder = data_test::temp_folder();
  const PipelineOptions options = mixed_dataset(folder);
  const DataSurvey survey = survey_data(options, data_test::qwen3_tokenizer(), "test data", (folder / "skips.jsonl").string());

  PipelineOptions one_epoch = options;
  DataPipeline pipeline(one_epoch, data_test::qwen3_tokenizer());
  int64_t batches = 0, samples = 0, longest = 0;
  while (std::optional<MicroBatch> batch = pipeline.next_batch()) {
    ++batches;
    samples += batch->num_samples();
    EXPECT_FALSE(batch->pixel_values.empty() && !batch->image_grid_thw.empty()) << "training decodes its images";
    for (size_t i = 0; i + 1 < batch->cu_seqlens.size(); ++i) {
      longest = std::max<int64_t>(longest, batch->cu_seqlens[i + 1] - batch->cu_seqlens[i]);
    }
  }
  std::printf("  survey: %lld micro-batches, %lld samples, longest %lld, %s\n", static_cast<long long>(survey.num_micro_batches),
              static_cast<long long>(survey.num_samples), static_cast<long long>(survey.longest_sample_tokens),
              survey.skips.summary().c_str());
  EXPECT_EQ(survey.num_lines, 15);
  EXPECT_EQ(survey.num_micro_batches, batches);
  EXPECT_EQ(survey.num_samples, samples);
  EXPECT_EQ(survey.num_samples, 12);
  EXPECT_EQ(survey.longest_sample_tokens, longest);
  EXPECT_EQ(survey.skips.summary(), pipeline.skip_stats().summary());
  EXPECT_EQ(survey.skips.summary(), "3 skipped (malformed_json 1, missing_image 1, bad_image 1)");

  std::ifstream skips(folder / "skips.jsonl");
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(skips, line);) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 3u);
  for (const nlohmann::json& line : lines) {
    EXPECT_NE(line["where"].get<std::string>().find("mixed.jsonl:1"), std::string::npos) << line.dump();
    EXPECT_FALSE(line["message"].get<std::string>().empty());
  }

  EXPECT_THROW(check_skip_ratio(survey, 0.1, "test data"), Error);  // 3 of 15 = 20%
  EXPECT_NO_THROW(check_skip_ratio(survey, 0.2, "test data"));
}

TEST(TrainData, EveryLineSkippedIsAnErrorBeforeStepOne) {
  const fs::path folder = data_test::temp_folder();
  data_test::write_text(folder / "bad.jsonl", "not json\n{\"messages\": []}\n");
  PipelineOptions options;
  options.dataset_paths = {(folder / "bad.jsonl").string()};
  options.token_budget = 256;
  options.num_workers = 0;
  const DataSurvey survey = survey_data(options, data_test::qwen3_tokenizer(), "training data");
  try {
    check_skip_ratio(survey, 1.0, "training data");
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("every sample of the training data (2 lines) was skipped"), std::string::npos)
        << error.what();
  }
}

TEST(TrainData, TheEngineIsSizedForTheLongestSampleInSamplesMode) {
  BatchPlan samples;
  samples.micro_batch_samples = 2;
  samples.token_budget = 2 * 262144;  // --max_length left at a 262,144-token model's maximum
  EXPECT_EQ(engine_token_budget(samples, 900), 1800);
  BatchPlan tokens;
  tokens.token_budget = 4096;  // packed micro-batches fill their budget whatever the samples
  EXPECT_EQ(engine_token_budget(tokens, 900), 4096);
}

}  // namespace
}  // namespace deltamoe
