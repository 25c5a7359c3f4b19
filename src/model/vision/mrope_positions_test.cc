// 3-D multimodal positions on hand-worked packed batches: text around images, an image first, two
// images in a row, a two-frame video, and clear errors when spans and grids disagree.
#include "model/vision/mrope_positions.h"

#include <gtest/gtest.h>

#include "core/error.h"
#include "testing/error_of.h"

namespace deltamoe {
namespace {

constexpr int64_t kImage = 100, kVideo = 101, kStart = 50, kEnd = 51;

std::vector<int64_t> row(const std::vector<int64_t>& positions, int axis) {
  const size_t tokens = positions.size() / 3;
  return {positions.begin() + axis * tokens, positions.begin() + (axis + 1) * tokens};
}

TEST(MropePositions, TextAndImagesInTwoPackedSamples) {
  // Sample 1: 3 text, start, a 4x6-patch image (2x3 merged = 6 tokens), end, 2 text, start, a
  // 2x2-patch image (1 token), end.  Sample 2 starts with an image of 4x4 patches, then text.
  const std::vector<int64_t> ids = {1, 2, 3, kStart, kImage, kImage, kImage, kImage, kImage, kImage, kEnd, 4, 5,
                                    kStart, kImage, kEnd,
                                    kImage, kImage, kImage, kImage, 6};
  const std::vector<int32_t> cu_seqlens = {0, 16, 21};
  const auto positions = compute_mrope_positions(ids.data(), 21, cu_seqlens, {{1, 4, 6}, {1, 2, 2}, {1, 4, 4}}, {}, 2,
                                                 kImage, kVideo);
  // Worked by hand from transformers' get_rope_index: the first image starts at s = 4 and advances s by max(2, 3) = 3.
  EXPECT_EQ(row(positions, 0), (std::vector<int64_t>{0, 1, 2, 3, 4, 4, 4, 4, 4, 4, 7, 8, 9, 10, 11, 12,
                                                     0, 0, 0, 0, 2}));
  EXPECT_EQ(row(positions, 1), (std::vector<int64_t>{0, 1, 2, 3, 4, 4, 4, 5, 5, 5, 7, 8, 9, 10, 11, 12,
                                                     0, 0, 1, 1, 2}));
  EXPECT_EQ(row(positions, 2), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                     0, 1, 0, 1, 2}));
}

TEST(MropePositions, AdjacentImagesAndVideoFrames) {
  // Two images back to back (types only), then a video of 2 frames of 2x4 patches (2 tokens each).
  using M = MmTokenType;
  const std::vector<M> types = {M::text, M::image, M::image, M::image, M::text, M::video, M::video, M::text,
                                M::video, M::video, M::text};
  const auto positions = compute_mrope_positions(types.data(), 11, {0, 11}, {{1, 2, 4}, {1, 2, 2}}, {{2, 2, 4}}, 2);
  // Image 1 (1x2 merged) at s = 1 -> s = 3; image 2 (1 token) at 3 -> 4; text 4; frame 1 at 5 -> 7;
  // text 7; frame 2 at 8 -> 10; text 10.
  EXPECT_EQ(row(positions, 0), (std::vector<int64_t>{0, 1, 1, 3, 4, 5, 5, 7, 8, 8, 10}));
  EXPECT_EQ(row(positions, 1), (std::vector<int64_t>{0, 1, 1, 3, 4, 5, 5, 7, 8, 8, 10}));
  EXPECT_EQ(row(positions, 2), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}));
}

TEST(MropePositions, TextOnlyIsArangePerSample) {
  const std::vector<int64_t> ids = {1, 2, 3, 4, 5};
  const auto positions = compute_mrope_positions(ids.data(), 5, {0, 2, 5}, {}, {}, 2, kImage, kVideo);
  for (int axis = 0; axis < 3; ++axis) EXPECT_EQ(row(positions, axis), (std::vector<int64_t>{0, 1, 0, 1, 2}));
}

TEST(MropePositions, MismatchedSpansAndGridsAreClearErrors) {
  const std::vector<int64_t> ids = {1, kImage, kImage, 2, kImage, 3};
  // Too few grids, too many grids, a span shorter than its grid, a span crossing samples.
  EXPECT_NE(error_of([&] { compute_mrope_positions(ids.data(), 6, {0, 6}, {{1, 2, 4}}, {}, 2, kImage, kVideo); })
                .find("grids are used"), std::string::npos);
  EXPECT_NE(error_of([&] {
              compute_mrope_positions(ids.data(), 6, {0, 6}, {{1, 2, 4}, {1, 2, 2}, {1, 2, 2}}, {}, 2, kImage, kVideo);
            }).find("only 2 spans"), std::string::npos);
  EXPECT_NE(error_of([&] {
              compute_mrope_positions(ids.data(), 6, {0, 6}, {{1, 2, 6}, {1, 2, 2}}, {}, 2, kImage, kVideo);
            }).find("needs 3 consecutive"), std::string::npos);
  EXPECT_NE(error_of([&] {
              compute_mrope_positions(ids.data(), 6, {0, 2, 6}, {{1, 2, 4}, {1, 2, 2}}, {}, 2, kImage, kVideo);
            }).find("within its sample"), std::string::npos);
}

}  // namespace
}  // namespace deltamoe
