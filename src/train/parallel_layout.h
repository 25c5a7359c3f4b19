// Who holds which training state when the CPU engine runs on several ranks:
// routed experts split over --expert_model_parallel_size ranks (each expert's master, gradient and
// moments only on its owner), everything else ("dense") data-parallel over all ranks with ZeRO-2
// (--use_distributed_optimizer true). The dense tensors form gradient groups, one per backward phase
// (model/gradient_phases.h: a decoder layer, the loss head, a vision block, ...) when the phases are
// given, else one group; each group is cut into buckets of about bucket_elements, every bucket but
// a group's last a multiple of the world size, and rank r owns piece r of every bucket. So a
// group's buckets, padded, lie back to back: one reduce-scatter per bucket straight from the
// group's gradient memory as soon as the backward has finished the phase.
// A rank's training state is therefore a list of (tensor, element range) pieces: its experts, then
// its piece of each bucket. The same object tells the engine how to reduce-scatter a bucket, where
// the reduced piece lands, and how to all-gather the updated weights; tests use it to emulate N
// ranks on one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/gradient_phases.h"
#include "optim/param_layout.h"

namespace deltamoe {

struct ParallelOptions {
  int expert_parallel_size = 1;        // --expert_model_parallel_size: divides the world size
  bool distributed_optimizer = false;  // --use_distributed_optimizer: ZeRO-2 for the dense parameters
  // Elements of one dense gradient bucket, about (Megatron's default is max(40M, 1M x dp) parameters).
  int64_t bucket_elements = 40'000'000;
  // GPU engine, --expert_recv_headroom: the rows this rank's experts may receive per micro-batch
  // and layer, over the mean (tokens x top-k), which sizes the exchange's buffers; at most EP (the
  // worst case). 0: auto, at least kAutoExpertRecvHeadroom and as much more as the memory left
  // by the plan holds (model/text/expert_exchange_size.h). A micro-batch past it stops the job with
  // a message naming the headroom it needed.
  double expert_recv_headroom = 0;
};

// A routed-expert stack ("...mlp.experts.gate_up_proj" / "down_proj", leading dimension = experts;
// not the LoRA adapters on it, whose names start the same).
bool is_routed_expert_tensor(const std::string& name);

class ParallelLayout {
 public:
  // A run of consecutive elements of one tensor: entry `full_entry` of the full layout, elements
  // [tensor_begin, tensor_begin + count) of it, at `full_offset` in a full-layout flat buffer and at
  // `in_piece` in the piece (or bucket) it was listed for. Every tensor starts at a multiple of
  // kFlatAlignmentElements of the dense stream (gradients placed by the stream stay aligned for
  // vector loads and GEMMs), so a piece may hold zero gaps between its segments.
  struct Segment {
    int full_entry = 0;
    int64_t tensor_begin = 0;
    int64_t count = 0;
    int64_t full_offset = 0;
    int64_t in_piece = 0;
  };
  // One segment of this rank's piece of a bucket: where it is in the state buffer and in the piece.
  struct OwnSegment {
    int64_t state_offset = 0;
    int64_t count = 0;
    int64_t in_piece = 0;
  };

  // full: every trained tensor whole (trainable_layout). Checks the options against the world size
  // and the expert count (num_experts: routed experts per layer) with messages naming the flags.
  // phases: the model's backward phases (backward_gradient_phases), one gradient group each; dense
  // tensors of no phase form a last group. Null: one group of every dense tensor.
  ParallelLayout(const ParamLayout& full, int rank, int world, int64_t num_experts, const ParallelOptions& options,
                 const std::vector<GradientPhase>* phases = nullptr);

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

  // Full-layout entries of the dense tensors, in stream order (group after group).
  const std::vector<int>& dense_entries() const { return dense_entries_; }

  // Gradient groups, in backward order. A group's buckets are [group_first_bucket, group_end_bucket).
  int num_groups() const { return static_cast<int>(group_bucket_.size()) - 1; }
  int group_first_bucket(int group) const { return group_bucket_[group]; }
  int group_end_bucket(int group) const { return group_bucket_[group + 1]; }
  // The group of phase p of the constructor's list, or -1 when it holds no dense trained tensor.
  int group_of_phase(int phase) const;
  // Values of a group's padded buckets back to back (world * piece_elements of each).
  int64_t group_padded_elements(int group) const;
  // Where bucket b starts in its group's padded region.
  int64_t bucket_offset_in_group(int bucket) const;
  // Group and element offset in the group's padded region of a dense tensor (full-layout entry);
  // {-1, -1} for an expert tensor.
  std::pair<int, int64_t> group_position(int full_entry) const;

  int num_buckets() const { return static_cast<int>(bucket_begin_.size()) - 1; }
  // Elements of every rank's piece of bucket b (the last rank's may hold padding past the end).
  int64_t piece_elements(int bucket) const;
  // The segments of piece `piece_rank` of bucket b, in element order.
  std::vector<Segment> piece_segments(int bucket, int piece_rank) const;
  // Bucket b of a full-layout buffer as world * piece_elements(b) values (zero past its end): the
  // reduce-scatter input.
  void pack_bucket(int bucket, const float* full, float* padded) const;
  // Where this rank's piece of bucket b lives in its state buffer, segment by segment in element
  // order (the piece's other values are alignment gaps and padding, zero in every gradient).
  const std::vector<OwnSegment>& own_piece_in_state(int bucket) const {
    return own_piece_state_[bucket];
  }

 private:
  // The tensors' runs in stream range [begin, end), in_piece relative to begin.
  std::vector<Segment> stream_segments(int64_t begin, int64_t end) const;

  const ParamLayout& full_;
  int rank_, world_, ep_;
  int64_t experts_per_rank_ = 0;
  std::vector<int> dense_entries_;        // full entry index of each dense tensor, in order
  std::vector<int64_t> dense_stream_;     // stream offset of each (aligned), then the stream's end
  std::vector<int64_t> bucket_begin_;     // stream offsets of bucket starts (size num_buckets + 1)
  std::vector<int> group_bucket_;         // first bucket of each group (size num_groups + 1)
  std::vector<int> phase_group_;          // group of each phase, or -1
  std::vector<int> group_of_entry_;       // per full entry: its group, or -1
  std::vector<int64_t> stream_of_entry_;  // per full entry: its stream offset, or -1
  ParamLayout state_;
  std::vector<std::pair<int, int>> expert_pieces_;
  int64_t dense_state_begin_ = 0;
  std::vector<std::vector<OwnSegment>> own_piece_state_;
};

}  // namespace deltamoe
