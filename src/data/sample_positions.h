// 3-D (t, h, w) rotary positions of one sample (transformers' get_rope_index): text
// tokens advance all three together; an image's merged tokens sit at (s + frame, s + row, s + col)
// from the current position s, after which s advances by max(t, h/m, w/m).
// Kept in data (data may not use model); the vision engineer's compute_mrope_positions is the same rule.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

namespace deltamoe {

// ids [T]; image_grids [I] = (t, h, w) in patches before merging, in order of appearance; each
// image is a run of t*h*w/m^2 image_token_id tokens. Returns int64 [3, T] (row t, then h, then w).
// Throws deltamoe::Error when the runs and grids disagree.
std::vector<int64_t> compute_sample_positions(std::span<const int32_t> ids, std::span<const std::array<int64_t, 3>> image_grids,
                                              int64_t merge_size, int32_t image_token_id);

}  // namespace deltamoe
