// Per-rank data reading (step_batch_reader.h): every rank packs the whole global batch from measured
// samples and decodes the images of its own micro-batches only. Checked here: the union over ranks
// (1, 2, 3 ranks) is, batch for batch and byte for byte, the sequence a full pipeline decoding
// every image gives one rank, over two epochs; each rank decodes exactly the images of its own
// micro-batches (counted by load_sample_image); a position saved at one world size resumes at
// another; an image that fails only when decoded leaves its sample out on every world size alike.
#include <gtest/gtest.h>

#include "data/data_test_util.h"
#include "data/image_test_util.h"
#include "data/sample_image.h"
#include "train/step_batch_reader.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

using data_test::image_line;

// Image and text samples of several sizes, a line skipped by its header (a missing image) and,
// with `corrupt`, a JPEG whose data is cut after a good header.
PipelineOptions dataset(const fs::path& folder, bool corrupt, bool missing = true) {
  const int64_t sides[][2] = {{40, 300}, {333, 65}, {100, 100}, {64, 64}, {500, 20}, {90, 30}, {70, 70}, {32, 200}};
  std::string text;
  for (int i = 0; i < 8; ++i) {
    const std::string name = "img" + std::to_string(i) + ".jpg";
    data_test::write_bytes(folder / name, image_test::encode_jpeg(image_test::gradient_image(sides[i][0], sides[i][1]), 90));
    text += image_line(name, "A gradient number " + std::to_string(i) + ".");
    text += data_test::chat_line("Question " + std::to_string(i) + "?", std::string(static_cast<size_t>(5 + 7 * i), 'x'));
  }
  if (missing) text += image_line("missing.jpg", "no");
  if (corrupt) {
    // A PNG cut in its pixel data: the header (IHDR) is whole, the decode fails.
    std::vector<uint8_t> cut = image_test::encode_png_rgb(image_test::gradient_image(80, 80));
    cut.resize(cut.size() * 2 / 3);
    data_test::write_bytes(folder / "cut.png", cut);
    text += image_line("cut.png", "broken");
  }
  data_test::write_text(folder / "data.jsonl", text);
  PipelineOptions options;
  options.dataset_paths = {(folder / "data.jsonl").string()};
  options.sample.image_config = data_test::small_image_config();
  options.sample.image_config.max_pixels = 128 * 128;
  options.token_budget = 60;
  options.num_workers = 2;
  options.seed = 3;
  options.num_epochs = 2;
  return options;
}

void expect_same(const MicroBatch& a, const MicroBatch& b, const std::string& where) {
  EXPECT_EQ(a.input_ids, b.input_ids) << where;
  EXPECT_EQ(a.labels, b.labels) << where;
  EXPECT_EQ(a.cu_seqlens, b.cu_seqlens) << where;
  EXPECT_EQ(a.positions, b.positions) << where;
  EXPECT_EQ(a.image_grid_thw, b.image_grid_thw) << where;
  EXPECT_EQ(a.sample_indices, b.sample_indices) << where;
  EXPECT_EQ(a.num_supervised, b.num_supervised) << where;
  EXPECT_EQ(a.num_image_tokens, b.num_image_tokens) << where;
  EXPECT_TRUE(a.pixel_values == b.pixel_values) << where << ": pixel values differ";
}

struct RankRun {
  std::vector<std::vector<MicroBatch>> steps;  // this rank's micro-batches per step
  std::vector<DataPosition> positions;         // after each step
  int64_t images_decoded = 0;                  // load_sample_image calls while it read
};

// One rank's reader to the end of the data (or max_steps), alone in this process meanwhile.
RankRun read_rank(const PipelineOptions& options, int64_t global, StepShare share, const DataPosition& start = {},
                  int64_t max_steps = -1) {
  PipelineOptions packing = options;
  packing.sample.measure_images_only = true;
  RankRun run;
  const int64_t decoded_before = sample_images_decoded();
  {
    DataPipeline pipeline(packing, data_test::qwen3_tokenizer(), start);
    StepBatchReader reader(pipeline, options.sample, global, share, 2);
    for (int64_t step = 0; max_steps < 0 || step < max_steps; ++step) {
      StepBatches batches = reader.take(/*read_ahead=*/true);
      if (batches.num_read == 0) break;
      run.steps.push_back(std::move(batches.batches));
      run.positions.push_back(batches.position_after);
    }
  }
  run.images_decoded = sample_images_decoded() - decoded_before;
  return run;
}

int64_t count_images(const RankRun& run) {
  int64_t images = 0;
  for (const auto& step : run.steps) {
    for (const MicroBatch& batch : step) images += static_cast<int64_t>(batch.image_grid_thw.size());
  }
  return images;
}

TEST(StepBatchReader, RanksTogetherReadTheOneRankSequenceAndDecodeOnlyTheirOwn) {
  const fs::path folder = data_test::temp_folder();
  const PipelineOptions options = dataset(folder, false);
  DataPipeline full(options, data_test::qwen3_tokenizer());  // decodes every image as it packs
  const std::vector<MicroBatch> reference = data_test::run_to_end(full);
  int64_t reference_images = 0;
  for (const MicroBatch& batch : reference) reference_images += static_cast<int64_t>(batch.image_grid_thw.size());
  ASSERT_GE(reference.size(), 12u);
  for (const int world : {1, 2, 3}) {
    const int64_t global = 2 * world;  // two micro-batches per rank and step
    std::vector<int64_t> decoded(static_cast<size_t>(world)), own(static_cast<size_t>(world));
    size_t covered = 0;
    for (int rank = 0; rank < world; ++rank) {
      const RankRun run = read_rank(options, global, StepShare{rank, world});
      for (size_t s = 0; s < run.steps.size(); ++s) {
        for (size_t g = 0; g < run.steps[s].size(); ++g) {
          const size_t index = s * static_cast<size_t>(global) + g * static_cast<size_t>(world) + static_cast<size_t>(rank);
          ASSERT_LT(index, reference.size());
          expect_same(run.steps[s][g], reference[index], str_cat("world ", world, " rank ", rank, " step ", s, " g ", g));
          ++covered;
        }
        const size_t last = std::min(reference.size(), (s + 1) * static_cast<size_t>(global)) - 1;
        EXPECT_EQ(data_position_to_json(run.positions[s]), data_position_to_json(reference[last].position_after));
      }
      decoded[rank] = run.images_decoded;
      own[rank] = count_images(run);
    }
    EXPECT_EQ(covered, reference.size()) << "world " << world;
    int64_t total = 0;
    for (int rank = 0; rank < world; ++rank) {
      std::printf("  world %d rank %d: decoded %lld images, its micro-batches hold %lld (of %lld)\n", world, rank,
                  static_cast<long long>(decoded[rank]), static_cast<long long>(own[rank]),
                  static_cast<long long>(reference_images));
      EXPECT_EQ(decoded[rank], own[rank]) << "a rank decoded images outside its own micro-batches";
      total += decoded[rank];
    }
    EXPECT_EQ(total, reference_images);
  }
}

// A position saved after step 1 of 2 ranks (4 micro-batches a step) resumes at 1 rank and at 4
// ranks with the global batch unchanged: the next steps are the reference's micro-batches 4, 5, ...
TEST(StepBatchReader, APositionSavedAtOneWorldSizeResumesAtAnother) {
  const fs::path folder = data_test::temp_folder();
  const PipelineOptions options = dataset(folder, false);
  DataPipeline full(options, data_test::qwen3_tokenizer());
  const std::vector<MicroBatch> reference = data_test::run_to_end(full);
  const RankRun first = read_rank(options, 4, StepShare{1, 2}, {}, 1);
  ASSERT_EQ(first.positions.size(), 1u);
  for (const int world : {1, 4}) {
    for (int rank = 0; rank < world; ++rank) {
      const RankRun resumed = read_rank(options, 4, StepShare{rank, world}, first.positions[0], 2);
      ASSERT_EQ(resumed.steps.size(), 2u);
      for (size_t s = 0; s < 2; ++s) {
        for (size_t g = 0; g < resumed.steps[s].size(); ++g) {
          expect_same(resumed.steps[s][g], reference[4 + 4 * s + g * static_cast<size_t>(world) + static_cast<size_t>(rank)],
                      str_cat("resumed at world ", world, " rank ", rank, " step ", s));
        }
      }
    }
  }
}

// An image that passes its header but does not decode: its sample is left out of its micro-batch
// (the batch keeps its other samples), the same on 1 and 2 ranks; --strict makes it an error.
TEST(StepBatchReader, AnImageFailingAtDecodeLeavesItsSampleOutOnEveryWorldSize) {
  const fs::path folder = data_test::temp_folder();
  const PipelineOptions options = dataset(folder, true);
  const RankRun one = read_rank(options, 2, StepShare{0, 1});
  const RankRun two_0 = read_rank(options, 2, StepShare{0, 2}), two_1 = read_rank(options, 2, StepShare{1, 2});
  int64_t broken_seen = 0, samples = 0;
  ASSERT_EQ(one.steps.size(), two_0.steps.size());
  for (size_t s = 0; s < one.steps.size(); ++s) {
    ASSERT_EQ(one.steps[s].size(), 2u);
    expect_same(two_0.steps[s][0], one.steps[s][0], str_cat("step ", s, " rank 0"));
    expect_same(two_1.steps[s][0], one.steps[s][1], str_cat("step ", s, " rank 1"));
    for (const MicroBatch& batch : one.steps[s]) {
      samples += batch.num_samples();
      EXPECT_EQ(static_cast<size_t>(batch.num_tokens()), batch.labels.size());
      EXPECT_EQ(static_cast<size_t>(3 * batch.num_tokens()), batch.positions.size());
      EXPECT_EQ(batch.cu_seqlens.back(), batch.num_tokens());
      for (const int64_t index : batch.sample_indices) broken_seen += index == 17;  // cut.png's line
    }
  }
  EXPECT_EQ(broken_seen, 0);
  EXPECT_EQ(samples, 2 * 16);  // 16 good samples per epoch
  fs::create_directories(folder / "strict");
  PipelineOptions strict = dataset(folder / "strict", true, false);  // no line that the headers refuse
  strict.strict = true;
  try {
    read_rank(strict, 2, StepShare{0, 1});
    ADD_FAILURE() << "--strict let a sample with an undecodable image through";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("--strict: bad_image"), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("left out of its micro-batch"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace deltamoe
