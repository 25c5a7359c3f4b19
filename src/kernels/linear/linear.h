// Dense projection without bias in torch's [out, in] weight layout: y = x W^T.
// Legend: T rows, K input features, N output features.
#pragma once

#include <cstdint>

namespace deltamoe {

// x [T, K]; weight [N, K]; y [T, N] written.
template <typename T>
void linear_forward_ref(const T* x, const T* weight, T* y, int64_t rows, int64_t in_features, int64_t out_features);

// dy [T, N] -> dx [T, K] written (skipped when dx is null); d_weight [N, K] added to (skipped when null).
template <typename T>
void linear_backward_ref(const T* x, const T* weight, const T* dy, T* dx, T* d_weight, int64_t rows,
                         int64_t in_features, int64_t out_features);

}  // namespace deltamoe
