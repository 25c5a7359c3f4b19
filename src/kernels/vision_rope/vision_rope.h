// The vision tower's 2-D rotary embedding: a patch at (row, col) of its image's patch grid rotates
// channel pairs (c, c + D/2) of q and k by angle[c], angle = [row * inv_freq ‖ col * inv_freq]
// with inv_freq_j = theta^(-2j / (D/2)), j < D/4 (rotate_half over the whole head).
// Legend: N patches, H heads, D head dim (a multiple of 4).
#pragma once

#include <cstdint>

namespace deltamoe {

// grid_thw int64 [I, 3]; positions int64 [N, 2] = (row, col) written, in vision_grid.h order.
void vision_rope_positions(const int64_t* grid_thw, int64_t num_images, int64_t merge_size, int64_t* positions);

// positions [N, 2]; cos, sin [N, D/2] written. Angles are formed in T (fp32 like transformers).
template <typename T>
void vision_rope_tables_ref(const int64_t* positions, int64_t num_patches, int64_t head_dim, double theta, T* cos,
                            T* sin);

// x [N, H, D] -> y [N, H, D] written (y may alias x).
template <typename T>
void vision_rope_forward_ref(const T* x, const T* cos, const T* sin, T* y, int64_t num_patches, int64_t num_heads,
                             int64_t head_dim);

// dy [N, H, D] -> dx [N, H, D] written, the inverse rotation (dx may alias dy).
template <typename T>
void vision_rope_backward_ref(const T* dy, const T* cos, const T* sin, T* dx, int64_t num_patches, int64_t num_heads,
                              int64_t head_dim);

}  // namespace deltamoe
