// Zero-centred ("Gemma style") RMSNorm over the last dimension: y = x * rsqrt(mean(x^2) + eps) * (1 + w).
// Used for the decoder norms, the final norm and the per-head q/k norms (rows = tokens x heads).
// Legend: T rows, C normalised width.
#pragma once

#include <cstdint>

namespace deltamoe {

// x [T, C]; weight [C] (stored as w, applied as 1 + w); y [T, C] written; rstd [T] written
// (1 / rms of each row, saved for the backward).
template <typename T>
void rms_norm_forward_ref(const T* x, const T* weight, T* y, T* rstd, int64_t rows, int64_t width, double eps);

// dy [T, C] -> dx [T, C] written; d_weight [C] added to (null: not computed, e.g. a frozen weight).
// x, weight and rstd as in the forward.
template <typename T>
void rms_norm_backward_ref(const T* x, const T* weight, const T* rstd, const T* dy, T* dx, T* d_weight, int64_t rows,
                           int64_t width);

}  // namespace deltamoe
