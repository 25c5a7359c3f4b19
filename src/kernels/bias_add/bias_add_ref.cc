// Plain CPU bias add and its backward (column sums).
#include "kernels/bias_add/bias_add.h"

namespace deltamoe {

template <typename T>
void bias_add_forward_ref(const T* bias, T* y, int64_t rows, int64_t features) {
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t n = 0; n < features; ++n) y[t * features + n] += bias[n];
  }
}

template <typename T>
void bias_add_backward_ref(const T* dy, T* d_bias, int64_t rows, int64_t features) {
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t n = 0; n < features; ++n) d_bias[n] += dy[t * features + n];
  }
}

template void bias_add_forward_ref<float>(const float*, float*, int64_t, int64_t);
template void bias_add_forward_ref<double>(const double*, double*, int64_t, int64_t);
template void bias_add_backward_ref<float>(const float*, float*, int64_t, int64_t);
template void bias_add_backward_ref<double>(const double*, double*, int64_t, int64_t);

}  // namespace deltamoe
