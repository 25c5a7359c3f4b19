// Plain CPU LayerNorm; statistics accumulate in double whatever T is (fp32 like torch's CPU/GPU
// kernels would be close enough; the reference favours accuracy).
#include <cmath>

#include "kernels/layer_norm/layer_norm.h"

namespace deltamoe {

template <typename T>
void layer_norm_forward_ref(const T* x, const T* weight, const T* bias, T* y, T* mean, T* rstd, int64_t rows,
                            int64_t hidden, double eps) {
  for (int64_t t = 0; t < rows; ++t) {
    const T* row = x + t * hidden;
    double sum = 0;
    for (int64_t c = 0; c < hidden; ++c) sum += row[c];
    const double mu = sum / hidden;
    double squares = 0;
    for (int64_t c = 0; c < hidden; ++c) squares += (row[c] - mu) * (row[c] - mu);
    const double inv_std = 1.0 / std::sqrt(squares / hidden + eps);
    mean[t] = static_cast<T>(mu);
    rstd[t] = static_cast<T>(inv_std);
    for (int64_t c = 0; c < hidden; ++c) {
      y[t * hidden + c] = static_cast<T>((row[c] - mu) * inv_std * weight[c] + bias[c]);
    }
  }
}

template <typename T>
void layer_norm_backward_ref(const T* x, const T* weight, const T* mean, const T* rstd, const T* dy, T* dx,
                             T* d_weight, T* d_bias, int64_t rows, int64_t hidden) {
  for (int64_t t = 0; t < rows; ++t) {
    const T* row = x + t * hidden;
    const T* d_row = dy + t * hidden;
    const double mu = mean[t], inv_std = rstd[t];
    // With xhat = (x - mu) * rstd and g = dy * w: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
    double mean_g = 0, mean_g_xhat = 0;
    for (int64_t c = 0; c < hidden; ++c) {
      const double xhat = (row[c] - mu) * inv_std;
      const double g = static_cast<double>(d_row[c]) * weight[c];
      mean_g += g;
      mean_g_xhat += g * xhat;
      if (d_weight != nullptr) d_weight[c] += static_cast<T>(d_row[c] * xhat);
      if (d_bias != nullptr) d_bias[c] += d_row[c];
    }
    mean_g /= hidden;
    mean_g_xhat /= hidden;
    for (int64_t c = 0; c < hidden; ++c) {
      const double xhat = (row[c] - mu) * inv_std;
      const double g = static_cast<double>(d_row[c]) * weight[c];
      dx[t * hidden + c] = static_cast<T>(inv_std * (g - mean_g - xhat * mean_g_xhat));
    }
  }
}

#define DELTAMOE_INSTANTIATE(T)                                                                             \
  template void layer_norm_forward_ref<T>(const T*, const T*, const T*, T*, T*, T*, int64_t, int64_t, double); \
  template void layer_norm_backward_ref<T>(const T*, const T*, const T*, const T*, const T*, T*, T*, T*, int64_t, \
                                           int64_t);
DELTAMOE_INSTANTIATE(float)
DELTAMOE_INSTANTIATE(double)
#undef DELTAMOE_INSTANTIATE

}  // namespace deltamoe
