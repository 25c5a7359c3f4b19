// Tests of the gated RMSNorm reference: the formula with a plain weight, fp64 finite-difference
// gradients (dweight added to), float vs double, and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/gated_delta_rule/gradient_check_test_util.h"
#include "kernels/gated_rmsnorm/gated_rmsnorm.h"

namespace deltamoe {
namespace {

using gdn_test::compare;
using gdn_test::random_uniform;

TEST(GatedRmsNormRef, MatchesFormulaWithPlainWeight) {
  const int64_t rows = 3;
  const int dim = 5;
  const double eps = 1e-6;
  const auto o = random_uniform(rows * dim, -2, 2, 1);
  const auto z = random_uniform(rows * dim, -3, 3, 2);
  const auto w = random_uniform(dim, 0.5, 1.5, 3);
  std::vector<double> y(o.size());
  gated_rmsnorm_forward_ref(o.data(), z.data(), w.data(), rows, dim, eps, y.data());
  std::vector<double> expected;
  for (int64_t r = 0; r < rows; ++r) {
    double mean_sq = 0;
    for (int d = 0; d < dim; ++d) mean_sq += o[r * dim + d] * o[r * dim + d] / dim;
    for (int d = 0; d < dim; ++d) {
      const double zv = z[r * dim + d];
      expected.push_back(o[r * dim + d] / std::sqrt(mean_sq + eps) * w[d] * zv /
                         (1 + std::exp(-zv)));
    }
  }
  EXPECT_LT(compare("y vs formula", y, expected).max_rel, 1e-14);
}

TEST(GatedRmsNormRef, BackwardMatchesFiniteDifferences) {
  const std::vector<std::pair<int64_t, int>> shapes = {{1, 1}, {1, 4}, {6, 3}, {5, 17}, {2, 128}};
  const double eps = 1e-6;
  uint64_t seed = 10;
  for (const auto& [rows, dim] : shapes) {
    auto o = random_uniform(rows * dim, -2, 2, ++seed);
    auto z = random_uniform(rows * dim, -3, 3, ++seed);
    auto w = random_uniform(dim, 0.5, 1.5, ++seed);
    const auto cotangent = random_uniform(rows * dim, -1, 1, ++seed);
    std::vector<double> y(o.size());
    auto loss = [&] {
      gated_rmsnorm_forward_ref(o.data(), z.data(), w.data(), rows, dim, eps, y.data());
      return gdn_test::dot(y, cotangent);
    };
    std::vector<double> d_o(o.size()), dz(z.size()), dw(dim, 0.25);  // dweight is added to
    gated_rmsnorm_backward_ref(o.data(), z.data(), w.data(), cotangent.data(), rows, dim, eps,
                               d_o.data(), dz.data(), dw.data());
    for (double& value : dw) value -= 0.25;
    std::printf("case rows=%lld dim=%d\n", static_cast<long long>(rows), dim);
    EXPECT_LT(compare("d_o", d_o, gdn_test::finite_difference(o, loss)).rel_or_abs(), 1e-7);
    EXPECT_LT(compare("dz", dz, gdn_test::finite_difference(z, loss)).rel_or_abs(), 1e-7);
    EXPECT_LT(compare("dweight", dw, gdn_test::finite_difference(w, loss)).rel_or_abs(), 1e-7);
  }
}

TEST(GatedRmsNormRef, FloatAgreesWithDouble) {
  const int64_t rows = 8;
  const int dim = 64;
  const auto o = random_uniform(rows * dim, -2, 2, 40);
  const auto z = random_uniform(rows * dim, -3, 3, 41);
  const auto w = random_uniform(dim, 0.5, 1.5, 42);
  const auto dy = random_uniform(rows * dim, -1, 1, 43);
  std::vector<double> y(o.size()), d_o(o.size()), dz(o.size()), dw(dim, 0);
  gated_rmsnorm_forward_ref(o.data(), z.data(), w.data(), rows, dim, 1e-6, y.data());
  gated_rmsnorm_backward_ref(o.data(), z.data(), w.data(), dy.data(), rows, dim, 1e-6, d_o.data(),
                             dz.data(), dw.data());
  const auto of = gdn_test::to_float(o), zf = gdn_test::to_float(z);
  const auto wf = gdn_test::to_float(w), dyf = gdn_test::to_float(dy);
  std::vector<float> yf(o.size()), d_of(o.size()), dzf(o.size()), dwf(dim, 0);
  gated_rmsnorm_forward_ref(of.data(), zf.data(), wf.data(), rows, dim, 1e-6f, yf.data());
  gated_rmsnorm_backward_ref(of.data(), zf.data(), wf.data(), dyf.data(), rows, dim, 1e-6f,
                             d_of.data(), dzf.data(), dwf.data());
  EXPECT_LT(compare("y f32 vs f64", yf, y).max_rel, 1e-5);
  EXPECT_LT(compare("d_o f32 vs f64", d_of, d_o).max_rel, 1e-5);
  EXPECT_LT(compare("dz f32 vs f64", dzf, dz).max_rel, 1e-5);
  EXPECT_LT(compare("dweight f32 vs f64", dwf, dw).max_rel, 1e-5);
}

TEST(GatedRmsNormRef, RejectsBadSizes) {
  std::vector<float> x(4);
  EXPECT_THROW(gated_rmsnorm_forward_ref(x.data(), x.data(), x.data(), 1, 0, 1e-6f, x.data()),
               Error);
  EXPECT_THROW(gated_rmsnorm_forward_ref(x.data(), x.data(), x.data(), 1, 4, -1.0f, x.data()),
               Error);
}


// A null dweight (frozen norm weight) skips the weight gradient and leaves d_o and dz bitwise unchanged.
TEST(GatedRmsNormRef, NullWeightGradientGivesIdenticalInputGradients) {
  const int64_t rows = 9;
  const int dim = 16;
  const auto o = gdn_test::to_float(random_uniform(rows * dim, -2, 2, 50));
  const auto z = gdn_test::to_float(random_uniform(rows * dim, -3, 3, 51));
  const auto w = gdn_test::to_float(random_uniform(dim, 0.5, 1.5, 52));
  const auto dy = gdn_test::to_float(random_uniform(rows * dim, -1, 1, 53));
  std::vector<float> d_o(o.size()), dz(o.size()), dw(dim, 0.0f), d_o_frozen(o.size()), dz_frozen(o.size());
  gated_rmsnorm_backward_ref(o.data(), z.data(), w.data(), dy.data(), rows, dim, 1e-6f, d_o.data(), dz.data(),
                             dw.data());
  gated_rmsnorm_backward_ref(o.data(), z.data(), w.data(), dy.data(), rows, dim, 1e-6f, d_o_frozen.data(),
                             dz_frozen.data(), static_cast<float*>(nullptr));
  const gdn_test::ErrorStats d_o_stats = compare("d_o (dweight null vs given)", d_o_frozen, d_o);
  const gdn_test::ErrorStats dz_stats = compare("dz (dweight null vs given)", dz_frozen, dz);
  EXPECT_GT(d_o_stats.scale, 0.0);
  EXPECT_GT(dz_stats.scale, 0.0);
  EXPECT_EQ(d_o_stats.max_abs, 0.0);
  EXPECT_EQ(dz_stats.max_abs, 0.0);
}

}  // namespace
}  // namespace deltamoe
