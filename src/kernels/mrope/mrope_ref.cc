// Plain CPU reference of partial interleaved M-RoPE: frequency tables, rotation and its transpose.
#include "kernels/mrope/mrope.h"

#include <cmath>

#include "core/error.h"

namespace deltamoe {

namespace {

void check_spec(const MropeSpec& spec, int64_t head_dim) {
  CHECK(spec.rotary_dim > 0 && spec.rotary_dim % 2 == 0 && spec.rotary_dim <= head_dim, "mrope: rotary dim ",
        spec.rotary_dim, " must be even and within the head dim ", head_dim);
  CHECK(spec.section[0] + spec.section[1] + spec.section[2] == spec.rotary_dim / 2, "mrope: mrope_section [",
        spec.section[0], ", ", spec.section[1], ", ", spec.section[2],
        "] must sum to rotary_dim / 2 = ", spec.rotary_dim / 2);
}

}  // namespace

int mrope_axis_of_frequency(const MropeSpec& spec, int64_t frequency_idx) {
  if (frequency_idx % 3 == 1 && frequency_idx < 3 * spec.section[1]) return 1;
  if (frequency_idx % 3 == 2 && frequency_idx < 3 * spec.section[2]) return 2;
  return 0;
}

template <typename T>
void mrope_tables_ref(const MropeSpec& spec, const int64_t* positions, int64_t num_tokens, T* cos, T* sin) {
  check_spec(spec, spec.rotary_dim);
  const int64_t half = spec.rotary_dim / 2;
  for (int64_t j = 0; j < half; ++j) {
    // Same order of operations as transformers: inv_freq = 1 / theta^(2j / R), then pos * inv_freq.
    const T exponent = T(2 * j) / T(spec.rotary_dim);
    const T inv_freq = T(1) / std::pow(T(spec.theta), exponent);
    const int axis = mrope_axis_of_frequency(spec, j);
    for (int64_t t = 0; t < num_tokens; ++t) {
      const T angle = T(positions[axis * num_tokens + t]) * inv_freq;
      cos[t * half + j] = std::cos(angle);
      sin[t * half + j] = std::sin(angle);
    }
  }
}

template <typename T>
void mrope_forward_ref(const MropeSpec& spec, const T* x, const T* cos, const T* sin, T* y, int64_t num_tokens,
                       int64_t num_heads, int64_t head_dim) {
  check_spec(spec, head_dim);
  const int64_t half = spec.rotary_dim / 2;
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t h = 0; h < num_heads; ++h) {
      const T* x_head = x + (t * num_heads + h) * head_dim;
      T* y_head = y + (t * num_heads + h) * head_dim;
      for (int64_t c = 0; c < half; ++c) {
        const T first = x_head[c], second = x_head[c + half];
        const T cos_c = cos[t * half + c], sin_c = sin[t * half + c];
        y_head[c] = first * cos_c - second * sin_c;
        y_head[c + half] = second * cos_c + first * sin_c;
      }
      for (int64_t c = spec.rotary_dim; c < head_dim; ++c) y_head[c] = x_head[c];
    }
  }
}

template <typename T>
void mrope_backward_ref(const MropeSpec& spec, const T* dy, const T* cos, const T* sin, T* dx, int64_t num_tokens,
                        int64_t num_heads, int64_t head_dim) {
  check_spec(spec, head_dim);
  const int64_t half = spec.rotary_dim / 2;
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t h = 0; h < num_heads; ++h) {
      const T* dy_head = dy + (t * num_heads + h) * head_dim;
      T* dx_head = dx + (t * num_heads + h) * head_dim;
      for (int64_t c = 0; c < half; ++c) {
        const T first = dy_head[c], second = dy_head[c + half];
        const T cos_c = cos[t * half + c], sin_c = sin[t * half + c];
        // Transpose of the 2x2 rotation [[cos, -sin], [sin, cos]].
        dx_head[c] = first * cos_c + second * sin_c;
        dx_head[c + half] = second * cos_c - first * sin_c;
      }
      for (int64_t c = spec.rotary_dim; c < head_dim; ++c) dx_head[c] = dy_head[c];
    }
  }
}

#define INSTANTIATE(T)                                                                                               \
  template void mrope_tables_ref<T>(const MropeSpec&, const int64_t*, int64_t, T*, T*);                              \
  template void mrope_forward_ref<T>(const MropeSpec&, const T*, const T*, const T*, T*, int64_t, int64_t, int64_t); \
  template void mrope_backward_ref<T>(const MropeSpec&, const T*, const T*, const T*, T*, int64_t, int64_t, int64_t);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace deltamoe
