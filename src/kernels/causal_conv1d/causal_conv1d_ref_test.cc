// Tests of the causal conv1d + SiLU reference: the HF tap convention, sequence isolation under
// packing, finite-difference gradients in fp64, and errors for bad cu_seqlens.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/causal_conv1d/causal_conv1d.h"
#include "kernels/gated_delta_rule/gradient_check_test_util.h"

namespace deltamoe {
namespace {

using gdn_test::compare;
using gdn_test::random_uniform;

std::vector<int32_t> offsets_of(const std::vector<int>& lengths) {
  std::vector<int32_t> cu{0};
  for (int length : lengths) cu.push_back(cu.back() + length);
  return cu;
}

// Independent single-sequence formula from the spec (F.conv1d with padding K-1, then SiLU):
// y[t,c] = silu(sum_k w[c,k] x[t-(K-1)+k, c]), zeros before the sequence start.
std::vector<double> conv_by_spec(const std::vector<double>& x, const std::vector<double>& w,
                                 int64_t begin, int64_t end, int channels, int kernel) {
  std::vector<double> y;
  for (int64_t t = begin; t < end; ++t) {
    for (int c = 0; c < channels; ++c) {
      double z = 0;
      for (int k = 0; k < kernel; ++k) {
        const int64_t src = t - (kernel - 1) + k;
        if (src >= begin) z += w[c * kernel + k] * x[src * channels + c];
      }
      y.push_back(z / (1 + std::exp(-z)));
    }
  }
  return y;
}

TEST(CausalConv1dRef, MatchesSpecFormulaPerSequence) {
  const std::vector<int> lengths = {1, 5, 2, 9};
  const int channels = 3, kernel = 4;
  const auto cu = offsets_of(lengths);
  const int64_t tokens = cu.back();
  auto x = random_uniform(tokens * channels, -2, 2, 1);
  auto w = random_uniform(channels * kernel, -1, 1, 2);
  std::vector<double> y(x.size());
  causal_conv1d_forward_ref(x.data(), w.data(), cu.data(), static_cast<int>(lengths.size()), tokens,
                            channels, kernel, y.data());
  for (size_t n = 0; n < lengths.size(); ++n) {
    const auto expected = conv_by_spec(x, w, cu[n], cu[n + 1], channels, kernel);
    const std::vector<double> actual(y.begin() + cu[n] * channels,
                                     y.begin() + cu[n + 1] * channels);
    EXPECT_LT(compare("seq " + std::to_string(n), actual, expected).max_abs, 1e-14);
  }
}

TEST(CausalConv1dRef, LastTapMultipliesCurrentToken) {
  // One channel, x = impulse at t=0: y[t] = silu(w[K-1-t]), so the current token uses w[K-1].
  const int kernel = 4;
  const std::vector<int32_t> cu = {0, 4};
  const std::vector<double> x = {1, 0, 0, 0};
  const std::vector<double> w = {0.1, 0.2, 0.3, 0.4};
  std::vector<double> y(4);
  causal_conv1d_forward_ref(x.data(), w.data(), cu.data(), 1, 4, 1, kernel, y.data());
  for (int t = 0; t < 4; ++t) {
    const double z = w[kernel - 1 - t];
    EXPECT_NEAR(y[t], z / (1 + std::exp(-z)), 1e-15) << "t=" << t;
  }
}

struct ConvCase {
  std::vector<int> lengths;
  int channels;
  int kernel;
};

TEST(CausalConv1dRef, BackwardMatchesFiniteDifferences) {
  const std::vector<ConvCase> cases = {
      {{1}, 1, 4}, {{7}, 3, 4}, {{1, 63, 64, 65}, 2, 4}, {{130, 3}, 5, 4}, {{2, 6}, 3, 1}};
  uint64_t seed = 10;
  for (const auto& test_case : cases) {
    const auto cu = offsets_of(test_case.lengths);
    const int num_seqs = static_cast<int>(test_case.lengths.size());
    const int64_t tokens = cu.back();
    const int channels = test_case.channels, kernel = test_case.kernel;
    auto x = random_uniform(tokens * channels, -2, 2, ++seed);
    auto w = random_uniform(channels * kernel, -1, 1, ++seed);
    const auto cotangent = random_uniform(tokens * channels, -1, 1, ++seed);
    std::vector<double> y(x.size());
    auto loss = [&] {
      causal_conv1d_forward_ref(x.data(), w.data(), cu.data(), num_seqs, tokens, channels, kernel,
                                y.data());
      return gdn_test::dot(y, cotangent);
    };
    std::vector<double> dx(x.size());
    std::vector<double> dw(w.size(), 0.5);  // dweight is added to: start from a known offset
    causal_conv1d_backward_ref(x.data(), w.data(), cotangent.data(), cu.data(), num_seqs, tokens,
                               channels, kernel, dx.data(), dw.data());
    for (double& value : dw) value -= 0.5;
    std::printf("case T=%lld N=%d C=%d K=%d\n", static_cast<long long>(tokens), num_seqs, channels,
                kernel);
    EXPECT_LT(compare("dx", dx, gdn_test::finite_difference(x, loss)).rel_or_abs(), 1e-7);
    EXPECT_LT(compare("dweight", dw, gdn_test::finite_difference(w, loss)).rel_or_abs(), 1e-7);
  }
}

TEST(CausalConv1dRef, FloatAgreesWithDouble) {
  const auto cu = offsets_of({3, 70});
  const int channels = 6, kernel = 4;
  const int64_t tokens = cu.back();
  const auto x = random_uniform(tokens * channels, -2, 2, 40);
  const auto w = random_uniform(channels * kernel, -1, 1, 41);
  const auto dy = random_uniform(tokens * channels, -1, 1, 42);
  std::vector<double> y(x.size()), dx(x.size()), dw(w.size(), 0);
  causal_conv1d_forward_ref(x.data(), w.data(), cu.data(), 2, tokens, channels, kernel, y.data());
  causal_conv1d_backward_ref(x.data(), w.data(), dy.data(), cu.data(), 2, tokens, channels, kernel,
                             dx.data(), dw.data());
  const auto xf = gdn_test::to_float(x), wf = gdn_test::to_float(w), dyf = gdn_test::to_float(dy);
  std::vector<float> yf(x.size()), dxf(x.size()), dwf(w.size(), 0);
  causal_conv1d_forward_ref(xf.data(), wf.data(), cu.data(), 2, tokens, channels, kernel,
                            yf.data());
  causal_conv1d_backward_ref(xf.data(), wf.data(), dyf.data(), cu.data(), 2, tokens, channels,
                             kernel, dxf.data(), dwf.data());
  EXPECT_LT(compare("y f32 vs f64", yf, y).max_rel, 1e-5);
  EXPECT_LT(compare("dx f32 vs f64", dxf, dx).max_rel, 1e-5);
  EXPECT_LT(compare("dweight f32 vs f64", dwf, dw).max_rel, 1e-5);
}

TEST(CausalConv1dRef, RejectsBadCuSeqlens) {
  std::vector<float> x(8), w(4), y(8);
  const std::vector<int32_t> wrong_total = {0, 3};  // T is 4
  EXPECT_THROW(
      causal_conv1d_forward_ref(x.data(), w.data(), wrong_total.data(), 1, 4, 2, 2, y.data()),
      Error);
  const std::vector<int32_t> decreasing = {0, 3, 2, 4};
  EXPECT_THROW(
      causal_conv1d_forward_ref(x.data(), w.data(), decreasing.data(), 3, 4, 2, 2, y.data()),
      Error);
  const std::vector<int32_t> ok = {0, 4};
  EXPECT_THROW(causal_conv1d_forward_ref(x.data(), w.data(), ok.data(), 1, 4, 2, 0, y.data()),
               Error);
}


// A null dweight (frozen conv weight) skips the weight gradient and leaves dx bitwise unchanged.
TEST(CausalConv1dRef, NullWeightGradientGivesIdenticalInputGradient) {
  const auto cu = offsets_of({5, 11});
  const int channels = 6, kernel = 4;
  const int64_t tokens = cu.back();
  const auto x = gdn_test::to_float(random_uniform(tokens * channels, -2, 2, 70));
  const auto w = gdn_test::to_float(random_uniform(channels * kernel, -1, 1, 71));
  const auto dy = gdn_test::to_float(random_uniform(tokens * channels, -1, 1, 72));
  std::vector<float> dx(x.size()), dx_frozen(x.size()), dw(w.size(), 0.0f);
  causal_conv1d_backward_ref(x.data(), w.data(), dy.data(), cu.data(), 2, tokens, channels, kernel, dx.data(),
                             dw.data());
  causal_conv1d_backward_ref(x.data(), w.data(), dy.data(), cu.data(), 2, tokens, channels, kernel,
                             dx_frozen.data(), static_cast<float*>(nullptr));
  const gdn_test::ErrorStats stats = compare("dx (dweight null vs given)", dx_frozen, dx);
  EXPECT_GT(stats.scale, 0.0);
  EXPECT_EQ(stats.max_abs, 0.0);
}

}  // namespace
}  // namespace deltamoe
