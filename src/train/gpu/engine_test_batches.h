// Synthetic micro-batches for the GPU engine tests (header-only): packed text samples and samples
// with images laid out as the data pipeline packs them, from a seed.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "data/packer.h"
#include "model/config.h"
#include "model/vision/mrope_positions.h"

namespace deltamoe {

// Samples of the given lengths packed into one micro-batch: random ordinary token ids (below the
// special-token block, so no image placeholders), labels = ids with ~30% masked as prompt, text
// positions (t = h = w = index in the sample).
inline MicroBatch synthetic_text_batch(const ModelConfig& config, const std::vector<int32_t>& lengths, uint32_t seed) {
  // The tiny vocabularies end with their special tokens (image placeholders among them): stay below.
  const int32_t ordinary = static_cast<int32_t>(config.text.vocab_size) - 64;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> token(0, ordinary - 1);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  MicroBatch batch;
  batch.cu_seqlens.push_back(0);
  std::vector<int64_t> position;
  for (size_t s = 0; s < lengths.size(); ++s) {
    for (int32_t i = 0; i < lengths[s]; ++i) {
      const int32_t id = token(rng);
      batch.input_ids.push_back(id);
      batch.labels.push_back(unit(rng) < 0.3f ? -100 : id);
      if (batch.labels.back() != -100) ++batch.num_supervised;
      position.push_back(i);
    }
    batch.cu_seqlens.push_back(static_cast<int32_t>(batch.input_ids.size()));
    batch.sample_indices.push_back(static_cast<int64_t>(s));
  }
  for (int row = 0; row < 3; ++row) batch.positions.insert(batch.positions.end(), position.begin(), position.end());
  return batch;
}

// Samples with images, as the data pipeline packs them: per sample a few prompt tokens, then for
// each image <|vision_start|>, t*h*w/4 <|image_pad|> tokens, <|vision_end|>; then the supervised
// answer. grids[s] lists sample s's images (none: a text-only sample); pixel values random;
// positions are the 3-D rope positions of the model's processor.
inline MicroBatch synthetic_image_batch(const ModelConfig& config, const std::vector<std::vector<GridThw>>& grids,
                                        uint32_t seed) {
  const int64_t merge = config.vision.spatial_merge_size;
  const int32_t ordinary = static_cast<int32_t>(config.text.vocab_size) - 64;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> token(0, ordinary - 1);
  std::normal_distribution<float> pixel(0.0f, 1.0f);
  MicroBatch batch;
  batch.cu_seqlens.push_back(0);
  std::vector<GridThw> all_grids;
  auto add = [&](int32_t id, bool supervised) {
    batch.input_ids.push_back(id);
    batch.labels.push_back(supervised ? id : -100);
    batch.num_supervised += supervised;
  };
  for (size_t s = 0; s < grids.size(); ++s) {
    for (int i = 0; i < 5; ++i) add(token(rng), false);
    for (const GridThw& grid : grids[s]) {
      add(static_cast<int32_t>(config.vision_start_token_id), false);
      const int64_t patches = grid[0] * grid[1] * grid[2];
      for (int64_t i = 0; i < patches / (merge * merge); ++i) add(static_cast<int32_t>(config.image_token_id), false);
      add(static_cast<int32_t>(config.vision_end_token_id), false);
      for (int64_t i = 0; i < patches * config.vision.patch_dim(); ++i) batch.pixel_values.push_back(pixel(rng));
      batch.image_grid_thw.push_back(grid);
      all_grids.push_back(grid);
      batch.num_image_tokens += patches / (merge * merge);
    }
    for (int i = 0; i < 23; ++i) add(token(rng), true);
    batch.cu_seqlens.push_back(static_cast<int32_t>(batch.input_ids.size()));
    batch.sample_indices.push_back(static_cast<int64_t>(s));
  }
  const std::vector<int64_t> ids(batch.input_ids.begin(), batch.input_ids.end());
  batch.positions = compute_mrope_positions(ids.data(), batch.num_tokens(), batch.cu_seqlens, all_grids, {}, merge,
                                            config.image_token_id, config.video_token_id);
  return batch;
}

}  // namespace deltamoe
