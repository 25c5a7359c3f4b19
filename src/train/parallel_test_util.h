// Fixtures of the parallel CPU-engine tests: synthetic packed micro-batches (text, or with a small
// image) for the tiny presets, and a random checkpoint with engine options.
#pragma once

#include <string>
#include <vector>

#include "checkpoint/random_init.h"
#include "core/rng.h"
#include "model/config.h"
#include "model/vision/mrope_positions.h"
#include "train/train_engine.h"

namespace deltamoe::parallel_test {

// Two packed samples; with images the first one carries a 4 x 4-patch image (4 merged tokens).
inline MicroBatch make_batch(const ModelConfig& config, uint64_t seed, bool image) {
  Rng rng(seed);
  MicroBatch batch;
  std::vector<int32_t> ids;
  std::vector<GridThw> grids;
  auto text = [&](int count) {
    for (int i = 0; i < count; ++i) ids.push_back(static_cast<int32_t>(rng.next_u64() % 4000));
  };
  text(5 + static_cast<int>(seed % 3));
  if (image) {
    ids.push_back(static_cast<int32_t>(config.vision_start_token_id));
    ids.insert(ids.end(), 4, static_cast<int32_t>(config.image_token_id));
    ids.push_back(static_cast<int32_t>(config.vision_end_token_id));
    grids.push_back({1, 4, 4});
    batch.image_grid_thw.push_back({1, 4, 4});
    batch.pixel_values.resize(static_cast<size_t>(16 * config.vision.patch_dim()));
    for (float& value : batch.pixel_values) value = static_cast<float>(rng.normal());
  }
  text(4);
  const int32_t first_end = static_cast<int32_t>(ids.size());
  text(6 + static_cast<int>(seed % 2));
  const int64_t T = static_cast<int64_t>(ids.size());
  batch.input_ids = ids;
  batch.cu_seqlens = {0, first_end, static_cast<int32_t>(T)};
  batch.labels.resize(ids.size());
  for (int64_t t = 0; t < T; ++t) {
    const bool prompt = t < 3 || (t >= first_end && t < first_end + 2);
    const bool media = ids[t] == config.image_token_id || ids[t] == config.vision_start_token_id ||
                       ids[t] == config.vision_end_token_id;
    batch.labels[t] = prompt || media ? -100 : ids[t];
  }
  for (int64_t t = 1; t < T; ++t) {
    const bool same_sample = (t < first_end) == (t - 1 < first_end);
    batch.num_supervised += same_sample && batch.labels[t] != -100;
  }
  std::vector<int64_t> ids64(ids.begin(), ids.end());
  batch.positions = compute_mrope_positions(ids64.data(), T, batch.cu_seqlens, grids, {},
                                            config.vision.spatial_merge_size, config.image_token_id,
                                            config.video_token_id);
  batch.sample_indices = {static_cast<int64_t>(2 * seed), static_cast<int64_t>(2 * seed + 1)};
  batch.num_image_tokens = image ? 4 : 0;
  return batch;
}

struct Setup {
  ModelCheckpoint checkpoint;
  EngineOptions options;
  std::vector<MicroBatch> batches;  // the global batches of all steps, micro-batch m of step s at s * M + m
};

inline Setup make_setup(const std::string& preset, bool images, bool freeze_vit, int64_t micro_batches_per_step, int steps) {
  Setup setup;
  const ModelConfig config = model_config_preset(preset);
  setup.checkpoint = random_init_checkpoint(config, 11, DType::f32);
  setup.options.freeze.freeze_vit = freeze_vit;
  setup.options.freeze.freeze_aligner = false;
  setup.options.aux_coef = 0.01;
  for (int64_t m = 0; m < micro_batches_per_step * steps; ++m) {
    setup.batches.push_back(make_batch(config, static_cast<uint64_t>(m + 1), images && m % 2 == 0));
  }
  return setup;
}

}  // namespace deltamoe::parallel_test
