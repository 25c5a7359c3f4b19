// Vision 2-D RoPE: positions in merge-block order, angles from the closed form, and the backward
// against fp64 finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/gradcheck/gradcheck.h"
#include "kernels/vision_rope/vision_rope.h"

namespace deltamoe {
namespace {

TEST(VisionRopeRef, PositionsAndAnglesFollowTheSpec) {
  const int64_t grid_thw[3] = {1, 4, 4};
  std::vector<int64_t> positions(16 * 2);
  vision_rope_positions(grid_thw, 1, 2, positions.data());
  // Patch 5 is the second patch of block (0, 1): row 0, col 3. Patch 14: block (1, 1), inner (1, 0).
  EXPECT_EQ(positions[5 * 2], 0);
  EXPECT_EQ(positions[5 * 2 + 1], 3);
  EXPECT_EQ(positions[14 * 2], 3);
  EXPECT_EQ(positions[14 * 2 + 1], 2);
  const int64_t head_dim = 8;
  std::vector<double> cos(16 * 4), sin(16 * 4);
  vision_rope_tables_ref(positions.data(), 16, head_dim, 10000.0, cos.data(), sin.data());
  double max_diff = 0;
  for (int64_t n = 0; n < 16; ++n) {
    for (int64_t c = 0; c < 4; ++c) {
      const double inv_freq = std::pow(10000.0, -2.0 * (c % 2) / 4.0);
      const double angle = positions[n * 2 + c / 2] * inv_freq;
      max_diff = std::max({max_diff, std::abs(cos[n * 4 + c] - std::cos(angle)), std::abs(sin[n * 4 + c] - std::sin(angle))});
    }
  }
  std::printf("  max|diff| of cos/sin vs closed form = %.3e\n", max_diff);
  EXPECT_LT(max_diff, 1e-12);
}

TEST(VisionRopeRef, BackwardMatchesFiniteDifferences) {
  const int64_t grid_thw[3] = {2, 2, 4};
  const int64_t num_patches = 16, heads = 2, head_dim = 8;
  std::vector<int64_t> positions(num_patches * 2);
  vision_rope_positions(grid_thw, 1, 2, positions.data());
  std::vector<double> cos(num_patches * 4), sin(num_patches * 4);
  vision_rope_tables_ref(positions.data(), num_patches, head_dim, 100.0, cos.data(), sin.data());
  Rng rng(7);
  std::vector<double> x = gradcheck::random_normal(rng, num_patches * heads * head_dim);
  const std::vector<double> dy = gradcheck::random_normal(rng, x.size());
  std::vector<double> y(x.size()), dx(x.size());
  auto loss = [&] {
    vision_rope_forward_ref(x.data(), cos.data(), sin.data(), y.data(), num_patches, heads, head_dim);
    return gradcheck::dot(y, dy);
  };
  vision_rope_backward_ref(dy.data(), cos.data(), sin.data(), dx.data(), num_patches, heads, head_dim);
  EXPECT_LT(gradcheck::check_gradient("dx", x, dx, loss).relative(), gradcheck::kGradTolerance);
}

}  // namespace
}  // namespace deltamoe
