// Checks the linear reference's backward (input and weight gradients) against fp64 central
// finite differences.
#include <gtest/gtest.h>

#include "kernels/gradcheck/gradcheck.h"
#include "kernels/linear/linear.h"

namespace deltamoe {
namespace {

TEST(LinearRef, BackwardMatchesFiniteDifferences) {
  const int64_t rows = 5, in_features = 7, out_features = 3;
  Rng rng(4);
  std::vector<double> x = gradcheck::random_normal(rng, rows * in_features);
  std::vector<double> weight = gradcheck::random_normal(rng, out_features * in_features);
  const std::vector<double> dy = gradcheck::random_normal(rng, rows * out_features);
  std::vector<double> y(rows * out_features);
  auto loss = [&] {
    linear_forward_ref(x.data(), weight.data(), y.data(), rows, in_features, out_features);
    return gradcheck::dot(y, dy);
  };
  std::vector<double> dx(rows * in_features, 123.0), d_weight(out_features * in_features, 0.0);
  linear_backward_ref(x.data(), weight.data(), dy.data(), dx.data(), d_weight.data(), rows, in_features, out_features);
  EXPECT_LT(gradcheck::check_gradient("dx", x, dx, loss).relative(), gradcheck::kGradTolerance);
  EXPECT_LT(gradcheck::check_gradient("d_weight", weight, d_weight, loss).relative(), gradcheck::kGradTolerance);
}

}  // namespace
}  // namespace deltamoe
