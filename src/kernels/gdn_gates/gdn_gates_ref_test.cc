// Tests of the GDN gate reference: the formulas (including torch's softplus threshold), fp64
// finite-difference gradients (parameter gradients added to), float vs double.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/gated_delta_rule/gradient_check_test_util.h"
#include "kernels/gdn_gates/gdn_gates.h"

namespace deltamoe {
namespace {

using gdn_test::compare;
using gdn_test::random_uniform;

TEST(GdnGatesRef, FormulasAndSoftplusThreshold) {
  // a + dt_bias covers the log1p branch and the linear branch above 20.
  const std::vector<double> a = {-3.0, 0.0, 19.0, 25.0};
  const std::vector<double> b = {-1.0, 0.0, 2.0, 4.0};
  const std::vector<double> a_log = {0.3};
  const std::vector<double> dt_bias = {0.5};
  std::vector<double> g(4), beta(4);
  gdn_gates_forward_ref(a.data(), b.data(), a_log.data(), dt_bias.data(), 4, 1, g.data(),
                        beta.data());
  for (int t = 0; t < 4; ++t) {
    const double x = a[t] + dt_bias[0];
    const double softplus = x > 20 ? x : std::log(1 + std::exp(x));
    EXPECT_NEAR(g[t], -std::exp(a_log[0]) * softplus, 1e-13) << "t=" << t;
    EXPECT_LE(g[t], 0.0);
    EXPECT_NEAR(beta[t], 1 / (1 + std::exp(-b[t])), 1e-15) << "t=" << t;
  }
  // Above the threshold softplus is the identity (torch returns x, not log1p(exp(x))).
  EXPECT_EQ(g[3], -std::exp(a_log[0]) * 25.5);
}

TEST(GdnGatesRef, BackwardMatchesFiniteDifferences) {
  const std::vector<std::pair<int64_t, int>> shapes = {{1, 1}, {1, 3}, {5, 2}, {17, 7}};
  uint64_t seed = 10;
  for (const auto& [tokens, heads] : shapes) {
    auto a = random_uniform(tokens * heads, -4, 4, ++seed);
    auto b = random_uniform(tokens * heads, -4, 4, ++seed);
    auto a_log = random_uniform(heads, -1, 1, ++seed);
    auto dt_bias = random_uniform(heads, -1, 1, ++seed);
    a[0] = 22.0;  // one entry on softplus's linear branch (away from the kink at 20)
    const auto dg_out = random_uniform(tokens * heads, -1, 1, ++seed);
    const auto dbeta_out = random_uniform(tokens * heads, -1, 1, ++seed);
    std::vector<double> g(a.size()), beta(a.size());
    auto loss = [&] {
      gdn_gates_forward_ref(a.data(), b.data(), a_log.data(), dt_bias.data(), tokens, heads,
                            g.data(), beta.data());
      return gdn_test::dot(g, dg_out) + gdn_test::dot(beta, dbeta_out);
    };
    std::vector<double> da(a.size()), db(b.size());
    std::vector<double> da_log(heads, 1.0), ddt_bias(heads, -2.0);  // added to: known offsets
    gdn_gates_backward_ref(a.data(), b.data(), a_log.data(), dt_bias.data(), dg_out.data(),
                           dbeta_out.data(), tokens, heads, da.data(), db.data(), da_log.data(),
                           ddt_bias.data());
    for (double& value : da_log) value -= 1.0;
    for (double& value : ddt_bias) value += 2.0;
    std::printf("case T=%lld H=%d\n", static_cast<long long>(tokens), heads);
    EXPECT_LT(compare("da", da, gdn_test::finite_difference(a, loss)).rel_or_abs(), 1e-7);
    EXPECT_LT(compare("db", db, gdn_test::finite_difference(b, loss)).rel_or_abs(), 1e-7);
    EXPECT_LT(compare("dA_log", da_log, gdn_test::finite_difference(a_log, loss)).rel_or_abs(),
              1e-7);
    EXPECT_LT(
        compare("ddt_bias", ddt_bias, gdn_test::finite_difference(dt_bias, loss)).rel_or_abs(),
        1e-7);
  }
}

TEST(GdnGatesRef, FloatAgreesWithDouble) {
  const int64_t tokens = 33;
  const int heads = 4;
  const auto a = random_uniform(tokens * heads, -5, 5, 40);
  const auto b = random_uniform(tokens * heads, -5, 5, 41);
  const auto a_log = random_uniform(heads, -1, 1, 42);
  const auto dt_bias = random_uniform(heads, -1, 1, 43);
  std::vector<double> g(a.size()), beta(a.size());
  gdn_gates_forward_ref(a.data(), b.data(), a_log.data(), dt_bias.data(), tokens, heads, g.data(),
                        beta.data());
  const auto af = gdn_test::to_float(a), bf = gdn_test::to_float(b);
  const auto a_logf = gdn_test::to_float(a_log), dt_biasf = gdn_test::to_float(dt_bias);
  std::vector<float> gf(a.size()), betaf(a.size());
  gdn_gates_forward_ref(af.data(), bf.data(), a_logf.data(), dt_biasf.data(), tokens, heads,
                        gf.data(), betaf.data());
  EXPECT_LT(compare("g f32 vs f64", gf, g).max_rel, 1e-6);
  EXPECT_LT(compare("beta f32 vs f64", betaf, beta).max_rel, 1e-6);
}

TEST(GdnGatesRef, RejectsBadSizes) {
  std::vector<float> x(4);
  EXPECT_THROW(
      gdn_gates_forward_ref(x.data(), x.data(), x.data(), x.data(), 2, 0, x.data(), x.data()),
      Error);
}


// Null dA_log / ddt_bias (frozen gate parameters) skip those gradients, one or both at a time; da,
// db and the gradient still asked for stay bitwise unchanged.
TEST(GdnGatesRef, NullParameterGradientsGiveIdenticalInputGradients) {
  const int64_t tokens = 21;
  const int heads = 4;
  const auto a = gdn_test::to_float(random_uniform(tokens * heads, -5, 5, 60));
  const auto b = gdn_test::to_float(random_uniform(tokens * heads, -5, 5, 61));
  const auto a_log = gdn_test::to_float(random_uniform(heads, -1, 1, 62));
  const auto dt_bias = gdn_test::to_float(random_uniform(heads, -1, 1, 63));
  const auto dg = gdn_test::to_float(random_uniform(tokens * heads, -1, 1, 64));
  const auto dbeta = gdn_test::to_float(random_uniform(tokens * heads, -1, 1, 65));
  std::vector<float> da(a.size()), db(a.size()), d_a_log(heads, 0.0f), d_dt_bias(heads, 0.0f);
  gdn_gates_backward_ref(a.data(), b.data(), a_log.data(), dt_bias.data(), dg.data(), dbeta.data(), tokens, heads,
                         da.data(), db.data(), d_a_log.data(), d_dt_bias.data());
  // mask bit 0: dA_log asked for, bit 1: ddt_bias asked for; 3 (both) is the run above.
  for (int mask = 0; mask < 3; ++mask) {
    const bool keep_a_log = mask & 1, keep_dt_bias = mask & 2;
    std::vector<float> da_frozen(a.size()), db_frozen(a.size()), d_a_log_kept(heads, 0.0f), d_dt_bias_kept(heads, 0.0f);
    gdn_gates_backward_ref(a.data(), b.data(), a_log.data(), dt_bias.data(), dg.data(), dbeta.data(), tokens, heads,
                           da_frozen.data(), db_frozen.data(), keep_a_log ? d_a_log_kept.data() : nullptr,
                           keep_dt_bias ? d_dt_bias_kept.data() : nullptr);
    SCOPED_TRACE(mask);
    const gdn_test::ErrorStats da_stats = compare("da (parameter grads null)", da_frozen, da);
    const gdn_test::ErrorStats db_stats = compare("db (parameter grads null)", db_frozen, db);
    EXPECT_GT(da_stats.scale, 0.0);
    EXPECT_GT(db_stats.scale, 0.0);
    EXPECT_EQ(da_stats.max_abs, 0.0);
    EXPECT_EQ(db_stats.max_abs, 0.0);
    if (mask == 1) {
      EXPECT_EQ(compare("dA_log (ddt_bias null)", d_a_log_kept, d_a_log).max_abs, 0.0);
    }
    if (mask == 2) {
      EXPECT_EQ(compare("ddt_bias (dA_log null)", d_dt_bias_kept, d_dt_bias).max_abs, 0.0);
    }
  }
}

}  // namespace
}  // namespace deltamoe
