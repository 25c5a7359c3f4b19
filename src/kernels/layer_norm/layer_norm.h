// LayerNorm over the last axis with weight and bias (the vision tower's norm1/norm2/merger norm):
// y = (x - mean) * rstd * weight + bias, rstd = 1 / sqrt(var + eps), biased variance.
// Legend: T rows, C hidden.
#pragma once

#include <cstdint>

namespace deltamoe {

// x [T, C]; weight, bias [C]; y [T, C] written; mean, rstd [T] written (kept for the backward).
template <typename T>
void layer_norm_forward_ref(const T* x, const T* weight, const T* bias, T* y, T* mean, T* rstd, int64_t rows,
                            int64_t hidden, double eps);

// dy [T, C] -> dx [T, C] written; d_weight, d_bias [C] added to (either may be null to skip).
template <typename T>
void layer_norm_backward_ref(const T* x, const T* weight, const T* mean, const T* rstd, const T* dy, T* dx,
                             T* d_weight, T* d_bias, int64_t rows, int64_t hidden);

}  // namespace deltamoe
