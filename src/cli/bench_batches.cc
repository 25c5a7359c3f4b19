// Synthetic micro-batches for `deltamoe bench` (bench_batches.h).
#include "cli/bench_batches.h"

#include <algorithm>
#include <sstream>

#include "core/error.h"
#include "model/vision/mrope_positions.h"

namespace deltamoe {

std::vector<std::pair<int64_t, int64_t>> parse_image_grids(const std::string& text) {
  std::vector<std::pair<int64_t, int64_t>> grids;
  if (text.empty()) return grids;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    const size_t x = item.find('x');
    CHECK(x != std::string::npos, "--images: '", item, "' is not HxW (merged tokens, e.g. 16x16)");
    const int64_t h = std::stoll(item.substr(0, x)), w = std::stoll(item.substr(x + 1));
    CHECK(h >= 1 && w >= 1 && h * w <= 16384, "--images: '", item, "' must be positive and at most 16384 tokens");
    grids.emplace_back(h, w);
  }
  return grids;
}

std::vector<int64_t> sample_lengths(int64_t tokens, int64_t seqs, bool varied, Rng& rng) {
  if (!varied) return std::vector<int64_t>(static_cast<size_t>(seqs), tokens / seqs);
  const int64_t total = (tokens / 2 + static_cast<int64_t>(rng.below(static_cast<uint64_t>(tokens / 2 + 1)))) / 8 * 8;
  const int64_t n = std::min<int64_t>(1 + static_cast<int64_t>(rng.below(static_cast<uint64_t>(seqs))), total / 16);
  std::vector<int64_t> lengths(static_cast<size_t>(n), 16);
  for (int64_t left = total - 16 * n; left > 0;) {  // the rest in random pieces to random samples
    const int64_t piece = std::min<int64_t>(left, 1 + static_cast<int64_t>(rng.below(static_cast<uint64_t>(total))));
    lengths[static_cast<size_t>(rng.below(static_cast<uint64_t>(n)))] += piece;
    left -= piece;
  }
  return lengths;
}

MicroBatch synthetic_batch(const ModelConfig& config, const std::vector<int64_t>& lengths,
                           const std::vector<std::pair<int64_t, int64_t>>& grids, double image_fraction, Rng& rng,
                           size_t* next_grid) {
  const int64_t seqs = static_cast<int64_t>(lengths.size());
  // Text ids below the vision tokens (whose places the positions and the tower read), and for a
  // model with them below 240,000, under Qwen3.5's specials; a small model's specials sit at the top
  // of its vocabulary.
  int64_t text_vocab = config.text.vocab_size;
  for (int64_t special : {config.image_token_id, config.video_token_id, config.vision_start_token_id,
                          config.vision_end_token_id})
    if (special > 0) text_vocab = std::min<int64_t>({text_vocab, special, 240000});
  const int64_t merge = config.vision.spatial_merge_size;
  MicroBatch batch;
  std::vector<GridThw> image_grids;
  batch.cu_seqlens = {0};
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t seq_len = lengths[static_cast<size_t>(s)];
    const int64_t start = static_cast<int64_t>(batch.input_ids.size());
    auto text = [&](int64_t count, bool supervised) {
      for (int64_t i = 0; i < count; ++i) {
        const int32_t id = static_cast<int32_t>(rng.below(static_cast<uint64_t>(text_vocab)));
        batch.input_ids.push_back(id);
        batch.labels.push_back(supervised ? id : -100);
      }
    };
    text(8, false);
    int64_t image_budget = static_cast<int64_t>(image_fraction * static_cast<double>(seq_len));
    while (!grids.empty()) {
      const auto [h, w] = grids[*next_grid % grids.size()];
      if (h * w + 2 > image_budget || static_cast<int64_t>(batch.input_ids.size()) - start + h * w + 2 + 8 > seq_len)
        break;
      ++*next_grid;
      image_budget -= h * w + 2;
      batch.input_ids.push_back(static_cast<int32_t>(config.vision_start_token_id));
      batch.labels.push_back(-100);
      for (int64_t i = 0; i < h * w; ++i) {
        batch.input_ids.push_back(static_cast<int32_t>(config.image_token_id));
        batch.labels.push_back(-100);
      }
      batch.input_ids.push_back(static_cast<int32_t>(config.vision_end_token_id));
      batch.labels.push_back(-100);
      image_grids.push_back({1, h * merge, w * merge});
      batch.image_grid_thw.push_back({1, h * merge, w * merge});
    }
    text(start + seq_len - static_cast<int64_t>(batch.input_ids.size()), true);
    batch.cu_seqlens.push_back(static_cast<int32_t>(batch.input_ids.size()));
    batch.sample_indices.push_back(s);
  }
  for (int32_t label : batch.labels) batch.num_supervised += label != -100;
  const int64_t T = batch.num_tokens();
  const std::vector<int64_t> ids(batch.input_ids.begin(), batch.input_ids.end());
  batch.positions = compute_mrope_positions(ids.data(), T, batch.cu_seqlens, image_grids, {}, merge,
                                            config.image_token_id, config.video_token_id);
  const int64_t patches = batch.num_patches();
  batch.pixel_values.resize(static_cast<size_t>(patches * config.vision.patch_dim()));
  for (float& value : batch.pixel_values) value = static_cast<float>(rng.normal());
  batch.num_image_tokens = patches / (merge * merge);
  return batch;
}

std::vector<std::vector<MicroBatch>> make_bench_batches(const ModelConfig& config, const BenchBatchSpec& spec,
                                                        Rng& rng) {
  size_t next_grid = 0;
  std::vector<std::vector<MicroBatch>> steps;
  int64_t images = 0;
  for (int64_t k = 0; k < spec.distinct_steps; ++k) {
    std::vector<MicroBatch> batches;
    for (int64_t m = 0; m < spec.micro_batches; ++m) {
      batches.push_back(synthetic_batch(config, sample_lengths(spec.tokens, spec.seqs, spec.varied, rng), spec.grids,
                                        spec.grids.empty() ? 0.0 : spec.image_fraction, rng, &next_grid));
      images += static_cast<int64_t>(batches.back().image_grid_thw.size());
    }
    steps.push_back(std::move(batches));
  }
  // A sample takes images, in the grids' order, while the next one fits its share of the tokens;
  // one that does not ends the sample's images.
  if (!spec.grids.empty() && images == 0) {
    const auto& [h, w] = spec.grids[next_grid % spec.grids.size()];
    RAISE("bench: --images asks for images but none fits a sample: the next image, ", h, "x", w,
          " merged tokens + 2, is more than --image_fraction ", spec.image_fraction, " of a sample's tokens (",
          spec.tokens, " over ", spec.seqs,
          " samples); use fewer --seqs, a larger --image_fraction or smaller --images");
  }
  return steps;
}

}  // namespace deltamoe
