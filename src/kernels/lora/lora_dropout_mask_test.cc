// LoRA dropout's counter-based mask: its Philox is core/rng.h's, the dropped fraction is p (overall,
// per column lane and per row block) with kept elements scaled by exactly 1 / (1 - p), p = 0 drops
// nothing, and every counter (seed, step, micro-batch, adapter, row, column) changes the mask.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "kernels/lora/lora_dropout_mask.h"

namespace deltamoe {
namespace {

TEST(LoraDropoutMask, PhiloxIsCoreRngs) {
  Rng rng(1);
  for (int i = 0; i < 200; ++i) {
    const std::array<uint32_t, 4> c = {rng.next_u32(), rng.next_u32(), rng.next_u32(), rng.next_u32()};
    const std::array<uint32_t, 2> k = {rng.next_u32(), rng.next_u32()};
    const std::array<uint32_t, 4> want = philox4x32(c, k);
    const LoraPhilox4 got = lora_philox4x32(c[0], c[1], c[2], c[3], k[0], k[1]);
    for (int j = 0; j < 4; ++j) ASSERT_EQ(got.v[j], want[j]) << "case " << i << " word " << j;
  }
}

// Fraction of dropped elements of a rows x cols mask, and the kept value checked on the way.
double dropped_fraction(const LoraDropoutMask& mask, int64_t rows, int64_t cols, int64_t col_begin = 0,
                        int64_t col_step = 1) {
  int64_t dropped = 0, total = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = col_begin; c < cols; c += col_step) {
      const float factor = lora_dropout_factor(mask, r, c);
      EXPECT_TRUE(factor == 0.0f || factor == mask.keep_scale) << factor;
      dropped += factor == 0.0f;
      ++total;
    }
  }
  return static_cast<double>(dropped) / static_cast<double>(total);
}

TEST(LoraDropoutMask, DropsTheFractionPAndScalesTheRest) {
  for (double p : {0.05, 0.1, 0.5, 0.9}) {
    const LoraDropoutMask mask = lora_dropout_mask(p, 42, 7, 3, 11);
    ASSERT_TRUE(mask.active());
    EXPECT_EQ(mask.keep_scale, static_cast<float>(1.0 / (1.0 - p)));
    const int64_t rows = 512, cols = 1000;
    const double n = static_cast<double>(rows * cols);
    const double sigma = std::sqrt(p * (1 - p) / n);
    const double fraction = dropped_fraction(mask, rows, cols);
    std::printf("  p %.2f: dropped %.5f of %.0f (%.1f sigma)\n", p, fraction, n, (fraction - p) / sigma);
    EXPECT_NEAR(fraction, p, 5 * sigma) << "p " << p;
    // Each of the four Philox lanes (column mod 4) and a block of rows alone drop p too.
    for (int lane = 0; lane < 4; ++lane) {
      EXPECT_NEAR(dropped_fraction(mask, rows, cols, lane, 4), p, 10 * sigma) << "lane " << lane;
    }
    EXPECT_NEAR(dropped_fraction(mask, 64, cols), p, 5 * std::sqrt(p * (1 - p) / (64.0 * cols)));
  }
}

TEST(LoraDropoutMask, ZeroDropsNothingAndBadPIsRefused) {
  const LoraDropoutMask none = lora_dropout_mask(0.0, 42, 7, 3, 11);
  EXPECT_FALSE(none.active());
  EXPECT_EQ(none.keep_scale, 1.0f);
  EXPECT_EQ(dropped_fraction(none, 16, 64), 0.0);
  EXPECT_THROW(lora_dropout_mask(1.0, 1, 0, 0, 0), Error);
  EXPECT_THROW(lora_dropout_mask(-0.1, 1, 0, 0, 0), Error);
}

// Agreement of two masks (fraction of elements with the same keep/drop decision): independent masks
// agree on p^2 + (1 - p)^2 of the elements.
double agreement(const LoraDropoutMask& a, const LoraDropoutMask& b) {
  const int64_t rows = 128, cols = 256;
  int64_t same = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) same += (lora_dropout_factor(a, r, c) == 0) == (lora_dropout_factor(b, r, c) == 0);
  }
  return static_cast<double>(same) / (rows * cols);
}

TEST(LoraDropoutMask, EveryCounterChangesTheMask) {
  const double p = 0.5, independent = p * p + (1 - p) * (1 - p);
  const LoraDropoutMask base = lora_dropout_mask(p, 42, 7, 3, 11);
  EXPECT_EQ(agreement(base, lora_dropout_mask(p, 42, 7, 3, 11)), 1.0) << "the same counters give the same mask";
  for (const LoraDropoutMask& other : {lora_dropout_mask(p, 43, 7, 3, 11), lora_dropout_mask(p, 42 + (1ull << 32), 7, 3, 11),
                                       lora_dropout_mask(p, 42, 8, 3, 11), lora_dropout_mask(p, 42, 7 + (1ull << 32), 3, 11),
                                       lora_dropout_mask(p, 42, 7, 4, 11), lora_dropout_mask(p, 42, 7, 3, 12)}) {
    EXPECT_NEAR(agreement(base, other), independent, 0.02);
  }
  // Rows and columns: shifting by one row or one column decorrelates too.
  int64_t same_row = 0, same_col = 0;
  const int64_t n = 20000;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = i / 100, c = i % 100;
    same_row += (lora_dropout_factor(base, r, c) == 0) == (lora_dropout_factor(base, r + 1, c) == 0);
    same_col += (lora_dropout_factor(base, r, c) == 0) == (lora_dropout_factor(base, r, c + 1) == 0);
  }
  EXPECT_NEAR(static_cast<double>(same_row) / n, independent, 0.03);
  EXPECT_NEAR(static_cast<double>(same_col) / n, independent, 0.03);
}

TEST(LoraDropoutMask, ApplyRefMultipliesByTheFactor) {
  const LoraDropoutMask mask = lora_dropout_mask(0.25, 5, 1, 0, 2);
  const int64_t rows = 6, cols = 10, offset = 3;
  std::vector<double> x(rows * cols), y(rows * cols);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.5 + static_cast<double>(i);
  lora_dropout_apply_ref(mask, x.data(), y.data(), rows, cols, offset);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      EXPECT_EQ(y[r * cols + c], x[r * cols + c] * static_cast<double>(lora_dropout_factor(mask, r + offset, c)));
    }
  }
}

}  // namespace
}  // namespace deltamoe
