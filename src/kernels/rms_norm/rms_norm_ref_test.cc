// Checks the zero-centred RMSNorm reference against a direct evaluation of its formula and its
// backward against fp64 central finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/gated_delta_rule/gradient_check_test_util.h"
#include "kernels/gradcheck/gradcheck.h"
#include "kernels/rms_norm/rms_norm.h"

namespace deltamoe {
namespace {

TEST(RmsNormRef, ForwardIsZeroCentred) {
  // With w = 0 every row has unit mean square (up to eps).
  const int64_t rows = 3, width = 8;
  Rng rng(2);
  const std::vector<double> x = gradcheck::random_normal(rng, rows * width, 3.0);
  const std::vector<double> weight(width, 0.0);
  std::vector<double> y(rows * width), rstd(rows);
  rms_norm_forward_ref(x.data(), weight.data(), y.data(), rstd.data(), rows, width, 1e-6);
  double worst = 0;
  for (int64_t r = 0; r < rows; ++r) {
    double mean_square = 0;
    for (int64_t c = 0; c < width; ++c) mean_square += y[r * width + c] * y[r * width + c] / width;
    worst = std::max(worst, std::abs(mean_square - 1.0));
  }
  std::printf("  max |mean(y^2) - 1| = %.3e\n", worst);
  EXPECT_LT(worst, 1e-6);
}

TEST(RmsNormRef, BackwardMatchesFiniteDifferences) {
  const int64_t rows = 4, width = 6;
  Rng rng(3);
  std::vector<double> x = gradcheck::random_normal(rng, rows * width);
  std::vector<double> weight = gradcheck::random_normal(rng, width, 0.5);
  const std::vector<double> dy = gradcheck::random_normal(rng, rows * width);
  std::vector<double> y(rows * width), rstd(rows);
  auto loss = [&] {
    rms_norm_forward_ref(x.data(), weight.data(), y.data(), rstd.data(), rows, width, 1e-6);
    return gradcheck::dot(y, dy);
  };
  loss();
  std::vector<double> dx(rows * width), d_weight(width, 0.0);
  rms_norm_backward_ref(x.data(), weight.data(), rstd.data(), dy.data(), dx.data(), d_weight.data(), rows, width);
  EXPECT_LT(gradcheck::check_gradient("dx", x, dx, loss).relative(), gradcheck::kGradTolerance);
  EXPECT_LT(gradcheck::check_gradient("d_weight", weight, d_weight, loss).relative(), gradcheck::kGradTolerance);
}


// A null d_weight (frozen norm weight) skips the weight gradient and leaves dx bitwise unchanged.
TEST(RmsNormRef, NullWeightGradientGivesIdenticalInputGradient) {
  const int64_t rows = 7, width = 16;
  const auto x = gdn_test::to_float(gdn_test::random_uniform(rows * width, -2, 2, 30));
  const auto weight = gdn_test::to_float(gdn_test::random_uniform(width, -0.5, 0.5, 31));
  const auto dy = gdn_test::to_float(gdn_test::random_uniform(rows * width, -1, 1, 32));
  std::vector<float> y(rows * width), rstd(rows), dx(rows * width), dx_frozen(rows * width), d_weight(width, 0.0f);
  rms_norm_forward_ref(x.data(), weight.data(), y.data(), rstd.data(), rows, width, 1e-6);
  rms_norm_backward_ref(x.data(), weight.data(), rstd.data(), dy.data(), dx.data(), d_weight.data(), rows, width);
  rms_norm_backward_ref(x.data(), weight.data(), rstd.data(), dy.data(), dx_frozen.data(), static_cast<float*>(nullptr),
                        rows, width);
  const gdn_test::ErrorStats stats = gdn_test::compare("dx (d_weight null vs given)", dx_frozen, dx);
  EXPECT_GT(stats.scale, 0.0) << "the input gradient is all zeros, so the comparison proves nothing";
  EXPECT_EQ(stats.max_abs, 0.0);
}

}  // namespace
}  // namespace deltamoe
