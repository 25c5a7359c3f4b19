// Image-feature scatter: rows land on the pad tokens in order, a count mismatch is a clear error,
// and the backward (feature and embedding gradients) matches fp64 finite differences.
#include <gtest/gtest.h>

#include "core/error.h"
#include "kernels/gradcheck/gradcheck.h"
#include "kernels/token_scatter/token_scatter.h"

namespace deltamoe {
namespace {

constexpr int64_t kPad = 9;

TEST(TokenScatterRef, BackwardMatchesFiniteDifferences) {
  const std::vector<int64_t> ids = {1, kPad, kPad, 4, kPad, 2};
  const int64_t tokens = 6, features_rows = 3, hidden = 4;
  Rng rng(10);
  std::vector<double> embeds = gradcheck::random_normal(rng, tokens * hidden);
  std::vector<double> features = gradcheck::random_normal(rng, features_rows * hidden);
  const std::vector<double> dy = gradcheck::random_normal(rng, tokens * hidden);
  std::vector<double> y;
  auto loss = [&] {
    y = embeds;
    token_scatter_forward_ref(ids.data(), tokens, kPad, features.data(), features_rows, y.data(), hidden);
    return gradcheck::dot(y, dy);
  };
  loss();
  EXPECT_EQ(y[4 * hidden], features[2 * hidden]);  // the third pad row gets the third feature row
  std::vector<double> d_embeds = dy, d_features(features.size(), 7.0);
  token_scatter_backward_ref(ids.data(), tokens, kPad, d_embeds.data(), d_features.data(), features_rows, hidden);
  EXPECT_LT(gradcheck::check_gradient("d_features", features, d_features, loss).relative(), gradcheck::kGradTolerance);
  EXPECT_LT(gradcheck::check_gradient("d_embeds", embeds, d_embeds, loss).relative(), gradcheck::kGradTolerance);
}

TEST(TokenScatterRef, CountMismatchIsAClearError) {
  const std::vector<int64_t> ids = {kPad, 3, kPad};
  std::vector<float> embeds(3 * 2), features(3 * 2);
  try {
    token_scatter_forward_ref(ids.data(), 3, kPad, features.data(), 3, embeds.data(), 2);
    FAIL() << "mismatch accepted";
  } catch (const Error& error) {
    std::printf("  %s\n", error.what());
    EXPECT_NE(std::string(error.what()).find("2 tokens"), std::string::npos);
  }
}

}  // namespace
}  // namespace deltamoe
