// Plain CPU reference of the bias-free linear projection and its gradients.
#include "kernels/linear/linear.h"

namespace deltamoe {

template <typename T>
void linear_forward_ref(const T* x, const T* weight, T* y, int64_t rows, int64_t in_features, int64_t out_features) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* x_row = x + r * in_features;
    for (int64_t n = 0; n < out_features; ++n) {
      const T* w_row = weight + n * in_features;
      T sum = 0;
      for (int64_t k = 0; k < in_features; ++k) sum += x_row[k] * w_row[k];
      y[r * out_features + n] = sum;
    }
  }
}

template <typename T>
void linear_backward_ref(const T* x, const T* weight, const T* dy, T* dx, T* d_weight, int64_t rows,
                         int64_t in_features, int64_t out_features) {
  if (dx != nullptr) {
    for (int64_t i = 0; i < rows * in_features; ++i) dx[i] = 0;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const T* x_row = x + r * in_features;
    for (int64_t n = 0; n < out_features; ++n) {
      const T g = dy[r * out_features + n];
      if (g == T(0)) continue;
      const T* w_row = weight + n * in_features;
      if (dx != nullptr) {
        T* dx_row = dx + r * in_features;
        for (int64_t k = 0; k < in_features; ++k) dx_row[k] += g * w_row[k];
      }
      if (d_weight != nullptr) {
        T* dw_row = d_weight + n * in_features;
        for (int64_t k = 0; k < in_features; ++k) dw_row[k] += g * x_row[k];
      }
    }
  }
}

#define INSTANTIATE(T)                                                                    \
  template void linear_forward_ref<T>(const T*, const T*, T*, int64_t, int64_t, int64_t); \
  template void linear_backward_ref<T>(const T*, const T*, const T*, T*, T*, int64_t, int64_t, int64_t);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace deltamoe
