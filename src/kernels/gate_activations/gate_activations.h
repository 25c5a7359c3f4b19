// SiLU-gated MLP activation (SwiGLU) of the experts and the shared expert: h = silu(g) * u, with
// gate and up side by side in one row as a fused gate|up projection writes them.
// (The attention output gate y = o * sigmoid(gate) has its reference in kernels/attention.)
// Legend: T rows, I intermediate width.
#pragma once

#include <cstdint>

namespace deltamoe {

// gate_up [T, 2I] (columns [0, I) gate g, [I, 2I) up u); h [T, I] written.
template <typename T>
void swiglu_forward_ref(const T* gate_up, T* h, int64_t rows, int64_t intermediate);

// dh [T, I] -> d_gate_up [T, 2I] written: dg = dh * u * silu'(g), du = dh * silu(g).
template <typename T>
void swiglu_backward_ref(const T* gate_up, const T* dh, T* d_gate_up, int64_t rows, int64_t intermediate);

}  // namespace deltamoe
