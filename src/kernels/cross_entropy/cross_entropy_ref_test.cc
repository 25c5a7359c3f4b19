// Checks the causal-LM loss: the label shift, the ignore index, the mean against a direct sum of
// -log softmax, the backward by fp64 finite differences, and the error for an invalid label.
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "kernels/cross_entropy/cross_entropy.h"
#include "kernels/gradcheck/gradcheck.h"

namespace deltamoe {
namespace {

TEST(CrossEntropyRef, ShiftMovesLabelsLeftPerRow) {
  const std::vector<int64_t> labels = {1, 2, 3, 4, 5, 6};
  std::vector<int64_t> shifted(6);
  shift_labels_ref(labels.data(), shifted.data(), 2, 3);
  EXPECT_EQ(shifted, (std::vector<int64_t>{2, 3, -100, 5, 6, -100}));
}

TEST(CrossEntropyRef, MeanOverSupervisedAndBackward) {
  const int64_t tokens = 5, vocab = 6;
  Rng rng(14);
  std::vector<double> logits = gradcheck::random_normal(rng, tokens * vocab, 2.0);
  const std::vector<int64_t> labels = {3, kIgnoreIndex, 0, 5, kIgnoreIndex};
  std::vector<double> lse(tokens);
  int64_t count = 0;
  auto loss = [&] {
    return cross_entropy_forward_ref(logits.data(), labels.data(), lse.data(), tokens, vocab, &count);
  };
  const double value = loss();
  double expected = 0;
  for (int64_t t : {0, 2, 3}) {
    double sum = 0;
    for (int64_t v = 0; v < vocab; ++v) sum += std::exp(logits[t * vocab + v]);
    expected += std::log(sum) - logits[t * vocab + labels[t]];
  }
  expected /= 3;
  std::printf("  loss %.12f direct %.12f diff %.3e\n", value, expected, std::abs(value - expected));
  EXPECT_EQ(count, 3);
  EXPECT_LT(std::abs(value - expected), 1e-12);
  std::vector<double> d_logits(tokens * vocab);
  cross_entropy_backward_ref(logits.data(), labels.data(), lse.data(), 1.0, d_logits.data(), tokens, vocab);
  EXPECT_LT(gradcheck::check_gradient("d_logits", logits, d_logits, loss).relative(), gradcheck::kGradTolerance);
}

TEST(CrossEntropyRef, RejectsLabelOutsideVocabulary) {
  const std::vector<float> logits(2 * 3);
  const std::vector<int64_t> labels = {1, 7};
  std::vector<float> lse(2);
  int64_t count = 0;
  EXPECT_THROW(cross_entropy_forward_ref(logits.data(), labels.data(), lse.data(), 2, 3, &count), Error);
}

}  // namespace
}  // namespace deltamoe
