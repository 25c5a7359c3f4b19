// Packing samples into micro-batches of at most a fixed token budget (and optionally a number of
// samples), without padding: samples are concatenated and described by cu_seqlens; positions
// restart at every sample. A small window of waiting samples lets later short samples fill the
// space an earlier long one leaves.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
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
  std::vector<int32_t> sample_num_images;         // [S] images of each sample (their grids in order)
  int64_t num_supervised = 0;
  int64_t num_image_tokens = 0;
  DataPosition position_after;  // resume here to continue after this batch

  int64_t num_tokens() const { return static_cast<int64_t>(input_ids.size()); }
  int64_t num_samples() const { return static_cast<int64_t>(sample_indices.size()); }
  int64_t num_patches() const;  // N = sum over images of t*h*w
};

class Packer {
 public:
  // A sample with its slot in the epoch order (kept for resume).
  struct Slotted {
    int64_t slot;
    SftSample sample;
  };
  // Gives the next sample of the stream, or nullopt at its end.
  using Feed = std::function<std::optional<Slotted>()>;

  // token_budget: most tokens per batch; window: how many samples that did not fit may wait for a
  // later batch (>= 1; 1 = plain in-order packing); max_samples: most samples per batch (0: no
  // limit; the sample-counted --micro_batch_size).
  Packer(int64_t token_budget, size_t window, int64_t max_samples = 0);

  // One batch: waiting samples that fit, oldest first (the oldest always fits, so none waits
  // forever); then samples from feed, each taken if it fits or else set waiting, until the window
  // is full, the batch holds max_samples samples, or the feed ends. nullopt when nothing is waiting and the feed is empty.
  // Throws if a sample exceeds the budget.
  std::optional<MicroBatch> pack(const Feed& feed);

  // Puts a sample back in the waiting list (resume: the pending slots of a DataPosition, in order).
  void push_waiting(Slotted sample);
  bool empty() const { return waiting_.empty(); }
  // Slots of the waiting samples, oldest first.
  std::vector<int64_t> pending_slots() const;
  int64_t token_budget() const { return token_budget_; }
  int64_t max_samples() const { return max_samples_; }

 private:
  void check_sample(const SftSample& sample) const;

  bool is_full(size_t num_taken) const {
    return max_samples_ > 0 && static_cast<int64_t>(num_taken) >= max_samples_;
  }

  int64_t token_budget_;
  size_t window_;
  int64_t max_samples_;
  std::deque<Slotted> waiting_;
};

}  // namespace deltamoe
