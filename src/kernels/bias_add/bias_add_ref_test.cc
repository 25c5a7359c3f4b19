// Bias add reference: the bias gradient against fp64 finite differences.
#include <gtest/gtest.h>

#include "kernels/bias_add/bias_add.h"
#include "kernels/gradcheck/gradcheck.h"

namespace deltamoe {
namespace {

TEST(BiasAddRef, BackwardMatchesFiniteDifferences) {
  const int64_t rows = 5, features = 6;
  Rng rng(5);
  std::vector<double> bias = gradcheck::random_normal(rng, features);
  const std::vector<double> x = gradcheck::random_normal(rng, rows * features);
  const std::vector<double> dy = gradcheck::random_normal(rng, rows * features);
  std::vector<double> y;
  auto loss = [&] {
    y = x;
    bias_add_forward_ref(bias.data(), y.data(), rows, features);
    return gradcheck::dot(y, dy);
  };
  std::vector<double> d_bias(features, 0.0);
  bias_add_backward_ref(dy.data(), d_bias.data(), rows, features);
  EXPECT_LT(gradcheck::check_gradient("d_bias", bias, d_bias, loss).relative(), gradcheck::kGradTolerance);
}

}  // namespace
}  // namespace deltamoe
