// GELU references: known values of both forms and the backward against fp64 finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/gelu/gelu.h"
#include "kernels/gradcheck/gradcheck.h"

namespace deltamoe {
namespace {

TEST(GeluRef, ExactAndTanhFormsAgreeClosely) {
  // The tanh form approximates erf to about 1e-3 absolute on [-5, 5]; both vanish at -inf.
  std::vector<double> x;
  for (int i = -50; i <= 50; ++i) x.push_back(i * 0.1);
  std::vector<double> exact(x.size()), approx(x.size());
  gelu_forward_ref(GeluKind::exact, x.data(), exact.data(), static_cast<int64_t>(x.size()));
  gelu_forward_ref(GeluKind::tanh, x.data(), approx.data(), static_cast<int64_t>(x.size()));
  double max_diff = 0;
  for (size_t i = 0; i < x.size(); ++i) max_diff = std::max(max_diff, std::abs(exact[i] - approx[i]));
  std::printf("  max|exact - tanh| on [-5, 5] = %.3e; gelu(1) = %.9f\n", max_diff, exact[60]);
  EXPECT_LT(max_diff, 1e-3);
  EXPECT_NEAR(exact[60], 0.5 * (1 + std::erf(1 / std::sqrt(2.0))), 1e-15);  // x = 1
  EXPECT_NEAR(exact[50], 0.0, 1e-15);                                          // x = 0
}

TEST(GeluRef, BackwardMatchesFiniteDifferences) {
  Rng rng(3);
  for (GeluKind kind : {GeluKind::exact, GeluKind::tanh}) {
    std::vector<double> x = gradcheck::random_normal(rng, 40, 2.0);
    const std::vector<double> dy = gradcheck::random_normal(rng, 40);
    std::vector<double> y(40), dx(40);
    auto loss = [&] {
      gelu_forward_ref(kind, x.data(), y.data(), 40);
      return gradcheck::dot(y, dy);
    };
    gelu_backward_ref(kind, x.data(), dy.data(), dx.data(), 40);
    EXPECT_LT(gradcheck::check_gradient(kind == GeluKind::exact ? "dx exact" : "dx tanh", x, dx, loss).relative(),
              gradcheck::kGradTolerance);
  }
}

}  // namespace
}  // namespace deltamoe
