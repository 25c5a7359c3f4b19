// Bilinear position-embedding taps and the gather / scatter-add that apply them.
#include <algorithm>
#include <cmath>

#include "kernels/vision_grid/vision_grid.h"
#include "kernels/vision_pos_embed/vision_pos_embed.h"

namespace deltamoe {
namespace {

// align_corners=True: patch 0 sits on table row 0 and patch n-1 on row G-1 (a lone patch on 0).
double source_coordinate(int64_t idx, int64_t count, int64_t grid_side) {
  return count > 1 ? static_cast<double>(idx) * static_cast<double>(grid_side - 1) / static_cast<double>(count - 1)
                   : 0.0;
}

}  // namespace

template <typename T>
void vision_pos_embed_taps(const int64_t* grid_thw, int64_t num_images, int64_t grid_side, int64_t merge_size,
                           int64_t* index, T* weight) {
  for_each_vision_patch(grid_thw, num_images, merge_size,
                        [&](int64_t n, int64_t, int64_t row, int64_t col, int64_t grid_h, int64_t grid_w) {
    // HF forms the fractions in fp32 (current transformers); T = float reproduces that.
    const T src_r = static_cast<T>(source_coordinate(row, grid_h, grid_side));
    const T src_c = static_cast<T>(source_coordinate(col, grid_w, grid_side));
    const int64_t r0 = static_cast<int64_t>(src_r), c0 = static_cast<int64_t>(src_c);
    const int64_t r1 = std::min(r0 + 1, grid_side - 1), c1 = std::min(c0 + 1, grid_side - 1);
    const T dr = src_r - static_cast<T>(r0), dc = src_c - static_cast<T>(c0);
    const int64_t taps[4] = {r0 * grid_side + c0, r0 * grid_side + c1, r1 * grid_side + c0, r1 * grid_side + c1};
    const T weights[4] = {(1 - dr) * (1 - dc), (1 - dr) * dc, dr * (1 - dc), dr * dc};
    for (int k = 0; k < 4; ++k) {
      index[n * 4 + k] = taps[k];
      weight[n * 4 + k] = weights[k];
    }
  });
}

template <typename T>
void vision_pos_embed_forward_ref(const T* table, const int64_t* index, const T* weight, T* out, int64_t num_patches,
                                  int64_t hidden) {
  for (int64_t n = 0; n < num_patches; ++n) {
    for (int64_t c = 0; c < hidden; ++c) {
      T sum = 0;
      for (int k = 0; k < 4; ++k) sum += weight[n * 4 + k] * table[index[n * 4 + k] * hidden + c];
      out[n * hidden + c] += sum;
    }
  }
}

template <typename T>
void vision_pos_embed_backward_ref(const T* d_out, const int64_t* index, const T* weight, T* d_table,
                                   int64_t num_patches, int64_t hidden) {
  for (int64_t n = 0; n < num_patches; ++n) {
    for (int k = 0; k < 4; ++k) {
      T* d_row = d_table + index[n * 4 + k] * hidden;
      for (int64_t c = 0; c < hidden; ++c) d_row[c] += weight[n * 4 + k] * d_out[n * hidden + c];
    }
  }
}

#define DELTAMOE_INSTANTIATE(T)                                                                                   \
  template void vision_pos_embed_taps<T>(const int64_t*, int64_t, int64_t, int64_t, int64_t*, T*);                \
  template void vision_pos_embed_forward_ref<T>(const T*, const int64_t*, const T*, T*, int64_t, int64_t);        \
  template void vision_pos_embed_backward_ref<T>(const T*, const int64_t*, const T*, T*, int64_t, int64_t);
DELTAMOE_INSTANTIATE(float)
DELTAMOE_INSTANTIATE(double)
#undef DELTAMOE_INSTANTIATE

}  // namespace deltamoe
