// The vision tower's learned absolute position embedding: a G x G table resampled bilinearly
// (align_corners=True) to each image's patch grid, in the patch order of vision_grid.h.
// Legend: N patches, C hidden, G grid side (sqrt of num_position_embeddings).
#pragma once

#include <cstdint>

namespace deltamoe {

// For every patch: the 4 table rows it reads and their bilinear weights, taps in the order
// (floor_r, floor_c), (floor_r, ceil_c), (ceil_r, floor_c), (ceil_r, ceil_c).
// grid_thw int64 [I, 3]; index int64 [N, 4] and weight [N, 4] written.
template <typename T>
void vision_pos_embed_taps(const int64_t* grid_thw, int64_t num_images, int64_t grid_side, int64_t merge_size,
                           int64_t* index, T* weight);

// table [G*G, C]; out [N, C] added to: out[n] += sum_k weight[n, k] * table[index[n, k]].
template <typename T>
void vision_pos_embed_forward_ref(const T* table, const int64_t* index, const T* weight, T* out, int64_t num_patches,
                                  int64_t hidden);

// d_out [N, C] -> d_table [G*G, C] added to.
template <typename T>
void vision_pos_embed_backward_ref(const T* d_out, const int64_t* index, const T* weight, T* d_table,
                                   int64_t num_patches, int64_t hidden);

}  // namespace deltamoe
