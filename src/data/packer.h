// Packing samples into micro-batches of at most a fixed token budget, without padding: samples
// are concatenated and described by cu_seqlens; positions restart at every sample. A small window
// of waiting samples lets later short samples fill the space an earlier long one leaves.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <vector>

#include "data/data_position.h"
#include "data/sft_sample.h"

namespace deltamoe {

// Legend: T tokens (<= budget), S samples, I images, N patches.
struct MicroBatch {
  std::vector<int32_t> input_ids;                 // [T]
  std::vector<int32_t> labels;                    // [T], unshifted, -100 = ignored
  std::vector<int32_t> cu_seqlens;                // [S+1], 0 .. T
  std::vector<int64_t> positions;                 // [3, T]: rows t, h, w
  std::vector<float> pixel_values;                // [N, patch_dim], images in token order
  std::vector<std::array<int64_t, 3>> image_grid_thw;  // [I]
  std::vector<int64_t> sample_indices;            // [S] dataset index of each sample
  int64_t num_supervised = 0;
  int64_t num_image_tokens = 0;
  DataPosition position_after;  // resume here to continue after this batch

  int64_t num_tokens() const { return static_cast<int64_t>(input_ids.size()); }
  int64_t num_samples() const { return static_cast<int64_t>(sample_indices.size()); }
};

class Packer {
 public:
  // token_budget: most tokens per batch; window: how many samples may wait (>= 1; 1 = in order).
  Packer(int64_t token_budget, size_t window);

  bool wants_sample() const { return waiting_.size() < window_; }
  bool empty() const { return waiting_.empty(); }
  // slot: the sample's slot in its epoch order (kept for resume). Throws if it exceeds the budget.
  void push(int64_t slot, SftSample sample);
  // One batch: the oldest waiting sample first (so none waits forever), then every waiting sample
  // that still fits, oldest first. Requires !empty().
  MicroBatch pack();
  // Slots of the waiting samples, oldest first.
  std::vector<int64_t> pending_slots() const;
  int64_t token_budget() const { return token_budget_; }

 private:
  struct Waiting {
    int64_t slot;
    SftSample sample;
  };
  int64_t token_budget_;
  size_t window_;
  std::deque<Waiting> waiting_;
};

}  // namespace deltamoe
