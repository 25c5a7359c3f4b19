// Checks causal GQA attention: a single-key row returns v exactly, packed sequences equal separate
// runs, and the backward (q, k, v and the output gate) matches fp64 central finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "kernels/attention/attention.h"
#include "kernels/gradcheck/gradcheck.h"

namespace deltamoe {
namespace {

struct Inputs {
  AttentionDims dims;
  std::vector<double> q, k, v;
};

Inputs random_inputs(Rng& rng, int64_t tokens) {
  Inputs in;
  in.dims = {tokens, 4, 2, 5};
  in.q = gradcheck::random_normal(rng, tokens * 4 * 5);
  in.k = gradcheck::random_normal(rng, tokens * 2 * 5);
  in.v = gradcheck::random_normal(rng, tokens * 2 * 5);
  return in;
}

TEST(AttentionRef, PackedEqualsSeparateAndFirstTokenCopiesValue) {
  Rng rng(6);
  Inputs in = random_inputs(rng, 7);
  const std::vector<int32_t> cu = {0, 3, 7};
  const double scale = 1.0 / std::sqrt(5.0);
  std::vector<double> out(7 * 4 * 5), lse(7 * 4);
  attention_forward_ref(in.dims, in.q.data(), in.k.data(), in.v.data(), cu.data(), 2, scale, out.data(), lse.data());
  // Second sequence alone: tokens 3..6.
  AttentionDims tail = in.dims;
  tail.num_tokens = 4;
  const std::vector<int32_t> cu_tail = {0, 4};
  std::vector<double> out_tail(4 * 4 * 5), lse_tail(4 * 4);
  attention_forward_ref(tail, in.q.data() + 3 * 20, in.k.data() + 3 * 10, in.v.data() + 3 * 10, cu_tail.data(), 1,
                        scale, out_tail.data(), lse_tail.data());
  double worst = 0;
  for (size_t i = 0; i < out_tail.size(); ++i) worst = std::max(worst, std::abs(out_tail[i] - out[3 * 20 + i]));
  // The first token of each sequence attends only to itself: out = v of its KV head.
  for (int64_t h = 0; h < 4; ++h)
    for (int64_t d = 0; d < 5; ++d) {
      worst = std::max(worst, std::abs(out[(0 * 4 + h) * 5 + d] - in.v[(0 * 2 + h / 2) * 5 + d]));
      worst = std::max(worst, std::abs(out[(3 * 4 + h) * 5 + d] - in.v[(3 * 2 + h / 2) * 5 + d]));
    }
  std::printf("  packed vs separate / first-token max|diff| = %.3e\n", worst);
  EXPECT_LT(worst, 1e-12);
}

TEST(AttentionRef, BackwardMatchesFiniteDifferences) {
  Rng rng(7);
  Inputs in = random_inputs(rng, 6);
  const std::vector<int32_t> cu = {0, 2, 6};
  const double scale = 0.4;
  const std::vector<double> d_out = gradcheck::random_normal(rng, in.q.size());
  std::vector<double> out(in.q.size()), lse(6 * 4);
  auto loss = [&] {
    attention_forward_ref(in.dims, in.q.data(), in.k.data(), in.v.data(), cu.data(), 2, scale, out.data(), lse.data());
    return gradcheck::dot(out, d_out);
  };
  loss();
  std::vector<double> dq(in.q.size()), dk(in.k.size()), dv(in.v.size());
  attention_backward_ref(in.dims, in.q.data(), in.k.data(), in.v.data(), out.data(), lse.data(), d_out.data(),
                         cu.data(), 2, scale, dq.data(), dk.data(), dv.data());
  EXPECT_LT(gradcheck::check_gradient("dq", in.q, dq, loss).relative(), gradcheck::kGradTolerance);
  EXPECT_LT(gradcheck::check_gradient("dk", in.k, dk, loss).relative(), gradcheck::kGradTolerance);
  EXPECT_LT(gradcheck::check_gradient("dv", in.v, dv, loss).relative(), gradcheck::kGradTolerance);
}

TEST(AttentionRef, GateBackwardMatchesFiniteDifferences) {
  Rng rng(8);
  std::vector<double> attn = gradcheck::random_normal(rng, 12), gate = gradcheck::random_normal(rng, 12);
  const std::vector<double> dy = gradcheck::random_normal(rng, 12);
  std::vector<double> y(12), d_attn(12), d_gate(12);
  auto loss = [&] {
    attention_gate_forward_ref(attn.data(), gate.data(), y.data(), 12);
    return gradcheck::dot(y, dy);
  };
  attention_gate_backward_ref(attn.data(), gate.data(), dy.data(), d_attn.data(), d_gate.data(), 12);
  EXPECT_LT(gradcheck::check_gradient("d_attn", attn, d_attn, loss).relative(), gradcheck::kGradTolerance);
  EXPECT_LT(gradcheck::check_gradient("d_gate", gate, d_gate, loss).relative(), gradcheck::kGradTolerance);
}

TEST(AttentionRef, RejectsBadCuSeqlens) {
  const std::vector<int32_t> cu = {0, 5, 3};
  EXPECT_THROW(check_cu_seqlens(cu.data(), 2, 3, "test"), Error);
  const std::vector<int32_t> short_end = {0, 2};
  EXPECT_THROW(check_cu_seqlens(short_end.data(), 1, 3, "test"), Error);
}

}  // namespace
}  // namespace deltamoe
