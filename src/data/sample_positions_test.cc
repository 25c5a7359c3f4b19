// 3-D positions of one sample on hand-written cases (transformers' get_rope_index): text runs, an image grid, two
// adjacent images, and mismatches between token runs and grids.
#include <gtest/gtest.h>

#include "core/error.h"
#include "data/sample_positions.h"

namespace deltamoe {
namespace {

constexpr int32_t kPad = 9;
using Grid = std::array<int64_t, 3>;

TEST(SamplePositions, TextImageText) {
  // 2 text, one image of grid (1, 4, 6) -> 2x3 merged tokens, 2 text.
  const std::vector<int32_t> ids = {1, 2, kPad, kPad, kPad, kPad, kPad, kPad, 3, 4};
  const std::vector<Grid> grids = {{1, 4, 6}};
  const std::vector<int64_t> expected = {0, 1, 2, 2, 2, 2, 2, 2, 5, 6,   // t
                                         0, 1, 2, 2, 2, 3, 3, 3, 5, 6,   // h
                                         0, 1, 2, 3, 4, 2, 3, 4, 5, 6};  // w
  EXPECT_EQ(compute_sample_positions(ids, grids, 2, kPad), expected);
}

TEST(SamplePositions, AdjacentImagesAndTallGrid) {
  // Image (1, 2, 2) -> 1 token, then image (1, 6, 2) -> 3x1 tokens, then text.
  const std::vector<int32_t> ids = {kPad, kPad, kPad, kPad, 5};
  const std::vector<Grid> grids = {{1, 2, 2}, {1, 6, 2}};
  const std::vector<int64_t> expected = {0, 1, 1, 1, 4,
                                         0, 1, 2, 3, 4,
                                         0, 1, 1, 1, 4};
  EXPECT_EQ(compute_sample_positions(ids, grids, 2, kPad), expected);
}

TEST(SamplePositions, MismatchesThrow) {
  const std::vector<Grid> one = {{1, 4, 4}};  // 4 tokens
  EXPECT_THROW(compute_sample_positions(std::vector<int32_t>{kPad, kPad, kPad}, one, 2, kPad), Error);
  EXPECT_THROW(compute_sample_positions(std::vector<int32_t>{1, 2}, one, 2, kPad), Error);
  EXPECT_THROW(compute_sample_positions(std::vector<int32_t>{kPad}, std::vector<Grid>{}, 2, kPad), Error);
  EXPECT_THROW(compute_sample_positions(std::vector<int32_t>{kPad}, std::vector<Grid>{{1, 3, 2}}, 2, kPad), Error);
}

}  // namespace
}  // namespace deltamoe
