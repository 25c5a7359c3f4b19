// Plain CPU reference of the zero-centred RMSNorm and its gradient.
#include "kernels/rms_norm/rms_norm.h"

#include <cmath>

namespace deltamoe {

template <typename T>
void rms_norm_forward_ref(const T* x, const T* weight, T* y, T* rstd, int64_t rows, int64_t width, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* x_row = x + r * width;
    T sum_squares = 0;
    for (int64_t c = 0; c < width; ++c) sum_squares += x_row[c] * x_row[c];
    const T inv_rms = T(1) / std::sqrt(sum_squares / T(width) + T(eps));
    rstd[r] = inv_rms;
    for (int64_t c = 0; c < width; ++c) y[r * width + c] = x_row[c] * inv_rms * (T(1) + weight[c]);
  }
}

template <typename T>
void rms_norm_backward_ref(const T* x, const T* weight, const T* rstd, const T* dy, T* dx, T* d_weight, int64_t rows,
                           int64_t width) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* x_row = x + r * width;
    const T* dy_row = dy + r * width;
    const T inv_rms = rstd[r];
    // n = x * inv_rms; y = n * (1 + w). dn = dy * (1 + w); dx = inv_rms * (dn - n * mean(dn * n)).
    T mean_dn_n = 0;
    for (int64_t c = 0; c < width; ++c) {
      const T normed = x_row[c] * inv_rms;
      if (d_weight != nullptr) d_weight[c] += dy_row[c] * normed;
      mean_dn_n += dy_row[c] * (T(1) + weight[c]) * normed;
    }
    mean_dn_n /= T(width);
    for (int64_t c = 0; c < width; ++c) {
      const T normed = x_row[c] * inv_rms;
      dx[r * width + c] = inv_rms * (dy_row[c] * (T(1) + weight[c]) - normed * mean_dn_n);
    }
  }
}

#define INSTANTIATE(T)                                                                         \
  template void rms_norm_forward_ref<T>(const T*, const T*, T*, T*, int64_t, int64_t, double); \
  template void rms_norm_backward_ref<T>(const T*, const T*, const T*, const T*, T*, T*, int64_t, int64_t);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace deltamoe
