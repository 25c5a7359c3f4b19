// Expert-parallel token exchange on device buffers: the device form of ExpertDispatcher
// (parallel/expert_dispatch.h) with the same plan, row orders and results, over any Communicator
// with device buffers (NcclComm, DeviceLoopbackComm). The plan costs one host sync per layer per
// micro-batch (the exchanged row counts size the transfers, design §2.6 backend 1), split in two so
// that the stream has work while the host waits: start_plan enqueues the plan over ranks, the count
// exchange and the counts' copy to the host (on a side stream); finish_plan waits for that copy
// only, through the communicator's poll loop (abort flag, deadline). Dispatch and combine only
// enqueue. All memory is taken once at construction for the capacity given.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "core/device_buffer.h"
#include "core/dtype.h"
#include "parallel/communicator.h"

namespace deltamoe {

// Made by DeviceExpertDispatcher::plan(index, ...) and valid until the next plan with that index
// (the MoE layer keeps one per decoder layer: the backward reuses the forward's); device arrays
// are the dispatcher's.
struct DeviceExpertDispatchPlan {
  int64_t num_tokens = 0;  // T of this rank
  int64_t top_k = 0;       // K
  // Send side, in (destination rank, token, slot) order: routed slot t*K+k of each row [T*K].
  const int32_t* send_slot = nullptr;
  // Row of each routed slot in the send order [T*K] (the inverse of send_slot).
  const int32_t* row_of_slot = nullptr;
  // Receive side, in (source rank, token, slot) order: global expert id of each row [recv_rows].
  const int32_t* recv_expert = nullptr;
  std::vector<int64_t> send_counts;  // [EP] rows to each rank (host)
  std::vector<int64_t> recv_counts;  // [EP] rows from each rank (host)
  int64_t recv_rows = 0;
};

struct DeviceDispatchCapacity {
  int64_t max_tokens = 0;     // T per micro-batch on this rank
  int64_t top_k = 0;          // K
  int64_t max_recv_rows = 0;  // rows this rank's experts may receive (a plan over it aborts the job)
  int64_t max_row_bytes = 0;  // width x element size of the widest rows dispatched
};

class DeviceExpertDispatcher {
 public:
  // Experts [0, num_experts) in ep.size() contiguous blocks, block r on rank r of `ep` (the count
  // must divide evenly); room for `num_plans` plans kept at once. Every call is ordered on
  // `stream`. `ep` must outlive the dispatcher.
  DeviceExpertDispatcher(Communicator& ep, int64_t num_experts, const DeviceDispatchCapacity& capacity,
                         int num_plans, cudaStream_t stream);

  int64_t experts_per_rank() const { return experts_per_rank_; }
  int64_t first_local_expert() const { return ep_.rank() * experts_per_rank_; }
  Communicator& comm() const { return ep_; }

  // Collective over `ep`: topk_idx int32 [T, K] on the device -> plan `index` (replacing the one
  // there). Exchanges the row counts together with each rank's first invalid routing (expert id
  // outside [0, E) or chosen twice by a token), so every rank refuses a bad routing with the same
  // message, naming the rank and token. start_plan + finish_plan.
  const DeviceExpertDispatchPlan& plan(int index, const int32_t* topk_idx, int64_t num_tokens);
  // The plan in two calls. start_plan only enqueues (the plan over ranks, the count exchange, the
  // counts' copy to pinned host memory on a side stream) and returns without waiting; work the
  // caller enqueues on the stream before finish_plan runs while the host waits there. finish_plan
  // (the one host sync: it waits for the counts' copy only) checks the routing, sizes the
  // transfers and enqueues the exchange of the rows' expert ids. One plan at a time is started;
  // topk_idx must hold its values until finish_plan has returned.
  void start_plan(int index, const int32_t* topk_idx, int64_t num_tokens);
  const DeviceExpertDispatchPlan& finish_plan(int index);

  // Collective: rows [T*K or T, width] of `dtype` (per_slot: one row per routed slot, else one per
  // token sent to each of its experts) -> recv [recv_rows, width] in receive order.
  void dispatch(const DeviceExpertDispatchPlan& plan, const void* rows, DType dtype, int64_t width, bool per_slot,
                void* recv);
  // Collective: recv_rows [recv_rows, width] back to their sources -> slot_rows [T*K, width], row
  // t*K+k for each routed slot.
  void combine(const DeviceExpertDispatchPlan& plan, const void* recv_rows, DType dtype, int64_t width,
               void* slot_rows);
  // Local: ids[i] = plan.recv_expert[i] - first_local_expert() for the plan's received rows (the
  // owner's expert index of each, the input of its routing plan).
  void local_expert_ids(const DeviceExpertDispatchPlan& plan, int32_t* ids);
  // Collective: the same rows back, left in send order: row i of send_rows [T*K, width] belongs to
  // routed slot plan.send_slot[i] (a combine that reads through plan.row_of_slot needs no scatter).
  void combine_in_send_order(const DeviceExpertDispatchPlan& plan, const void* recv_rows, DType dtype, int64_t width,
                             void* send_rows);

 private:
  struct PlanMemory {
    DeviceBuffer routing;      // the routing plan over destination ranks
    DeviceBuffer recv_expert;  // [max_recv_rows]
    DeviceExpertDispatchPlan plan;
  };
  // What start_plan leaves for finish_plan.
  struct StartedPlan {
    int index = -1;  // -1: none started
    const int32_t* topk_idx = nullptr;
    int64_t num_tokens = 0;
  };
  void exchange_rows(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                     const std::vector<int64_t>& recv_counts, DType dtype, int64_t width);
  void check_row_bytes(DType dtype, int64_t width) const;

  Communicator& ep_;
  int64_t num_experts_;
  int64_t experts_per_rank_;
  DeviceDispatchCapacity capacity_;
  cudaStream_t stream_;
  std::vector<PlanMemory> plans_;
  DeviceBuffer owner_;          // [T*K] destination rank of each routed slot
  DeviceBuffer counts_;         // [4 * EP] int64 (rows, first bad slot) per peer, sent then received; + bad word
  DeviceBuffer send_expert_;    // [T*K] global expert id in send order
  DeviceBuffer staging_;        // [T*K rows] send order rows (dispatch) / returned rows (combine)
  void release_handles();  // the stream, event and pinned counts (destructor, failed constructor)
  int64_t* host_counts_ = nullptr;  // pinned [4 * EP]: sent then received (rows, bad) pairs
  // The counts' device-to-host copy runs here, after counts_exchanged_, so that the host waits for
  // it alone and not for the work enqueued on stream_ after start_plan.
  cudaStream_t counts_stream_ = nullptr;
  cudaEvent_t counts_exchanged_ = nullptr;
  StartedPlan started_;

 public:
  ~DeviceExpertDispatcher();
  DeviceExpertDispatcher(const DeviceExpertDispatcher&) = delete;
  DeviceExpertDispatcher& operator=(const DeviceExpertDispatcher&) = delete;
};

}  // namespace deltamoe
