// The gradient's division by the step's supervised-token count on the device, as the CPU engine
// does it (divide_gradient: fl32(fl64(g) / divisor)), shared by the sum of squares behind the
// gradient norm (sum_of_squares.cu) and AdamW (optim/adamw.cu). Plain C++ apart from the device
// function at the end, so that a CPU test checks the arithmetic (gradient_divide_test).
//
// When the divisor is an integer below 2^24 (a token count) the quotient is formed in fp32: the
// correctly rounded fp32 quotient of two such numbers equals the fp64 one rounded to fp32 (the
// exact quotient is never within an fp64 half-ulp of an fp32 rounding midpoint unless it is one).
// And not by fp32 division either, a sequence of ~10 instructions with a slow path: by the
// correctly rounded reciprocal r and one FMA correction (Markstein), q0 = g r,
// q = q0 + (g - q0 d) r, which is the correctly rounded quotient whenever that is a normal number.
// A quotient below 2^-125 (or an infinite g) takes the division.
#pragma once

#include <cmath>
#include <initializer_list>

#include "kernels/common/host_device.h"

namespace deltamoe {

enum class GradientDivide { none, f32, f64 };

// Which form divides by `divisor` exactly as fl32(fl64(g) / divisor).
inline GradientDivide gradient_divide_for(double divisor) {
  if (divisor == 1.0) return GradientDivide::none;
  if (divisor == std::floor(divisor) && divisor < 16777216.0) return GradientDivide::f32;
  return GradientDivide::f64;
}

// A divisor as the kernels take it (gradient_divisor builds it).
struct GradientDivisor {
  double f64 = 1.0;
  float f32 = 1.0f;
  float reciprocal = 1.0f;  // fl32(1 / divisor), correctly rounded (the f32 form reads it)
  GradientDivide kind = GradientDivide::none;
};

// The fp32 value nearest to 1 / d for d > 0 exactly representable in fp32: the rounded fp64
// reciprocal or a neighbour of it, whichever leaves the smallest |1 - r d| (exact in fp64: r and d
// have 24 significant bits each).
inline float correctly_rounded_reciprocal(float d) {
  const float guess = static_cast<float>(1.0 / static_cast<double>(d));
  float best = guess;
  double best_error = std::fabs(1.0 - static_cast<double>(guess) * d);
  for (const float candidate : {std::nextafter(guess, 0.0f), std::nextafter(guess, 2.0f * guess)}) {
    const double error = std::fabs(1.0 - static_cast<double>(candidate) * d);
    if (error < best_error) best_error = error, best = candidate;
  }
  return best;
}

inline GradientDivisor gradient_divisor(double divisor) {
  GradientDivisor d;
  d.f64 = divisor;
  d.f32 = static_cast<float>(divisor);
  d.kind = gradient_divide_for(divisor);
  d.reciprocal = d.kind == GradientDivide::f32 ? correctly_rounded_reciprocal(d.f32) : 1.0f;
  return d;
}

// fl32(g / d) for d an integer below 2^24 and r = correctly_rounded_reciprocal(d) (see the top).
DELTAMOE_HOST_DEVICE inline float divide_by_integer(float g, float d, float r) {
#if defined(__CUDA_ARCH__)
  const float q0 = __fmul_rn(g, r);
  const float q = __fmaf_rn(__fmaf_rn(-q0, d, g), r, q0);
  if (fabsf(q) >= 0x1p-125f) return q;
  return g == 0.0f ? g : __fdiv_rn(g, d);  // g itself keeps the sign of a zero
#else
  const float q0 = g * r;
  const float q = std::fma(std::fma(-q0, d, g), r, q0);
  if (std::fabs(q) >= 0x1p-125f) return q;
  return g == 0.0f ? g : g / d;
#endif
}

#if defined(__CUDACC__)
template <GradientDivide kDivide>
__device__ __forceinline__ float divide_gradient(float g, const GradientDivisor& divisor) {
  if constexpr (kDivide == GradientDivide::f32) return divide_by_integer(g, divisor.f32, divisor.reciprocal);
  if constexpr (kDivide == GradientDivide::f64) return __double2float_rn(__ddiv_rn(static_cast<double>(g), divisor.f64));
  return g;
}
#endif

}  // namespace deltamoe
