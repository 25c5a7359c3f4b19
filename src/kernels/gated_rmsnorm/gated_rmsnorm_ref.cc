// CPU reference of the gated RMSNorm y = o * rsqrt(mean(o^2) + eps) * w * silu(z) (forward,
// backward).
#include <cmath>

#include "core/error.h"
#include "kernels/gated_rmsnorm/gated_rmsnorm.h"

namespace deltamoe {
namespace {

template <typename S>
S inverse_rms(const S* row, int dim, S eps) {
  S sum_sq = 0;
  for (int d = 0; d < dim; ++d) sum_sq += row[d] * row[d];
  return S(1) / std::sqrt(sum_sq / S(dim) + eps);
}

template <typename S>
S sigmoid(S x) {
  return S(1) / (S(1) + std::exp(-x));
}

template <typename S>
void check_gated_rmsnorm_args(int64_t num_rows, int dim, S eps) {
  CHECK(num_rows >= 0, "gated_rmsnorm: num_rows must not be negative, got ", num_rows);
  CHECK(dim > 0, "gated_rmsnorm: dim must be positive, got ", dim);
  CHECK(eps >= 0, "gated_rmsnorm: eps must not be negative, got ", eps);
}

}  // namespace

template <typename S>
void gated_rmsnorm_forward_ref(const S* o, const S* z, const S* weight, int64_t num_rows, int dim,
                               S eps, S* y) {
  check_gated_rmsnorm_args(num_rows, dim, eps);
  for (int64_t r = 0; r < num_rows; ++r) {
    const S* o_row = o + r * dim;
    const S rstd = inverse_rms(o_row, dim, eps);
    for (int d = 0; d < dim; ++d) {
      const S zv = z[r * dim + d];
      y[r * dim + d] = o_row[d] * rstd * weight[d] * (zv * sigmoid(zv));
    }
  }
}

template <typename S>
void gated_rmsnorm_backward_ref(const S* o, const S* z, const S* weight, const S* dy,
                                int64_t num_rows, int dim, S eps, S* d_o, S* dz, S* dweight) {
  check_gated_rmsnorm_args(num_rows, dim, eps);
  for (int64_t r = 0; r < num_rows; ++r) {
    const S* o_row = o + r * dim;
    const S rstd = inverse_rms(o_row, dim, eps);
    // u = dL/dn where n = o * rstd; then d_o = rstd (u - mean(u . n) n), because
    // d rstd / d o_i = -rstd^3 o_i / D.
    S u_dot_n = 0;
    for (int d = 0; d < dim; ++d) {
      const int64_t i = r * dim + d;
      const S n = o_row[d] * rstd;
      const S s = sigmoid(z[i]);
      const S gate = z[i] * s;
      const S u = dy[i] * gate * weight[d];
      u_dot_n += u * n;
      if (dweight != nullptr) dweight[d] += dy[i] * gate * n;
      // d silu(z)/dz = s (1 + z (1 - s)).
      dz[i] = dy[i] * n * weight[d] * s * (S(1) + z[i] * (S(1) - s));
    }
    const S mean_u_dot_n = u_dot_n / S(dim);
    for (int d = 0; d < dim; ++d) {
      const int64_t i = r * dim + d;
      const S n = o_row[d] * rstd;
      const S u = dy[i] * (z[i] * sigmoid(z[i])) * weight[d];
      d_o[i] = rstd * (u - mean_u_dot_n * n);
    }
  }
}

template void gated_rmsnorm_forward_ref<float>(const float*, const float*, const float*, int64_t,
                                               int, float, float*);
template void gated_rmsnorm_forward_ref<double>(const double*, const double*, const double*,
                                                int64_t, int, double, double*);
template void gated_rmsnorm_backward_ref<float>(const float*, const float*, const float*,
                                                const float*, int64_t, int, float, float*, float*,
                                                float*);
template void gated_rmsnorm_backward_ref<double>(const double*, const double*, const double*,
                                                 const double*, int64_t, int, double, double*,
                                                 double*, double*);

}  // namespace deltamoe
