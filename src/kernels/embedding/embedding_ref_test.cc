// Checks the embedding reference: lookup values, repeated-id gradient accumulation (by finite
// differences in fp64) and the error on an out-of-range id.
#include <gtest/gtest.h>

#include "core/error.h"
#include "kernels/embedding/embedding.h"
#include "kernels/gradcheck/gradcheck.h"

namespace deltamoe {
namespace {

TEST(EmbeddingRef, BackwardMatchesFiniteDifferences) {
  const int64_t vocab = 7, hidden = 5;
  const std::vector<int64_t> ids = {3, 0, 3, 6, 1, 3};
  const int64_t num_tokens = static_cast<int64_t>(ids.size());
  Rng rng(1);
  std::vector<double> table = gradcheck::random_normal(rng, vocab * hidden);
  const std::vector<double> d_out = gradcheck::random_normal(rng, num_tokens * hidden);
  std::vector<double> out(num_tokens * hidden);
  auto loss = [&] {
    embedding_forward_ref(ids.data(), table.data(), out.data(), num_tokens, vocab, hidden);
    return gradcheck::dot(out, d_out);
  };
  loss();
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t c = 0; c < hidden; ++c) EXPECT_EQ(out[t * hidden + c], table[ids[t] * hidden + c]);
  std::vector<double> d_table(vocab * hidden, 0.0);
  embedding_backward_ref(ids.data(), d_out.data(), d_table.data(), num_tokens, vocab, hidden);
  EXPECT_LT(gradcheck::check_gradient("d_table", table, d_table, loss).relative(), gradcheck::kGradTolerance);
}

TEST(EmbeddingRef, RejectsOutOfRangeIds) {
  const std::vector<int64_t> ids = {0, 9};
  std::vector<float> table(4 * 2), out(2 * 2);
  EXPECT_THROW(embedding_forward_ref(ids.data(), table.data(), out.data(), 2, 4, 2), Error);
}

}  // namespace
}  // namespace deltamoe
