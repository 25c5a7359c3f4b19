// The bench's synthetic batches: the --images grammar, sample lengths (equal, and varied within their
// bounds), images placed whole between their markers with only the text after them supervised, and
// the refusal when no image fits a sample.
#include "cli/bench_batches.h"

#include <gtest/gtest.h>

#include <numeric>

#include "testing/error_of.h"

namespace deltamoe {
namespace {

TEST(BenchBatches, ParsesImageGridsAndRefusesMalformedOnes) {
  const auto grids = parse_image_grids("16x16,20x24");
  ASSERT_EQ(grids.size(), 2u);
  EXPECT_EQ(grids[1], std::make_pair(int64_t{20}, int64_t{24}));
  EXPECT_TRUE(parse_image_grids("").empty());
  EXPECT_NE(error_of([] { parse_image_grids("16"); }).find("is not HxW"), std::string::npos);
  EXPECT_NE(error_of([] { parse_image_grids("0x4"); }).find("must be positive"), std::string::npos);
  EXPECT_NE(error_of([] { parse_image_grids("200x200"); }).find("at most 16384"), std::string::npos);
}

TEST(BenchBatches, EqualLengthsFillTheTokens) {
  Rng rng(1, 1);
  EXPECT_EQ(sample_lengths(8192, 4, false, rng), std::vector<int64_t>(4, 2048));
}

TEST(BenchBatches, VariedLengthsStayWithinTheirBounds) {
  Rng rng(7, 1);
  bool saw_one = false, saw_most = false;
  std::vector<int64_t> totals;
  for (int i = 0; i < 300; ++i) {
    const std::vector<int64_t> lengths = sample_lengths(4096, 4, true, rng);
    ASSERT_GE(lengths.size(), 1u);
    ASSERT_LE(lengths.size(), 4u);
    saw_one |= lengths.size() == 1;
    saw_most |= lengths.size() == 4;
    for (int64_t length : lengths) ASSERT_GE(length, 16);
    const int64_t total = std::accumulate(lengths.begin(), lengths.end(), int64_t{0});
    ASSERT_GE(total, 2048);
    ASSERT_LE(total, 4096);
    ASSERT_EQ(total % 8, 0);
    totals.push_back(total);
  }
  EXPECT_TRUE(saw_one && saw_most);
  EXPECT_NE(*std::min_element(totals.begin(), totals.end()), *std::max_element(totals.begin(), totals.end()));
}

TEST(BenchBatches, ImagesSitWholeBetweenTheirMarkersAndOnlyTheTextAfterIsSupervised) {
  const ModelConfig config = resolve_model_config("tiny-vl");
  const int64_t merge = config.vision.spatial_merge_size;
  Rng rng(3, 1);
  size_t next_grid = 0;
  const std::vector<std::pair<int64_t, int64_t>> grids = {{2, 3}, {4, 4}};
  const MicroBatch batch = synthetic_batch(config, {200, 120}, grids, 0.5, rng, &next_grid);
  ASSERT_EQ(batch.cu_seqlens, (std::vector<int32_t>{0, 200, 320}));
  ASSERT_EQ(batch.labels.size(), batch.input_ids.size());
  ASSERT_EQ(batch.positions.size(), 3 * batch.input_ids.size());
  // Each sample: 8 unsupervised text tokens, its images one after another (the grids in turn while
  // they fit half the sample), then supervised text to its end.
  int64_t images = 0, image_tokens = 0, supervised = 0;
  std::vector<int64_t> images_per_sample;
  for (size_t s = 0; s + 1 < batch.cu_seqlens.size(); ++s) {
    const size_t end = static_cast<size_t>(batch.cu_seqlens[s + 1]);
    size_t t = static_cast<size_t>(batch.cu_seqlens[s]);
    for (const size_t text_end = t + 8; t < text_end; ++t) {
      ASSERT_EQ(batch.labels[t], -100) << t;
      ASSERT_NE(batch.input_ids[t], config.image_token_id) << t;
    }
    const int64_t images_before = images;
    while (batch.input_ids[t] == config.vision_start_token_id) {
      const auto [h, w] = grids[static_cast<size_t>(images) % grids.size()];
      for (int64_t i = 1; i <= h * w; ++i) ASSERT_EQ(batch.input_ids[t + static_cast<size_t>(i)], config.image_token_id);
      ASSERT_EQ(batch.input_ids[t + static_cast<size_t>(h * w + 1)], config.vision_end_token_id);
      for (int64_t i = 0; i < h * w + 2; ++i) ASSERT_EQ(batch.labels[t + static_cast<size_t>(i)], -100);
      image_tokens += h * w;
      ++images;
      t += static_cast<size_t>(h * w + 2);
    }
    images_per_sample.push_back(images - images_before);
    for (; t < end; ++t) {
      ASSERT_NE(batch.input_ids[t], config.image_token_id) << "an image token outside its markers at " << t;
      ASSERT_EQ(batch.labels[t], batch.input_ids[t]) << t;
      ++supervised;
    }
  }
  // Sample 0 has 100 tokens for images: 2x3 (8 with its markers), 4x4 (18), and so on in turn, seven
  // of them (86); the next 4x4 would pass 100. Sample 1 has 60 and goes on with the grids: 4x4, 2x3,
  // 4x4, 2x3 (52); the next 4x4 would pass 60.
  EXPECT_EQ(images_per_sample, (std::vector<int64_t>{7, 4}));
  EXPECT_EQ(static_cast<size_t>(images), batch.image_grid_thw.size());
  EXPECT_EQ(next_grid, static_cast<size_t>(images));
  EXPECT_EQ(batch.num_image_tokens, image_tokens);
  EXPECT_EQ(batch.num_patches(), image_tokens * merge * merge);
  EXPECT_EQ(batch.pixel_values.size(), static_cast<size_t>(batch.num_patches() * config.vision.patch_dim()));
  EXPECT_EQ(batch.num_supervised, supervised);
}

TEST(BenchBatches, MakesTheStepsAndRefusesImagesThatFitNoSample) {
  const ModelConfig config = resolve_model_config("tiny-vl");
  Rng rng(5, 1);
  BenchBatchSpec spec;
  spec.tokens = 256;
  spec.seqs = 2;
  spec.micro_batches = 3;
  spec.distinct_steps = 2;
  const auto steps = make_bench_batches(config, spec, rng);
  ASSERT_EQ(steps.size(), 2u);
  for (const auto& step : steps) {
    ASSERT_EQ(step.size(), 3u);
    for (const MicroBatch& batch : step) EXPECT_EQ(batch.num_tokens(), 256);
  }
  EXPECT_NE(steps[0][0].input_ids, steps[1][0].input_ids);
  spec.grids = {{16, 16}};
  spec.image_fraction = 0.5;
  const std::string refusal = error_of([&] { make_bench_batches(config, spec, rng); });
  EXPECT_NE(refusal.find("none fits a sample"), std::string::npos) << refusal;
  EXPECT_NE(refusal.find("16x16"), std::string::npos) << refusal;
}

}  // namespace
}  // namespace deltamoe
