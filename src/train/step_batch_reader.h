// Reads the micro-batches of the next step on a background thread while the engine runs the
// current one, so the data pipeline's work (above all decoding and preprocessing every image, and
// copying its pixel values into the batch: ~130 MB for 16 images at 8192 tokens) overlaps the
// device's work instead of leaving the GPU idle between steps. Only one thread reads the pipeline
// at a time: take() joins the read in flight before it starts the next. Each batch carries its
// data position, so what a checkpoint records does not change with reading ahead; batches read
// ahead of a stop are dropped.
//
// Data parallel: the pipeline packs measured samples (token ids and image grids from headers, no
// pixels), so every rank packs the whole global batch alike, keeps micro-batches g x world + rank
// and loads the images of those alone (data/batch_images.h). N ranks thereby see the samples, in
// the order, of one rank running all the micro-batches; one rank reads the same way.
#pragma once

#include <cstdint>
#include <future>
#include <vector>

#include "data/batch_images.h"
#include "data/data_pipeline.h"

namespace deltamoe {

struct StepBatches {
  std::vector<MicroBatch> batches;  // this rank's micro-batches of the step, with their pixels
                                    // (without them when a stop signal came: the step is dropped)
  int64_t num_read = 0;             // micro-batches of the global batch read (all ranks'); fewer than
                                    // world x accumulation at the end of the data or on a stop
  DataPosition position_after;      // after the last micro-batch read (valid when num_read > 0)
  int64_t epoch = 0;                // the pipeline's epoch after reading them
};

struct StepShare {
  int rank = 0;
  int world = 1;
};

class StepBatchReader {
 public:
  // pipeline: packs measured samples (PipelineOptions::sample.measure_images_only); images: the
  // sample options the images are loaded with (measure_images_only off); global_micro_batches:
  // micro-batches per step over all ranks. image_threads: threads loading a step's images.
  StepBatchReader(DataPipeline& pipeline, const SampleOptions& images, int64_t global_micro_batches, StepShare share,
                  int image_threads);
  ~StepBatchReader();  // joins a read in flight (its batches are dropped)
  StepBatchReader(const StepBatchReader&) = delete;
  StepBatchReader& operator=(const StepBatchReader&) = delete;

  // The next step's batches (read now, or joined from the read started by the previous call);
  // with read_ahead, starts reading the step after on a background thread before returning.
  // Errors of the pipeline surface here, for the step whose batches they belong to.
  StepBatches take(bool read_ahead);
  // Joins a read in flight, e.g. before the pipeline's counters are read at the end of a run.
  void finish();
  // Samples dropped so far because an image of theirs failed when it was loaded.
  int64_t num_dropped() const { return num_dropped_; }

 private:
  StepBatches read();

  DataPipeline& pipeline_;
  SampleOptions images_;
  int64_t global_micro_batches_;
  StepShare share_;
  int image_threads_;
  int64_t num_dropped_ = 0;  // written by the reading thread only, read after take() / finish()
  std::future<StepBatches> ahead_;
};

}  // namespace deltamoe
