// Segment attention: tokens never see other segments, a one-token segment copies its value, and
// the backward matches fp64 finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/bidirectional_attention/bidirectional_attention.h"
#include "kernels/gradcheck/gradcheck.h"

namespace deltamoe {
namespace {

TEST(BidirectionalAttentionRef, SegmentsDoNotSeeEachOther) {
  const int64_t tokens = 6, heads = 2, head_dim = 3;
  const int32_t cu_seqlens[4] = {0, 1, 4, 6};
  Rng rng(8);
  std::vector<double> q = gradcheck::random_normal(rng, tokens * heads * head_dim);
  std::vector<double> k = gradcheck::random_normal(rng, q.size()), v = gradcheck::random_normal(rng, q.size());
  std::vector<double> out(q.size()), lse(tokens * heads), changed_out(q.size());
  bidirectional_attention_forward_ref(q.data(), k.data(), v.data(), cu_seqlens, 3, out.data(), lse.data(), tokens,
                                      heads, head_dim, 0.5);
  // Token 0 is alone: its output is its own value.
  double self_diff = 0;
  for (int64_t e = 0; e < heads * head_dim; ++e) self_diff = std::max(self_diff, std::abs(out[e] - v[e]));
  // Changing the last segment's keys and values leaves the first two segments' outputs unchanged.
  for (int64_t e = 4 * heads * head_dim; e < tokens * heads * head_dim; ++e) k[e] += 1.0, v[e] -= 2.0;
  bidirectional_attention_forward_ref(q.data(), k.data(), v.data(), cu_seqlens, 3, changed_out.data(), lse.data(),
                                      tokens, heads, head_dim, 0.5);
  double leak = 0;
  for (int64_t e = 0; e < 4 * heads * head_dim; ++e) leak = std::max(leak, std::abs(out[e] - changed_out[e]));
  std::printf("  single-token |out - v| = %.3e, cross-segment change = %.3e\n", self_diff, leak);
  EXPECT_LT(self_diff, 1e-15);
  EXPECT_EQ(leak, 0.0);
}

TEST(BidirectionalAttentionRef, BackwardMatchesFiniteDifferences) {
  const int64_t tokens = 7, heads = 2, head_dim = 4;
  const int32_t cu_seqlens[3] = {0, 4, 7};
  Rng rng(9);
  std::vector<double> q = gradcheck::random_normal(rng, tokens * heads * head_dim);
  std::vector<double> k = gradcheck::random_normal(rng, q.size()), v = gradcheck::random_normal(rng, q.size());
  const std::vector<double> d_out = gradcheck::random_normal(rng, q.size());
  std::vector<double> out(q.size()), lse(tokens * heads);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  auto loss = [&] {
    bidirectional_attention_forward_ref(q.data(), k.data(), v.data(), cu_seqlens, 2, out.data(), lse.data(), tokens,
                                        heads, head_dim, scale);
    return gradcheck::dot(out, d_out);
  };
  loss();
  std::vector<double> dq(q.size()), dk(q.size()), dv(q.size());
  bidirectional_attention_backward_ref(q.data(), k.data(), v.data(), out.data(), lse.data(), d_out.data(), cu_seqlens, 2,
                                       dq.data(), dk.data(), dv.data(), tokens, heads, head_dim, scale);
  EXPECT_LT(gradcheck::check_gradient("dq", q, dq, loss).relative(), gradcheck::kGradTolerance);
  EXPECT_LT(gradcheck::check_gradient("dk", k, dk, loss).relative(), gradcheck::kGradTolerance);
  EXPECT_LT(gradcheck::check_gradient("dv", v, dv, loss).relative(), gradcheck::kGradTolerance);
}

}  // namespace
}  // namespace deltamoe
