// The SFT data pipeline: worker threads read dataset lines in the epoch's (shuffled) order, load
// images, render, tokenize and label them; the caller's thread takes the results in order, counts
// skips, and packs micro-batches. Output depends only on (files, options, seed, start position),
// never on the number of threads or their timing.
#pragma once

#include <condition_variable>
#include <functional>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "data/data_position.h"
#include "data/packer.h"
#include "data/sample_builder.h"
#include "data/sample_source.h"
#include "data/skip_stats.h"

namespace deltamoe {

struct PipelineOptions {
  std::vector<std::string> dataset_paths;
  SampleOptions sample;
  int64_t token_budget = 8192;  // most tokens per micro-batch; max_length defaults to it
  size_t pack_window = 16;      // samples that did not fit and may wait for a later batch
  int64_t max_samples_per_batch = 0;  // most samples per micro-batch (0: tokens only)
  int num_workers = 2;          // 0: build samples on the caller's thread
  size_t prefetch = 32;         // samples built ahead of the packer
  bool shuffle = true;
  uint64_t seed = 42;
  int64_t num_epochs = 1;       // 0: repeat forever
  size_t num_skip_messages = 8; // skip messages kept and logged
  int64_t max_line_bytes = int64_t{128} << 20;  // longer lines are skipped (too_long) without being read
  bool strict = false;          // --strict: the first skipped line is an error instead of a counted skip
  // Called (on the caller's thread) for every skipped line: reason, detail, file:line, message.
  std::function<void(SkipReason, const std::string&, const std::string&, const std::string&)> on_skip;
  // Asked between samples; when it returns true, next_batch returns nullopt at once (the trainer's
  // SIGTERM check, so that a long pass over skipped samples does not delay a stop).
  std::function<bool()> stop_requested;
};

class DataPipeline {
 public:
  // Indexes the files and starts the workers. `start` comes from MicroBatch::position_after of
  // the last batch trained on (default: the beginning); it must match the dataset and shuffle.
  DataPipeline(const PipelineOptions& options, Tokenizer tokenizer, const DataPosition& start = {});
  ~DataPipeline();
  DataPipeline(const DataPipeline&) = delete;
  DataPipeline& operator=(const DataPipeline&) = delete;

  // The next micro-batch, or nullopt after the last epoch (or once stop_requested() said so; the
  // pipeline is then finished). Batches never span two epochs. Throws deltamoe::Error on failures
  // that are not a sample's fault (a dataset file unreadable), and when a whole epoch yields no
  // sample while more epochs are to come (every line skipped: repeating would spin forever).
  std::optional<MicroBatch> next_batch();

  int64_t num_samples() const { return files_.size(); }
  int64_t epoch() const { return epoch_; }
  const SkipStats& skip_stats() const { return skips_; }
  const DatasetFiles& files() const { return files_; }
  const PipelineOptions& options() const { return options_; }

 private:
  struct Result {
    int64_t slot = 0;
    bool resumed = false;  // a pending slot replayed after resume (does not move next_slot)
    std::optional<SftSample> sample;
    SkipReason reason = SkipReason::kCount;
    std::string message;
    std::string detail;
    std::string where;  // file:line
    std::string fatal;  // non-empty: not a sample problem; next_batch rethrows it
  };
  Result produce(int64_t job) const;
  Result take(int64_t job);
  // The next good sample of the current epoch (skips counted on the way), or nullopt at its end.
  std::optional<Packer::Slotted> next_sample();
  void start_workers();
  void worker_loop();
  std::shared_ptr<const std::vector<int64_t>> order_of(int64_t epoch) const;
  DataPosition position_now() const;

  PipelineOptions options_;
  DatasetFiles files_;
  SampleBuilder builder_;
  DataPosition start_;
  int64_t first_epoch_jobs_ = 0;  // jobs of the start epoch: pending slots + the rest of its order
  int64_t total_jobs_ = 0;        // INT64_MAX when repeating forever

  // Consumer state (caller's thread only).
  Packer packer_;
  SkipStats skips_;
  int64_t epoch_ = 0, next_slot_ = 0, next_job_to_take_ = 0, epoch_end_job_ = 0;
  int64_t samples_this_epoch_ = 0;
  bool epoch_is_whole_ = true;  // false for a resumed run's first epoch (it starts part-way)
  bool stopped_ = false;

  // Shared with the workers.
  mutable std::mutex mutex_;
  std::condition_variable work_cv_, ready_cv_;
  int64_t next_job_to_start_ = 0;
  int64_t consumer_job_ = 0;  // jobs below this have been taken
  std::map<int64_t, Result> done_;
  bool stop_ = false;
  mutable std::mutex order_mutex_;
  mutable std::map<int64_t, std::shared_ptr<const std::vector<int64_t>>> orders_;
  std::vector<std::thread> workers_;
};

}  // namespace deltamoe
