// Checks the routed experts: one token through one expert against a hand-written SiLU MLP, and the
// backward (x, routing weights, gate_up, down) against fp64 central finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "kernels/gradcheck/gradcheck.h"
#include "kernels/moe_experts/moe_experts.h"

namespace deltamoe {
namespace {

TEST(MoeExpertsRef, SingleExpertMatchesDirectFormula) {
  const MoeExpertsDims dims{1, 3, 2, 1, 2};
  Rng rng(11);
  const std::vector<double> x = gradcheck::random_normal(rng, 3);
  const std::vector<double> gate_up = gradcheck::random_normal(rng, 2 * 4 * 3);
  const std::vector<double> down = gradcheck::random_normal(rng, 2 * 3 * 2);
  const std::vector<int32_t> idx = {1};
  const std::vector<double> weight = {0.7};
  std::vector<double> y(3);
  moe_experts_forward_ref(dims, x.data(), idx.data(), weight.data(), gate_up.data(), down.data(), y.data());
  double worst = 0;
  for (int64_t c = 0; c < 3; ++c) {
    double expected = 0;
    for (int64_t i = 0; i < 2; ++i) {
      double g = 0, u = 0;
      for (int64_t k = 0; k < 3; ++k) {
        g += gate_up[(1 * 4 + i) * 3 + k] * x[k];
        u += gate_up[(1 * 4 + 2 + i) * 3 + k] * x[k];
      }
      expected += down[(1 * 3 + c) * 2 + i] * g / (1 + std::exp(-g)) * u;
    }
    worst = std::max(worst, std::abs(y[c] - 0.7 * expected));
  }
  std::printf("  single expert max|diff| = %.3e\n", worst);
  EXPECT_LT(worst, 1e-12);
}

TEST(MoeExpertsRef, BackwardMatchesFiniteDifferences) {
  const MoeExpertsDims dims{5, 4, 3, 2, 3};
  Rng rng(12);
  std::vector<double> x = gradcheck::random_normal(rng, 5 * 4);
  std::vector<double> gate_up = gradcheck::random_normal(rng, 3 * 6 * 4, 0.7);
  std::vector<double> down = gradcheck::random_normal(rng, 3 * 4 * 3, 0.7);
  std::vector<double> weight = gradcheck::random_normal(rng, 5 * 2);
  // Expert 2 is used twice by one token's neighbours, expert 0 by nobody in the last rows.
  const std::vector<int32_t> idx = {0, 1, 2, 1, 1, 2, 2, 0, 2, 1};
  const std::vector<double> dy = gradcheck::random_normal(rng, 5 * 4);
  std::vector<double> y(5 * 4);
  auto loss = [&] {
    moe_experts_forward_ref(dims, x.data(), idx.data(), weight.data(), gate_up.data(), down.data(), y.data());
    return gradcheck::dot(y, dy);
  };
  std::vector<double> dx(x.size()), d_weight(weight.size()), d_gate_up(gate_up.size(), 0.0), d_down(down.size(), 0.0);
  moe_experts_backward_ref(dims, x.data(), idx.data(), weight.data(), gate_up.data(), down.data(), dy.data(), dx.data(),
                           d_weight.data(), d_gate_up.data(), d_down.data());
  EXPECT_LT(gradcheck::check_gradient("dx", x, dx, loss).relative(), gradcheck::kGradTolerance);
  EXPECT_LT(gradcheck::check_gradient("d_weight", weight, d_weight, loss).relative(), gradcheck::kGradTolerance);
  EXPECT_LT(gradcheck::check_gradient("d_gate_up", gate_up, d_gate_up, loss).relative(), gradcheck::kGradTolerance);
  EXPECT_LT(gradcheck::check_gradient("d_down", down, d_down, loss).relative(), gradcheck::kGradTolerance);
}

TEST(MoeExpertsRef, RejectsBadExpertIndex) {
  const MoeExpertsDims dims{1, 2, 2, 1, 1};
  const std::vector<float> x(2), gate_up(2 * 2 * 2), down(2 * 2 * 1), weight = {1.0f};
  const std::vector<int32_t> idx = {5};
  std::vector<float> y(2);
  EXPECT_THROW(
      moe_experts_forward_ref(dims, x.data(), idx.data(), weight.data(), gate_up.data(), down.data(), y.data()), Error);
}

}  // namespace
}  // namespace deltamoe
