// Checks the routed experts: one token through one expert against a hand-written SiLU MLP, and the
// backward (x, routing weights, gate_up, down) against fp64 central finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "kernels/gated_delta_rule/gradient_check_test_util.h"
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


// Null d_gate_up / d_down (frozen experts) skip those weight products, one or both at a time; dx,
// d_topk_weight and the weight gradient still asked for stay bitwise unchanged.
TEST(MoeExpertsRef, NullWeightGradientsGiveIdenticalInputGradients) {
  const MoeExpertsDims dims{6, 8, 4, 2, 5};
  const auto x = gdn_test::to_float(gdn_test::random_uniform(6 * 8, -2, 2, 80));
  const auto gate_up = gdn_test::to_float(gdn_test::random_uniform(4 * 10 * 8, -0.5, 0.5, 81));
  const auto down = gdn_test::to_float(gdn_test::random_uniform(4 * 8 * 5, -0.5, 0.5, 82));
  const auto weight = gdn_test::to_float(gdn_test::random_uniform(6 * 2, 0, 1, 83));
  const auto dy = gdn_test::to_float(gdn_test::random_uniform(6 * 8, -1, 1, 84));
  const std::vector<int32_t> idx = {0, 3, 1, 2, 3, 1, 2, 0, 1, 3, 0, 2};
  std::vector<float> dx(x.size()), d_weight(weight.size()), d_gate_up(gate_up.size(), 0.0f), d_down(down.size(), 0.0f);
  moe_experts_backward_ref(dims, x.data(), idx.data(), weight.data(), gate_up.data(), down.data(), dy.data(), dx.data(),
                           d_weight.data(), d_gate_up.data(), d_down.data());
  // mask bit 0: d_gate_up asked for, bit 1: d_down asked for; 3 (both) is the run above.
  for (int mask = 0; mask < 3; ++mask) {
    SCOPED_TRACE(mask);
    const bool keep_gate_up = mask & 1, keep_down = mask & 2;
    std::vector<float> dx_frozen(x.size()), d_weight_frozen(weight.size()), d_gate_up_kept(gate_up.size(), 0.0f),
        d_down_kept(down.size(), 0.0f);
    moe_experts_backward_ref(dims, x.data(), idx.data(), weight.data(), gate_up.data(), down.data(), dy.data(),
                             dx_frozen.data(), d_weight_frozen.data(), keep_gate_up ? d_gate_up_kept.data() : nullptr,
                             keep_down ? d_down_kept.data() : nullptr);
    const gdn_test::ErrorStats dx_stats = gdn_test::compare("dx (weight grads null)", dx_frozen, dx);
    const gdn_test::ErrorStats dw_stats =
        gdn_test::compare("d_topk_weight (weight grads null)", d_weight_frozen, d_weight);
    EXPECT_GT(dx_stats.scale, 0.0);
    EXPECT_GT(dw_stats.scale, 0.0);
    EXPECT_EQ(dx_stats.max_abs, 0.0);
    EXPECT_EQ(dw_stats.max_abs, 0.0);
    if (keep_gate_up) {
      EXPECT_EQ(gdn_test::compare("d_gate_up (d_down null)", d_gate_up_kept, d_gate_up).max_abs, 0.0);
    }
    if (keep_down) {
      EXPECT_EQ(gdn_test::compare("d_down (d_gate_up null)", d_down_kept, d_down).max_abs, 0.0);
    }
  }
}

}  // namespace
}  // namespace deltamoe
