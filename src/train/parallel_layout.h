// Who holds which training state when the CPU engine runs on several ranks:
// routed experts split over --expert_model_parallel_size ranks (each expert's master, gradient and
// moments only on its owner), everything else ("dense") data-parallel over all ranks with ZeRO-2
// (--use_distributed_optimizer true): the dense elements, tensor after tensor in the full layout's
// order, are cut into buckets of at most bucket_elements, and rank r owns piece r of every bucket.
// A rank's training state is therefore a list of (tensor, element range) pieces: its experts, then
// its piece of each bucket. The same object tells the engine how to reduce-scatter a bucket, where
// the reduced piece lands, and how to all-gather the updated weights; tests use it to emulate N
// ranks on one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "optim/param_layout.h"

namespace deltamoe {

struct ParallelOptions {
  int expert_parallel_size = 1;        // --expert_model_parallel_size: divides the world size
  bool distributed_optimizer = false;  // --use_distributed_optimizer: ZeRO-2 for the dense parameters
  // Most elements of one dense gradient bucket (Megatron's default is max(40M, 1M x dp) parameters).
  int64_t bucket_elements = 40'000'000;
  // GPU engine: rows this rank's experts may receive per micro-batch and layer, the exchange's
  // buffers (0: the worst case, EP x tokens x top-k; a run past it aborts the job).
  int64_t expert_recv_rows = 0;
};

// A routed-expert stack ("...mlp.experts.gate_up_proj" / "down_proj", leading dimension = experts).
bool is_routed_expert_tensor(const std::string& name);

class ParallelLayout {
 public:
  // A run of consecutive elements of one tensor: entry `full_entry` of the full layout, elements
  // [tensor_begin, tensor_begin + count) of it, at `full_offset` in a full-layout flat buffer.
  struct Segment {
    int full_entry = 0;
    int64_t tensor_begin = 0;
    int64_t count = 0;
    int64_t full_offset = 0;
  };

  // full: every trained tensor whole (trainable_layout). Checks the options against the world size
  // and the expert count (num_experts: routed experts per layer) with messages naming the flags.
  ParallelLayout(const ParamLayout& full, int rank, int world, int64_t num_experts, const ParallelOptions& options);

  int rank() const { return rank_; }
  int world() const { return world_; }
  int expert_parallel_size() const { return ep_; }
  const ParamLayout& full() const { return full_; }
  // This rank's pieces (what its TrainStateStore holds).
  const ParamLayout& state() const { return state_; }

  // Routed experts owned by this rank: [first_local_expert, first_local_expert + experts_per_rank).
  // Consecutive groups of EP ranks each split all experts (rank r owns block r mod EP); with fewer
  // EP ranks than the world, world / EP replicas of every block (expert data parallelism) hold the
  // same state and all-reduce its gradient.
  int64_t first_local_expert() const { return (rank_ % ep_) * experts_per_rank_; }
  int expert_replicas() const { return world_ / ep_; }
  // Whether this rank's expert pieces count in the job's gradient norm and checkpoint (the first
  // replica of its block).
  bool first_expert_replica() const { return rank_ < ep_; }
  int64_t experts_per_rank() const { return experts_per_rank_; }
  // First element of the state buffer after the expert pieces (which come first).
  int64_t dense_state_begin() const { return dense_state_begin_; }
  // State entries that are this rank's expert pieces and the full entries they come from.
  const std::vector<std::pair<int, int>>& expert_pieces() const { return expert_pieces_; }  // (state, full)

  // Full-layout entries of the dense tensors, in order.
  const std::vector<int>& dense_entries() const { return dense_entries_; }

  int num_buckets() const { return static_cast<int>(bucket_begin_.size()) - 1; }
  // Elements of every rank's piece of bucket b (the last rank's may hold padding past the end).
  int64_t piece_elements(int bucket) const;
  // The segments of piece `piece_rank` of bucket b, in element order.
  std::vector<Segment> piece_segments(int bucket, int piece_rank) const;
  // Bucket b of a full-layout buffer as world * piece_elements(b) values (zero past its end): the
  // reduce-scatter input.
  void pack_bucket(int bucket, const float* full, float* padded) const;
  // Where this rank's piece of bucket b lives in its state buffer: pairs (state offset, count) in
  // element order, piece_elements(b) values in all plus padding at the end.
  const std::vector<std::pair<int64_t, int64_t>>& own_piece_in_state(int bucket) const {
    return own_piece_state_[bucket];
  }

 private:
  // Dense stream: the dense entries of the full layout in order; stream offset of each.
  std::vector<Segment> stream_segments(int64_t begin, int64_t end) const;

  const ParamLayout& full_;
  int rank_, world_, ep_;
  int64_t experts_per_rank_ = 0;
  std::vector<int> dense_entries_;        // full entry index of each dense tensor, in order
  std::vector<int64_t> dense_stream_;     // stream offset of each (size + 1)
  std::vector<int64_t> bucket_begin_;     // stream offsets of bucket starts (size num_buckets + 1)
  ParamLayout state_;
  std::vector<std::pair<int, int>> expert_pieces_;
  int64_t dense_state_begin_ = 0;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> own_piece_state_;
};

}  // namespace deltamoe
