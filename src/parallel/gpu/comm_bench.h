// The communication benchmark of the multi-GPU bring-up (design §4.5 item 2), over any device
// communicator: the expert exchange (DeviceExpertDispatcher: plan, dispatch, combine) at the
// training shape (8,192 tokens x 2,048 x top-8 of 256 experts per GPU, uniform routing) beside
// ncclAlltoAll of the same bytes, and the ZeRO reduce-scatter (fp32) / all-gather (bf16) of the
// dense parameters. Times are medians over iterations, the slowest rank's; bandwidths are the bytes
// each rank sends over that time (algbw) and NCCL's bus bandwidth, algbw x (n - 1) / n.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "parallel/communicator.h"

namespace deltamoe {

struct CommBenchOptions {
  int64_t tokens = 8192;   // per rank
  int64_t hidden = 2048;   // row width (bf16)
  int64_t top_k = 8;
  int64_t experts = 256;   // split over the ranks
  int64_t dense_params = 2'900'000'000;  // reduce-scatter / all-gather size; 0 skips them
  int iterations = 10;
  uint64_t seed = 1;
};

struct CommBenchRow {
  std::string what;
  double bytes_per_rank = 0;  // sent by each rank (0: no data, e.g. the plan)
  double ms = 0;              // median, slowest rank
  double algbw_gbs = 0;
  double busbw_gbs = 0;
};

// Collective over `comm` (device buffers); returns the same rows on every rank.
std::vector<CommBenchRow> run_comm_bench(Communicator& comm, int device, const CommBenchOptions& options);

// The rows as a Markdown table.
std::string format_comm_bench(const std::vector<CommBenchRow>& rows, int ranks);

}  // namespace deltamoe
