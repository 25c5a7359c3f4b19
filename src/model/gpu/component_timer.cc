// CUDA-event component timing of a training step.
#include "model/gpu/component_timer.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/cuda_check.h"
#include "core/error.h"

namespace deltamoe {

const char* component_name(StepComponent component) {
  switch (component) {
    case StepComponent::gdn: return "GDN";
    case StepComponent::attention: return "attention";
    case StepComponent::moe: return "MoE";
    case StepComponent::lm_head_loss: return "lm_head + loss";
    case StepComponent::vision: return "vision tower";
    case StepComponent::optimizer: return "optimizer";
    case StepComponent::other: return "other";
    case StepComponent::count: break;
  }
  return "?";
}

ComponentTimer::ComponentTimer(int max_marks) : events_(static_cast<size_t>(max_marks)), labels_(events_.size()) {
  const char* trace = std::getenv("DELTAMOE_MEMORY_TRACE");
  trace_memory_ = trace != nullptr && std::strcmp(trace, "1") == 0;
  for (cudaEvent_t& event : events_) CUDA_CHECK(cudaEventCreate(&event));
}

ComponentTimer::~ComponentTimer() {
  for (cudaEvent_t event : events_) cudaEventDestroy(event);
}

void ComponentTimer::mark(StepComponent component, cudaStream_t stream) {
  if (!enabled_) return;
  // One slot stays free for finish(); too many marks is a programming error, not user input.
  CHECK(used_ + 1 < static_cast<int>(events_.size()), "component timer: more than ", events_.size() - 1,
        " marks in one step");
  trace_memory(stream);
  CUDA_CHECK(cudaEventRecord(events_[used_], stream));
  labels_[used_] = component;
  ++used_;
}

void ComponentTimer::trace_memory(cudaStream_t stream) {
  ++marks_seen_;
  if (!trace_memory_) return;
  CUDA_CHECK(cudaStreamSynchronize(stream));
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (traced_free_ != 0 && free_bytes != traced_free_) {
    const char* during = used_ > 0 ? component_name(labels_[used_ - 1]) : "between steps";
    std::fprintf(stderr, "memory trace: GPU memory in use %+lld bytes during %s (mark %lld of the run, %d of the step)\n",
                 static_cast<long long>(traced_free_) - static_cast<long long>(free_bytes), during,
                 static_cast<long long>(marks_seen_), used_);
  }
  traced_free_ = free_bytes;
}

void ComponentTimer::finish(cudaStream_t stream) {
  if (!enabled_ || used_ == 0) return;
  trace_memory(stream);
  CUDA_CHECK(cudaEventRecord(events_[used_], stream));
  CUDA_CHECK(cudaEventSynchronize(events_[used_]));
  for (int i = 0; i < used_; ++i) {
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, events_[i], events_[i + 1]));
    totals_ms_[static_cast<int>(labels_[i])] += ms;
  }
  used_ = 0;
}

}  // namespace deltamoe
