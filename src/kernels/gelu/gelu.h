// GELU, exact (erf; the patch merger) and tanh-approximated (gelu_pytorch_tanh; the vision blocks),
// element-wise. Legend: n elements.
#pragma once

#include <cstdint>

namespace deltamoe {

enum class GeluKind { exact, tanh };

// x [n] -> y [n] written (y may alias x).
template <typename T>
void gelu_forward_ref(GeluKind kind, const T* x, T* y, int64_t count);

// dy [n] -> dx [n] written (dx may alias dy); x is the forward input.
template <typename T>
void gelu_backward_ref(GeluKind kind, const T* x, const T* dy, T* dx, int64_t count);

}  // namespace deltamoe
