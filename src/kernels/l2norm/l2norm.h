// L2 normalisation over the last dim, as applied to the GDN queries and keys:
// y = x * rsqrt(sum(x^2) + eps), eps = 1e-6 added to the SUM (not the mean). CPU reference.
#pragma once

#include <cstdint>

namespace deltamoe {

constexpr double kL2NormEps = 1e-6;

// Shape legend: R rows (e.g. T*H for q or k of shape [T, H, D]), D the normalised (last) dim.
//   x, y, dy, dx  [R, D] contiguous

// Writes y.
template <typename S>
void l2norm_forward_ref(const S* x, int64_t num_rows, int dim, S* y);

// Given dy, writes dx (recomputes the norm from x).
template <typename S>
void l2norm_backward_ref(const S* x, const S* dy, int64_t num_rows, int dim, S* dx);

}  // namespace deltamoe
