// Tests of the l2norm reference: unit norm (eps on the sum), fp64 finite-difference gradients,
// float vs double agreement, and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/gated_delta_rule/gradient_check_test_util.h"
#include "kernels/l2norm/l2norm.h"

namespace deltamoe {
namespace {

using gdn_test::compare;
using gdn_test::random_uniform;

TEST(L2NormRef, RowsHaveUnitNormWithEpsOnTheSum) {
  const int64_t rows = 5;
  const int dim = 7;
  const auto x = random_uniform(rows * dim, -3, 3, 1);
  std::vector<double> y(x.size());
  l2norm_forward_ref(x.data(), rows, dim, y.data());
  for (int64_t r = 0; r < rows; ++r) {
    double x_sq = 0, y_sq = 0;
    for (int d = 0; d < dim; ++d) {
      x_sq += x[r * dim + d] * x[r * dim + d];
      y_sq += y[r * dim + d] * y[r * dim + d];
    }
    // |y|^2 = |x|^2 / (|x|^2 + eps) exactly when eps is added to the sum of squares.
    EXPECT_NEAR(y_sq, x_sq / (x_sq + kL2NormEps), 1e-14) << "row " << r;
  }
  // A tiny row shows eps: |x|^2 = 1e-6 gives |y|^2 = 1/2.
  const std::vector<double> tiny = {std::sqrt(0.5e-6), std::sqrt(0.5e-6)};
  std::vector<double> tiny_y(2);
  l2norm_forward_ref(tiny.data(), 1, 2, tiny_y.data());
  EXPECT_NEAR(tiny_y[0] * tiny_y[0] + tiny_y[1] * tiny_y[1], 0.5, 1e-12);
}

TEST(L2NormRef, BackwardMatchesFiniteDifferences) {
  const std::vector<std::pair<int64_t, int>> shapes = {{1, 1}, {1, 5}, {3, 8}, {7, 13}, {4, 128}};
  uint64_t seed = 10;
  for (const auto& [rows, dim] : shapes) {
    auto x = random_uniform(rows * dim, -2, 2, ++seed);
    const auto cotangent = random_uniform(rows * dim, -1, 1, ++seed);
    std::vector<double> y(x.size()), dx(x.size());
    auto loss = [&] {
      l2norm_forward_ref(x.data(), rows, dim, y.data());
      return gdn_test::dot(y, cotangent);
    };
    l2norm_backward_ref(x.data(), cotangent.data(), rows, dim, dx.data());
    std::printf("case rows=%lld dim=%d\n", static_cast<long long>(rows), dim);
    EXPECT_LT(compare("dx", dx, gdn_test::finite_difference(x, loss)).rel_or_abs(), 1e-7);
  }
}

TEST(L2NormRef, FloatAgreesWithDouble) {
  const int64_t rows = 9;
  const int dim = 64;
  const auto x = random_uniform(rows * dim, -2, 2, 30);
  const auto dy = random_uniform(rows * dim, -1, 1, 31);
  std::vector<double> y(x.size()), dx(x.size());
  l2norm_forward_ref(x.data(), rows, dim, y.data());
  l2norm_backward_ref(x.data(), dy.data(), rows, dim, dx.data());
  const auto xf = gdn_test::to_float(x), dyf = gdn_test::to_float(dy);
  std::vector<float> yf(x.size()), dxf(x.size());
  l2norm_forward_ref(xf.data(), rows, dim, yf.data());
  l2norm_backward_ref(xf.data(), dyf.data(), rows, dim, dxf.data());
  EXPECT_LT(compare("y f32 vs f64", yf, y).max_rel, 1e-6);
  EXPECT_LT(compare("dx f32 vs f64", dxf, dx).max_rel, 1e-5);
}

TEST(L2NormRef, RejectsBadSizes) {
  std::vector<float> x(4), y(4);
  EXPECT_THROW(l2norm_forward_ref(x.data(), 1, 0, y.data()), Error);
  EXPECT_THROW(l2norm_backward_ref(x.data(), x.data(), -1, 4, y.data()), Error);
}

}  // namespace
}  // namespace deltamoe
