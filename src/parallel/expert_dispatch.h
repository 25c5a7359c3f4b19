// Expert-parallel token exchange on host buffers (one row per (token, expert), exact counts, no de-duplication):
// the routed experts of a layer are split over the ranks of an `ep` communicator in contiguous
// blocks, every (token, slot) row goes to the owner of its expert, and results come back one row
// per (token, slot) so that the source combines them in slot order exactly as one rank would.
// Used by the CPU reference engine; a device backend keeps the same plan and row orders.
#pragma once

#include <cstdint>
#include <vector>

#include "parallel/communicator.h"

namespace deltamoe {

// Built once per layer per micro-batch and reused by the combine, the backward and its combine.
// Row orders are fixed so that an expert sees its rows in (source rank, token, slot) order, the
// order in which one rank running the sources' micro-batches one after the other would see them.
struct ExpertDispatchPlan {
  int64_t num_tokens = 0;  // T of this rank
  int64_t top_k = 0;       // K
  // Send side, in (destination rank, token, slot) order: the routed slot (token * K + slot) of each row.
  std::vector<int64_t> send_slot;
  std::vector<int64_t> send_counts;  // [EP] rows to each rank
  // Receive side, in (source rank, token, slot) order: the global expert id of each received row.
  std::vector<int32_t> recv_expert;
  std::vector<int64_t> recv_counts;  // [EP] rows from each rank
  int64_t recv_rows() const { return static_cast<int64_t>(recv_expert.size()); }
};

class ExpertDispatcher {
 public:
  // Experts [0, num_experts) in ep.size() contiguous blocks; rank r of `ep` owns block r. The
  // expert count must divide evenly (checked). `ep` must outlive the dispatcher.
  ExpertDispatcher(Communicator& ep, int64_t num_experts);

  int ep_size() const { return ep_.size(); }
  int ep_rank() const { return ep_.rank(); }
  int64_t num_experts() const { return num_experts_; }
  int64_t experts_per_rank() const { return experts_per_rank_; }
  int64_t first_local_expert() const { return ep_.rank() * experts_per_rank_; }
  int owner(int64_t expert) const { return static_cast<int>(expert / experts_per_rank_); }
  Communicator& comm() const { return ep_; }

  // Collective over `ep` (every rank calls it, possibly with 0 tokens): exchanges the row counts and
  // the expert id of every row. topk_idx [T, K]; an id outside [0, E) or an expert chosen twice by
  // one token is refused with a message naming the token (before anything is sent).
  ExpertDispatchPlan plan(const int32_t* topk_idx, int64_t num_tokens, int64_t top_k) const;

  // Copy direction (collective): the row of routed slot (t, k) is rows + (t * K + k) * width when
  // per_slot, else rows + t * width (one token row sent to each of its experts). recv
  // [plan.recv_rows(), width] is written in receive order.
  void dispatch(const ExpertDispatchPlan& plan, const float* rows, int64_t width, bool per_slot, float* recv) const;

  // Return direction (collective): recv_rows [plan.recv_rows(), width] in receive order go back to
  // their sources; slot_rows [T * K, width] receives row t * K + k for every routed slot.
  void combine(const ExpertDispatchPlan& plan, const float* recv_rows, int64_t width, float* slot_rows) const;

 private:
  Communicator& ep_;
  int64_t num_experts_;
  int64_t experts_per_rank_;
};

}  // namespace deltamoe
