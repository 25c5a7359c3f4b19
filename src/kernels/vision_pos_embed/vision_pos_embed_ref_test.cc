// Vision position embedding: taps against align_corners=True bilinear resampling worked out
// independently, the merge-block patch order, and the backward against fp64 finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/gradcheck/gradcheck.h"
#include "kernels/vision_pos_embed/vision_pos_embed.h"

namespace deltamoe {
namespace {

TEST(VisionPosEmbedRef, ReproducesBilinearResamplingInMergeBlockOrder) {
  // A table whose entry is a linear function of (row, col) is reproduced exactly by bilinear
  // resampling: the value at a patch must be f(row * (G-1)/(h-1), col * (G-1)/(w-1)).
  const int64_t grid_side = 5, hidden = 2, merge = 2;
  std::vector<double> table(grid_side * grid_side * hidden);
  for (int64_t r = 0; r < grid_side; ++r) {
    for (int64_t c = 0; c < grid_side; ++c) {
      table[(r * grid_side + c) * hidden + 0] = 3.0 * r + 0.5 * c;
      table[(r * grid_side + c) * hidden + 1] = -1.0 * r + 2.0 * c + 1.0;
    }
  }
  const int64_t grid_thw[6] = {1, 4, 6, 2, 2, 4};  // two images, the second with two frames
  const int64_t num_patches = 24 + 16;
  std::vector<int64_t> index(num_patches * 4);
  std::vector<double> weight(num_patches * 4), out(num_patches * hidden, 0.0);
  vision_pos_embed_taps(grid_thw, 2, grid_side, merge, index.data(), weight.data());
  vision_pos_embed_forward_ref(table.data(), index.data(), weight.data(), out.data(), num_patches, hidden);
  double max_diff = 0;
  int64_t n = 0;
  for (int64_t image = 0; image < 2; ++image) {
    const int64_t t = grid_thw[image * 3], h = grid_thw[image * 3 + 1], w = grid_thw[image * 3 + 2];
    for (int64_t frame = 0; frame < t; ++frame) {
      for (int64_t block = 0; block < (h / 2) * (w / 2); ++block) {
        for (int64_t inner = 0; inner < 4; ++inner, ++n) {
          const int64_t row = (block / (w / 2)) * 2 + inner / 2, col = (block % (w / 2)) * 2 + inner % 2;
          const double src_r = row * 4.0 / (h - 1), src_c = col * 4.0 / (w - 1);
          max_diff = std::max(max_diff, std::abs(out[n * hidden + 0] - (3.0 * src_r + 0.5 * src_c)));
          max_diff = std::max(max_diff, std::abs(out[n * hidden + 1] - (-1.0 * src_r + 2.0 * src_c + 1.0)));
        }
      }
    }
  }
  std::printf("  max|diff| vs bilinear formula = %.3e\n", max_diff);
  EXPECT_LT(max_diff, 1e-12);
  // Corners land exactly on the table corners (align_corners=True).
  EXPECT_EQ(index[0], 0);
  EXPECT_DOUBLE_EQ(weight[0], 1.0);
}

TEST(VisionPosEmbedRef, BackwardMatchesFiniteDifferences) {
  const int64_t grid_side = 4, hidden = 3, merge = 2;
  const int64_t grid_thw[6] = {1, 2, 6, 1, 4, 2};
  const int64_t num_patches = 12 + 8;
  Rng rng(6);
  std::vector<double> table = gradcheck::random_normal(rng, grid_side * grid_side * hidden);
  const std::vector<double> d_out = gradcheck::random_normal(rng, num_patches * hidden);
  std::vector<int64_t> index(num_patches * 4);
  std::vector<double> weight(num_patches * 4), out;
  vision_pos_embed_taps(grid_thw, 2, grid_side, merge, index.data(), weight.data());
  auto loss = [&] {
    out.assign(num_patches * hidden, 0.0);
    vision_pos_embed_forward_ref(table.data(), index.data(), weight.data(), out.data(), num_patches, hidden);
    return gradcheck::dot(out, d_out);
  };
  std::vector<double> d_table(table.size(), 0.0);
  vision_pos_embed_backward_ref(d_out.data(), index.data(), weight.data(), d_table.data(), num_patches, hidden);
  EXPECT_LT(gradcheck::check_gradient("d_table", table, d_table, loss).relative(), gradcheck::kGradTolerance);
}

}  // namespace
}  // namespace deltamoe
