// The two ways `deltamoe bench` runs its steps, and what the steps after the first took:
// - timed: a synchronisation around every step, the step's wall time and its components (CUDA
//   events of the text model's timer), a line a step on rank 0;
// - back to back: the same steps again with one synchronisation before and one after, the host
//   preparing each batch while the GPU runs the previous step's optimizer (as a training loop runs
//   and as the transformers anchor is timed).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/device_alloc.h"
#include "data/packer.h"
#include "train/gpu/gpu_engine.h"
#include "train/train_engine.h"

namespace deltamoe {

// What a step may take that the steps before it had not: allocations (device, pinned), GPU memory
// (anything a library takes, module loads), cuDNN plans, cuBLASLt heuristic queries.
struct ResourceSnapshot {
  AllocationCounts allocations;
  int64_t cudnn_plans = 0;
  int64_t cublaslt_queries = 0;
  size_t free_bytes = 0;  // cudaMemGetInfo
  static ResourceSnapshot take();
};

// The steps cycle through `batches` (a step's micro-batches each): step s takes batches[s % size].
struct BenchSchedule {
  const std::vector<std::vector<MicroBatch>>* batches = nullptr;
  int64_t warmup = 0;
  int64_t steps = 0;  // measured
  const std::vector<MicroBatch>& step(int64_t s) const { return (*batches)[static_cast<size_t>(s) % batches->size()]; }
};

struct TimedSteps {
  std::vector<double> step_ms;  // the measured steps'
  double first_loss = 0, last_loss = 0;
  double measured_ms = 0, measured_tokens = 0, measured_flops = 0;  // sums over the measured steps
  StepResult last;
  ResourceSnapshot after_first;  // after step 1 (the warm-up's first)
};
// Steps 0 .. warmup + steps - 1; the component totals are reset at the first measured one. Raises on
// a non-finite loss or gradient norm. `rank` 0 prints a line a step.
TimedSteps run_timed_steps(GpuEngine& engine, const BenchSchedule& schedule, int rank);

struct BackToBackSteps {
  double ms_per_step = 0, tokens_per_s = 0;
  ResourceSnapshot before;  // after the timed steps
  // Which back-to-back step changed the GPU memory in use, and its packing, a line each (rank 0).
  std::string memory_changes;
};
// Steps warmup + steps .. warmup + 2 steps - 1 (other inputs than the timed ones' where the
// schedule has them); turns the component timer off (its events would synchronise).
BackToBackSteps run_back_to_back(GpuEngine& engine, const BenchSchedule& schedule, int rank);

// The samples and the longest sample of a step's micro-batches (what a library that sizes work by
// sequence could key on).
struct PackingShape {
  int64_t samples = 0;
  int64_t longest = 0;
};
PackingShape packing_shape(const std::vector<MicroBatch>& batches);

}  // namespace deltamoe
