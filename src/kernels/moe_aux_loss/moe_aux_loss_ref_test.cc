// Checks the load-balancing loss: perfectly balanced uniform routing gives exactly K, two layers pool
// into one loss, and the gradient w.r.t. every layer's router logits matches fp64 finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/gradcheck/gradcheck.h"
#include "kernels/moe_aux_loss/moe_aux_loss.h"
#include "kernels/moe_router/moe_router.h"

namespace deltamoe {
namespace {

TEST(MoeAuxLossRef, UniformBalancedRoutingGivesTopK) {
  // 4 experts, K 2, rows select {0,1} and {2,3}: f_e = 1/2, P_e = 1/4 -> aux = 4 * 4 * 1/8 = 2 = K.
  const std::vector<double> probs(2 * 4, 0.25);
  const std::vector<int32_t> idx = {0, 1, 2, 3};
  MoeAuxStats stats;
  moe_aux_loss_accumulate_ref(probs.data(), idx.data(), 2, 4, 2, &stats);
  std::printf("  aux %.15f (expected 2)\n", moe_aux_loss_value(stats));
  EXPECT_NEAR(moe_aux_loss_value(stats), 2.0, 1e-14);
}

TEST(MoeAuxLossRef, BackwardOverTwoLayersMatchesFiniteDifferences) {
  const int64_t rows = 5, experts = 6, top_k = 2;
  Rng rng(15);
  std::vector<double> logits_a = gradcheck::random_normal(rng, rows * experts, 2.0);
  std::vector<double> logits_b = gradcheck::random_normal(rng, rows * experts, 2.0);
  std::vector<double> probs_a(rows * experts), probs_b(rows * experts), weight(rows * top_k);
  std::vector<int32_t> idx_a(rows * top_k), idx_b(rows * top_k);
  MoeAuxStats stats;
  auto loss = [&] {
    stats = MoeAuxStats{};
    moe_router_forward_ref(logits_a.data(), probs_a.data(), idx_a.data(), weight.data(), rows, experts, top_k);
    moe_router_forward_ref(logits_b.data(), probs_b.data(), idx_b.data(), weight.data(), rows, experts, top_k);
    moe_aux_loss_accumulate_ref(probs_a.data(), idx_a.data(), rows, experts, top_k, &stats);
    moe_aux_loss_accumulate_ref(probs_b.data(), idx_b.data(), rows, experts, top_k, &stats);
    return moe_aux_loss_value(stats);
  };
  loss();
  std::vector<double> d_a(rows * experts), d_b(rows * experts);
  moe_aux_loss_backward_ref(probs_a.data(), stats, 1.0, d_a.data(), rows);
  moe_aux_loss_backward_ref(probs_b.data(), stats, 1.0, d_b.data(), rows);
  EXPECT_LT(gradcheck::check_gradient("d_logits_a", logits_a, d_a, loss).relative(), gradcheck::kGradTolerance);
  EXPECT_LT(gradcheck::check_gradient("d_logits_b", logits_b, d_b, loss).relative(), gradcheck::kGradTolerance);
}

}  // namespace
}  // namespace deltamoe
