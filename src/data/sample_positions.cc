// The 3-D position rule for one sample.
#include "data/sample_positions.h"

#include <algorithm>

#include "core/error.h"

namespace deltamoe {

std::vector<int64_t> compute_sample_positions(std::span<const int32_t> ids, std::span<const std::array<int64_t, 3>> image_grids,
                                              int64_t merge_size, int32_t image_token_id) {
  const size_t num_tokens = ids.size();
  std::vector<int64_t> positions(3 * num_tokens);
  int64_t* pos_t = positions.data();
  int64_t* pos_h = pos_t + num_tokens;
  int64_t* pos_w = pos_h + num_tokens;
  int64_t next = 0;  // position of the next text token
  size_t image = 0;
  for (size_t i = 0; i < num_tokens;) {
    if (ids[i] != image_token_id) {
      pos_t[i] = pos_h[i] = pos_w[i] = next++;
      ++i;
      continue;
    }
    CHECK(image < image_grids.size(), "token ", i, " starts image ", image + 1, " but only ", image_grids.size(),
          " image grid(s) were given");
    const auto [grid_t, grid_h, grid_w] = image_grids[image];
    CHECK(grid_h % merge_size == 0 && grid_w % merge_size == 0, "image ", image, " grid (", grid_t, ", ", grid_h, ", ",
          grid_w, ") is not divisible by the merge size ", merge_size);
    const int64_t rows = grid_h / merge_size, cols = grid_w / merge_size;
    const size_t run = static_cast<size_t>(grid_t * rows * cols);
    CHECK(i + run <= num_tokens && std::all_of(ids.begin() + static_cast<ptrdiff_t>(i), ids.begin() + static_cast<ptrdiff_t>(i + run),
                                               [&](int32_t id) { return id == image_token_id; }),
          "image ", image, " needs ", run, " consecutive image tokens from token ", i);
    for (int64_t f = 0; f < grid_t; ++f) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c, ++i) {
          pos_t[i] = next + f;
          pos_h[i] = next + r;
          pos_w[i] = next + c;
        }
      }
    }
    next += std::max({grid_t, rows, cols});
    ++image;
  }
  CHECK(image == image_grids.size(), "the tokens hold ", image, " image(s) but ", image_grids.size(), " grid(s) were given");
  return positions;
}

}  // namespace deltamoe
