// GELU references: exact 0.5 x (1 + erf(x / sqrt 2)) and torch's tanh form
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), with their derivatives.
#include <cmath>

#include "kernels/gelu/gelu.h"

namespace deltamoe {
namespace {

constexpr double kSqrt2OverPi = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kInvSqrt2 = 0.7071067811865476;
constexpr double kInvSqrt2Pi = 0.3989422804014327;  // 1 / sqrt(2 pi)
constexpr double kCubic = 0.044715;

double gelu_value(GeluKind kind, double x) {
  if (kind == GeluKind::exact) return 0.5 * x * (1.0 + std::erf(x * kInvSqrt2));
  return 0.5 * x * (1.0 + std::tanh(kSqrt2OverPi * (x + kCubic * x * x * x)));
}

double gelu_derivative(GeluKind kind, double x) {
  if (kind == GeluKind::exact) return 0.5 * (1.0 + std::erf(x * kInvSqrt2)) + x * kInvSqrt2Pi * std::exp(-0.5 * x * x);
  const double inner = kSqrt2OverPi * (x + kCubic * x * x * x);
  const double t = std::tanh(inner);
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * kSqrt2OverPi * (1.0 + 3.0 * kCubic * x * x);
}

}  // namespace

template <typename T>
void gelu_forward_ref(GeluKind kind, const T* x, T* y, int64_t count) {
  for (int64_t i = 0; i < count; ++i) y[i] = static_cast<T>(gelu_value(kind, x[i]));
}

template <typename T>
void gelu_backward_ref(GeluKind kind, const T* x, const T* dy, T* dx, int64_t count) {
  for (int64_t i = 0; i < count; ++i) dx[i] = static_cast<T>(dy[i] * gelu_derivative(kind, x[i]));
}

template void gelu_forward_ref<float>(GeluKind, const float*, float*, int64_t);
template void gelu_forward_ref<double>(GeluKind, const double*, double*, int64_t);
template void gelu_backward_ref<float>(GeluKind, const float*, const float*, float*, int64_t);
template void gelu_backward_ref<double>(GeluKind, const double*, const double*, double*, int64_t);

}  // namespace deltamoe
