// Reading a step's micro-batches, one step ahead of the engine (see step_batch_reader.h).
#include "train/step_batch_reader.h"

#include "train/stop_signal.h"

namespace deltamoe {

StepBatchReader::StepBatchReader(DataPipeline& pipeline, int64_t accumulation)
    : pipeline_(pipeline), accumulation_(accumulation) {}

StepBatchReader::~StepBatchReader() {
  // An error of a read nobody takes any more is not reported: the run is already ending.
  try {
    finish();
  } catch (...) {
  }
}

StepBatches StepBatchReader::read() {
  StepBatches step;
  while (static_cast<int64_t>(step.batches.size()) < accumulation_ && StopSignalGuard::stop_signal() == 0) {
    std::optional<MicroBatch> batch = pipeline_.next_batch();
    if (!batch) break;
    step.batches.push_back(std::move(*batch));
  }
  step.epoch = pipeline_.epoch();
  return step;
}

StepBatches StepBatchReader::take(bool read_ahead) {
  StepBatches step = ahead_.valid() ? ahead_.get() : read();
  if (read_ahead) ahead_ = std::async(std::launch::async, [this] { return read(); });
  return step;
}

void StepBatchReader::finish() {
  if (ahead_.valid()) ahead_.get();
}

}  // namespace deltamoe
