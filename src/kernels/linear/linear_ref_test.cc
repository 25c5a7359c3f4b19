// Checks the linear reference's backward (input and weight gradients) against fp64 central
// finite differences.
#include <gtest/gtest.h>

#include "kernels/gated_delta_rule/gradient_check_test_util.h"
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


// A null d_weight (frozen weight) leaves dx bitwise unchanged, and a null dx (nothing upstream
// needs it) leaves d_weight bitwise unchanged.
TEST(LinearRef, NullGradientsLeaveTheOtherBitwiseUnchanged) {
  const int64_t rows = 9, in_features = 12, out_features = 7;
  const auto x = gdn_test::to_float(gdn_test::random_uniform(rows * in_features, -2, 2, 20));
  const auto weight = gdn_test::to_float(gdn_test::random_uniform(out_features * in_features, -1, 1, 21));
  auto dy = gdn_test::to_float(gdn_test::random_uniform(rows * out_features, -1, 1, 22));
  dy[3] = 0.0f;  // the reference skips zero upstream entries; cover that branch too
  std::vector<float> dx(x.size()), d_weight(weight.size(), 0.0f);
  std::vector<float> dx_frozen(x.size()), d_weight_only(weight.size(), 0.0f);
  linear_backward_ref(x.data(), weight.data(), dy.data(), dx.data(), d_weight.data(), rows, in_features, out_features);
  linear_backward_ref(x.data(), weight.data(), dy.data(), dx_frozen.data(), static_cast<float*>(nullptr), rows,
                      in_features, out_features);
  linear_backward_ref(x.data(), weight.data(), dy.data(), static_cast<float*>(nullptr), d_weight_only.data(), rows,
                      in_features, out_features);
  const gdn_test::ErrorStats dx_stats = gdn_test::compare("dx (d_weight null)", dx_frozen, dx);
  const gdn_test::ErrorStats dw_stats = gdn_test::compare("d_weight (dx null)", d_weight_only, d_weight);
  EXPECT_GT(dx_stats.scale, 0.0);
  EXPECT_GT(dw_stats.scale, 0.0);
  EXPECT_EQ(dx_stats.max_abs, 0.0);
  EXPECT_EQ(dw_stats.max_abs, 0.0);
}

}  // namespace
}  // namespace deltamoe
