// Test helpers for the reference ops: random fp64 tensors and a central finite-difference check
// that compares an analytic gradient with (L(x + h) - L(x - h)) / 2h, element by element.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "core/rng.h"

namespace deltamoe::gradcheck {

inline std::vector<double> random_normal(Rng& rng, size_t count, double scale = 1.0) {
  std::vector<double> values(count);
  for (double& value : values) value = rng.normal() * scale;
  return values;
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double sum = 0;
  for (size_t i = 0; i < a.size(); ++i) sum += a[i] * b[i];
  return sum;
}

struct GradError {
  double max_abs = 0;  // max |analytic - numeric|
  double max_ref = 0;  // max |numeric|
  // Error relative to the gradient's scale: max abs diff / max |numeric|.
  double relative() const { return max_abs / std::max(max_ref, 1e-30); }
};

// Perturbs every element of `input` by +-step, evaluates `loss` (which reads `input`), and compares
// the central difference with analytic[i]. Prints the errors under `name`. `input` is restored.
inline GradError check_gradient(const std::string& name, std::vector<double>& input,
                                const std::vector<double>& analytic, const std::function<double()>& loss,
                                double step = 1e-6) {
  GradError error;
  for (size_t i = 0; i < input.size(); ++i) {
    const double saved = input[i];
    input[i] = saved + step;
    const double plus = loss();
    input[i] = saved - step;
    const double minus = loss();
    input[i] = saved;
    const double numeric = (plus - minus) / (2 * step);
    error.max_abs = std::max(error.max_abs, std::abs(numeric - analytic[i]));
    error.max_ref = std::max(error.max_ref, std::abs(numeric));
  }
  std::printf("  gradcheck %-12s n=%-6zu max|diff|=%.3e max|ref|=%.3e rel=%.3e\n", name.c_str(), input.size(),
              error.max_abs, error.max_ref, error.relative());
  return error;
}

// Tolerance for fp64 central differences with step 1e-6 on smooth, O(1) functions.
constexpr double kGradTolerance = 1e-6;

}  // namespace deltamoe::gradcheck
