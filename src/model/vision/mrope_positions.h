// 3-D (t, h, w) position ids for multimodal rotary embedding (transformers' get_rope_index) over
// a packed batch: text tokens advance all three axes together; an image's merged tokens
// take (s + frame, s + row, s + col) from the current position s, after which s advances by
// max(t, h/m, w/m). Positions restart at 0 at every sample of cu_seqlens.
// Legend: T tokens, S samples, I images, V videos.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

namespace deltamoe {

enum class MmTokenType : uint8_t { text = 0, image = 1, video = 2 };  // HF's mm_token_type_ids

using GridThw = std::array<int64_t, 3>;  // (t, h, w) in patches, before merging

// token_types [T]; cu_seqlens int32 [S+1] (0 .. T); image_grids [I] and video_grids [V] in the
// order their tokens appear across the batch. A video is split into t single-frame grids (each
// frame is its own span, as the Qwen3.5 processor writes them). Returns positions int64 [3, T]
// (rows t, h, w). Throws when the spans and grids do not match (count, length, or a span that
// crosses a sample boundary).
std::vector<int64_t> compute_mrope_positions(const MmTokenType* token_types, int64_t num_tokens,
                                             const std::vector<int32_t>& cu_seqlens,
                                             const std::vector<GridThw>& image_grids,
                                             const std::vector<GridThw>& video_grids, int64_t merge_size);

// The same from input_ids: tokens equal to image_token_id / video_token_id are image / video tokens.
std::vector<int64_t> compute_mrope_positions(const int64_t* input_ids, int64_t num_tokens,
                                             const std::vector<int32_t>& cu_seqlens,
                                             const std::vector<GridThw>& image_grids,
                                             const std::vector<GridThw>& video_grids, int64_t merge_size,
                                             int64_t image_token_id, int64_t video_token_id);

}  // namespace deltamoe
