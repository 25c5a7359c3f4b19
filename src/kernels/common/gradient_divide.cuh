// The gradient's division by the step's supervised-token count on the device, as the CPU engine
// does it (divide_gradient: fl32(fl64(g) / divisor)), shared by the sum of squares behind the
// gradient norm (sum_of_squares.cu, and the grouped GEMM's dW epilogue that forms it) and AdamW
// (optim/adamw.cu).
//
// When the divisor is an integer below 2^24 (a token count) the quotient is formed in fp32: the
// correctly rounded fp32 quotient of two such numbers equals the fp64 one rounded to fp32 (the
// exact quotient is never within an fp64 half-ulp of an fp32 rounding midpoint unless it is one).
// fp64 division is a long instruction sequence that made these memory-bound passes compute-bound.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

namespace deltamoe {

enum class GradientDivide { none, f32, f64 };

// Which form divides by `divisor` exactly as fl32(fl64(g) / divisor).
inline GradientDivide gradient_divide_for(double divisor) {
  if (divisor == 1.0) return GradientDivide::none;
  if (divisor == std::floor(divisor) && divisor < 16777216.0) return GradientDivide::f32;
  return GradientDivide::f64;
}

template <GradientDivide kDivide>
__device__ __forceinline__ float divide_gradient(float g, double divisor, float divisor_f32) {
  if constexpr (kDivide == GradientDivide::f32) return __fdiv_rn(g, divisor_f32);
  if constexpr (kDivide == GradientDivide::f64) return __double2float_rn(__ddiv_rn(static_cast<double>(g), divisor));
  return g;
}

}  // namespace deltamoe
