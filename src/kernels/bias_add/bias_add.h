// Adding a bias row to every row (the bias of nn.Linear / Conv3d kept apart from the matrix
// product in linear/). Legend: T rows, N features.
#pragma once

#include <cstdint>

namespace deltamoe {

// y [T, N] added to: y[t, n] += bias[n].
template <typename T>
void bias_add_forward_ref(const T* bias, T* y, int64_t rows, int64_t features);

// dy [T, N] -> d_bias [N] added to (the column sums).
template <typename T>
void bias_add_backward_ref(const T* dy, T* d_bias, int64_t rows, int64_t features);

}  // namespace deltamoe
