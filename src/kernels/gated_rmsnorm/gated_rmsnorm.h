// Gated RMSNorm of the GDN output, per value head:
// y = o * rsqrt(mean(o^2) + eps) * w * silu(z), with a plain weight w (NOT 1 + w). CPU reference.
#pragma once

#include <cstdint>

namespace deltamoe {

// Shape legend: R rows (T*Hv for o of shape [T, Hv, Dv]), D the head dim (Dv).
//   o, z, y, dy, d_o, dz  [R, D] contiguous
//   weight, dweight       [D]    (norm.weight, initialised to ones)
// eps is rms_norm_eps from the config (1e-6 for Qwen3.5).
// NOTE: HF rounds n to bf16 and multiplies by the bf16 weight before the fp32 gate; this reference
// is fp32 throughout, so a golden comparison must apply those roundings outside it.

// Writes y.
template <typename S>
void gated_rmsnorm_forward_ref(const S* o, const S* z, const S* weight, int64_t num_rows, int dim,
                               S eps, S* y);

// Given dy: writes d_o and dz; ADDS to dweight (null: not computed, e.g. a frozen weight).
template <typename S>
void gated_rmsnorm_backward_ref(const S* o, const S* z, const S* weight, const S* dy,
                                int64_t num_rows, int dim, S eps, S* d_o, S* dz, S* dweight);

}  // namespace deltamoe
