// Loading the images of packed micro-batches after the packing (see batch_images.h).
#include "data/batch_images.h"

#include <algorithm>
#include <exception>
#include <thread>

#include "core/error.h"
#include "data/sample_image.h"
#include "data/sft_record.h"

namespace deltamoe {
namespace {

// One sample of one batch whose images are to be loaded.
struct Job {
  MicroBatch* batch = nullptr;
  size_t sample = 0;      // in the batch
  size_t first_grid = 0;  // its first image among the batch's grids
  std::vector<ImagePatches> images;
  bool dropped = false;
  DroppedSample why;
  std::exception_ptr error;  // not the sample's fault: rethrown
};

void run_job(Job& job, const DatasetFiles& files, const SampleOptions& options) {
  const MicroBatch& batch = *job.batch;
  const int64_t index = batch.sample_indices[job.sample];
  const size_t count = static_cast<size_t>(batch.sample_num_images[job.sample]);
  const std::string where = files.where(index);
  try {
    const DatasetFiles::Location location = files.locate(index);
    const SftRecord record =
        parse_sft_record(location.source->read(location.index), ImageRoots{location.source->directory(), options.media_dir}, where);
    CHECK(record.images.size() >= count, where, ": the line names ", record.images.size(), " image(s) but its packed ",
          "sample holds ", count, "; the dataset changed while the run read it");
    for (size_t i = 0; i < count; ++i) {
      ImagePatches image = load_sample_image(record.images[i], options.image_config, options.image_limits, where);
      const std::array<int64_t, 3>& measured = batch.image_grid_thw[job.first_grid + i];
      if (image.grid_thw != measured) {
        throw SampleSkip(SkipReason::kBadImage,
                         str_cat(where, ": image ", i + 1, " decodes to a ", image.grid_thw[1], "x", image.grid_thw[2],
                                 " patch grid but its header promised ", measured[1], "x", measured[2]));
      }
      job.images.push_back(std::move(image));
    }
  } catch (const SampleSkip& skip) {
    job.dropped = true;
    job.why = {index, skip.reason(), skip.what()};
    job.images.clear();
  } catch (...) {
    job.error = std::current_exception();
  }
}

// Removes sample s of batch (whose images start at grid first_grid).
void drop_sample(MicroBatch& batch, size_t s, size_t first_grid, int64_t merge_size) {
  const size_t begin = static_cast<size_t>(batch.cu_seqlens[s]), end = static_cast<size_t>(batch.cu_seqlens[s + 1]);
  const size_t length = end - begin, total = batch.input_ids.size();
  batch.num_supervised -= std::count_if(batch.labels.begin() + static_cast<ptrdiff_t>(begin),
                                        batch.labels.begin() + static_cast<ptrdiff_t>(end),
                                        [](int32_t label) { return label != kIgnoreLabel; });
  batch.input_ids.erase(batch.input_ids.begin() + static_cast<ptrdiff_t>(begin),
                        batch.input_ids.begin() + static_cast<ptrdiff_t>(end));
  batch.labels.erase(batch.labels.begin() + static_cast<ptrdiff_t>(begin), batch.labels.begin() + static_cast<ptrdiff_t>(end));
  std::vector<int64_t> positions;
  positions.reserve(3 * (total - length));
  for (size_t row = 0; row < 3; ++row) {
    for (size_t t = 0; t < total; ++t) {
      if (t < begin || t >= end) positions.push_back(batch.positions[row * total + t]);
    }
  }
  batch.positions = std::move(positions);
  batch.cu_seqlens.erase(batch.cu_seqlens.begin() + static_cast<ptrdiff_t>(s) + 1);
  for (size_t i = s + 1; i < batch.cu_seqlens.size(); ++i) batch.cu_seqlens[i] -= static_cast<int32_t>(length);
  const size_t count = static_cast<size_t>(batch.sample_num_images[s]);
  for (size_t i = first_grid; i < first_grid + count; ++i) {
    const auto& [t, h, w] = batch.image_grid_thw[i];
    batch.num_image_tokens -= t * h * w / (merge_size * merge_size);
  }
  batch.image_grid_thw.erase(batch.image_grid_thw.begin() + static_cast<ptrdiff_t>(first_grid),
                             batch.image_grid_thw.begin() + static_cast<ptrdiff_t>(first_grid + count));
  batch.sample_indices.erase(batch.sample_indices.begin() + static_cast<ptrdiff_t>(s));
  batch.sample_num_images.erase(batch.sample_num_images.begin() + static_cast<ptrdiff_t>(s));
}

}  // namespace

std::vector<DroppedSample> load_batch_images(const std::vector<MicroBatch*>& batches, const DatasetFiles& files,
                                             const SampleOptions& options, int threads) {
  std::vector<Job> jobs;
  for (MicroBatch* batch : batches) {
    CHECK(batch->sample_num_images.size() == batch->sample_indices.size() && batch->pixel_values.empty(),
          "load_batch_images: the batch was not packed from measured samples");
    size_t grid = 0;
    for (size_t s = 0; s < batch->sample_indices.size(); ++s) {
      if (batch->sample_num_images[s] > 0) jobs.push_back(Job{batch, s, grid, {}, false, {}, nullptr});
      grid += static_cast<size_t>(batch->sample_num_images[s]);
    }
  }
  // Jobs are independent; each thread takes every n-th one.
  const size_t num_threads = std::min(jobs.size(), static_cast<size_t>(std::max(1, threads)));
  if (num_threads <= 1) {
    for (Job& job : jobs) run_job(job, files, options);
  } else {
    std::vector<std::thread> workers;
    for (size_t w = 0; w < num_threads; ++w) {
      workers.emplace_back([&, w] {
        for (size_t j = w; j < jobs.size(); j += num_threads) run_job(jobs[j], files, options);
      });
    }
    for (std::thread& worker : workers) worker.join();
  }
  for (const Job& job : jobs) {
    if (job.error) std::rethrow_exception(job.error);
  }

  std::vector<DroppedSample> dropped;
  const int64_t merge = std::max<int64_t>(1, options.image_config.merge_size);
  // Pixels in token order, batch by batch; then the dropped samples go, last first so that the
  // earlier ones' token and grid offsets stay valid.
  for (MicroBatch* batch : batches) {
    size_t values = 0;
    for (const Job& job : jobs) {
      if (job.batch != batch) continue;
      for (const ImagePatches& image : job.images) values += image.pixel_values.size();
    }
    batch->pixel_values.reserve(values);
    for (Job& job : jobs) {
      if (job.batch != batch) continue;
      for (ImagePatches& image : job.images) {
        batch->pixel_values.insert(batch->pixel_values.end(), image.pixel_values.begin(), image.pixel_values.end());
        image.pixel_values = {};
      }
    }
  }
  for (auto job = jobs.rbegin(); job != jobs.rend(); ++job) {
    if (!job->dropped) continue;
    drop_sample(*job->batch, job->sample, job->first_grid, merge);
    dropped.push_back(job->why);
  }
  std::reverse(dropped.begin(), dropped.end());
  return dropped;
}

}  // namespace deltamoe
