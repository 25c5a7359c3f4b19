// get_rope_index over packed samples: a walk over the tokens that consumes one grid per vision span.
#include "model/vision/mrope_positions.h"

#include <algorithm>

#include "core/error.h"

namespace deltamoe {
namespace {

const char* type_name(MmTokenType type) { return type == MmTokenType::image ? "image" : "video"; }

}  // namespace

std::vector<int64_t> compute_mrope_positions(const MmTokenType* token_types, int64_t num_tokens,
                                             const std::vector<int32_t>& cu_seqlens,
                                             const std::vector<GridThw>& image_grids,
                                             const std::vector<GridThw>& video_grids, int64_t merge_size) {
  CHECK(cu_seqlens.size() >= 2 && cu_seqlens.front() == 0 && cu_seqlens.back() == num_tokens,
        "mrope positions: cu_seqlens must run from 0 to the token count ", num_tokens);
  // Videos are positioned frame by frame: t single-frame grids each.
  std::vector<GridThw> frame_grids;
  for (const GridThw& grid : video_grids) {
    for (int64_t frame = 0; frame < grid[0]; ++frame) frame_grids.push_back({1, grid[1], grid[2]});
  }
  const std::vector<GridThw>* grids[3] = {nullptr, &image_grids, &frame_grids};
  size_t next_grid[3] = {0, 0, 0};

  std::vector<int64_t> positions(3 * num_tokens);
  int64_t* t_row = positions.data();
  int64_t* h_row = t_row + num_tokens;
  int64_t* w_row = h_row + num_tokens;
  for (size_t sample = 0; sample + 1 < cu_seqlens.size(); ++sample) {
    const int64_t end = cu_seqlens[sample + 1];
    CHECK(cu_seqlens[sample] <= end, "mrope positions: cu_seqlens decreases at sample ", sample);
    int64_t position = 0;
    for (int64_t i = cu_seqlens[sample]; i < end;) {
      const MmTokenType type = token_types[i];
      if (type == MmTokenType::text) {
        t_row[i] = h_row[i] = w_row[i] = position++;
        ++i;
        continue;
      }
      const int kind = static_cast<int>(type);
      CHECK(kind == 1 || kind == 2, "mrope positions: token ", i, " has type ", kind, " (expected 0, 1 or 2)");
      CHECK(next_grid[kind] < grids[kind]->size(), "mrope positions: ", type_name(type), " tokens at ", i,
            " but all ", grids[kind]->size(), " ", type_name(type), " grids are used; check image_grid_thw");
      const GridThw& grid = (*grids[kind])[next_grid[kind]++];
      CHECK(grid[1] % merge_size == 0 && grid[2] % merge_size == 0, "mrope positions: grid [", grid[0], ", ", grid[1],
            ", ", grid[2], "] is not divisible by the merge size ", merge_size);
      const int64_t llm_h = grid[1] / merge_size, llm_w = grid[2] / merge_size, count = grid[0] * llm_h * llm_w;
      CHECK(i + count <= end && std::all_of(token_types + i, token_types + i + count,
                                            [&](MmTokenType t) { return t == type; }),
            "mrope positions: the ", type_name(type), " at token ", i, " (grid [", grid[0], ", ", grid[1], ", ",
            grid[2], "]) needs ", count, " consecutive ", type_name(type), " tokens within its sample");
      for (int64_t k = 0; k < count; ++k) {
        const int64_t frame = k / (llm_h * llm_w), row = (k / llm_w) % llm_h, col = k % llm_w;
        t_row[i + k] = position + frame;
        h_row[i + k] = position + row;
        w_row[i + k] = position + col;
      }
      // The next token continues after the largest position used by the span.
      position += std::max({grid[0], llm_h, llm_w});
      i += count;
    }
  }
  for (int kind = 1; kind <= 2; ++kind) {
    CHECK(next_grid[kind] == grids[kind]->size(), "mrope positions: ", grids[kind]->size(), " ",
          type_name(static_cast<MmTokenType>(kind)), " grids given but only ", next_grid[kind],
          " spans of their tokens found");
  }
  return positions;
}

std::vector<int64_t> compute_mrope_positions(const int64_t* input_ids, int64_t num_tokens,
                                             const std::vector<int32_t>& cu_seqlens,
                                             const std::vector<GridThw>& image_grids,
                                             const std::vector<GridThw>& video_grids, int64_t merge_size,
                                             int64_t image_token_id, int64_t video_token_id) {
  std::vector<MmTokenType> types(num_tokens, MmTokenType::text);
  for (int64_t i = 0; i < num_tokens; ++i) {
    if (input_ids[i] == image_token_id) types[i] = MmTokenType::image;
    if (input_ids[i] == video_token_id) types[i] = MmTokenType::video;
  }
  return compute_mrope_positions(types.data(), num_tokens, cu_seqlens, image_grids, video_grids, merge_size);
}

}  // namespace deltamoe
