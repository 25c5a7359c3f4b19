// How many rows one rank's routed experts may receive per micro-batch and layer under expert
// parallelism, and the device memory that capacity costs (GpuExpertParallel's buffers and the shared
// expert's output held across the exchange). Host arithmetic: the GPU text model allocates by it and
// the CPU planners (`deltamoe plan`, the engine's fit check) count by it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "model/config.h"

namespace deltamoe {

// --expert_recv_headroom auto starts here: 25% over the mean covers a trained router's imbalance
// between the ranks of a micro-batch; the memory the plan leaves then raises it (up to the worst case).
constexpr double kAutoExpertRecvHeadroom = 1.25;

// Rows a rank receives on average: every rank routes max_tokens x top-k slots, spread over the group.
int64_t expert_recv_mean_rows(const TextConfig& config, int64_t max_tokens);
// The most a rank can receive: every rank's every slot routed to its experts.
int64_t expert_recv_worst_rows(const TextConfig& config, int ep_size, int64_t max_tokens);
// The capacity of a headroom over the mean (0: kAutoExpertRecvHeadroom), rounded up, at most the
// worst case.
int64_t expert_recv_rows_for(const TextConfig& config, int ep_size, int64_t max_tokens, double headroom);
// max_recv_rows > 0 as given (at most the worst case), 0 for the worst case.
int64_t expert_recv_capacity(const TextConfig& config, int ep_size, int64_t max_tokens, int64_t max_recv_rows);

// Device bytes of the exchange for that capacity: the dispatcher's plans and staging, the received
// row buffers, the local experts' workspace, and the shared expert's pending output.
size_t expert_exchange_bytes(const TextConfig& config, int ep_size, int64_t max_tokens, int64_t max_recv_rows);

// The largest capacity (rows) whose exchange fits in `budget_bytes`, between `min_rows` and the
// worst case; min_rows when even that does not fit (the caller's fit check then refuses).
int64_t expert_recv_rows_within(const TextConfig& config, int ep_size, int64_t max_tokens, int64_t min_rows,
                                size_t budget_bytes);

}  // namespace deltamoe
