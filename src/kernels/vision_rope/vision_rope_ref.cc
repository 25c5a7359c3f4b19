// 2-D rotary tables and rotations for the vision tower (see vision_rope.h).
#include <cmath>

#include "core/error.h"
#include "kernels/vision_grid/vision_grid.h"
#include "kernels/vision_rope/vision_rope.h"

namespace deltamoe {
namespace {

// Rotates each pair (a, b) = (x[c], x[c + D/2]) by +angle (sign 1) or -angle (sign -1).
template <typename T>
void rotate_pairs(const T* x, const T* cos, const T* sin, T* y, int64_t num_patches, int64_t num_heads,
                  int64_t head_dim, T sign) {
  const int64_t half = head_dim / 2;
  for (int64_t n = 0; n < num_patches; ++n) {
    for (int64_t h = 0; h < num_heads; ++h) {
      const T* in = x + (n * num_heads + h) * head_dim;
      T* out = y + (n * num_heads + h) * head_dim;
      for (int64_t c = 0; c < half; ++c) {
        const T a = in[c], b = in[c + half], cs = cos[n * half + c], sn = sign * sin[n * half + c];
        out[c] = a * cs - b * sn;
        out[c + half] = b * cs + a * sn;
      }
    }
  }
}

}  // namespace

void vision_rope_positions(const int64_t* grid_thw, int64_t num_images, int64_t merge_size, int64_t* positions) {
  for_each_vision_patch(grid_thw, num_images, merge_size, [&](int64_t n, int64_t, int64_t row, int64_t col, int64_t,
                                                              int64_t) {
    positions[n * 2] = row;
    positions[n * 2 + 1] = col;
  });
}

template <typename T>
void vision_rope_tables_ref(const int64_t* positions, int64_t num_patches, int64_t head_dim, double theta, T* cos,
                            T* sin) {
  CHECK(head_dim % 4 == 0, "vision rope: head_dim ", head_dim, " must be a multiple of 4");
  const int64_t half = head_dim / 2, quarter = head_dim / 4;
  for (int64_t n = 0; n < num_patches; ++n) {
    for (int64_t c = 0; c < half; ++c) {
      const int64_t j = c % quarter;
      const T inv_freq = static_cast<T>(1) / static_cast<T>(std::pow(static_cast<T>(theta), static_cast<T>(2 * j) / static_cast<T>(half)));
      const T angle = static_cast<T>(positions[n * 2 + (c < quarter ? 0 : 1)]) * inv_freq;
      cos[n * half + c] = std::cos(angle);
      sin[n * half + c] = std::sin(angle);
    }
  }
}

template <typename T>
void vision_rope_forward_ref(const T* x, const T* cos, const T* sin, T* y, int64_t num_patches, int64_t num_heads,
                             int64_t head_dim) {
  rotate_pairs(x, cos, sin, y, num_patches, num_heads, head_dim, static_cast<T>(1));
}

template <typename T>
void vision_rope_backward_ref(const T* dy, const T* cos, const T* sin, T* dx, int64_t num_patches, int64_t num_heads,
                              int64_t head_dim) {
  // A rotation's transpose is the rotation by the opposite angle.
  rotate_pairs(dy, cos, sin, dx, num_patches, num_heads, head_dim, static_cast<T>(-1));
}

#define DELTAMOE_INSTANTIATE(T)                                                                            \
  template void vision_rope_tables_ref<T>(const int64_t*, int64_t, int64_t, double, T*, T*);               \
  template void vision_rope_forward_ref<T>(const T*, const T*, const T*, T*, int64_t, int64_t, int64_t);   \
  template void vision_rope_backward_ref<T>(const T*, const T*, const T*, T*, int64_t, int64_t, int64_t);
DELTAMOE_INSTANTIATE(float)
DELTAMOE_INSTANTIATE(double)
#undef DELTAMOE_INSTANTIATE

}  // namespace deltamoe
