// The GPU tests' host form of the gradient norm's sum (sum_of_squares_cuda.h, and the squares the
// grouped GEMM's written dW forms): sum over the values of fl32(fl64(v) / divisor)^2 in fp64, in
// order.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace deltamoe {

inline double host_sum_of_squares(const float* values, int64_t count, double divisor) {
  double sum = 0.0;
  for (int64_t i = 0; i < count; ++i) {
    const auto q = static_cast<float>(static_cast<double>(values[i]) / divisor);
    sum += static_cast<double>(q) * static_cast<double>(q);
  }
  return sum;
}

// A downloaded tensor of any float type, widened to fp32 first (bf16 gradients exactly).
inline double host_sum_of_squares(const HostTensor& stored, double divisor) {
  const HostTensor c = stored.to_f32();
  return host_sum_of_squares(c.as<float>(), c.numel(), divisor);
}

}  // namespace deltamoe
