// SwiGLU reference: known values and the backward against fp64 central finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/gate_activations/gate_activations.h"
#include "kernels/gradcheck/gradcheck.h"

namespace deltamoe {
namespace {

TEST(SwigluRef, KnownValues) {
  // silu(1) * 2 = 2 / (1 + e^-1); silu(0) * u = 0; silu(-2) * -1 = 2 / (1 + e^2).
  const double gate_up[] = {1.0, 0.0, -2.0, 2.0, 5.0, -1.0};
  double h[3];
  swiglu_forward_ref(gate_up, h, 1, 3);
  EXPECT_NEAR(h[0], 2.0 / (1.0 + std::exp(-1.0)), 1e-15);
  EXPECT_EQ(h[1], 0.0);
  EXPECT_NEAR(h[2], 2.0 / (1.0 + std::exp(2.0)), 1e-15);
}

TEST(SwigluRef, BackwardMatchesFiniteDifferences) {
  Rng rng(5);
  const int64_t rows = 3, intermediate = 7;
  std::vector<double> gate_up = gradcheck::random_normal(rng, rows * 2 * intermediate, 2.0);
  const std::vector<double> dh = gradcheck::random_normal(rng, rows * intermediate);
  std::vector<double> h(rows * intermediate), d_gate_up(gate_up.size());
  auto loss = [&] {
    swiglu_forward_ref(gate_up.data(), h.data(), rows, intermediate);
    return gradcheck::dot(h, dh);
  };
  swiglu_backward_ref(gate_up.data(), dh.data(), d_gate_up.data(), rows, intermediate);
  EXPECT_LT(gradcheck::check_gradient("d_gate_up", gate_up, d_gate_up, loss).relative(), gradcheck::kGradTolerance);
}

}  // namespace
}  // namespace deltamoe
