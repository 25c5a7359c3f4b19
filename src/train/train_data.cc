// Sample and pipeline settings of a run, and the survey pass before step 1 (see train_data.h).
#include "train/train_data.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/error.h"
#include "core/log.h"
#include "data/image_processor_config.h"
#include "train/stop_signal.h"
#include "train/train_metrics.h"

namespace deltamoe {

SampleOptions sample_options(const TrainOptions& options, const ModelConfig& config, const Tokenizer& tokenizer) {
  SampleOptions sample;
  sample.max_length = options.max_length;
  sample.truncate = options.truncate;
  sample.allow_images = config.has_vision;
  sample.image_limits.max_decoded_pixels = options.max_decoded_pixels;
  sample.chat_format = options.chat_format;
  sample.chat_options.think_on_every_turn = options.add_non_thinking_prefix;
  sample.media_dir = options.media_dir;
  if (config.has_vision) {
    const VisionGeometry vision{config.vision.patch_size, config.vision.temporal_patch_size,
                                config.vision.spatial_merge_size, config.image_token_id};
    sample.image_config =
        load_image_processor_config(options.model_dir, vision, tokenizer, {options.min_pixels, options.max_pixels});
  }
  return sample;
}

PipelineOptions pipeline_options(const TrainOptions& options, const SampleOptions& sample,
                                 const std::vector<std::string>& paths, bool training) {
  PipelineOptions pipeline;
  pipeline.dataset_paths = paths;
  pipeline.sample = sample;
  // A stop request must not wait for a long pass over skipped samples.
  pipeline.stop_requested = [] { return StopSignalGuard::stop_signal() != 0; };
  const BatchPlan plan = plan_batches(options);
  pipeline.token_budget = plan.token_budget;
  pipeline.max_samples_per_batch = plan.micro_batch_samples;
  pipeline.num_workers = options.num_workers;
  pipeline.seed = options.seed;
  pipeline.shuffle = training;
  pipeline.strict = options.strict;
  // With --max_steps the data repeats until the steps are done; otherwise it ends after the epochs.
  pipeline.num_epochs = training && options.max_steps > 0 ? 0 : (training ? options.num_train_epochs : 1);
  return pipeline;
}

DataSurvey survey_data(const PipelineOptions& options, const Tokenizer& tokenizer, const std::string& what,
                       const std::string& skips_path) {
  using Clock = std::chrono::steady_clock;
  PipelineOptions one_epoch = options;
  // Every skip, not only the first few the log shows.
  std::ofstream skips_file;
  int64_t num_written = 0;
  if (!skips_path.empty()) {
    one_epoch.on_skip = [&](SkipReason reason, const std::string& detail, const std::string& where,
                            const std::string& message) {
      if (!skips_file.is_open()) skips_file.open(skips_path, std::ios::trunc);
      nlohmann::ordered_json line;
      line["where"] = where;
      line["reason"] = skip_reason_name(reason);
      if (!detail.empty()) line["detail"] = detail;
      line["message"] = message;
      skips_file << line.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) << "\n";
      ++num_written;
    };
  }
  one_epoch.num_epochs = 1;
  one_epoch.sample.measure_images_only = true;
  const int cores = static_cast<int>(std::min(64u, std::max(1u, std::thread::hardware_concurrency())));
  one_epoch.num_workers = std::max(options.num_workers, cores);
  one_epoch.prefetch = std::max<size_t>(options.prefetch, 4 * static_cast<size_t>(one_epoch.num_workers));
  DataPipeline pipeline(one_epoch, tokenizer);
  DataSurvey survey;
  survey.num_lines = pipeline.num_samples();
  const Clock::time_point start = Clock::now();
  Clock::time_point last_report = start;
  const auto report = [&](bool last) {
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    const int64_t read = survey.num_samples + pipeline.skip_stats().total();
    const double rate = seconds > 0 ? static_cast<double>(read) / seconds : 0.0;
    const double eta = rate > 0 ? static_cast<double>(survey.num_lines - read) / rate : 0.0;
    log_info(what, ": ", read, "/", survey.num_lines, " lines read before step 1 (", static_cast<int64_t>(rate),
             " lines/s, ", pipeline.skip_stats().total(), " skipped)",
             last ? str_cat(" in ", format_duration(seconds)) : str_cat(", ETA ", format_duration(eta)));
  };
  while (std::optional<MicroBatch> batch = pipeline.next_batch()) {
    ++survey.num_micro_batches;
    survey.num_samples += batch->num_samples();
    for (size_t i = 0; i + 1 < batch->cu_seqlens.size(); ++i) {
      survey.longest_sample_tokens = std::max<int64_t>(survey.longest_sample_tokens, batch->cu_seqlens[i + 1] - batch->cu_seqlens[i]);
    }
    if (Clock::now() - last_report > std::chrono::seconds(5)) {
      report(false);
      last_report = Clock::now();
    }
  }
  CHECK(StopSignalGuard::stop_signal() == 0, "stopped by signal ", StopSignalGuard::stop_signal(),
        " while reading the ", what, " before the first step; nothing was trained");
  if (std::chrono::duration<double>(Clock::now() - start).count() > 5) report(true);
  survey.skips = pipeline.skip_stats();
  if (num_written > 0) {
    skips_file.close();
    CHECK(skips_file.good(), "writing ", skips_path, " failed");
    log_info(what, ": every skipped line (", num_written, ") with its reason: ", skips_path);
  } else if (!skips_path.empty()) {
    std::filesystem::remove(skips_path);  // a file from an earlier run into this folder would mislead
  }
  return survey;
}

void check_skip_ratio(const DataSurvey& survey, double max_skip_ratio, const std::string& what) {
  const int64_t skipped = survey.skips.total();
  if (skipped == 0) return;
  std::string first;
  for (const std::string& message : survey.skips.first_messages()) first += "\n  " + message;
  CHECK(survey.num_samples > 0, "every sample of the ", what, " (", survey.num_lines, " lines) was skipped in epoch 0: ",
        survey.skips.summary(), "; nothing to train on", first.empty() ? " (see the skip messages above)" : first);
  const double ratio = static_cast<double>(skipped) / static_cast<double>(std::max<int64_t>(1, survey.num_lines));
  CHECK(ratio <= max_skip_ratio, "--max_skip_ratio: ", skipped, " of the ", survey.num_lines, " lines of the ", what,
        " (", 100.0 * ratio, "%) would be skipped, over the limit of ", 100.0 * max_skip_ratio, "%: ",
        survey.skips.summary(), first, "\nfix the data (`deltamoe data` lists the skips), or raise --max_skip_ratio");
  log_warn(what, ": ", survey.skips.summary(), " of ", survey.num_lines, " lines (", 100.0 * ratio,
           "%, within --max_skip_ratio ", 100.0 * max_skip_ratio, "%)");
}

int64_t engine_token_budget(const BatchPlan& plan, int64_t longest_sample_tokens) {
  if (plan.micro_batch_samples <= 0 || longest_sample_tokens <= 0) return plan.token_budget;
  return std::min(plan.token_budget, plan.micro_batch_samples * longest_sample_tokens);
}

}  // namespace deltamoe
