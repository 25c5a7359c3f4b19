// Checks the gated shared expert's backward (input and all four weights) against fp64 central
// finite differences.
#include <gtest/gtest.h>

#include "kernels/gated_delta_rule/gradient_check_test_util.h"
#include "kernels/gradcheck/gradcheck.h"
#include "kernels/shared_expert/shared_expert.h"

namespace deltamoe {
namespace {

TEST(SharedExpertRef, BackwardMatchesFiniteDifferences) {
  const int64_t tokens = 4, hidden = 5, inter = 3;
  Rng rng(13);
  std::vector<double> x = gradcheck::random_normal(rng, tokens * hidden);
  std::vector<double> gate_proj = gradcheck::random_normal(rng, inter * hidden, 0.7);
  std::vector<double> up_proj = gradcheck::random_normal(rng, inter * hidden, 0.7);
  std::vector<double> down_proj = gradcheck::random_normal(rng, hidden * inter, 0.7);
  std::vector<double> expert_gate = gradcheck::random_normal(rng, hidden, 0.7);
  const std::vector<double> dy = gradcheck::random_normal(rng, tokens * hidden);
  std::vector<double> y(tokens * hidden);
  auto loss = [&] {
    shared_expert_forward_ref(x.data(), gate_proj.data(), up_proj.data(), down_proj.data(), expert_gate.data(),
                              y.data(), tokens, hidden, inter);
    return gradcheck::dot(y, dy);
  };
  std::vector<double> dx(x.size()), d_gate(gate_proj.size(), 0.0), d_up(up_proj.size(), 0.0),
      d_down(down_proj.size(), 0.0), d_expert_gate(hidden, 0.0);
  shared_expert_backward_ref(x.data(), gate_proj.data(), up_proj.data(), down_proj.data(), expert_gate.data(),
                             dy.data(), dx.data(), d_gate.data(), d_up.data(), d_down.data(), d_expert_gate.data(),
                             tokens, hidden, inter);
  EXPECT_LT(gradcheck::check_gradient("dx", x, dx, loss).relative(), gradcheck::kGradTolerance);
  EXPECT_LT(gradcheck::check_gradient("d_gate_proj", gate_proj, d_gate, loss).relative(), gradcheck::kGradTolerance);
  EXPECT_LT(gradcheck::check_gradient("d_up_proj", up_proj, d_up, loss).relative(), gradcheck::kGradTolerance);
  EXPECT_LT(gradcheck::check_gradient("d_down_proj", down_proj, d_down, loss).relative(), gradcheck::kGradTolerance);
  EXPECT_LT(gradcheck::check_gradient("d_expert_gate", expert_gate, d_expert_gate, loss).relative(),
            gradcheck::kGradTolerance);
}


// All four weight gradients null (a frozen shared expert) skip the weight products; dx stays
// bitwise unchanged.
TEST(SharedExpertRef, NullWeightGradientsGiveIdenticalInputGradient) {
  const int64_t tokens = 6, hidden = 8, inter = 5;
  const auto x = gdn_test::to_float(gdn_test::random_uniform(tokens * hidden, -2, 2, 90));
  const auto gate_proj = gdn_test::to_float(gdn_test::random_uniform(inter * hidden, -0.5, 0.5, 91));
  const auto up_proj = gdn_test::to_float(gdn_test::random_uniform(inter * hidden, -0.5, 0.5, 92));
  const auto down_proj = gdn_test::to_float(gdn_test::random_uniform(hidden * inter, -0.5, 0.5, 93));
  const auto expert_gate = gdn_test::to_float(gdn_test::random_uniform(hidden, -0.5, 0.5, 94));
  const auto dy = gdn_test::to_float(gdn_test::random_uniform(tokens * hidden, -1, 1, 95));
  std::vector<float> dx(x.size()), dx_frozen(x.size()), d_gate(gate_proj.size(), 0.0f), d_up(up_proj.size(), 0.0f),
      d_down(down_proj.size(), 0.0f), d_expert_gate(hidden, 0.0f);
  shared_expert_backward_ref(x.data(), gate_proj.data(), up_proj.data(), down_proj.data(), expert_gate.data(),
                             dy.data(), dx.data(), d_gate.data(), d_up.data(), d_down.data(), d_expert_gate.data(),
                             tokens, hidden, inter);
  float* const frozen = nullptr;
  shared_expert_backward_ref(x.data(), gate_proj.data(), up_proj.data(), down_proj.data(), expert_gate.data(),
                             dy.data(), dx_frozen.data(), frozen, frozen, frozen, frozen, tokens, hidden, inter);
  const gdn_test::ErrorStats stats = gdn_test::compare("dx (weight grads null)", dx_frozen, dx);
  EXPECT_GT(stats.scale, 0.0);
  EXPECT_EQ(stats.max_abs, 0.0);
}

}  // namespace
}  // namespace deltamoe
