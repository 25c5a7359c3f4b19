// First-fit packing over a window of waiting samples.
#include "data/packer.h"

#include <algorithm>

#include "core/error.h"

namespace deltamoe {
namespace {

void append_sample(MicroBatch& batch, const SftSample& sample) {
  batch.input_ids.insert(batch.input_ids.end(), sample.input_ids.begin(), sample.input_ids.end());
  batch.labels.insert(batch.labels.end(), sample.labels.begin(), sample.labels.end());
  batch.cu_seqlens.push_back(static_cast<int32_t>(batch.input_ids.size()));
  for (const ImagePatches& image : sample.images) {
    batch.pixel_values.insert(batch.pixel_values.end(), image.pixel_values.begin(), image.pixel_values.end());
    batch.image_grid_thw.push_back(image.grid_thw);
  }
  batch.sample_indices.push_back(sample.sample_index);
  batch.sample_num_images.push_back(static_cast<int32_t>(sample.images.size()));
  batch.num_supervised += sample.num_supervised;
  batch.num_image_tokens += sample.num_image_tokens;
}

// Positions are [3, T] per sample and per batch, so each row is copied separately.
void gather_positions(MicroBatch& batch, const std::vector<const SftSample*>& samples) {
  const size_t total = batch.input_ids.size();
  batch.positions.resize(3 * total);
  size_t offset = 0;
  for (const SftSample* sample : samples) {
    const size_t length = sample->input_ids.size();
    for (size_t row = 0; row < 3; ++row) {
      std::copy_n(sample->positions.begin() + static_cast<ptrdiff_t>(row * length), length,
                  batch.positions.begin() + static_cast<ptrdiff_t>(row * total + offset));
    }
    offset += length;
  }
}

}  // namespace

int64_t MicroBatch::num_patches() const {
  int64_t total = 0;
  for (const auto& [t, h, w] : image_grid_thw) total += t * h * w;
  return total;
}

Packer::Packer(int64_t token_budget, size_t window, int64_t max_samples)
    : token_budget_(token_budget), window_(window), max_samples_(max_samples) {
  CHECK(token_budget > 0, "token budget must be positive, got ", token_budget);
  CHECK(window >= 1, "packing window must be at least 1");
  CHECK(max_samples >= 0, "samples per micro-batch must be >= 0 (0: no limit), got ", max_samples);
}

void Packer::check_sample(const SftSample& sample) const {
  CHECK(sample.num_tokens() > 0 && sample.num_tokens() <= token_budget_, "sample ", sample.sample_index, " has ",
        sample.num_tokens(), " tokens; the batch budget is ", token_budget_, " (max_length must not exceed it)");
  CHECK(sample.positions.size() == 3 * sample.input_ids.size() && sample.labels.size() == sample.input_ids.size(),
        "sample ", sample.sample_index, ": positions/labels do not match its tokens");
}

void Packer::push_waiting(Slotted sample) {
  check_sample(sample.sample);
  CHECK(waiting_.size() < window_, "Packer: more waiting samples than the window of ", window_);
  waiting_.push_back(std::move(sample));
}

std::optional<MicroBatch> Packer::pack(const Feed& feed) {
  std::vector<Slotted> taken;
  int64_t used = 0;
  for (auto it = waiting_.begin(); it != waiting_.end() && !is_full(taken.size());) {
    if (used + it->sample.num_tokens() <= token_budget_) {
      used += it->sample.num_tokens();
      taken.push_back(std::move(*it));
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }
  // A full batch stops reading the feed, so no sample is taken from it only to wait.
  while (waiting_.size() < window_ && used < token_budget_ && !is_full(taken.size())) {
    std::optional<Slotted> next = feed();
    if (!next) break;
    check_sample(next->sample);
    if (used + next->sample.num_tokens() <= token_budget_) {
      used += next->sample.num_tokens();
      taken.push_back(std::move(*next));
    } else {
      waiting_.push_back(std::move(*next));
    }
  }
  if (taken.empty()) return std::nullopt;
  MicroBatch batch;
  batch.cu_seqlens.push_back(0);
  batch.input_ids.reserve(static_cast<size_t>(used));
  batch.labels.reserve(static_cast<size_t>(used));
  // Exact reservation: pixel values are megabytes per image, and growing by doubling would copy
  // them again and fault in fresh pages each time.
  size_t num_pixel_values = 0;
  for (const Slotted& entry : taken) {
    for (const ImagePatches& image : entry.sample.images) num_pixel_values += image.pixel_values.size();
  }
  batch.pixel_values.reserve(num_pixel_values);
  std::vector<const SftSample*> samples;
  for (const Slotted& entry : taken) {
    append_sample(batch, entry.sample);
    samples.push_back(&entry.sample);
  }
  gather_positions(batch, samples);
  return batch;
}

std::vector<int64_t> Packer::pending_slots() const {
  std::vector<int64_t> slots;
  for (const Slotted& entry : waiting_) slots.push_back(entry.slot);
  return slots;
}

}  // namespace deltamoe
