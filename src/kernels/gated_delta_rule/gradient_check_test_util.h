// Test helpers shared by the Gated DeltaNet family's reference tests: random inputs, central
// finite differences in fp64, and max abs / relative error reports.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "core/rng.h"

namespace deltamoe::gdn_test {

// Uniform values in [lo, hi), reproducible from the seed.
inline std::vector<double> random_uniform(int64_t count, double lo, double hi, uint64_t seed) {
  Rng rng(seed);
  std::vector<double> values(static_cast<size_t>(count));
  for (double& value : values) value = lo + (hi - lo) * rng.uniform_f64();
  return values;
}

inline std::vector<float> to_float(const std::vector<double>& values) {
  return std::vector<float>(values.begin(), values.end());
}

struct ErrorStats {
  double max_abs = 0;  // max |actual - expected|
  double max_rel = 0;  // max_abs / max |expected| (relative to the tensor's scale)
  double scale = 0;    // max |expected|
  // Relative where the tensor is large, absolute where it is below 1 (a gradient that is ~0
  // everywhere, e.g. of a norm over one element, has no meaningful relative error).
  double rel_or_abs() const { return max_abs / std::max(scale, 1.0); }
};

// Compares two tensors and prints the errors under `label`.
template <typename A, typename B>
ErrorStats compare(const std::string& label, const std::vector<A>& actual,
                   const std::vector<B>& expected) {
  ErrorStats stats;
  double& scale = stats.scale;
  const size_t count = std::min(actual.size(), expected.size());
  for (size_t i = 0; i < count; ++i) {
    const double diff = std::abs(static_cast<double>(actual[i]) - static_cast<double>(expected[i]));
    // A NaN must fail the comparison, so it becomes an infinite error.
    stats.max_abs = std::max(stats.max_abs, std::isnan(diff) ? INFINITY : diff);
    scale = std::max(scale, std::abs(static_cast<double>(expected[i])));
  }
  if (actual.size() != expected.size()) stats.max_abs = INFINITY;
  stats.max_rel = stats.max_abs / std::max(scale, 1e-30);
  std::printf("  %-28s n=%-6zu max_abs=%.3e max_rel=%.3e (scale %.3e)\n", label.c_str(),
              expected.size(), stats.max_abs, stats.max_rel, scale);
  return stats;
}

// Central finite differences of loss() with respect to every entry of `param` (perturbed in
// place and restored): grad[i] = (loss(p + h e_i) - loss(p - h e_i)) / 2h.
inline std::vector<double> finite_difference(std::vector<double>& param,
                                             const std::function<double()>& loss,
                                             double step = 1e-6) {
  std::vector<double> grad(param.size());
  for (size_t i = 0; i < param.size(); ++i) {
    const double saved = param[i];
    param[i] = saved + step;
    const double plus = loss();
    param[i] = saved - step;
    const double minus = loss();
    param[i] = saved;
    grad[i] = (plus - minus) / (2 * step);
  }
  return grad;
}

// sum_i a[i] * b[i]: a scalar loss from an output and a fixed random cotangent.
inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double sum = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace deltamoe::gdn_test
