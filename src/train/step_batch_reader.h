// Reads the micro-batches of the next step on a background thread while the engine runs the
// current one, so the data pipeline's packing (above all the copy of every image's pixel values
// into one batch: ~130 MB for 16 images at 8192 tokens) overlaps the device's work instead of
// leaving the GPU idle between steps. Only one thread reads the pipeline at a time: take() joins
// the read in flight before it starts the next. Each batch carries its data position, so what a
// checkpoint records does not change with reading ahead; batches read ahead of a stop are dropped.
#pragma once

#include <cstdint>
#include <future>
#include <vector>

#include "data/data_pipeline.h"

namespace deltamoe {

struct StepBatches {
  std::vector<MicroBatch> batches;  // up to the accumulation count; fewer at the end of the data or on a stop
  int64_t epoch = 0;                // the pipeline's epoch after reading them
};

class StepBatchReader {
 public:
  StepBatchReader(DataPipeline& pipeline, int64_t accumulation);
  ~StepBatchReader();  // joins a read in flight (its batches are dropped)
  StepBatchReader(const StepBatchReader&) = delete;
  StepBatchReader& operator=(const StepBatchReader&) = delete;

  // The next step's batches (read now, or joined from the read started by the previous call);
  // with read_ahead, starts reading the step after on a background thread before returning.
  // Errors of the pipeline surface here, for the step whose batches they belong to.
  StepBatches take(bool read_ahead);
  // Joins a read in flight, e.g. before the pipeline's counters are read at the end of a run.
  void finish();

 private:
  StepBatches read();

  DataPipeline& pipeline_;
  int64_t accumulation_;
  std::future<StepBatches> ahead_;
};

}  // namespace deltamoe
