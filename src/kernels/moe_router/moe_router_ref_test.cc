// Checks the router: selected experts are the K largest probabilities, weights sum to one, and the
// backward matches fp64 central finite differences (selection fixed by well-separated logits).
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/gradcheck/gradcheck.h"
#include "kernels/moe_router/moe_router.h"

namespace deltamoe {
namespace {

TEST(MoeRouterRef, SelectsLargestAndRenormalises) {
  const int64_t tokens = 5, experts = 8, top_k = 3;
  Rng rng(9);
  const std::vector<double> logits = gradcheck::random_normal(rng, tokens * experts, 2.0);
  std::vector<double> probs(tokens * experts), weight(tokens * top_k);
  std::vector<int32_t> idx(tokens * top_k);
  moe_router_forward_ref(logits.data(), probs.data(), idx.data(), weight.data(), tokens, experts, top_k);
  double worst = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    double sum = 0;
    for (int64_t s = 0; s < top_k; ++s) sum += weight[t * top_k + s];
    worst = std::max(worst, std::abs(sum - 1.0));
    // Every unselected expert has a logit no larger than the smallest selected one.
    const double smallest_selected = logits[t * experts + idx[t * top_k + top_k - 1]];
    for (int64_t e = 0; e < experts; ++e) {
      bool selected = false;
      for (int64_t s = 0; s < top_k; ++s) selected |= idx[t * top_k + s] == e;
      if (!selected) {
        EXPECT_LE(logits[t * experts + e], smallest_selected);
      }
    }
  }
  std::printf("  max |sum(w) - 1| = %.3e\n", worst);
  EXPECT_LT(worst, 1e-12);
}

TEST(MoeRouterRef, GivenChoiceReproducesOwnChoice) {
  const int64_t tokens = 6, experts = 8, top_k = 3;
  Rng rng(16);
  const std::vector<double> logits = gradcheck::random_normal(rng, tokens * experts, 2.0);
  std::vector<double> probs(tokens * experts), weight(tokens * top_k), probs2(probs.size()), weight2(weight.size());
  std::vector<int32_t> idx(tokens * top_k);
  moe_router_forward_ref(logits.data(), probs.data(), idx.data(), weight.data(), tokens, experts, top_k);
  moe_router_forward_given_choice_ref(logits.data(), probs2.data(), idx.data(), weight2.data(), tokens, experts, top_k);
  double worst = 0;
  for (size_t i = 0; i < weight.size(); ++i) worst = std::max(worst, std::abs(weight[i] - weight2[i]));
  std::printf("  given-choice weights max|diff| = %.3e\n", worst);
  EXPECT_EQ(worst, 0.0);
  EXPECT_EQ(probs, probs2);
}

TEST(MoeRouterRef, BackwardMatchesFiniteDifferences) {
  const int64_t tokens = 4, experts = 6, top_k = 2;
  Rng rng(10);
  std::vector<double> logits = gradcheck::random_normal(rng, tokens * experts, 2.0);
  const std::vector<double> d_weight = gradcheck::random_normal(rng, tokens * top_k);
  std::vector<double> probs(tokens * experts), weight(tokens * top_k);
  std::vector<int32_t> idx(tokens * top_k);
  auto loss = [&] {
    moe_router_forward_ref(logits.data(), probs.data(), idx.data(), weight.data(), tokens, experts, top_k);
    return gradcheck::dot(weight, d_weight);
  };
  loss();
  std::vector<double> d_logits(tokens * experts);
  moe_router_backward_ref(probs.data(), idx.data(), weight.data(), d_weight.data(), d_logits.data(), tokens, experts,
                          top_k);
  EXPECT_LT(gradcheck::check_gradient("d_logits", logits, d_logits, loss).relative(), gradcheck::kGradTolerance);
}

}  // namespace
}  // namespace deltamoe
