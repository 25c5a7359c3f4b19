// The data side of a training run: sample and pipeline settings from TrainOptions (shared with the
// trainer's loop and its validation set), and the pass over the data before step 1 that counts
// micro-batches and tokens from image headers (no decoding, all cores, with progress) and stops a
// run that would lose too much of its data.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/data_pipeline.h"
#include "data/skip_stats.h"
#include "model/config.h"
#include "tokenizer/tokenizer.h"
#include "train/batch_plan.h"
#include "train/train_options.h"

namespace deltamoe {

// The image settings `deltamoe data` uses too (preprocessor_config.json + flags), validated before
// any sample is read; the renderer, image roots and the loss of per-message switches from options.
SampleOptions sample_options(const TrainOptions& options, const ModelConfig& config, const Tokenizer& tokenizer);

// The pipeline of the training data (shuffled; epochs, or endless with --max_steps) or of the
// validation data (in order, one pass).
PipelineOptions pipeline_options(const TrainOptions& options, const SampleOptions& sample,
                                 const std::vector<std::string>& paths, bool training);

struct DataSurvey {
  int64_t num_lines = 0;            // samples in the files (after #N)
  int64_t num_samples = 0;          // kept
  int64_t num_micro_batches = 0;    // of one epoch, packed as training packs them
  int64_t longest_sample_tokens = 0;
  SkipStats skips{0, false};
};

// One epoch of `options` (its packing, order and skips) with image sizes from the files' headers:
// nothing is decoded. Runs on every core (at least options.num_workers threads) and logs progress
// every few seconds with `what` ("training data"). Every skipped line goes to skips_path as one JSON
// line ({"where", "reason", "detail", "message"}) when it is not empty and there are skips. Throws
// when a stop signal arrives meanwhile.
DataSurvey survey_data(const PipelineOptions& options, const Tokenizer& tokenizer, const std::string& what,
                       const std::string& skips_path = "");

// Throws, before step 1, when more than max_skip_ratio of the lines were skipped (every line: the
// data holds nothing to train on), naming the counts by reason and the first messages.
void check_skip_ratio(const DataSurvey& survey, double max_skip_ratio, const std::string& what);

// The token count the engine plans a micro-batch for: the budget, or in samples mode (at most m
// samples per micro-batch) m x the longest sample when that is smaller (--max_length defaults to
// the model's maximum, far above what a dataset holds).
int64_t engine_token_budget(const BatchPlan& plan, int64_t longest_sample_tokens);

}  // namespace deltamoe
