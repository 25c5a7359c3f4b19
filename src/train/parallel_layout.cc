// Bucketing of the dense elements and the pieces each rank owns (see the header).
#include "train/parallel_layout.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace deltamoe {

namespace {

int64_t align_up(int64_t elements) {
  return (elements + kFlatAlignmentElements - 1) / kFlatAlignmentElements * kFlatAlignmentElements;
}

}  // namespace

bool is_routed_expert_tensor(const std::string& name) {
  // The stack itself: a LoRA adapter on it ("<stack>.lora_A.weight", ...) is not one.
  return name.ends_with(".mlp.experts.gate_up_proj") || name.ends_with(".mlp.experts.down_proj");
}

ParallelLayout::ParallelLayout(const ParamLayout& full, int rank, int world, int64_t num_experts,
                               const ParallelOptions& options, const std::vector<GradientPhase>* phases)
    : full_(full), rank_(rank), world_(world), ep_(options.expert_parallel_size) {
  CHECK(world >= 1 && rank >= 0 && rank < world, "parallel layout: rank ", rank, " of ", world);
  CHECK(ep_ >= 1 && world % ep_ == 0, "--expert_model_parallel_size ", ep_, " must divide the ", world, " ranks");
  CHECK(world == 1 || options.distributed_optimizer, "training on ", world,
        " ranks needs --use_distributed_optimizer true (ZeRO-2 for the dense parameters); replicated optimizer "
        "state is not implemented");
  CHECK(options.bucket_elements > 0, "parallel layout: bucket_elements must be positive");
  if (ep_ > 1) {
    CHECK(num_experts % ep_ == 0, "--expert_model_parallel_size ", ep_, " does not divide the ", num_experts,
          " routed experts of each layer");
    experts_per_rank_ = num_experts / ep_;
  }
  // Each dense tensor's group: its phase's (the first that names it), or the last group.
  const int num_phases = phases != nullptr ? static_cast<int>(phases->size()) : 0;
  std::vector<std::vector<int>> members(static_cast<size_t>(num_phases + 1));
  group_of_entry_.assign(static_cast<size_t>(full.num_tensors()), -1);
  stream_of_entry_.assign(static_cast<size_t>(full.num_tensors()), -1);
  for (int i = 0; i < full.num_tensors(); ++i) {
    const ParamEntry& entry = full.entry(i);
    CHECK(entry.is_whole_tensor(), "parallel layout: '", entry.name, "' must be whole in the full layout");
    if (ep_ > 1 && is_routed_expert_tensor(entry.name)) {
      CHECK(!entry.shape.empty() && entry.shape[0] == num_experts, "parallel layout: '", entry.name,
            "' does not lead with the ", num_experts, " experts");
      const int64_t per_expert = entry.numel / num_experts;
      const int index = state_.add_piece(entry.name, entry.shape, first_local_expert() * per_expert,
                                         (first_local_expert() + experts_per_rank_) * per_expert);
      state_.set_lr_scale(index, entry.lr_scale);
      expert_pieces_.emplace_back(index, i);
      continue;
    }
    int phase = 0;
    while (phase < num_phases && !(*phases)[static_cast<size_t>(phase)].contains(entry.name)) ++phase;
    members[static_cast<size_t>(phase)].push_back(i);
  }
  for (const auto& [state_index, full_index] : expert_pieces_) {
    dense_state_begin_ = std::max(dense_state_begin_, state_.entry(state_index).offset + state_.entry(state_index).numel);
  }
  // The dense stream group after group; each group cut into n buckets of equal size rounded up to
  // a multiple of the world size (the last takes the rest), so only a group's last bucket pads.
  dense_stream_.push_back(0);
  phase_group_.assign(static_cast<size_t>(num_phases), -1);
  group_bucket_.push_back(0);
  for (int phase = 0; phase <= num_phases; ++phase) {
    const std::vector<int>& group = members[static_cast<size_t>(phase)];
    if (group.empty()) continue;
    const int g = static_cast<int>(group_bucket_.size()) - 1;
    if (phase < num_phases) phase_group_[static_cast<size_t>(phase)] = g;
    const int64_t begin = dense_stream_.back();
    for (const int i : group) {
      group_of_entry_[static_cast<size_t>(i)] = g;
      stream_of_entry_[static_cast<size_t>(i)] = dense_stream_.back();
      dense_entries_.push_back(i);
      dense_stream_.push_back(align_up(dense_stream_.back() + full.entry(i).numel));
    }
    const int64_t end = dense_stream_.back(), size = end - begin;
    const int64_t count = std::max<int64_t>(1, (size + options.bucket_elements - 1) / options.bucket_elements);
    const int64_t even = (size + count - 1) / count;
    const int64_t step = (even + world - 1) / world * world;
    for (int64_t at = begin; at < end; at += step) bucket_begin_.push_back(at);
    group_bucket_.push_back(static_cast<int>(bucket_begin_.size()));
  }
  bucket_begin_.push_back(dense_stream_.back());
  own_piece_state_.resize(static_cast<size_t>(num_buckets()));
  for (int b = 0; b < num_buckets(); ++b) {
    for (const Segment& segment : piece_segments(b, rank_)) {
      const ParamEntry& entry = full.entry(segment.full_entry);
      const int index =
          state_.add_piece(entry.name, entry.shape, segment.tensor_begin, segment.tensor_begin + segment.count);
      state_.set_lr_scale(index, entry.lr_scale);
      own_piece_state_[b].push_back({state_.entry(index).offset, segment.count, segment.in_piece});
    }
  }
}

int ParallelLayout::group_of_phase(int phase) const {
  CHECK(phase >= 0 && phase < static_cast<int>(phase_group_.size()), "parallel layout: phase ", phase, " of ",
        phase_group_.size());
  return phase_group_[static_cast<size_t>(phase)];
}

int64_t ParallelLayout::group_padded_elements(int group) const {
  int64_t total = 0;
  for (int b = group_first_bucket(group); b < group_end_bucket(group); ++b) total += piece_elements(b) * world_;
  return total;
}

int64_t ParallelLayout::bucket_offset_in_group(int bucket) const {
  int group = 0;
  while (group_end_bucket(group) <= bucket) ++group;
  // Every bucket before the group's last holds a multiple of the world: no padding in between.
  return bucket_begin_[bucket] - bucket_begin_[group_first_bucket(group)];
}

std::pair<int, int64_t> ParallelLayout::group_position(int full_entry) const {
  const int group = group_of_entry_[static_cast<size_t>(full_entry)];
  if (group < 0) return {-1, -1};
  return {group, stream_of_entry_[static_cast<size_t>(full_entry)] - bucket_begin_[group_first_bucket(group)]};
}

int64_t ParallelLayout::piece_elements(int bucket) const {
  const int64_t size = bucket_begin_[bucket + 1] - bucket_begin_[bucket];
  return (size + world_ - 1) / world_;
}

std::vector<ParallelLayout::Segment> ParallelLayout::stream_segments(int64_t begin, int64_t end) const {
  std::vector<Segment> segments;
  // First dense tensor whose stream range ends after `begin`.
  size_t i = std::upper_bound(dense_stream_.begin(), dense_stream_.end(), begin) - dense_stream_.begin() - 1;
  for (; i < dense_entries_.size() && dense_stream_[i] < end; ++i) {
    const ParamEntry& entry = full_.entry(dense_entries_[i]);
    const int64_t lo = std::max(begin, dense_stream_[i]), hi = std::min(end, dense_stream_[i] + entry.numel);
    if (lo >= hi) continue;  // the range starts in the alignment gap after the tensor
    segments.push_back(
        {dense_entries_[i], lo - dense_stream_[i], hi - lo, entry.offset + (lo - dense_stream_[i]), lo - begin});
  }
  return segments;
}

std::vector<ParallelLayout::Segment> ParallelLayout::piece_segments(int bucket, int piece_rank) const {
  const int64_t piece = piece_elements(bucket);
  const int64_t begin = std::min(bucket_begin_[bucket] + piece_rank * piece, bucket_begin_[bucket + 1]);
  const int64_t end = std::min(begin + piece, bucket_begin_[bucket + 1]);
  return stream_segments(begin, end);
}

void ParallelLayout::pack_bucket(int bucket, const float* full, float* padded) const {
  const int64_t total = piece_elements(bucket) * world_;
  std::fill(padded, padded + total, 0.0f);
  for (const Segment& segment : stream_segments(bucket_begin_[bucket], bucket_begin_[bucket + 1])) {
    std::memcpy(padded + segment.in_piece, full + segment.full_offset, static_cast<size_t>(segment.count) * sizeof(float));
  }
}

}  // namespace deltamoe
