// ComponentTimer: CUDA events recorded at component boundaries inside a step (no host sync),
// summed per component after the step, so the breakdown covers the whole step without gaps.
// DELTAMOE_MEMORY_TRACE=1 (a diagnostic: it synchronises at every mark) also prints each change
// of the GPU's memory in use (cudaMemGetInfo) with the component interval that made it.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <vector>

namespace deltamoe {

enum class StepComponent { gdn, attention, moe, lm_head_loss, vision, optimizer, other, count };
const char* component_name(StepComponent component);
constexpr int kNumStepComponents = static_cast<int>(StepComponent::count);

class ComponentTimer {
 public:
  explicit ComponentTimer(int max_marks = 16384);
  ~ComponentTimer();
  ComponentTimer(const ComponentTimer&) = delete;
  ComponentTimer& operator=(const ComponentTimer&) = delete;

  void set_enabled(bool enabled) { enabled_ = enabled; }
  bool enabled() const { return enabled_; }
  // Time from here to the next mark (or finish) counts for `component`.
  void mark(StepComponent component, cudaStream_t stream);
  // Closes the last interval, waits for the events and adds the intervals to the totals (ms).
  void finish(cudaStream_t stream);
  const std::array<double, kNumStepComponents>& totals_ms() const { return totals_ms_; }
  void reset_totals() { totals_ms_.fill(0.0); }

 private:
  // Under DELTAMOE_MEMORY_TRACE: the memory in use is read at each mark and a change printed.
  void trace_memory(cudaStream_t stream);

  bool enabled_ = false;
  bool trace_memory_ = false;
  size_t traced_free_ = 0;
  int64_t marks_seen_ = 0;  // marks since construction, to place a change in the run
  std::vector<cudaEvent_t> events_;
  std::vector<StepComponent> labels_;
  int used_ = 0;
  std::array<double, kNumStepComponents> totals_ms_{};
};

}  // namespace deltamoe
