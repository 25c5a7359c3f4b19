// CPU reference of the l2 normalisation y = x * rsqrt(sum(x^2) + 1e-6) over the last dim.
#include <cmath>

#include "core/error.h"
#include "kernels/l2norm/l2norm.h"

namespace deltamoe {
namespace {

template <typename S>
S inverse_norm(const S* row, int dim) {
  S sum_sq = 0;
  for (int d = 0; d < dim; ++d) sum_sq += row[d] * row[d];
  return S(1) / std::sqrt(sum_sq + S(kL2NormEps));
}

void check_l2norm_args(int64_t num_rows, int dim) {
  CHECK(num_rows >= 0, "l2norm: num_rows must not be negative, got ", num_rows);
  CHECK(dim > 0, "l2norm: dim must be positive, got ", dim);
}

}  // namespace

template <typename S>
void l2norm_forward_ref(const S* x, int64_t num_rows, int dim, S* y) {
  check_l2norm_args(num_rows, dim);
  for (int64_t r = 0; r < num_rows; ++r) {
    const S* x_row = x + r * dim;
    const S rstd = inverse_norm(x_row, dim);
    for (int d = 0; d < dim; ++d) y[r * dim + d] = x_row[d] * rstd;
  }
}

template <typename S>
void l2norm_backward_ref(const S* x, const S* dy, int64_t num_rows, int dim, S* dx) {
  check_l2norm_args(num_rows, dim);
  for (int64_t r = 0; r < num_rows; ++r) {
    const S* x_row = x + r * dim;
    const S* dy_row = dy + r * dim;
    const S rstd = inverse_norm(x_row, dim);
    // y = x r with r = (sum x^2 + eps)^-1/2 and dr/dx = -r^3 x, so
    // dx = r dy - r^3 (dy . x) x = r (dy - (dy . y) y).
    S dy_dot_y = 0;
    for (int d = 0; d < dim; ++d) dy_dot_y += dy_row[d] * x_row[d] * rstd;
    for (int d = 0; d < dim; ++d) {
      dx[r * dim + d] = rstd * (dy_row[d] - dy_dot_y * x_row[d] * rstd);
    }
  }
}

template void l2norm_forward_ref<float>(const float*, int64_t, int, float*);
template void l2norm_forward_ref<double>(const double*, int64_t, int, double*);
template void l2norm_backward_ref<float>(const float*, const float*, int64_t, int, float*);
template void l2norm_backward_ref<double>(const double*, const double*, int64_t, int, double*);

}  // namespace deltamoe
