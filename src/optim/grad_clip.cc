// Global gradient norm (fp64 sum of squares), torch's clip coefficient, in-place scaling.
#include "optim/grad_clip.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace deltamoe {

// torch adds this to the norm before dividing, so an all-zero gradient does not divide by zero.
constexpr double kClipNormEpsilon = 1e-6;

double sum_of_squares_f64(const float* values, int64_t count) {
  CHECK(count >= 0, "sum_of_squares_f64: negative count ", count);
  double sum = 0;
  for (int64_t i = 0; i < count; ++i) {
    const double value = values[i];
    sum += value * value;
  }
  return sum;
}

GradClipResult grad_clip_from_sum_of_squares(double sum_of_squares, double max_norm) {
  GradClipResult result;
  result.grad_norm = std::sqrt(sum_of_squares);
  result.finite = std::isfinite(result.grad_norm);
  if (!result.finite || !(max_norm > 0)) return result;
  const double coef = max_norm / (result.grad_norm + kClipNormEpsilon);
  result.clip_coef = static_cast<float>(std::min(1.0, coef));
  return result;
}

void scale_in_place(float* values, int64_t count, float coef) {
  for (int64_t i = 0; i < count; ++i) values[i] *= coef;
}

GradClipResult clip_grad_norm(float* grad, int64_t count, double max_norm) {
  GradClipResult result = grad_clip_from_sum_of_squares(sum_of_squares_f64(grad, count), max_norm);
  if (result.finite && result.clipped()) scale_in_place(grad, count, result.clip_coef);
  return result;
}

}  // namespace deltamoe
