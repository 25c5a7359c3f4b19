// Packing: budget never exceeded, cu_seqlens and per-sample positions/labels/images carried over
// exactly, every sample in exactly one batch, oldest-first order, and the waiting slots for resume.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

#include "core/error.h"
#include "data/packer.h"

namespace deltamoe {
namespace {

// A sample whose every value encodes (sample, token, row) so misplaced copies are caught.
SftSample synthetic_sample(int64_t index, int64_t length, int num_images) {
  SftSample sample;
  sample.sample_index = index;
  for (int64_t i = 0; i < length; ++i) {
    sample.input_ids.push_back(static_cast<int32_t>(index * 1000 + i));
    sample.labels.push_back(i % 3 == 0 ? kIgnoreLabel : static_cast<int32_t>(index * 1000 + i));
  }
  for (int row = 0; row < 3; ++row) {
    for (int64_t i = 0; i < length; ++i) sample.positions.push_back(index * 100000 + row * 10000 + i);
  }
  for (int k = 0; k < num_images; ++k) {
    ImagePatches image;
    image.grid_thw = {1, 2, 2 * (k + 1)};
    image.pixel_values.assign(static_cast<size_t>(image.num_patches() * 4), static_cast<float>(index) + 0.25f * k);
    sample.images.push_back(image);
  }
  sample.num_supervised = std::count_if(sample.labels.begin(), sample.labels.end(), [](int32_t l) { return l != kIgnoreLabel; });
  return sample;
}

void check_batch(const MicroBatch& batch, const std::map<int64_t, SftSample>& samples, int64_t budget) {
  ASSERT_GT(batch.num_tokens(), 0);
  EXPECT_LE(batch.num_tokens(), budget);
  ASSERT_EQ(batch.cu_seqlens.size(), batch.sample_indices.size() + 1);
  EXPECT_EQ(batch.cu_seqlens.front(), 0);
  EXPECT_EQ(batch.cu_seqlens.back(), batch.num_tokens());
  ASSERT_EQ(batch.labels.size(), batch.input_ids.size());
  ASSERT_EQ(batch.positions.size(), 3 * batch.input_ids.size());
  const size_t total = batch.input_ids.size();
  size_t image = 0, pixel = 0;
  const std::vector<float>& pixel_values = batch.pixel_values;
  EXPECT_EQ(static_cast<int64_t>(pixel_values.size()), batch.num_patches() * 4);
  int64_t supervised = 0;
  for (size_t s = 0; s < batch.sample_indices.size(); ++s) {
    const SftSample& sample = samples.at(batch.sample_indices[s]);
    const auto begin = static_cast<size_t>(batch.cu_seqlens[s]);
    ASSERT_EQ(static_cast<int64_t>(batch.cu_seqlens[s + 1] - batch.cu_seqlens[s]), sample.num_tokens());
    for (size_t i = 0; i < sample.input_ids.size(); ++i) {
      EXPECT_EQ(batch.input_ids[begin + i], sample.input_ids[i]);
      EXPECT_EQ(batch.labels[begin + i], sample.labels[i]);
      for (size_t row = 0; row < 3; ++row) {
        EXPECT_EQ(batch.positions[row * total + begin + i], sample.positions[row * sample.input_ids.size() + i]);
      }
    }
    for (const ImagePatches& expected : sample.images) {
      ASSERT_LT(image, batch.image_grid_thw.size());
      EXPECT_EQ(batch.image_grid_thw[image++], expected.grid_thw);
      for (const float value : expected.pixel_values) EXPECT_EQ(pixel_values[pixel++], value);
    }
    supervised += sample.num_supervised;
  }
  EXPECT_EQ(image, batch.image_grid_thw.size());
  EXPECT_EQ(pixel, pixel_values.size());
  EXPECT_EQ(batch.num_supervised, supervised);
}

TEST(Packer, BudgetCuSeqlensPositionsAndNoSampleLostOrDuplicated) {
  constexpr int64_t kBudget = 256;
  for (const size_t window : {size_t{1}, size_t{4}, size_t{16}}) {
    std::mt19937 random(7);
    std::map<int64_t, SftSample> samples;
    Packer packer(kBudget, window);
    std::vector<MicroBatch> batches;
    const int64_t num_samples = 300;
    int64_t total_tokens = 0;
    int64_t index = 0;
    const Packer::Feed feed = [&]() -> std::optional<Packer::Slotted> {
      if (index >= num_samples) return std::nullopt;
      const int64_t length = 1 + static_cast<int64_t>(random() % (index % 10 == 0 ? kBudget : 60));
      samples[index] = synthetic_sample(index, length, static_cast<int>(index % 3));
      total_tokens += length;
      ++index;
      return Packer::Slotted{index - 1, samples[index - 1]};
    };
    for (;;) {
      const std::vector<int64_t> waiting = packer.pending_slots();
      std::optional<MicroBatch> batch = packer.pack(feed);
      if (!batch) break;
      // The oldest waiting sample always goes first.
      if (!waiting.empty()) {
        EXPECT_EQ(batch->sample_indices.front(), waiting.front());
      }
      EXPECT_LE(packer.pending_slots().size(), window);
      batches.push_back(std::move(*batch));
    }
    EXPECT_TRUE(packer.empty());
    std::multiset<int64_t> seen;
    int64_t packed_tokens = 0;
    for (const MicroBatch& batch : batches) {
      check_batch(batch, samples, kBudget);
      seen.insert(batch.sample_indices.begin(), batch.sample_indices.end());
      packed_tokens += batch.num_tokens();
    }
    ASSERT_EQ(seen.size(), static_cast<size_t>(num_samples));
    for (int64_t index = 0; index < num_samples; ++index) EXPECT_EQ(seen.count(index), 1u) << index;
    EXPECT_EQ(packed_tokens, total_tokens);
    const double efficiency = static_cast<double>(total_tokens) / (static_cast<double>(batches.size()) * kBudget);
    std::printf("window %zu: %zu batches, packing efficiency %.3f\n", window, batches.size(), efficiency);
    if (window == 1) {  // in-order packing keeps the stream order
      int64_t expected = 0;
      for (const MicroBatch& batch : batches) {
        for (const int64_t index : batch.sample_indices) EXPECT_EQ(index, expected++);
      }
    }
  }
}

TEST(Packer, WaitingSamplesAndOversizedSamples) {
  Packer packer(10, 2);
  std::vector<Packer::Slotted> stream;
  for (const int64_t length : {6, 6, 7, 4, 3}) {
    stream.push_back({static_cast<int64_t>(stream.size()) + 5, synthetic_sample(static_cast<int64_t>(stream.size()), length, 0)});
  }
  size_t next = 0;
  const Packer::Feed feed = [&]() -> std::optional<Packer::Slotted> {
    if (next == stream.size()) return std::nullopt;
    return stream[next++];
  };
  // 6 taken; 6 and 7 do not fit and wait (window 2 full); 4 is not read yet.
  std::optional<MicroBatch> batch = packer.pack(feed);
  ASSERT_TRUE(batch);
  EXPECT_EQ(batch->sample_indices, (std::vector<int64_t>{0}));
  EXPECT_EQ(packer.pending_slots(), (std::vector<int64_t>{6, 7}));
  // 6 (oldest waiting) first, then 4 from the stream; 7 still waits, then 3 waits too.
  batch = packer.pack(feed);
  EXPECT_EQ(batch->sample_indices, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(batch->cu_seqlens, (std::vector<int32_t>{0, 6, 10}));
  batch = packer.pack(feed);
  EXPECT_EQ(batch->sample_indices, (std::vector<int64_t>{2, 4}));
  EXPECT_FALSE(packer.pack(feed).has_value());

  packer.push_waiting({1, synthetic_sample(9, 11 - 2, 0)});
  EXPECT_THROW(packer.push_waiting({2, synthetic_sample(10, 11, 0)}), Error);
  EXPECT_THROW(Packer(0, 1), Error);
}

// --micro_batch_size: at most max_samples samples per batch, in stream order when the token budget
// is no constraint; no sample lost or read ahead of need; the token budget still applies.
TEST(Packer, SampleCapLimitsSamplesPerBatch) {
  for (const int64_t cap : {int64_t{1}, int64_t{3}, int64_t{8}}) {
    std::mt19937 random(11);
    std::map<int64_t, SftSample> samples;
    constexpr int64_t kBudget = 8 * 40;  // cap x longest sample: tokens never limit the batch
    Packer packer(kBudget, 4, cap);
    EXPECT_EQ(packer.max_samples(), cap);
    const int64_t num_samples = 50;
    int64_t index = 0, num_read = 0;
    const Packer::Feed feed = [&]() -> std::optional<Packer::Slotted> {
      if (index >= num_samples) return std::nullopt;
      samples[index] = synthetic_sample(index, 1 + static_cast<int64_t>(random() % 40), static_cast<int>(index % 2));
      ++index;
      ++num_read;
      return Packer::Slotted{index - 1, samples[index - 1]};
    };
    int64_t expected = 0, num_batches = 0;
    while (std::optional<MicroBatch> batch = packer.pack(feed)) {
      check_batch(*batch, samples, kBudget);
      ++num_batches;
      // Every batch but the last is full, and the packer reads only the samples it takes.
      EXPECT_EQ(batch->num_samples(), std::min(cap, num_samples - expected));
      EXPECT_EQ(num_read, expected + batch->num_samples());
      EXPECT_TRUE(packer.empty());
      for (const int64_t sample : batch->sample_indices) EXPECT_EQ(sample, expected++);
    }
    EXPECT_EQ(expected, num_samples);
    EXPECT_EQ(num_batches, (num_samples + cap - 1) / cap);
    std::printf("cap %lld: %lld batches of 50 samples\n", static_cast<long long>(cap),
                static_cast<long long>(num_batches));
  }
}

TEST(Packer, SampleCapAndTokenBudgetTogether) {
  // Budget 10 and cap 2: lengths 3 3 3 -> [3 3] (cap), [3 2] (cap), then 6 and 5 do not fit
  // together (tokens): [6], and 5 alone; waiting samples count against the cap too.
  Packer packer(10, 2, 2);
  std::vector<Packer::Slotted> stream;
  for (const int64_t length : {3, 3, 3, 2, 6, 5}) {
    const auto i = static_cast<int64_t>(stream.size());
    stream.push_back({i, synthetic_sample(i, length, 0)});
  }
  size_t next = 0;
  const Packer::Feed feed = [&]() -> std::optional<Packer::Slotted> {
    if (next == stream.size()) return std::nullopt;
    return stream[next++];
  };
  std::vector<std::vector<int64_t>> batches;
  while (std::optional<MicroBatch> batch = packer.pack(feed)) {
    EXPECT_LE(batch->num_samples(), 2);
    EXPECT_LE(batch->num_tokens(), 10);
    batches.push_back(batch->sample_indices);
  }
  EXPECT_EQ(batches, (std::vector<std::vector<int64_t>>{{0, 1}, {2, 3}, {4}, {5}}));
  EXPECT_THROW(Packer(10, 1, -1), Error);
}

}  // namespace
}  // namespace deltamoe
