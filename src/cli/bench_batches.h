// The synthetic packed micro-batches `deltamoe bench` trains on: random token ids at the model's
// widths, samples of equal or random lengths, images of given merged-token grids placed in each
// sample's first part (its text after the first image supervised, as an answer would be).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/rng.h"
#include "data/packer.h"
#include "model/config.h"

namespace deltamoe {

// "16x16,20x24" -> merged-token grids (h, w) of the images each sample carries in turn; "" -> none.
std::vector<std::pair<int64_t, int64_t>> parse_image_grids(const std::string& text);

// Sample lengths of a micro-batch: `seqs` equal ones filling `tokens`; or, varied, between 1 and
// `seqs` samples of random lengths (at least 16 tokens each) filling between half of `tokens` and
// all of it, a multiple of 8 (a new packing and token count every step).
std::vector<int64_t> sample_lengths(int64_t tokens, int64_t seqs, bool varied, Rng& rng);

// One synthetic micro-batch: one sample per entry of `lengths` (tokens). Each sample is text, then
// as many images as fit in image_fraction of it (the grids taken in turn from *next_grid on), each
// between <|vision_start|> and <|vision_end|>, then supervised text.
MicroBatch synthetic_batch(const ModelConfig& config, const std::vector<int64_t>& lengths,
                           const std::vector<std::pair<int64_t, int64_t>>& grids, double image_fraction, Rng& rng,
                           size_t* next_grid);

// What a bench run trains on: the steps' micro-batches, in the order the steps take them.
struct BenchBatchSpec {
  int64_t tokens = 0;          // per micro-batch (equal lengths) or its most (varied)
  int64_t seqs = 0;            // samples per micro-batch (varied: the most)
  int64_t micro_batches = 1;   // per step
  bool varied = false;         // a packing of its own for every step
  int64_t distinct_steps = 2;  // steps' worth of batches made (the steps cycle through them)
  std::vector<std::pair<int64_t, int64_t>> grids;
  double image_fraction = 0;
};
// Raises when images were asked for and none fits a sample (a text step would be timed under a
// VLM label).
std::vector<std::vector<MicroBatch>> make_bench_batches(const ModelConfig& config, const BenchBatchSpec& spec,
                                                        Rng& rng);

}  // namespace deltamoe
