// The order in which the vision tower sees patches: per image, per temporal slice, merge blocks in
// raster order and the m x m patches of a block in raster order (the processor's pixel_values rows).
#pragma once

#include <cstdint>

#include "core/error.h"

namespace deltamoe {

// Number of patch rows for `num_images` images with grid_thw int64 [I, 3] = (t, h, w).
inline int64_t vision_num_patches(const int64_t* grid_thw, int64_t num_images) {
  int64_t total = 0;
  for (int64_t i = 0; i < num_images; ++i) total += grid_thw[i * 3] * grid_thw[i * 3 + 1] * grid_thw[i * 3 + 2];
  return total;
}

// Calls visit(patch_idx, image_idx, row, col, grid_h, grid_w) for every patch in row order, where
// (row, col) is the patch's place in its image's full-resolution patch grid.
template <typename Visit>
void for_each_vision_patch(const int64_t* grid_thw, int64_t num_images, int64_t merge_size, Visit&& visit) {
  int64_t patch_idx = 0;
  for (int64_t image = 0; image < num_images; ++image) {
    const int64_t t = grid_thw[image * 3], h = grid_thw[image * 3 + 1], w = grid_thw[image * 3 + 2];
    CHECK(t > 0 && h > 0 && w > 0 && h % merge_size == 0 && w % merge_size == 0, "image ", image, ": grid_thw [", t,
          ", ", h, ", ", w, "] must be positive with h and w multiples of the merge size ", merge_size);
    for (int64_t frame = 0; frame < t; ++frame) {
      for (int64_t block_r = 0; block_r < h / merge_size; ++block_r) {
        for (int64_t block_c = 0; block_c < w / merge_size; ++block_c) {
          for (int64_t inner_r = 0; inner_r < merge_size; ++inner_r) {
            for (int64_t inner_c = 0; inner_c < merge_size; ++inner_c) {
              visit(patch_idx++, image, block_r * merge_size + inner_r, block_c * merge_size + inner_c, h, w);
            }
          }
        }
      }
    }
  }
}

}  // namespace deltamoe
