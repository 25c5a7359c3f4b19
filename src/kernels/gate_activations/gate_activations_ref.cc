// Plain CPU reference of the SwiGLU activation and its gradient.
#include "kernels/gate_activations/gate_activations.h"

#include <cmath>

namespace deltamoe {

template <typename T>
void swiglu_forward_ref(const T* gate_up, T* h, int64_t rows, int64_t intermediate) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * 2 * intermediate;
    const T* up = gate + intermediate;
    for (int64_t i = 0; i < intermediate; ++i) {
      const T sig = T(1) / (T(1) + std::exp(-gate[i]));
      h[r * intermediate + i] = gate[i] * sig * up[i];
    }
  }
}

template <typename T>
void swiglu_backward_ref(const T* gate_up, const T* dh, T* d_gate_up, int64_t rows, int64_t intermediate) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * 2 * intermediate;
    const T* up = gate + intermediate;
    T* d_gate = d_gate_up + r * 2 * intermediate;
    T* d_up = d_gate + intermediate;
    for (int64_t i = 0; i < intermediate; ++i) {
      const T g = gate[i], grad = dh[r * intermediate + i];
      const T sig = T(1) / (T(1) + std::exp(-g));
      // silu(g) = g * s; silu'(g) = s * (1 + g * (1 - s)).
      d_gate[i] = grad * up[i] * sig * (T(1) + g * (T(1) - sig));
      d_up[i] = grad * g * sig;
    }
  }
}

#define INSTANTIATE(T)                                                              \
  template void swiglu_forward_ref<T>(const T*, T*, int64_t, int64_t);              \
  template void swiglu_backward_ref<T>(const T*, const T*, T*, int64_t, int64_t);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace deltamoe
