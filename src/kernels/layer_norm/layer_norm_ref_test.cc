// LayerNorm reference: forward statistics, and the backward against fp64 finite differences.
#include <gtest/gtest.h>

#include "kernels/gradcheck/gradcheck.h"
#include "kernels/layer_norm/layer_norm.h"

namespace deltamoe {
namespace {

TEST(LayerNormRef, OutputHasZeroMeanUnitVarianceBeforeTheAffine) {
  const int64_t rows = 3, hidden = 16;
  Rng rng(1);
  const std::vector<double> x = gradcheck::random_normal(rng, rows * hidden, 3.0);
  const std::vector<double> ones(hidden, 1.0), zeros(hidden, 0.0);
  std::vector<double> y(rows * hidden), mean(rows), rstd(rows);
  layer_norm_forward_ref(x.data(), ones.data(), zeros.data(), y.data(), mean.data(), rstd.data(), rows, hidden, 0.0);
  double worst = 0;
  for (int64_t t = 0; t < rows; ++t) {
    double sum = 0, squares = 0;
    for (int64_t c = 0; c < hidden; ++c) sum += y[t * hidden + c], squares += y[t * hidden + c] * y[t * hidden + c];
    worst = std::max({worst, std::abs(sum / hidden), std::abs(squares / hidden - 1.0)});
  }
  std::printf("  max |mean|, |var - 1| = %.3e\n", worst);
  EXPECT_LT(worst, 1e-12);
}

TEST(LayerNormRef, BackwardMatchesFiniteDifferences) {
  const int64_t rows = 4, hidden = 9;
  Rng rng(2);
  std::vector<double> x = gradcheck::random_normal(rng, rows * hidden, 2.0);
  std::vector<double> weight = gradcheck::random_normal(rng, hidden);
  std::vector<double> bias = gradcheck::random_normal(rng, hidden);
  const std::vector<double> dy = gradcheck::random_normal(rng, rows * hidden);
  std::vector<double> y(rows * hidden), mean(rows), rstd(rows);
  auto loss = [&] {
    layer_norm_forward_ref(x.data(), weight.data(), bias.data(), y.data(), mean.data(), rstd.data(), rows, hidden, 1e-6);
    return gradcheck::dot(y, dy);
  };
  loss();
  std::vector<double> dx(rows * hidden, 5.0), d_weight(hidden, 0.0), d_bias(hidden, 0.0);
  layer_norm_backward_ref(x.data(), weight.data(), mean.data(), rstd.data(), dy.data(), dx.data(), d_weight.data(),
                          d_bias.data(), rows, hidden);
  EXPECT_LT(gradcheck::check_gradient("dx", x, dx, loss).relative(), gradcheck::kGradTolerance);
  EXPECT_LT(gradcheck::check_gradient("d_weight", weight, d_weight, loss).relative(), gradcheck::kGradTolerance);
  EXPECT_LT(gradcheck::check_gradient("d_bias", bias, d_bias, loss).relative(), gradcheck::kGradTolerance);
}

}  // namespace
}  // namespace deltamoe
