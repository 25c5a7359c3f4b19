// Reading a step's micro-batches, one step ahead of the engine (see step_batch_reader.h).
#include "train/step_batch_reader.h"

#include "core/error.h"
#include "core/log.h"
#include "data/sample_skip.h"
#include "train/stop_signal.h"

namespace deltamoe {

StepBatchReader::StepBatchReader(DataPipeline& pipeline, const SampleOptions& images, int64_t global_micro_batches,
                                 StepShare share, int image_threads)
    : pipeline_(pipeline),
      images_(images),
      global_micro_batches_(global_micro_batches),
      share_(share),
      image_threads_(image_threads) {
  CHECK(share.world >= 1 && share.rank >= 0 && share.rank < share.world && global_micro_batches % share.world == 0,
        "StepBatchReader: bad share (rank ", share.rank, " of ", share.world, ", ", global_micro_batches,
        " micro-batches per step)");
  images_.measure_images_only = false;
}

StepBatchReader::~StepBatchReader() {
  // An error of a read nobody takes any more is not reported: the run is already ending.
  try {
    finish();
  } catch (...) {
  }
}

StepBatches StepBatchReader::read() {
  StepBatches step;
  while (step.num_read < global_micro_batches_ && StopSignalGuard::stop_signal() == 0) {
    std::optional<MicroBatch> batch = pipeline_.next_batch();
    if (!batch) break;
    step.position_after = batch->position_after;
    // Micro-batch g x world + rank of the global batch is this rank's; the others' are dropped
    // before their images are read.
    if (step.num_read % share_.world == share_.rank) step.batches.push_back(std::move(*batch));
    ++step.num_read;
  }
  step.epoch = pipeline_.epoch();
  // A stop while the step was read drops the step (trainer.cc): its images are not loaded, so that
  // the stop does not wait for thousands of them (a huge accumulation).
  if (StopSignalGuard::stop_signal() != 0) return step;
  std::vector<MicroBatch*> mine;
  for (MicroBatch& batch : step.batches) mine.push_back(&batch);
  const std::vector<DroppedSample> dropped = load_batch_images(mine, pipeline_.files(), images_, image_threads_);
  for (const DroppedSample& sample : dropped) {
    CHECK(!pipeline_.options().strict, "--strict: ", skip_reason_name(sample.reason), ": ", sample.message,
          " (without --strict the sample would be left out of its micro-batch)");
    log_warn("train: ", sample.message, "; the sample is left out of its micro-batch");
  }
  num_dropped_ += static_cast<int64_t>(dropped.size());
  for (const MicroBatch& batch : step.batches) {
    CHECK(!batch.sample_indices.empty(), "train: every sample of a micro-batch was left out because its images ",
          "failed to load (see the messages above); fix or remove those lines");
  }
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
