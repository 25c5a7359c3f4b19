// Checks M-RoPE: the interleaved axis assignment of the spec (Qwen3.5 sections [11, 11, 10]),
// that text positions reduce to plain RoPE, norm preservation, and the backward by finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/gradcheck/gradcheck.h"
#include "kernels/mrope/mrope.h"

namespace deltamoe {
namespace {

TEST(MropeRef, InterleavedAxisAssignment) {
  const MropeSpec spec{64, {11, 11, 10}, 1e7};
  int counts[3] = {0, 0, 0};
  for (int64_t j = 0; j < 32; ++j) {
    const int axis = mrope_axis_of_frequency(spec, j);
    ++counts[axis];
    if (axis == 1) {
      EXPECT_TRUE(j % 3 == 1 && j <= 31) << j;
    }
    if (axis == 2) {
      EXPECT_TRUE(j % 3 == 2 && j <= 29) << j;
    }
  }
  EXPECT_EQ(counts[0], 11);
  EXPECT_EQ(counts[1], 11);
  EXPECT_EQ(counts[2], 10);
}

TEST(MropeRef, TextPositionsGivePlainRope) {
  const MropeSpec spec{8, {2, 1, 1}, 10000.0};
  const int64_t num_tokens = 5;
  std::vector<int64_t> positions(3 * num_tokens);
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int axis = 0; axis < 3; ++axis) positions[axis * num_tokens + t] = t + 2;
  std::vector<double> cos(num_tokens * 4), sin(num_tokens * 4);
  mrope_tables_ref(spec, positions.data(), num_tokens, cos.data(), sin.data());
  double worst = 0;
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t j = 0; j < 4; ++j) {
      const double angle = double(t + 2) * std::pow(10000.0, -2.0 * j / 8.0);
      worst = std::max(worst, std::abs(cos[t * 4 + j] - std::cos(angle)) + std::abs(sin[t * 4 + j] - std::sin(angle)));
    }
  std::printf("  max table error vs plain RoPE = %.3e\n", worst);
  EXPECT_LT(worst, 1e-12);
}

TEST(MropeRef, RotationKeepsNormAndBackwardMatchesFiniteDifferences) {
  const MropeSpec spec{8, {2, 1, 1}, 100.0};
  const int64_t num_tokens = 4, num_heads = 3, head_dim = 12;
  Rng rng(5);
  std::vector<int64_t> positions(3 * num_tokens);
  for (auto& p : positions) p = static_cast<int64_t>(rng.below(20));
  std::vector<double> cos(num_tokens * 4), sin(num_tokens * 4);
  mrope_tables_ref(spec, positions.data(), num_tokens, cos.data(), sin.data());
  std::vector<double> x = gradcheck::random_normal(rng, num_tokens * num_heads * head_dim);
  const std::vector<double> dy = gradcheck::random_normal(rng, x.size());
  std::vector<double> y(x.size());
  auto loss = [&] {
    mrope_forward_ref(spec, x.data(), cos.data(), sin.data(), y.data(), num_tokens, num_heads, head_dim);
    return gradcheck::dot(y, dy);
  };
  loss();
  const double norm_change = std::abs(gradcheck::dot(y, y) - gradcheck::dot(x, x));
  std::printf("  | |y|^2 - |x|^2 | = %.3e\n", norm_change);
  EXPECT_LT(norm_change, 1e-10);
  std::vector<double> dx(x.size());
  mrope_backward_ref(spec, dy.data(), cos.data(), sin.data(), dx.data(), num_tokens, num_heads, head_dim);
  EXPECT_LT(gradcheck::check_gradient("dx", x, dx, loss).relative(), gradcheck::kGradTolerance);
}

}  // namespace
}  // namespace deltamoe
