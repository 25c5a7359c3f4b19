// Worker threads, the in-order hand-over of their results, and the packing loop.
#include "data/data_pipeline.h"

#include <limits>
#include <system_error>

#include "data/epoch_order.h"
#include "data/sample_skip.h"
#include "data/sft_record.h"

namespace deltamoe {
namespace {

DataPosition checked_start(const DataPosition& start, int64_t num_samples, const PipelineOptions& options) {
  DataPosition position = start;
  if (position.num_samples < 0) {  // a default position: the beginning
    position.num_samples = num_samples;
    position.seed = options.seed;
    position.shuffle = options.shuffle;
  }
  CHECK(position.num_samples == num_samples, "the data position was saved for ", position.num_samples,
        " samples but the datasets hold ", num_samples, "; resume needs the same files");
  CHECK(position.seed == options.seed && position.shuffle == options.shuffle, "the data position was saved with seed ",
        position.seed, (position.shuffle ? " (shuffled)" : " (not shuffled)"), "; resume needs the same seed and shuffle");
  CHECK(position.next_slot <= num_samples, "data position next_slot ", position.next_slot, " is past the ", num_samples,
        " samples");
  return position;
}

}  // namespace

DataPipeline::DataPipeline(const PipelineOptions& options, Tokenizer tokenizer, const DataPosition& start)
    : options_(options),
      files_(options.dataset_paths, options.seed),
      builder_(std::move(tokenizer),
               [&] {
                 SampleOptions sample = options.sample;
                 if (sample.max_length == 0) sample.max_length = options.token_budget;
                 CHECK(sample.max_length <= options.token_budget, "--max_length ", sample.max_length,
                       " exceeds the micro-batch token budget ", options.token_budget);
                 return sample;
               }()),
      start_(checked_start(start, files_.size(), options)),
      packer_(options.token_budget, options.pack_window, options.max_samples_per_batch),
      skips_(options.num_skip_messages) {
  CHECK(files_.size() > 0, "the datasets hold no samples (", options.dataset_paths.size(), " file(s), all empty)");
  CHECK(options.num_epochs >= 0 && options.num_workers >= 0 && options.prefetch >= 1,
        "bad pipeline options (num_epochs, num_workers >= 0, prefetch >= 1)");
  const int64_t n = files_.size();
  first_epoch_jobs_ = static_cast<int64_t>(start_.pending_slots.size()) + (n - start_.next_slot);
  if (options.num_epochs == 0) {
    total_jobs_ = std::numeric_limits<int64_t>::max();
  } else if (start_.epoch >= options.num_epochs) {
    total_jobs_ = 0;
  } else {
    total_jobs_ = first_epoch_jobs_ + (options.num_epochs - start_.epoch - 1) * n;
  }
  epoch_ = start_.epoch;
  next_slot_ = start_.next_slot;
  epoch_end_job_ = std::min(first_epoch_jobs_, total_jobs_);
  epoch_is_whole_ = start_.next_slot == 0 && start_.pending_slots.empty();
  start_workers();
}

void DataPipeline::start_workers() {
  try {
    for (int w = 0; w < options_.num_workers; ++w) workers_.emplace_back([this] { worker_loop(); });
  } catch (const std::system_error& error) {
    // The destructor does not run for a constructor that throws: stop and join what started, or
    // the joinable threads would end the process.
    const size_t started = workers_.size();
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (std::thread& worker : workers_) worker.join();
    RAISE("cannot start ", options_.num_workers, " data loader threads (", started, " started): ", error.what(),
          "; use fewer (--dataloader_num_workers)");
  }
}

DataPipeline::~DataPipeline() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

std::shared_ptr<const std::vector<int64_t>> DataPipeline::order_of(int64_t epoch) const {
  std::lock_guard lock(order_mutex_);
  auto it = orders_.find(epoch);
  if (it != orders_.end()) return it->second;
  // Old epochs are dropped; whoever still holds one keeps it alive, and a later request rebuilds it.
  while (!orders_.empty() && orders_.begin()->first < epoch - 1) orders_.erase(orders_.begin());
  auto order = std::make_shared<const std::vector<int64_t>>(epoch_order(files_.size(), options_.seed, epoch, options_.shuffle));
  orders_.emplace(epoch, order);
  return order;
}

DataPipeline::Result DataPipeline::produce(int64_t job) const {
  Result result;
  int64_t epoch = start_.epoch;
  const auto num_pending = static_cast<int64_t>(start_.pending_slots.size());
  if (job < num_pending) {
    result.slot = start_.pending_slots[static_cast<size_t>(job)];
    result.resumed = true;
  } else if (job < first_epoch_jobs_) {
    result.slot = start_.next_slot + (job - num_pending);
  } else {
    const int64_t later = job - first_epoch_jobs_;
    epoch += 1 + later / files_.size();
    result.slot = later % files_.size();
  }
  std::string where;
  try {  // everything inside: an exception escaping a worker thread would end the process
    const int64_t sample_index = (*order_of(epoch))[static_cast<size_t>(result.slot)];
    const DatasetFiles::Location location = files_.locate(sample_index);
    where = files_.where(sample_index);
    if (const int64_t length = location.source->length(location.index); length > options_.max_line_bytes) {
      throw SampleSkip(SkipReason::kTooLong, str_cat(where, ": the line is ", length, " bytes, over the ",
                                                     options_.max_line_bytes, "-byte limit for one sample"));
    }
    const std::string line = location.source->read(location.index);
    const SftRecord record = parse_sft_record(line, ImageRoots{location.source->directory(), options_.sample.media_dir}, where);
    result.sample = builder_.build(record, sample_index, where);
  } catch (const SampleSkip& skip) {
    result.reason = skip.reason();
    result.message = skip.what();
    result.detail = skip.detail();
    result.where = where;
  } catch (const std::exception& error) {
    result.fatal = str_cat(where.empty() ? "" : where + ": ", error.what());
  }
  return result;
}

void DataPipeline::worker_loop() {
  for (;;) {
    int64_t job;
    {
      std::unique_lock lock(mutex_);
      work_cv_.wait(lock, [&] {
        return stop_ || (next_job_to_start_ < total_jobs_ &&
                         next_job_to_start_ < consumer_job_ + static_cast<int64_t>(options_.prefetch));
      });
      if (stop_) return;
      job = next_job_to_start_++;
    }
    Result result = produce(job);
    {
      std::lock_guard lock(mutex_);
      done_.emplace(job, std::move(result));
    }
    ready_cv_.notify_all();
  }
}

DataPipeline::Result DataPipeline::take(int64_t job) {
  if (workers_.empty()) return produce(job);
  std::unique_lock lock(mutex_);
  ready_cv_.wait(lock, [&] { return done_.count(job) > 0; });
  Result result = std::move(done_.at(job));
  done_.erase(job);
  consumer_job_ = job + 1;
  lock.unlock();
  work_cv_.notify_all();
  return result;
}

DataPosition DataPipeline::position_now() const {
  DataPosition position{epoch_, next_slot_, packer_.pending_slots(), files_.size(), options_.seed, options_.shuffle};
  if (next_slot_ == files_.size() && position.pending_slots.empty() && next_job_to_take_ == epoch_end_job_) {
    position.epoch = epoch_ + 1;  // the epoch is used up: the same point, said as the next epoch's start
    position.next_slot = 0;
  }
  return position;
}

std::optional<Packer::Slotted> DataPipeline::next_sample() {
  while (next_job_to_take_ < epoch_end_job_) {
    if (options_.stop_requested && options_.stop_requested()) {
      stopped_ = true;
      return std::nullopt;
    }
    Result result = take(next_job_to_take_++);
    CHECK(result.fatal.empty(), result.fatal);
    if (!result.resumed) next_slot_ = result.slot + 1;
    if (!result.sample) {
      CHECK(!options_.strict, "--strict: ", skip_reason_name(result.reason), ": ", result.message,
            " (without --strict the line would be skipped and counted)");
      skips_.add(result.reason, result.message, result.detail);
      if (options_.on_skip) options_.on_skip(result.reason, result.detail, result.where, result.message);
      continue;
    }
    if (result.sample->truncated) skips_.add_truncated();
    ++samples_this_epoch_;
    return Packer::Slotted{result.slot, std::move(*result.sample)};
  }
  return std::nullopt;
}

std::optional<MicroBatch> DataPipeline::next_batch() {
  // After a resume, the first jobs rebuild the samples that were waiting in the packer; they wait
  // again, so the packer is where it was when the position was saved.
  while (next_job_to_take_ < std::min<int64_t>(static_cast<int64_t>(start_.pending_slots.size()), epoch_end_job_)) {
    if (std::optional<Packer::Slotted> waiting = next_sample()) packer_.push_waiting(std::move(*waiting));
  }
  const Packer::Feed feed = [this] { return next_sample(); };
  for (;;) {
    if (stopped_) return std::nullopt;
    std::optional<MicroBatch> batch = packer_.pack(feed);
    if (stopped_) return std::nullopt;  // a batch flushed by the stop is not a real one
    if (batch) {
      batch->position_after = position_now();
      return batch;
    }
    if (epoch_end_job_ >= total_jobs_) return std::nullopt;
    CHECK(samples_this_epoch_ > 0 || !epoch_is_whole_, "every sample of ", options_.dataset_paths.size() == 1 ? "the dataset" : "the datasets",
          " (", files_.size(), " lines) was skipped in epoch ", epoch_, ": ", skips_.summary(),
          "; nothing to train on (see the skip messages above)");
    samples_this_epoch_ = 0;
    epoch_is_whole_ = true;
    ++epoch_;
    next_slot_ = 0;
    epoch_end_job_ = total_jobs_ - epoch_end_job_ > files_.size() ? epoch_end_job_ + files_.size() : total_jobs_;
  }
}

}  // namespace deltamoe
